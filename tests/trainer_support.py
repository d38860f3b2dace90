"""Shared pieces of the trainer tests: a tiny model, local text, run specs, and the real `deepspeed` launcher.

Test modules import the fixtures (`corpus`, `tiny_model`) by name so pytest finds them there.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# Plain `pytest` does not put the repo root on sys.path (tests/ has no package); the trainer lives there.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
LAUNCH_TIMEOUT = 300  # a launch here takes under a minute; the ops are built at install time

Event = dict[str, Any]


def corpus_text() -> str:
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
    return corpus_text()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    from trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", corpus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_run_spec(tmp: Path, job: dict[str, Any], *, job_dir: Path | None = None) -> Path:
    from contract.deepspeed import resolve
    from contract.spec import JobSpec, RunPaths, RunSpec

    job_dir = job_dir or tmp / "job"
    resolved = resolve(JobSpec.model_validate(job))
    run = RunSpec(job=resolved, paths=RunPaths(job_dir=str(job_dir), checkpoint_dir=str(job_dir / "checkpoints"),
                                               output_dir=str(job_dir / "output")))
    path = tmp / f"run-{len(list(tmp.glob('run-*.json')))}.json"
    path.write_text(run.model_dump_json(indent=2))
    return path


def make_job(model: Path, train: Path, **overrides: Any) -> dict[str, Any]:
    """A small ZeRO-2 bf16 job on two processes; each override dict is merged into its section."""
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


def parse_event(line: str) -> Event | None:
    # DeepSpeed and torch log free text to the same stdout; an event is the JSON object on its line.
    start = line.find('{"event"')
    if start < 0:
        return None
    try:
        return json.loads(line[start:])
    except json.JSONDecodeError:
        return None


def ops_dir() -> Path:
    """The folder `make install` built DeepSpeed's ops into, so no launch here compiles them again. An op
    this machine became able to build since (libaio-dev installed later) is built first, by one process at a
    time (worker.prebuild), as a worker does at start: never by two launches' ranks at once."""
    from worker import prebuild
    from worker.ops import extensions_dir
    from worker.settings import WorkerSettings

    folder = extensions_dir(WorkerSettings())
    prebuild.ensure(folder)
    return folder


def launch(spec_path: Path, *, procs: int = 2,
           on_event: Callable[[Event, subprocess.Popen[str]], None] | None = None) -> tuple[int, list[Event], str]:
    """Run the trainer under the real launcher on `procs` CPU processes; returns (exit code, events, tail of
    stdout + stderr).

    The launcher gets its own session so `on_event` can signal it and every rank at once (`os.killpg`), as a
    supervisor must: the single-node runner does not forward SIGTERM to the ranks.
    """
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(procs),
            "--master_port", str(free_port()), "--module", "trainer", "--spec", str(spec_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(ops_dir())}
    events: list[Event] = []
    lines: list[str] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        # A hung run must fail the test, not hang it: the stdout loop below only ends at EOF.
        watchdog = threading.Timer(LAUNCH_TIMEOUT, lambda: os.killpg(proc.pid, signal.SIGKILL))
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                event = parse_event(line)
                if event is not None:
                    events.append(event)
                    if on_event is not None:
                        on_event(event, proc)
            proc.wait(timeout=60)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.seek(0)
        tail = "".join(lines)[-4000:] + err.read()[-4000:]
    return proc.returncode, events, tail


