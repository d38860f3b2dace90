"""A dpo job none of whose training pairs leaves room for an answer at its `seq_len` is refused at submit, naming
`hyperparameters.seq_len`, the shortest prompt and its line, instead of failing with `data_error` once placed.

The rule is the trainer's (trainer/pairs.py): a pair is dropped when its prompt alone takes `seq_len - 1` tokens or
more. Its prompt is counted as the trainer counts it, without torch or a model: the tokenizer's own `tokenizer.json`
through the `tokenizers` library, a conversational prompt rendered by transformers' chat-template renderer (the one
`apply_chat_template` calls) with the tokenizer's special tokens, or by the trainer's fallback where the tokenizer
has no template. tests/test_dpo_lengths.py holds the two counts equal.

A dry run shows the same count of the whole file (`survey`): what the trainer will keep, cut and drop.

The check refuses only what it has proved: it stops at the first pair that fits, and a job is let through (the
trainer still drops what does not fit) where the tokenizer is out of its reach (a hub model not in this host's
cache, a tokenizer of remote code, without `tokenizer.json` or that does not load) or where the file was not read
to its end within SCAN_SECONDS (a long file, a store down or slow).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, Field

from contract import datasets
from contract.codes import Method
from contract.datasets import ASSISTANT, PreferencePair
from contract.problems import FieldError
from contract.spec import ResolvedJob, checkpoint_ref, is_job_id
from store.objects import Store

log = logging.getLogger(__name__)

SCAN_SECONDS = 2.0  # of the submit's time, at most, spent proving that no pair fits
# Reading the tokenizer and the first lines included: a store that answers slowly costs a submit no more.
GIVE_UP_SECONDS = 2 * SCAN_SECONDS
BATCH_LINES = 256  # lines counted per trip to a worker thread
TOKENIZER = "tokenizer.json"
CONFIG = "tokenizer_config.json"
TEMPLATE = "chat_template.jinja"  # where transformers saves a tokenizer's template beside its config
FILES = (TOKENIZER, CONFIG, TEMPLATE)  # what a counter is made of, wherever they are read
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MIN_ANSWER = datasets.MIN_ANSWER_TOKENS


@dataclass(frozen=True)
class PromptCounter:
    """A pair's tokens as trainer/pairs.py's `_sides` makes them: the prompt's, and each answer's with its eos."""

    tokenizer: Any  # tokenizers.Tokenizer
    template: str | None
    special: dict[str, str]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _eos(self) -> int:
        found = self.tokenizer.token_to_id(self.special.get("eos_token", ""))
        return -1 if found is None else int(found)  # a tokenizer without one: only the counts matter here

    def _chat(self, messages: list[dict[str, str]]) -> list[int]:
        """trainer/data.py encode_chat's tokens without its closing eos: with a template, the rendering's (its
        prefixes render stably, so the sum of its turns is the whole); else the fallback's, one piece per turn."""
        if self.template is None:
            return [t for m in messages for t in self._ids(f"<|{m['role']}|>\n{m['content']}\n")]
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template, **self.special)
        return self._ids(rendered[0])

    def prompt_tokens(self, pair: PreferencePair) -> int:
        return len(self._ids(pair.prompt) if isinstance(pair.prompt, str) else self._chat(pair.prompt))

    def sides(self, pair: PreferencePair) -> tuple[list[int], list[int], list[int]]:
        """Prompt, chosen and rejected tokens, uncut."""
        eos = self._eos()
        if isinstance(pair.prompt, str):
            return self._ids(pair.prompt), self._ids(pair.chosen) + [eos], self._ids(pair.rejected) + [eos]
        prompt = self._chat(pair.prompt)
        answers = [self._chat([*pair.prompt, {"role": ASSISTANT, "content": text}])[len(prompt):] + [eos]
                   for text in (pair.chosen, pair.rejected)]
        return prompt, answers[0], answers[1]


def counter_of(files: dict[str, bytes]) -> PromptCounter | None:
    """A counter from a tokenizer's files by name, or None without `tokenizer.json` or where they do not load
    (the trainer will say what is wrong with them)."""
    if TOKENIZER not in files:
        return None
    try:
        return _loaded(files)
    except Exception as exc:  # the tokenizers library raises its own; a check that cannot count refuses nothing
        log.warning("the length check could not load a tokenizer: %s: %s", type(exc).__name__, exc)
        return None


