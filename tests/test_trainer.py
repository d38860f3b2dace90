"""The trainer, end to end: the real `deepspeed` launcher runs `python -m trainer` on a tiny Llama, on CPU.

Two CPU ranks talk over gloo; nothing is mocked. Launches cost ~15 s each, so there are few of them.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# Plain `pytest` does not put the repo root on sys.path (tests/ has no package); the trainer lives there.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
LAUNCH_TIMEOUT = 300


def _corpus() -> str:
    """Real English text with no download: the docstrings of some standard-library modules."""
    import argparse
    import collections
    import json as json_mod
    import pathlib
    import random
    import re
    import textwrap

    docs: list[str] = []
    for mod in (argparse, collections, json_mod, pathlib, random, re, textwrap):
        for obj in (mod, *[getattr(mod, n) for n in dir(mod) if not n.startswith("_")]):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80 and doc not in docs:
                docs.append(doc)
    return "\n\n".join(docs)


@pytest.fixture(scope="session")
def corpus() -> str:
    return _corpus()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    from trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", corpus)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_run_spec(tmp: Path, job: dict[str, Any], *, job_dir: Path | None = None) -> Path:
    from trainer.dsconfig import resolve
    from trainer.spec import JobSpec, RunPaths, RunSpec

    job_dir = job_dir or tmp / "job"
    resolved = resolve(JobSpec.model_validate(job))
    run = RunSpec(job=resolved, paths=RunPaths(job_dir=str(job_dir), checkpoint_dir=str(job_dir / "checkpoints"),
                                               output_dir=str(job_dir / "output")))
    path = tmp / f"run-{len(list(tmp.glob('run-*.json')))}.json"
    path.write_text(run.model_dump_json(indent=2))
    return path


def _job(model: Path, train: Path, **overrides: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "model": str(model),
        "data": {"train": str(train), "format": "text"},
        "hyperparameters": {"max_steps": 30, "learning_rate": 3e-3, "warmup_steps": 3, "global_batch_size": 8,
                            "micro_batch_size": 2, "seq_len": 64, "seed": 7},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
        "resources": {"num_gpus": 2},
        "checkpointing": {"every_steps": 10, "keep_last": 2},
    }
    for key, value in overrides.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) and key in job else value
    return job


def _launch(spec_path: Path) -> tuple[int, list[dict[str, Any]], str]:
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
            "--master_port", str(_free_port()), "--module", "trainer", "--spec", str(spec_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    events = []
    for line in proc.stdout.splitlines():
        # The launcher prefixes nothing, but DeepSpeed and torch log free text to the same stdout.
        start = line.find('{"event"')
        if start >= 0:
            try:
                events.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                pass
    return proc.returncode, events, proc.stdout[-4000:] + proc.stderr[-4000:]


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def _assert_loads_and_generates(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok("Return a new", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(gen[0, ids["input_ids"].shape[1]:]), str)


def test_zero2_bf16_trains_checkpoints_and_exports(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    rc, events, tail = _launch(_write_run_spec(tmp_path, _job(tiny_model, train)))
    assert rc == 0, tail
    started = _of(events, "started")
    assert len(started) == 1 and started[0]["world_size"] == 2 and started[0]["resumed_from_step"] is None
    assert started[0]["total_steps"] == 30 and 0 < started[0]["packing_efficiency"] <= 1
    progress = _of(events, "progress")
    assert progress[0]["step"] == 1 and progress[-1]["step"] == 30
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "eta_seconds", "epoch"} <= progress[0].keys()
    assert progress[-1]["loss"] < progress[0]["loss"] - 0.5, [p["loss"] for p in progress]
    ckpts = _of(events, "checkpoint")
    assert [c["step"] for c in ckpts] == [10, 20, 30]
    ckpt_dir = tmp_path / "job" / "checkpoints"
    # keep_last=2: step 10 was pruned once step 30 committed.
    assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-00000020", "step-00000030"]
    assert json.loads((ckpt_dir / "step-00000030" / "COMMITTED").read_text())["step"] == 30
    out = tmp_path / "job" / "output"
    complete = json.loads((out / "COMPLETE").read_text())
    assert complete["step"] == 30 and "model.safetensors" in complete["files"]
    (done,) = _of(events, "completed")
    assert done["steps"] == 30 and done["output_dir"] == str(out)
    assert not _of(events, "error")
    _assert_loads_and_generates(out)
    (Path(os.environ["TRAINER_EVENTS_DUMP"]).write_text(json.dumps(events, indent=1))
     if "TRAINER_EVENTS_DUMP" in os.environ else None)


def test_resume_continues_from_committed_checkpoint(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    job = _job(tiny_model, train, hyperparameters={"max_steps": 4}, checkpointing={"every_steps": 4})
    rc, events, tail = _launch(_write_run_spec(tmp_path, job))
    assert rc == 0, tail
    # A crash mid-save leaves an uncommitted dir behind; resume must not pick it.
    (tmp_path / "job" / "checkpoints" / "step-00000005").mkdir()
    job = _job(tiny_model, train, hyperparameters={"max_steps": 7}, checkpointing={"every_steps": 4})
    rc, events, tail = _launch(_write_run_spec(tmp_path, job))
    assert rc == 0, tail
    (started,) = _of(events, "started")
    assert started["resumed_from_step"] == 4
    progress = _of(events, "progress")
    assert progress[0]["step"] == 5 and progress[-1]["step"] == 7


def test_zero3_fp32_exports_loadable_model(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    job = _job(tiny_model, train, hyperparameters={"max_steps": 6}, deepspeed={"zero_stage": 3, "precision": "fp32"},
               checkpointing={"every_steps": None})
    rc, events, tail = _launch(_write_run_spec(tmp_path, job))
    assert rc == 0, tail
    assert _of(events, "completed") and not _of(events, "checkpoint")
    _assert_loads_and_generates(tmp_path / "job" / "output")


def test_bad_jsonl_line_is_a_data_error(tmp_path: Path, tiny_model: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "a fine line"}\n{"text": "another"}\n{"text": broken\n')
    job = _job(tiny_model, train, data={"format": "jsonl"})
    rc, events, tail = _launch(_write_run_spec(tmp_path, job))
    assert rc != 0
    errors = _of(events, "error")
    assert errors, tail
    assert errors[0]["code"] == "data_error"
    assert "line 3" in errors[0]["message"] and str(train) in errors[0]["message"]
    assert not (tmp_path / "job" / "output" / "COMPLETE").exists()
