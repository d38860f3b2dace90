"""What a checkpoint costs training: the step-time stall at a save when the upload to the artifact store runs beside
training, against the local save alone and against a save that waits for its upload (a synchronous save).

`python -m bench.checkpoint_stall [--shape demo|llama1b] [--store s3|file] [--steps 40] [--every 10]` runs the
real trainer under the DeepSpeed launcher four times on the same job, each in a fresh folder:

- `none`: no checkpoint at all: the training time every other mode is compared with;
- `local`: no store; the save is DeepSpeed's save on the node's disk (what every mode does first);
- `beside`: the store set; each node's first process uploads the checkpoint in a thread while training goes on;
- `sync`: the same, but the save returns only once the upload is committed (trainer/checkpoint.py's measuring seam).

`--shape demo` is `make demo`'s job (the tiny Llama, two CPU processes); `llama1b` is the Llama-3.2-1B shape of
bench/run_trainer.py (ZeRO-2, bf16, one GPU). The store is a moto S3 server this script starts (`s3`) or a folder
(`file`). The trainer reports progress every step for the first ten, then about once a second, so a stall is
measured on the whole loop rather than on single steps. One JSON line per mode, then one for the comparison:

- `loop_s`: the median over `--repeats` rounds (every mode in turn each round) of the time from the `started`
  event to the progress event of the last step (model load excluded; the save after the last step, which every
  mode makes, excluded);
- `saves`: the saves inside that window (steps `every`, 2×`every`, … below `--steps`);
- `stall_s`: (`loop_s` − `none`'s `loop_s`) / `saves`: what one save adds to training;
- `step_s`: `none`'s `loop_s` / `--steps`;
- `beyond_local_pct_of_step`: (`beside`'s stall − `local`'s stall) / `step_s` × 100 (target ≤ 10);
- `upload_mb_s`: a checkpoint's bytes (10^6 per MB) over (`sync`'s stall − `local`'s stall): the upload and commit
  alone, as the sync mode waits for them.

Beside these, each run is measured against itself, which no slow minute of the machine between runs can move:

- `in_run_step_s`: the median time of one step before the first save, from the progress events after `--skip`
  steps (the first steps compile and warm the allocator);
- `in_run_stall_s`: (the time from step `--skip` to the last step − those steps × `in_run_step_s`) / `saves`: what
  one save, and whatever runs beside the steps after it, adds to that run;
- `in_run_beyond_local_pct_of_step`: (`beside`'s − `local`'s in-run stall) / `local`'s step × 100.

Each run prints its own line as it ends (`"figure": "checkpoint stall run"`), so a cut-off run keeps what it
measured. A run's folder and its objects in a folder store are removed once measured: a 1B checkpoint is ~17 GB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from contract.codes import EventKind
from contract.deepspeed import ResolveLimits, resolve
from contract.spec import JobSpec, RunPaths, RunSpec
from trainer.checkpoint import SYNC_UPLOAD_ENV

ROOT = Path(__file__).resolve().parent.parent
MODES = ("none", "local", "beside", "sync")


def demo_spec(work: Path, steps: int, every: int) -> RunSpec:
    from scripts.demo import prepare_assets

    prepare_assets(work / "models", work / "data")
    job = json.loads((ROOT / "examples" / "demo-job.json").read_text())
    job["model"] = str(work / "models" / "tiny-llama")
    job["data"] = {**job["data"], "train": str(work / "data" / "demo" / "train.txt"),
                   "validation": str(work / "data" / "demo" / "validation.txt")}
    job["hyperparameters"] = {**job["hyperparameters"], "max_steps": steps, "eval_every_steps": None}
    job["checkpointing"] = {"every_steps": every, "keep_last": 2}
    resolved = resolve(JobSpec.model_validate(job), limits=ResolveLimits())
    return RunSpec(job=resolved, paths={"job_dir": "", "checkpoint_dir": "", "output_dir": ""})


def gpu_spec(work: Path, shape: str, steps: int, every: int) -> RunSpec:
    from bench.run_trainer import build_run, parser

    # Micro batch 32: what the job's `auto` probe picks for this shape on an H200, without the probe's start-up.
    args = parser().parse_args(["--model", shape, "--zero", "2", "--steps", str(steps), "--micro", "32",
                                "--work", str(work)])
    run = RunSpec.model_validate_json(build_run(args, work).read_text())
    # One checkpoint kept: a 1B full fine-tune's checkpoint is ~17 GB, and the store holds a copy of it.
    run.job.spec.checkpointing = run.job.spec.checkpointing.model_copy(update={"every_steps": every, "keep_last": 1})
    return run


def run_mode(mode: str, base: RunSpec, work: Path, store: dict[str, Any] | None, gpus: int) -> list[dict[str, Any]]:
    job_dir = work / mode
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(parents=True)
    paths: dict[str, Any] = {"job_dir": str(job_dir), "checkpoint_dir": str(job_dir / "checkpoints"),
                             "output_dir": str(job_dir / "output")}
    if store is not None and mode != "local":
        paths["store"] = {**store, "job_id": f"job_{uuid.uuid4().hex[:20]}"}
    spec = base.model_copy(update={"paths": RunPaths.model_validate(paths)})
    spec_file = job_dir / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop(SYNC_UPLOAD_ENV, None)
    if mode == "sync":
        env[SYNC_UPLOAD_ENV] = "1"
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--module", "trainer",
            "--spec", str(spec_file)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=job_dir)
    (job_dir / "launcher.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"{mode}: the trainer exited {done.returncode}; see {job_dir / 'launcher.log'}\n{tail}")
    events = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


def loop_seconds(events: list[dict[str, Any]], steps: int) -> float:
    started = next(e["ts"] for e in events if e.get("event") == EventKind.STARTED)
    last = next(e["ts"] for e in events if e.get("event") == EventKind.PROGRESS and e["step"] == steps)
    return last - started


def in_run(events: list[dict[str, Any]], steps: int, skip: int, first_save: int | None,
           saves: int) -> dict[str, float | None]:
    """The run against itself: its step time before the first save, and what each save added after it."""
    ts = {e["step"]: e["ts"] for e in events if e.get("event") == EventKind.PROGRESS}
    # Progress comes every step for the first ten, then about once a second: an interval may hold several steps.
    seen = sorted(s for s in ts if s >= skip)
    before = [(b - a, ts[b] - ts[a]) for a, b in itertools.pairwise(seen) if first_save is None or b <= first_save]
    if not before or skip not in ts or steps not in ts:
        return {"in_run_step_s": None, "in_run_stall_s": None}
    step = statistics.median(dt / n for n, dt in before)
    extra = (ts[steps] - ts[skip]) - (steps - skip) * step
    return {"in_run_step_s": round(step, 4), "in_run_stall_s": round(extra / saves, 3) if saves else None}


def checkpoint_bytes(folder: Path) -> int | None:
    tags = sorted(folder.glob("step-*"))
    return sum(f.stat().st_size for f in tags[-1].rglob("*") if f.is_file()) if tags else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="demo", help="demo (CPU, two processes) or a bench/shapes.py GPU shape")
    p.add_argument("--store", choices=["s3", "file"], default="s3")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="rounds of every mode; each figure is the median")
    p.add_argument("--skip", type=int, default=5, help="steps before the in-run step time is measured")
    p.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join(MODES))
    p.add_argument("--work", default=None)
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="ft-ckpt-stall-"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        if a.shape == "demo":
            base, gpus = demo_spec(work, a.steps, a.every), 2
        else:
            base, gpus = gpu_spec(work, a.shape, a.steps, a.every), 1
        if a.store == "s3":
            from tests.s3_support import CREDENTIALS, S3Server

            os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
            server = S3Server(work)
            store = {"url": f"s3://{server.bucket()}/bench", "endpoint": server.endpoint}
        else:
            store = {"url": f"file://{work / 'store'}", "endpoint": None}
        saves = len(range(a.every, a.steps, a.every))
        first_save = a.every if saves else None
        modes = [m for m in MODES if m in a.modes.split(",")]
        loops: dict[str, list[float]] = {mode: [] for mode in modes}
        stalls: dict[str, list[float]] = {mode: [] for mode in modes}
        steps_s: dict[str, list[float]] = {mode: [] for mode in modes}
        size: dict[str, int | None] = {}
        for _ in range(a.repeats):  # rounds of every mode in turn, so a slow minute of the machine hits all alike
            for mode in modes:
                spec = base
                if mode == "none":
                    spec = base.model_copy(deep=True)
                    spec.job.spec.checkpointing.every_steps = None
                events = run_mode(mode, spec, work, store, gpus)
                loops[mode].append(loop_seconds(events, a.steps))
                size[mode] = checkpoint_bytes(work / mode / "checkpoints")
                own = in_run(events, a.steps, a.skip, first_save, 0 if mode == "none" else saves)
                if own["in_run_step_s"] is not None:
                    steps_s[mode].append(own["in_run_step_s"])
                if own["in_run_stall_s"] is not None:
                    stalls[mode].append(own["in_run_stall_s"])
                print(json.dumps({"figure": "checkpoint stall run", "shape": a.shape, "store": a.store, "mode": mode,
                                  "loop_s": round(loops[mode][-1], 3), **own, "checkpoint_bytes": size[mode]}),
                      flush=True)
                shutil.rmtree(work / mode, ignore_errors=True)
                if a.store == "file":
                    shutil.rmtree(work / "store", ignore_errors=True)
        rows: dict[str, dict[str, Any]] = {}
        for mode in modes:
            loop = statistics.median(loops[mode])
            rows[mode] = {"loop_s": round(loop, 3), "loop_s_runs": [round(x, 3) for x in loops[mode]],
                          "saves": 0 if mode == "none" else saves, "checkpoint_bytes": size[mode],
                          "in_run_step_s": round(statistics.median(steps_s[mode]), 4) if steps_s[mode] else None,
                          "in_run_stall_s": round(statistics.median(stalls[mode]), 3) if stalls[mode] else None}
            if mode != "none" and "none" in rows:
                rows[mode]["stall_s"] = round((loop - rows["none"]["loop_s"]) / saves, 3)
            print(json.dumps({"figure": "checkpoint stall", "shape": a.shape, "store": a.store, "mode": mode,
                              **rows[mode]}), flush=True)
        summary: dict[str, Any] = {"figure": "checkpoint beside training", "shape": a.shape, "store": a.store,
                                   "target_pct": "<= 10"}
        if {"local", "beside"} <= rows.keys() and rows["local"]["in_run_step_s"]:
            local, beside = rows["local"], rows["beside"]
            summary["in_run_step_s"] = local["in_run_step_s"]
            summary["in_run_beyond_local_pct_of_step"] = round(
                100 * (beside["in_run_stall_s"] - local["in_run_stall_s"]) / local["in_run_step_s"], 1)
            if "sync" in rows:
                upload = rows["sync"]["in_run_stall_s"] - local["in_run_stall_s"]
                summary["in_run_sync_beyond_local_pct_of_step"] = round(100 * upload / local["in_run_step_s"], 1)
                if upload > 0 and rows["sync"]["checkpoint_bytes"]:
                    summary["in_run_upload_mb_s"] = round(rows["sync"]["checkpoint_bytes"] / upload / 1e6, 1)
        if {"none", "local", "beside"} <= rows.keys():
            step = rows["none"]["loop_s"] / a.steps
            local, beside = rows["local"], rows["beside"]
            summary["step_s"] = round(step, 4)
            summary["beyond_local_pct_of_step"] = round(100 * (beside["stall_s"] - local["stall_s"]) / step, 1)
            if "sync" in rows:
                upload_s = rows["sync"]["stall_s"] - local["stall_s"]
                summary["sync_beyond_local_pct_of_step"] = round(100 * upload_s / step, 1)
                summary["upload_mb_s"] = (round(rows["sync"]["checkpoint_bytes"] / upload_s / 1e6, 1)
                                          if upload_s > 0 else None)
        print(json.dumps(summary), flush=True)
    finally:
        if server is not None:
            server.stop()
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