def _loaded(files: dict[str, bytes]) -> PromptCounter:
    from tokenizers import Tokenizer

    config = json.loads(files.get(CONFIG, b"{}"))
    special = {}
    for name in SPECIAL:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    if "pad_token" not in special and "eos_token" in special:
        special["pad_token"] = special["eos_token"]  # what trainer/modeling.py's load_tokenizer sets
    template = files[TEMPLATE].decode() if TEMPLATE in files else config.get("chat_template")
    if not isinstance(template, str):
        template = None  # a dict of named templates is not what apply_chat_template renders by default
    return PromptCounter(Tokenizer.from_str(files[TOKENIZER].decode()), template, special)


# Counters of stored tokenizers by their files' hashes: a job's export is read from the store once, not per submit.
_STORED: dict[tuple[str, ...], PromptCounter | None] = {}
STORED_KEPT = 16


async def _counter(resolved: ResolvedJob, store: Store) -> PromptCounter | None:
    """The counter of the job's tokenizer, wherever this process can read it; None where it cannot."""
    model = resolved.spec.model
    if model.trust_remote_code:
        return None
    name = model.name_or_path
    if resolved.base_model is not None:  # a job's export or checkpoint (api/services/inputs.py)
        found = [f for f in resolved.base_model.files if f.path.rsplit("/", 1)[-1] in FILES]
        key = tuple(sorted(f.sha256 for f in found))
        if key not in _STORED:
            if len(_STORED) >= STORED_KEPT:
                _STORED.pop(next(iter(_STORED)))
            files = {f.path.rsplit("/", 1)[-1]: await store.get_bytes_async(f.key) for f in found}
            _STORED[key] = await anyio.to_thread.run_sync(counter_of, files)
        return _STORED[key]
    if is_job_id(name) or checkpoint_ref(name) is not None:
        return None
    return await anyio.to_thread.run_sync(_local_counter, name, model.revision)


def _local_counter(name: str, revision: str | None) -> PromptCounter | None:
    """From a folder under the model root (api/services/paths.py made the name absolute), or from this host's hub
    cache for a hub id; nothing is downloaded."""
    folder = Path(name)
    if folder.is_absolute():
        return counter_of({w: (folder / w).read_bytes() for w in FILES if (folder / w).is_file()})
    from huggingface_hub import try_to_load_from_cache

    cached = {w: try_to_load_from_cache(name, w, revision=revision) for w in FILES}
    return counter_of({w: Path(path).read_bytes() for w, path in cached.items() if isinstance(path, str)})


async def _lines(resolved: ResolvedJob, store: Store) -> AsyncIterator[bytes]:
    stored = resolved.inputs.get("data.train")
    if stored is not None:
        chunks = store.iter_async(stored.key)
    else:
        chunks = _file_chunks(Path(resolved.spec.data.train))
    rest = b""
    async for chunk in chunks:
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    async with await anyio.open_file(path, "rb") as f:
        while chunk := await f.read(1 << 20):
            yield chunk


DROPPED_LINES_SHOWN = 5


class Survey(BaseModel):
    """The training pairs under the job's length, as the trainer will keep, cut and drop them (trainer/pairs.py's
    `encode_pair`), over the lines read: a dry run's `pairs`."""

    complete: bool = Field(default=False, description="Every line was read; false: the figures cover the first "
                                                      "`lines_read` lines, read within the dry run's time")
    lines_read: int = 0
    pairs_kept: int = 0
    pairs_truncated: int = Field(default=0, description="Of the kept: at least one answer cut at its end")
    dropped: dict[str, int] = Field(default_factory=dict, description="Pairs dropped, by reason: prompt_too_long "
                                    "(no room for an answer), same_after_truncation (the cut answers are equal)")
    dropped_lines: list[int] = Field(default_factory=list, description="The first dropped pairs' line numbers")
    tokens: dict[str, int] = Field(default_factory=lambda: {"prompt": 0, "chosen": 0, "rejected": 0},
                                   description="Of the kept pairs, after cuts; a prompt counted once per pair")
    shortest_prompt: int | None = Field(default=None, description="Tokens of the shortest prompt read")
    shortest_prompt_line: int | None = None

    def add(self, number: int, prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int) -> None:
        if self.shortest_prompt is None or len(prompt) < self.shortest_prompt:
            self.shortest_prompt, self.shortest_prompt_line = len(prompt), number
        cut = datasets.cut_pair(len(prompt), chosen, rejected, seq_len)
        if cut.dropped is not None:
            self.dropped[cut.dropped] = self.dropped.get(cut.dropped, 0) + 1
            if len(self.dropped_lines) < DROPPED_LINES_SHOWN:
                self.dropped_lines.append(number)
            return
        self.pairs_kept += 1
        self.pairs_truncated += int(cut.truncated)
        for side, ids in (("prompt", prompt), ("chosen", cut.chosen), ("rejected", cut.rejected)):
            self.tokens[side] += len(ids)


