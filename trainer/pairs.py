"""Preference pairs (contract/datasets.py PreferencePair) as token sequences for a DPO-style loss, in rows that keep
both sides of a pair together.

Encoding. Each side is the prompt's tokens then its answer's, with labels IGNORE over the prompt. A conversational
prompt is rendered by trainer/data.py's `encode_chat` (the chat template's prefix differences, or its fallback), so a
DPO job that follows an SFT job on the same model sees the same template; as there, the answer's piece includes the
template's assistant header, which is the same in both sides and so cancels in the chosen-minus-rejected margin. A
string prompt and its answers are tokenized apart, as `encode_completion` does, so the boundary is exact. An answer
ends with eos.

Length. `seq_len` bounds one side (prompt + answer). A pair whose prompt alone is `seq_len - 1` tokens or more is
dropped ("prompt_too_long"): it leaves no room for an answer of two tokens. Otherwise each answer that does not fit is
cut at its end (its eos goes first) and the pair counts as truncated; the prompt is never cut, since what the answers
respond to must stay whole. A pair whose two answers are equal after the cut is dropped ("same_after_truncation"):
its two log-ratios would be equal and it would add no gradient.

Rows. Unpacked: one sequence per row of `seq_len` tokens, the chosen rows of pairs 0..n-1 and then their rejected
rows (row i and row n+i are pair i), with an attention mask. Packed: rows of `2 * seq_len` tokens (the most a kept
pair can take, so every pair fits one row and never spans two), filled with whole pairs in their order (next fit:
a pair that does not fit the open row starts the next one), each pair's chosen sequence then its rejected sequence,
so one forward of a row gives both; no attention mask (the model keeps sequences apart by `position_ids`, which
restart at 0 per sequence). In both, the unit a batch is drawn in (`len()`, `batch`) holds whole pairs: a packed row,
or an unpacked pair's two rows. Deterministic: the same pairs give the same rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from contract.datasets import ASSISTANT, PreferencePair, cut_pair
from trainer.data import IGNORE, _ids, encode_chat
from trainer.errors import DataError

CHOSEN, REJECTED = 0, 1


@dataclass(frozen=True)
class EncodedPair:
    """A pair's tokens: the prompt's, shared by both sides, and each answer's as cut to fit."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    truncated: bool

    def side(self, which: int) -> tuple[list[int], list[int]]:
        """Token ids and labels of one side (CHOSEN or REJECTED): the prompt's labels IGNORE."""
        answer = self.chosen if which == CHOSEN else self.rejected
        return self.prompt + answer, [IGNORE] * len(self.prompt) + answer

    def __len__(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass
class PairStats:
    kept: int = 0
    truncated: int = 0  # of the kept: at least one answer cut
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> pairs
    # Of the kept pairs, as encoded (after cuts); a prompt counted once per pair.
    prompt_tokens: int = 0
    chosen_tokens: int = 0
    rejected_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"pairs_kept": self.kept, "pairs_truncated": self.truncated,
                "pairs_dropped": sum(self.dropped.values()), "dropped": dict(sorted(self.dropped.items())),
                "tokens": {"prompt": self.prompt_tokens, "chosen": self.chosen_tokens,
                           "rejected": self.rejected_tokens}}


def _sides(tokenizer: PreTrainedTokenizerBase, pair: PreferencePair) -> tuple[list[int], list[int], list[int]]:
    """Prompt, chosen and rejected tokens, uncut."""
    if isinstance(pair.prompt, str):
        return (_ids(tokenizer, pair.prompt), _ids(tokenizer, pair.chosen) + [tokenizer.eos_token_id],
                _ids(tokenizer, pair.rejected) + [tokenizer.eos_token_id])
    # encode_chat ends every conversation with eos: the prompt's tokens are those before it.
    prompt = encode_chat(tokenizer, pair.prompt)[0][:-1]
    answers = []
    for text in (pair.chosen, pair.rejected):
        ids = encode_chat(tokenizer, [*pair.prompt, {"role": ASSISTANT, "content": text}])[0]
        if ids[: len(prompt)] != prompt:
            raise DataError("the tokenizer's chat template does not render a prompt the same with and without its "
                            "answer; cannot mask the prompt")
        answers.append(ids[len(prompt):])
    return prompt, answers[0], answers[1]


