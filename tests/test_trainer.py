"""The trainer, end to end: the real `deepspeed` launcher runs `python -m trainer` on a tiny Llama, on CPU.

Two CPU ranks talk over gloo; nothing is mocked. Launches cost ~15-60 s each, so there are few of them: training,
checkpoints, export, evaluation and resume in every ZeRO configuration are in tests/test_trainer_matrix.py (one
launch per configuration, shared by its checks); here are SIGTERM without periodic checkpoints, a data error, and
the data code's unit tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("tests.trainer_support")  # its asserts report values, like a test module's

from tests.trainer_support import (  # noqa: E402
    LAUNCH_TIMEOUT,
    REPO,
    free_port,
    launch,
    make_job,
    of,
    write_run_spec,
)

# The `corpus` and `tiny_model` fixtures.
pytest_plugins = ["tests.trainer_support"]


def test_sigterm_checkpoints_at_step_boundary_and_exits(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    job = make_job(tiny_model, train, hyperparameters={"max_steps": 100000}, checkpointing={"every_steps": None})
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
            "--master_port", str(free_port()), "--module", "trainer", "--spec", str(write_run_spec(tmp_path, job))]
    # Its own session, so the test can signal the launcher and every rank at once, as a supervisor must:
    # the single-node runner does not forward SIGTERM to the ranks.
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    # A hung run must fail the test, not hang it: the stdout loop below only ends at EOF.
    watchdog = threading.Timer(LAUNCH_TIMEOUT, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    events: list[dict[str, Any]] = []
    sent = False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"event"'):
                events.append(json.loads(line))
                if not sent and events[-1]["event"] == "progress" and events[-1]["step"] >= 3:
                    os.killpg(proc.pid, signal.SIGTERM)
                    sent = True
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (stopped,) = of(events, "interrupted")
    (ckpt,) = of(events, "checkpoint")
    assert ckpt["step"] == stopped["step"] >= 3
    assert (Path(ckpt["path"]) / "COMMITTED").is_file()
    assert ckpt["save_s"] > 0 and ckpt["waited_s"] == 0 and "upload_s" not in ckpt, ckpt
    assert proc.returncode != 0 and not of(events, "completed")


def test_bad_jsonl_line_is_a_data_error(tmp_path: Path, tiny_model: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "a fine line"}\n{"text": "another"}\n{"text": broken\n')
    job = make_job(tiny_model, train, data={"format": "jsonl"})
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc != 0
    errors = of(events, "error")
    assert errors, tail
    assert errors[0]["code"] == "data_error"
    assert "line 3" in errors[0]["message"] and str(train) in errors[0]["message"]
    assert not (tmp_path / "job" / "output" / "COMPLETE").exists()


# --- Data unit tests: no launcher, just the tokenizer and (for the boundary check) the tiny model. ---


def test_packing_restarts_positions_and_keeps_documents_apart(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import IGNORE, encode_text, pack

    tok = AutoTokenizer.from_pretrained(tiny_model)
    docs = ["The quick brown fox jumps over the lazy dog.", "Return a new list of the items.",
            "A short one.", "Parse the command line arguments and return them as a namespace object."]
    examples = [encode_text(tok, d) for d in docs]
    lengths = [len(ids) for ids, _ in examples]
    seq_len = 32
    blocks = pack(examples, seq_len, tok.pad_token_id, packing=True)
    flat_pos = blocks.position_ids.flatten().tolist()
    # Each document starts at position 0 (also where it spills into the next block) and counts up.
    expected: list[int] = []
    for n in lengths:
        for i in range(n):
            expected.append(0 if (len(expected) % seq_len == 0 or i == 0) else expected[-1] + 1)
    assert flat_pos[: sum(lengths)] == expected
    assert int(blocks.real_tokens.sum()) == sum(lengths)
    assert blocks.packing_efficiency == pytest.approx(sum(lengths) / blocks.input_ids.numel())
    # No target crosses a document boundary, padding is never a target.
    assert (blocks.labels[blocks.position_ids == 0] == IGNORE).all()
    assert (blocks.labels.flatten()[sum(lengths):] == IGNORE).all()

    # Numerically: a document packed after another gets the same logits as the document alone.
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    first, second = examples[0][0], examples[1][0]
    packed = pack([(first, first), (second, second)], len(first) + len(second), tok.pad_token_id, True)
    with torch.no_grad():
        together = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                         use_cache=False).logits[0, len(first):]
        alone = model(input_ids=torch.tensor([second])).logits[0]
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_unpacked_rows_are_padded_and_masked(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.data import IGNORE, encode_text, pack

    tok = AutoTokenizer.from_pretrained(tiny_model)
    examples = [encode_text(tok, d) for d in ("one small doc", "and another small document here")]
    blocks = pack(examples, 40, tok.pad_token_id, packing=False)
    assert blocks.input_ids.shape == (2, 40) and blocks.attention_mask is not None
    for row, (ids, _) in enumerate(examples):
        assert blocks.input_ids[row, : len(ids)].tolist() == ids
        assert blocks.attention_mask[row].sum() == len(ids)
        assert (blocks.labels[row, len(ids):] == IGNORE).all()


@pytest.mark.parametrize("with_template", [False, True])
def test_chat_labels_only_assistant_turns(tiny_model: Path, with_template: bool) -> None:
    from transformers import AutoTokenizer

    from trainer.data import IGNORE, encode_chat

    tok = AutoTokenizer.from_pretrained(tiny_model)
    if with_template:
        tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
                {"role": "assistant", "content": "Six."}]
    ids, labels = encode_chat(tok, messages)
    assert len(ids) == len(labels) and ids[-1] == tok.eos_token_id
    learned = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])
    if with_template:
        assert learned == "[assistant] Four.\n[assistant] Six.\n<|endoftext|>"
    else:
        assert learned == "<|assistant|>\nFour.\n<|assistant|>\nSix.\n<|endoftext|>"
    assert "two plus two" in tok.decode(ids) and "two plus two" not in learned


@pytest.mark.parametrize("with_template", [False, True])
def test_an_assistant_turn_of_weight_0_is_not_learned(tiny_model: Path, with_template: bool) -> None:
    from transformers import AutoTokenizer

    from trainer.data import IGNORE, encode_chat

    tok = AutoTokenizer.from_pretrained(tiny_model)
    if with_template:
        tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "user", "content": "Two plus two?", "name": "ann"},
                {"role": "assistant", "content": "Five.", "weight": 0}, {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": "Four.", "weight": 1}]
    ids, labels = encode_chat(tok, messages)
    learned = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])
    assert "Four." in learned and "Five." not in learned and "Five." in tok.decode(ids)
    # Weight 0 on the last answer: not even the end of the conversation is learned.
    ids, labels = encode_chat(tok, messages[:2])
    assert set(labels) == {IGNORE}


def test_a_completion_is_learned_given_its_prompt(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.data import IGNORE, encode_completion

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids, labels = encode_completion(tok, {"prompt": "Two plus two is", "completion": " four."})
    learned = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    assert tok.decode(ids).startswith("Two plus two is four.") and ids[-1] == tok.eos_token_id
    assert tok.decode(learned) == " four.<|endoftext|>"
    assert labels[: len(ids) - len(learned)] == [IGNORE] * (len(ids) - len(learned))


def test_data_errors_name_file_and_line(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from contract.spec import DataSpec, RunPaths
    from trainer.data import load_blocks
    from trainer.errors import DataError

    tok = AutoTokenizer.from_pretrained(tiny_model)
    paths = RunPaths(job_dir=str(tmp_path), checkpoint_dir=str(tmp_path), output_dir=str(tmp_path))
    cases = {
        "missing.jsonl": (None, "does not exist"),
        "empty.jsonl": ("\n  \n", "is empty"),
        "nofield.jsonl": ('{"text": "ok"}\n{"body": "no text"}\n', "line 2: missing field 'text'"),
        "chat.jsonl": ('{"messages": [{"role": "user"}]}\n', "line 1: each message"),
    }
    for name, (content, expected) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        fmt = "chat" if name.startswith("chat") else "jsonl"
        with pytest.raises(DataError, match=expected) as info:
            load_blocks(DataSpec(train=str(tmp_path / name), format=fmt), paths, tok, 32, 0)
        assert str(tmp_path / name) in str(info.value)