def _read(counter: PromptCounter, seq_len: int, lines: list[tuple[int, bytes]], survey: Survey,
          first_fit: bool) -> None:
    for number, line in lines:
        survey.lines_read = number
        if not line.strip():
            continue
        try:
            pair = datasets.preference_pair(json.loads(line))
        except (ValueError, datasets.LineProblem):
            continue  # the file's own check refused or passed it; here only pairs are counted
        try:
            if first_fit:  # the prompt alone decides whether a pair can fit: its answers are not tokenized
                sides = [0] * counter.prompt_tokens(pair), [0, 1], [1, 0]
            else:
                sides = counter.sides(pair)
        except Exception:  # a template that raises on this pair (a role it refuses): the trainer will say so
            continue
        survey.add(number, *sides, seq_len)
        if first_fit and survey.pairs_kept:
            return


async def _survey(resolved: ResolvedJob, store: Store, *, first_fit: bool) -> Survey | None:
    """The job's training pairs read within SCAN_SECONDS (up to the first that fits, with `first_fit`); None for
    a job that is no dpo job, or whose tokenizer or pairs are out of reach now. A store that is down or slow
    leaves the submit as it would be without the check: let through (its worker waits for the store)."""
    if resolved.spec.method.type != Method.DPO:
        return None
    with anyio.move_on_after(GIVE_UP_SECONDS):
        try:
            return await _read_all(resolved, store, first_fit)
        except Exception as exc:  # the store's client raises more than StoreError; refusing nothing is safe
            log.warning("the length check of a dpo submit could not read its tokenizer or pairs: %s: %s",
                        type(exc).__name__, exc)
            return None
    log.warning("the length check of a dpo submit gave up after %.0f s", GIVE_UP_SECONDS)
    return None


async def _read_all(resolved: ResolvedJob, store: Store, first_fit: bool) -> Survey | None:
    spec = resolved.spec
    counter = await _counter(resolved, store)
    if counter is None:
        return None
    seq_len = spec.hyperparameters.seq_len
    survey = Survey()
    deadline = time.monotonic() + SCAN_SECONDS
    batch: list[tuple[int, bytes]] = []
    number = 0
    async for line in _lines(resolved, store):
        number += 1
        batch.append((number, line))
        if len(batch) == BATCH_LINES:
            await anyio.to_thread.run_sync(_read, counter, seq_len, batch, survey, first_fit)
            batch = []
            if (first_fit and survey.pairs_kept) or time.monotonic() > deadline:
                return survey
    await anyio.to_thread.run_sync(_read, counter, seq_len, batch, survey, first_fit)
    survey.complete = not (first_fit and survey.pairs_kept)
    return survey


async def survey(resolved: ResolvedJob, store: Store) -> Survey | None:
    """What a dry run shows of a dpo job's pairs under its length."""
    return await _survey(resolved, store, first_fit=False)


async def check(resolved: ResolvedJob, store: Store) -> list[FieldError]:
    """The refusal of a dpo job none of whose training pairs fits its seq_len, where that is proved; else none."""
    found = await _survey(resolved, store, first_fit=True)
    if found is None or not found.complete or found.pairs_kept or found.shortest_prompt is None:
        return []
    seq_len = resolved.spec.hyperparameters.seq_len
    return [FieldError("hyperparameters.seq_len",
                       f"no pair of the training file leaves room for an answer within seq_len {seq_len}: every "
                       f"prompt takes {seq_len - MIN_ANSWER + 1} tokens or more (the shortest, line "
                       f"{found.shortest_prompt_line}, takes {found.shortest_prompt}); shorten the prompts or raise "
                       f"seq_len to at least {found.shortest_prompt + MIN_ANSWER}")]