def launch_gang(nodes: list[tuple[Path, int]], *,
                on_event: Callable[[Event, list[subprocess.Popen[str]]], None] | None = None,
                ) -> tuple[list[int], list[Event], str]:
    """A multi-node run on this machine: one launcher per (run spec, processes), each started as a worker starts
    its node's part (`--no_ssh`, its own `--node_rank`, node 0's address and port, the same hostfile), each with
    its own session. Returns (exit codes, events of every node in arrival order, tails). Each spec names its
    node's own folders, so nodes share a disk only where their specs name the same one."""
    from worker.gang import hostfile_text

    folder = Path(tempfile.mkdtemp(prefix="gang-"))
    hostfile = folder / "hostfile"
    hostfile.write_text(hostfile_text([(f"node-{i}", procs) for i, (_, procs) in enumerate(nodes)]))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(ops_dir())}
    events: list[Event] = []
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    errs = [(folder / f"stderr-{i}").open("w+") for i in range(len(nodes))]
    for i, (spec_path, _) in enumerate(nodes):
        argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                "--node_rank", str(i), "--master_addr", "127.0.0.1", "--master_port", str(port),
                "--module", "trainer", "--spec", str(spec_path)]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=errs[i], text=True,
                                      start_new_session=True))
    lines: list[list[str]] = [[] for _ in nodes]

    def pump(i: int) -> None:
        stdout = procs[i].stdout
        assert stdout is not None
        for line in stdout:
            lines[i].append(line)
            event = parse_event(line)
            if event is not None:
                with lock:
                    events.append(event)
                    if on_event is not None:
                        on_event(event, procs)

    def kill_all() -> None:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(LAUNCH_TIMEOUT, kill_all)
    watchdog.start()
    pumps = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(len(nodes))]
    try:
        for t in pumps:
            t.start()
        for t in pumps:
            t.join()
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        kill_all()
        for proc in procs:
            proc.wait()
    tails = []
    for i, err in enumerate(errs):
        err.seek(0)
        tails.append(f"--- node {i} ---\n" + "".join(lines[i])[-3000:] + err.read()[-3000:])
        err.close()
    return [proc.returncode for proc in procs], events, "\n".join(tails)


def of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e["event"] == kind]


def assert_loads_and_generates(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok("Return a new", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(gen[0, ids["input_ids"].shape[1]:]), str)


def stop_after_checkpoint(step: int) -> Callable[[Event, subprocess.Popen[str]], None]:
    """An `on_event` for `launch`: SIGTERM to the launcher and every rank once the checkpoint of `step` is
    committed. The trainer honours it at the next optimizer-step boundary, checkpointed."""
    def on_event(event: Event, proc: subprocess.Popen[str]) -> None:
        if event["event"] == "checkpoint" and event["step"] == step:
            os.killpg(proc.pid, signal.SIGTERM)
    return on_event


# --- A small standard job and what every successful run of it must show (tests/test_trainer_matrix.py and
# tests/test_trainer_options.py). ---

STEPS = 12


def small_job(model: Path, train: Path, **overrides: Any) -> dict[str, Any]:
    """12 steps of global batch 8 (micro 2 x accumulation 2 x 2 ranks), seq_len 64, a 10% validation split
    evaluated every 6 steps, no checkpoints unless an override asks for them."""
    base = make_job(model, train, data={"validation_fraction": 0.1},
                    hyperparameters={"max_steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 2,
                                     "eval_every_steps": 6},
                    checkpointing={"every_steps": None})
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return base


def train_file(tmp_path: Path, corpus: str) -> Path:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    return train


def assert_loss_falls(events: list[Event]) -> None:
    losses = [p["loss"] for p in of(events, "progress")]
    assert len(losses) >= 6 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def assert_eval_events(events: list[Event], steps: list[int]) -> None:
    evals = of(events, "eval")
    assert [e["step"] for e in evals] == steps, evals
    for e in evals:
        assert math.isfinite(e["loss"]) and e["loss"] > 0
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]), rel=1e-9)


def assert_completed(events: list[Event], tail: str, out: Path, steps: int) -> None:
    assert not of(events, "error"), tail
    (done,) = of(events, "completed")
    assert done["steps"] == steps and done["output_dir"] == str(out)
    assert json.loads((out / "COMPLETE").read_text())["step"] == steps


def train_and_check(tmp_path: Path, job: dict[str, Any]) -> list[Event]:
    """Launch a standard job without checkpoints and check what every successful one must show: loss falls,
    evals at 6 and the end, no checkpoint (checkpointing.every_steps None), completion marker, and an export
    that loads and generates."""
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    assert_loss_falls(events)
    # The validation split (validation_fraction) is evaluated every 6 steps and once at the end.
    assert_eval_events(events, [6, STEPS])
    assert not of(events, "checkpoint")
    out = tmp_path / "job" / "output"
    assert_completed(events, tail, out, STEPS)
    assert_loads_and_generates(out)
    return events
