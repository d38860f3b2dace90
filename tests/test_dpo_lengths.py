"""The submit's count of a pair's prompt tokens (api/services/lengths.py: `tokenizers` and transformers' template
renderer, no model, no torch) is the trainer's (trainer/pairs.py, through the tokenizer transformers loads), for string
and conversational prompts, with the trainer's fallback and with a chat template that reads a special token."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from transformers import AutoTokenizer

from api.services.lengths import (
    CONFIG,
    DROPPED_LINES_SHOWN,
    GIVE_UP_SECONDS,
    TEMPLATE,
    TOKENIZER,
    Survey,
    check,
    counter_of,
    survey,
)
from contract.datasets import PROMPT_TOO_LONG, preference_pair
from contract.deepspeed import resolve
from contract.spec import JobSpec, StoredInput
from contract.storage import StoreConfig
from store.objects import Store
from tests.helpers import free_port
from trainer.pairs import PairStats, _sides, encode_pair
from trainer.tiny import build_tokenizer

CORPUS = ("The quick brown fox jumps over the lazy dog. Name a colour: blue, green, red. "
          "Ünïcode façade — naïve café, 東京 and emoji 🙂 too.\n") * 40
# ChatML-like, ending each turn with the tokenizer's eos token as many real templates do.
TEMPLATE_TEXT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PAIRS = [
    {"prompt": "Name a colour:", "chosen": " Blue.", "rejected": " A horse."},
    {"prompt": "  spaces,\n\nnewlines\tand tabs  ", "chosen": "x", "rejected": "y"},
    {"prompt": "Ünïcode façade — 東京 🙂 " * 7, "chosen": "ok", "rejected": "no"},
    {"input": {"messages": [{"role": "user", "content": "Name a colour"}]},
     "preferred_output": [{"role": "assistant", "content": "Blue."}],
     "non_preferred_output": [{"role": "assistant", "content": "A horse."}]},
    {"input": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": "The quick brown fox " * 9}]},
     "preferred_output": [{"role": "assistant", "content": "Lazy dog."}],
     "non_preferred_output": [{"role": "assistant", "content": "Red."}]},
]


@pytest.fixture(scope="module", params=["fallback", "template"])
def tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"tok-{request.param}")
    tok = build_tokenizer(CORPUS, 300, 512)
    if request.param == "template":
        tok.chat_template = TEMPLATE_TEXT
    tok.save_pretrained(folder)
    return folder


def test_the_submit_counts_each_prompt_as_the_trainer_does(tokenizer_dir: Path) -> None:
    trainer_tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    files = {n: (tokenizer_dir / n).read_bytes() for n in (TOKENIZER, CONFIG, TEMPLATE)
             if (tokenizer_dir / n).is_file()}
    counter = counter_of(files)
    assert counter is not None
    assert (counter.template is not None) == bool(trainer_tok.chat_template)
    eos = trainer_tok.eos_token_id
    for raw in PAIRS:
        pair = preference_pair(raw)
        tokens = len(_sides(trainer_tok, pair)[0])
        assert counter.prompt_tokens(pair) == tokens, raw
        assert [[eos if t == -1 else t for t in side] for side in counter.sides(pair)] == list(
            _sides(trainer_tok, pair)), raw
        # The submit's rule is the trainer's: at seq_len = tokens + 1 the pair is dropped, at tokens + 2 kept.
        for seq_len, dropped in ((tokens + 1, True), (tokens + 2, False)):
            stats = PairStats()
            kept = encode_pair(trainer_tok, pair, seq_len, stats)
            assert (kept is None and stats.dropped.get(PROMPT_TOO_LONG) == 1) == dropped, (raw, seq_len)


@pytest.mark.parametrize("seq_len", [8, 12, 24, 200])
def test_the_dry_runs_survey_keeps_cuts_and_drops_as_the_trainer_does(tokenizer_dir: Path, seq_len: int) -> None:
    trainer_tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    counter = counter_of({n: (tokenizer_dir / n).read_bytes() for n in (TOKENIZER, CONFIG, TEMPLATE)
                          if (tokenizer_dir / n).is_file()})
    assert counter is not None
    # Beside PAIRS, one whose answers differ only past what a short seq_len leaves them.
    raws = [*PAIRS, {"prompt": "Hi", "chosen": " blue blue blue blue blue red",
                     "rejected": " blue blue blue blue blue"}]
    stats, survey = PairStats(), Survey()
    for number, raw in enumerate(raws, 1):
        pair = preference_pair(raw)
        encode_pair(trainer_tok, pair, seq_len, stats)
        survey.add(number, *counter.sides(pair), seq_len)
    want = stats.as_dict()
    assert (survey.pairs_kept, survey.pairs_truncated, survey.dropped, survey.tokens) == (
        want["pairs_kept"], want["pairs_truncated"], want["dropped"], want["tokens"])
    assert len(survey.dropped_lines) == min(DROPPED_LINES_SHOWN, want["pairs_dropped"])


def test_no_tokenizer_json_or_one_that_does_not_load_is_no_counter() -> None:
    # The check then refuses nothing: the trainer says what is wrong with the tokenizer.
    assert counter_of({CONFIG: b"{}"}) is None
    assert counter_of({TOKENIZER: b"not a tokenizer"}) is None
    assert counter_of({TOKENIZER: b'{"version": "1.0"}', CONFIG: b"{"}) is None


def test_a_store_out_of_reach_lets_the_submit_through_at_once(tokenizer_dir: Path) -> None:
    """The pairs are in a store nothing answers for: the check refuses nothing and gives up within its bound, as
    the submit would go without it (the job's worker waits for the store)."""
    job = resolve(JobSpec.model_validate({"model": str(tokenizer_dir), "data": {"train": "file-x"},
                                          "method": {"type": "dpo"}, "hyperparameters": {"seq_len": 8}}))
    job.inputs["data.train"] = StoredInput(file_id="file-x", key="files/file-x", bytes=10, sha256="0" * 64)
    store = Store(StoreConfig(url="s3://bucket/p", options={"endpoint": f"http://127.0.0.1:{free_port()}"}))
    began = time.monotonic()
    assert anyio.run(check, job, store) == []
    assert anyio.run(survey, job, store) is None
    assert time.monotonic() - began < 4 * GIVE_UP_SECONDS
