"""Read a job's data, tokenize it, and pack it into fixed blocks of `seq_len` tokens.

Every rank builds the same blocks and the same per-epoch order from `seed`, so the data position of a
run is just (epoch, index of the next global batch) and a resume continues exactly where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from contract import datasets
from contract.files import FileFormat
from contract.spec import DataSpec, RunPaths
from trainer.errors import DataError

IGNORE = -100
CHUNK_BYTES = 1 << 20
Document = datasets.Document


@dataclass
class Blocks:
    """Fixed-size training rows. attention_mask is None when packed: the model then reads document
    boundaries from position_ids (which restart at 0 per document) and keeps documents apart."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    real_tokens: torch.Tensor  # per row: tokens that are not padding
    packing_efficiency: float

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, rows: list[int]) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids[rows], "labels": self.labels[rows],
               "position_ids": self.position_ids[rows]}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask[rows]
        return out


def resolve_path(path: str, paths: RunPaths) -> Path:
    p = Path(path)
    if not p.is_absolute() and paths.data_root:
        p = Path(paths.data_root) / p
    return p


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def read_documents(path: Path, spec: DataSpec) -> list[Document]:
    """The file's documents, read and checked line by line by contract/datasets.py: the check an uploaded file
    passes is this one. The first problem is raised as a DataError naming the file and the line."""
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    docs: list[Document] = []
    found = datasets.scan(_chunks(path), spec.format, text_field=spec.text_field, on_document=docs.append,
                          max_problems=1)
    if found.problems:
        problem = found.problems[0]
        if problem.line is None:
            raise DataError(f"data file {path} {problem.message}")
        raise DataError(f"{path} line {problem.line}: {problem.message}")
    return docs


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_text(tokenizer: PreTrainedTokenizerBase, doc: str) -> tuple[list[int], list[int]]:
    ids = _ids(tokenizer, doc) + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode_chat(tokenizer: PreTrainedTokenizerBase,
                messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Tokens of a conversation, with labels only on assistant turns (not on one whose `weight` is 0).

    With a chat template, turn i is the difference between the rendering of messages[:i+1] and of
    messages[:i] (templates render prefixes stably). Without one the fallback renders each turn as
    `<|role|>\\ncontent\\n` and ends the conversation with eos.
    """
    ids: list[int] = []
    labels: list[int] = []
    if getattr(tokenizer, "chat_template", None):
        prev: list[int] = []
        for i, msg in enumerate(messages):
            rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            cur = _ids(tokenizer, rendered)
            if cur[: len(prev)] != prev:
                raise DataError("the tokenizer's chat template does not render conversation prefixes stably; "
                                "cannot mask non-assistant turns")
            piece = cur[len(prev):]
            ids += piece
            labels += piece if datasets.learns(msg) else [IGNORE] * len(piece)
            prev = cur
    else:
        for msg in messages:
            piece = _ids(tokenizer, f"<|{msg['role']}|>\n{msg['content']}\n")
            ids += piece
            labels += piece if datasets.learns(msg) else [IGNORE] * len(piece)
    ids.append(tokenizer.eos_token_id)
    # Learning to stop matters only after an assistant's answer.
    labels.append(tokenizer.eos_token_id if datasets.learns(messages[-1]) else IGNORE)
    return ids, labels


def encode_completion(tokenizer: PreTrainedTokenizerBase, pair: dict[str, str]) -> tuple[list[int], list[int]]:
    """The prompt's tokens then the completion's and eos, with labels only on the completion and eos. Each side
    is tokenized alone so the boundary between what is given and what is learned is exact."""
    prompt = _ids(tokenizer, pair["prompt"])
    completion = _ids(tokenizer, pair["completion"]) + [tokenizer.eos_token_id]
    return prompt + completion, [IGNORE] * len(prompt) + completion


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, packing: bool) -> Blocks:
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    rows_pos: list[list[int]] = []
    rows_real: list[int] = []
    if packing:
        ids_buf: list[int] = []
        lab_buf: list[int] = []
        pos_buf: list[int] = []
        for ids, labels in examples:
            # A document that spills over fills the current block and continues in the next one, where its
            # positions restart at 0 (a block is the longest stretch one document can attend over).
            while ids:
                take = min(seq_len - len(ids_buf), len(ids))
                ids_buf += ids[:take]
                lab_buf += labels[:take]
                pos_buf += list(range(take))
                ids, labels = ids[take:], labels[take:]
                if len(ids_buf) == seq_len:
                    rows_ids.append(ids_buf)
                    rows_labels.append(lab_buf)
                    rows_pos.append(pos_buf)
                    rows_real.append(seq_len)
                    ids_buf, lab_buf, pos_buf = [], [], []
        if ids_buf:
            real = len(ids_buf)
            pad = seq_len - real
            # Padding continues the last document's positions: it stays in that document's segment, where
            # causal attention keeps it invisible to the real tokens before it, and its labels are ignored.
            last = pos_buf[-1]
            rows_ids.append(ids_buf + [pad_id] * pad)
            rows_labels.append(lab_buf + [IGNORE] * pad)
            rows_pos.append(pos_buf + list(range(last + 1, last + 1 + pad)))
            rows_real.append(real)
        mask = None
    else:
        masks = []
        for ids, labels in examples:
            ids, labels = ids[:seq_len], labels[:seq_len]
            pad = seq_len - len(ids)
            rows_ids.append(ids + [pad_id] * pad)
            rows_labels.append(labels + [IGNORE] * pad)
            rows_pos.append(list(range(seq_len)))
            rows_real.append(len(ids))
            masks.append([1] * len(ids) + [0] * pad)
        mask = torch.tensor(masks, dtype=torch.long) if masks else None
    real = torch.tensor(rows_real, dtype=torch.long)
    n = len(rows_ids)
    labels_t = torch.tensor(rows_labels, dtype=torch.long).view(n, seq_len)
    pos_t = torch.tensor(rows_pos, dtype=torch.long).view(n, seq_len)
    if packing:
        # A document's first token would be predicted from the previous document's last one; not a target.
        labels_t[pos_t == 0] = IGNORE
    return Blocks(
        input_ids=torch.tensor(rows_ids, dtype=torch.long).view(n, seq_len),
        labels=labels_t,
        position_ids=pos_t,
        attention_mask=mask,
        real_tokens=real,
        packing_efficiency=float(real.sum()) / max(1, n * seq_len),
    )


def encode(tokenizer: PreTrainedTokenizerBase, docs: list[Document],
           fmt: str) -> list[tuple[list[int], list[int]]]:
    if fmt == FileFormat.CHAT.value:
        return [encode_chat(tokenizer, d) for d in docs]
    if fmt == FileFormat.COMPLETION.value:
        return [encode_completion(tokenizer, d) for d in docs]
    return [encode_text(tokenizer, d) for d in docs]


Example = tuple[list[int], list[int]]  # token ids and labels of one document


def load_examples(spec: DataSpec, paths: RunPaths, tokenizer: PreTrainedTokenizerBase,
                  seed: int) -> tuple[list[Example], list[Example]]:
    """Training and validation examples, tokenized (no validation: an empty list)."""
    train_docs, val_docs = read_split(spec, paths, seed)
    return encode(tokenizer, train_docs, spec.format), encode(tokenizer, val_docs, spec.format)


def read_split(spec: DataSpec, paths: RunPaths, seed: int) -> tuple[list[Document], list[Document]]:
    """The training documents and the validation documents: the validation file's, or a fraction held out."""
    train_docs = read_documents(resolve_path(spec.train, paths), spec)
    val_docs: list[Document] = []
    if spec.validation:
        val_docs = read_documents(resolve_path(spec.validation, paths), spec)
    elif spec.validation_fraction > 0 and len(train_docs) >= 2:
        # Hold out whole documents, chosen from the seed, so the split is the same on every rank and attempt.
        order = list(range(len(train_docs)))
        random.Random(seed).shuffle(order)
        n_val = max(1, int(len(train_docs) * spec.validation_fraction))
        held = set(order[:n_val])
        val_docs = [d for i, d in enumerate(train_docs) if i in held]
        train_docs = [d for i, d in enumerate(train_docs) if i not in held]
    return train_docs, val_docs


def blocks_of(train: list[Example], val: list[Example], *, seq_len: int, pad_id: int, packing: bool,
              name: str) -> tuple[Blocks, Blocks | None]:
    """Training blocks and validation blocks (None when there is no validation data); `name` is the training
    data's, for the error."""
    blocks = pack(train, seq_len, pad_id, packing)
    if int((blocks.labels != IGNORE).sum()) == 0:
        raise DataError(f"{name}: no token to learn from (all labels masked)")
    return blocks, (pack(val, seq_len, pad_id, packing) if val else None)


def load_blocks(spec: DataSpec, paths: RunPaths, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                seed: int) -> tuple[Blocks, Blocks | None]:
    """Training blocks and validation blocks (None when there is no validation data)."""
    train, val = load_examples(spec, paths, tokenizer, seed)
    return blocks_of(train, val, seq_len=seq_len, pad_id=tokenizer.pad_token_id, packing=spec.packing,
                     name=spec.train)


class BatchOrder:
    """Which rows each rank reads for each micro batch of each optimizer step.

    A global batch is `micro * accum * world` rows of one seeded per-epoch permutation; within it, micro
    batch j (0-based) goes to rank j % world, so rank r reads micro batches r, r+world, ... .
    """

    def __init__(self, n_rows: int, *, micro: int, accum: int, world: int, seed: int) -> None:
        self.n_rows, self.micro, self.accum, self.world, self.seed = n_rows, micro, accum, world, seed
        self.global_batch = micro * accum * world
        self.batches_per_epoch = n_rows // self.global_batch
        if self.batches_per_epoch == 0:
            raise DataError(f"the training data makes {n_rows} blocks, fewer than one global batch "
                            f"({self.global_batch} = micro {micro} x accumulation {accum} x "
                            f"processes {world}); add data or lower global_batch_size / seq_len")
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n_rows, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def global_rows(self, epoch: int, index: int) -> list[int]:
        perm = self._permutation(epoch)
        return perm[index * self.global_batch:(index + 1) * self.global_batch]

    def micro_rows(self, epoch: int, index: int, rank: int) -> list[list[int]]:
        rows = self.global_rows(epoch, index)
        micros = [rows[j * self.micro:(j + 1) * self.micro] for j in range(self.accum * self.world)]
        return [micros[k * self.world + rank] for k in range(self.accum)]