def encode_pair(tokenizer: PreTrainedTokenizerBase, pair: PreferencePair, seq_len: int,
                stats: PairStats | None = None) -> EncodedPair | None:
    """The pair's tokens under the length rule of this module; None for a dropped pair. Counted into `stats` where
    given."""
    prompt, chosen, rejected = _sides(tokenizer, pair)
    cut = cut_pair(len(prompt), chosen, rejected, seq_len)
    if cut.dropped is not None:
        if stats is not None:
            stats.dropped[cut.dropped] = stats.dropped.get(cut.dropped, 0) + 1
        return None
    if stats is not None:
        stats.kept += 1
        stats.truncated += int(cut.truncated)
        stats.prompt_tokens += len(prompt)
        stats.chosen_tokens += len(cut.chosen)
        stats.rejected_tokens += len(cut.rejected)
    return EncodedPair(prompt=prompt, chosen=cut.chosen, rejected=cut.rejected, truncated=cut.truncated)


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: Iterable[PreferencePair],
                 seq_len: int) -> tuple[list[EncodedPair], PairStats]:
    """The kept pairs, in their order, and what happened to all of them."""
    stats = PairStats()
    kept = [e for p in pairs if (e := encode_pair(tokenizer, p, seq_len, stats)) is not None]
    return kept, stats


@dataclass
class PairBlocks:
    """Rows of whole pairs (layout in the module's docstring). Per token: `segment_ids`, which sequence of its row
    the token is in (0, 1, ... in row order), -1 for padding. Per sequence, in row order: its row, its segment, its
    pair (index into the encoded list) and its side (CHOSEN or REJECTED)."""

    input_ids: torch.Tensor  # [rows, row_len]
    labels: torch.Tensor  # IGNORE on prompts, padding, and each sequence's first token
    position_ids: torch.Tensor  # restart at 0 per sequence
    segment_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # unpacked only
    seq_row: torch.Tensor
    seq_segment: torch.Tensor
    seq_pair: torch.Tensor
    seq_side: torch.Tensor
    row_start: torch.Tensor  # [rows + 1]: row r's sequences are row_start[r] up to row_start[r + 1]
    real_tokens: torch.Tensor  # per row: tokens that are not padding
    packing_efficiency: float
    packed: bool
    pairs: int

    @property
    def row_len(self) -> int:
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        """Units a batch is drawn in: packed rows, or pairs when unpacked."""
        return int(self.input_ids.shape[0]) if self.packed else self.pairs

    def unit_rows(self, units: list[int]) -> list[int]:
        """The rows of `units`; unpacked, the chosen rows then the rejected rows (trl's concatenated layout)."""
        if self.packed:
            return list(units)
        return list(units) + [self.pairs + u for u in units]

    def batch(self, units: list[int]) -> dict[str, torch.Tensor]:
        """The rows of `units` and, for the loss, their sequences ordered chosen first: `sequence_ids` (per token,
        the index of its sequence in that order, -1 for padding), `pair_ids` and `chosen` per sequence. With k
        pairs, sequences 0..k-1 are their chosen and k..2k-1 their rejected, pair by pair, so a per-sequence sum
        of log-probs (`index_add_` over `sequence_ids` where labels are not IGNORE) splits into the two halves
        of a DPO margin."""
        rows = self.unit_rows(units)
        picked = [(b, s) for b, row in enumerate(rows)
                  for s in range(int(self.row_start[row]), int(self.row_start[row + 1]))]
        pairs = list(dict.fromkeys(int(self.seq_pair[s]) for _, s in picked))
        slot = {p: k for k, p in enumerate(pairs)}
        segments = self.segment_ids[rows]
        sequence_ids = torch.full_like(segments, -1)
        for b, s in picked:
            index = slot[int(self.seq_pair[s])] + (len(pairs) if int(self.seq_side[s]) == REJECTED else 0)
            sequence_ids[b][segments[b] == self.seq_segment[s]] = index
        out = {"input_ids": self.input_ids[rows], "labels": self.labels[rows],
               "position_ids": self.position_ids[rows], "segment_ids": segments, "sequence_ids": sequence_ids,
               "pair_ids": torch.tensor(pairs + pairs, dtype=torch.long),
               "chosen": torch.tensor([True] * len(pairs) + [False] * len(pairs))}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask[rows]
        return out


def pack_pairs(encoded: list[EncodedPair], seq_len: int, pad_id: int, packing: bool) -> PairBlocks:
    """Rows of the encoded pairs (layout in the module's docstring); `seq_len` is the one they were encoded with."""
    row_len = 2 * seq_len if packing else seq_len
    # (pair, side) per sequence, grouped by row.
    rows: list[list[tuple[int, int]]] = []
    if packing:
        used = row_len
        for p, pair in enumerate(encoded):
            if len(pair) > row_len:
                raise ValueError(f"pair {p} takes {len(pair)} tokens, more than a row of {row_len}; encode it with "
                                 f"seq_len {seq_len}")
            if used + len(pair) > row_len:
                rows.append([])
                used = 0
            rows[-1] += [(p, CHOSEN), (p, REJECTED)]
            used += len(pair)
    else:
        rows = [[(p, side)] for side in (CHOSEN, REJECTED) for p in range(len(encoded))]
    ids_rows, label_rows, pos_rows, seg_rows, real, masks = [], [], [], [], [], []
    seq_row, seq_segment, seq_pair, seq_side = [], [], [], []
    for r, sequences in enumerate(rows):
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        seg: list[int] = []
        for segment, (p, side) in enumerate(sequences):
            s_ids, s_labels = encoded[p].side(side)
            if len(s_ids) > row_len:
                raise ValueError(f"pair {p} has a side of {len(s_ids)} tokens, more than a row of {row_len}")
            ids += s_ids
            # A sequence's first token would be predicted from the sequence before it: never a target.
            labels += [IGNORE] + s_labels[1:]
            pos += list(range(len(s_ids)))
            seg += [segment] * len(s_ids)
            seq_row.append(r)
            seq_segment.append(segment)
            seq_pair.append(p)
            seq_side.append(side)
        pad = row_len - len(ids)
        real.append(len(ids))
        masks.append([1] * len(ids) + [0] * pad)
        ids += [pad_id] * pad
        labels += [IGNORE] * pad
        # Padding counts its own positions from 0, wrapping at seq_len: it is a sequence of its own to a model that
        # reads boundaries from position_ids, and no position exceeds what an unpacked row would use.
        pos += [i % seq_len for i in range(pad)]
        seg += [-1] * pad
        ids_rows.append(ids)
        label_rows.append(labels)
        pos_rows.append(pos)
        seg_rows.append(seg)
    n = len(rows)

    def grid(values: list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).view(n, row_len)

    def line(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    real_t = line(real)
    return PairBlocks(
        input_ids=grid(ids_rows), labels=grid(label_rows), position_ids=grid(pos_rows), segment_ids=grid(seg_rows),
        attention_mask=None if packing else grid(masks),
        seq_row=line(seq_row), seq_segment=line(seq_segment), seq_pair=line(seq_pair), seq_side=line(seq_side),
        row_start=line([0, *itertools.accumulate(len(r) for r in rows)]),
        real_tokens=real_t, packing_efficiency=float(real_t.sum()) / max(1, n * row_len), packed=packing,
        pairs=len(encoded))
