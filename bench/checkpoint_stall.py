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
"""

from __future__ import annotations

import argparse
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

    args = parser().parse_args(["--model", shape, "--zero", "2", "--steps", str(steps), "--work", str(work)])
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
        raise SystemExit(f"{mode}: the trainer exited {done.returncode}; see {job_dir / 'launcher.log'}")
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="demo", help="demo (CPU, two processes) or a bench/shapes.py GPU shape")
    p.add_argument("--store", choices=["s3", "file"], default="s3")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="rounds of every mode; each figure is the median")
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
        loops: dict[str, list[float]] = {mode: [] for mode in MODES}
        size: dict[str, int | None] = {}
        for _ in range(a.repeats):  # rounds of every mode in turn, so a slow minute of the machine hits all alike
            for mode in MODES:
                spec = base
                if mode == "none":
                    spec = base.model_copy(deep=True)
                    spec.job.spec.checkpointing.every_steps = None
                loops[mode].append(loop_seconds(run_mode(mode, spec, work, store, gpus), a.steps))
                tags = sorted((work / mode / "checkpoints").glob("step-*"))
                size[mode] = sum(f.stat().st_size for f in tags[-1].rglob("*") if f.is_file()) if tags else None
        rows: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            loop = statistics.median(loops[mode])
            rows[mode] = {"loop_s": round(loop, 3), "loop_s_runs": [round(x, 3) for x in loops[mode]],
                          "saves": 0 if mode == "none" else saves, "checkpoint_bytes": size[mode]}
            if mode != "none":
                rows[mode]["stall_s"] = round((loop - rows["none"]["loop_s"]) / saves, 3)
            print(json.dumps({"figure": "checkpoint stall", "shape": a.shape, "store": a.store, "mode": mode,
                              **rows[mode]}), flush=True)
        step = rows["none"]["loop_s"] / a.steps
        local, beside, sync = rows["local"], rows["beside"], rows["sync"]
        upload_s = sync["stall_s"] - local["stall_s"]
        print(json.dumps({
            "figure": "checkpoint beside training", "shape": a.shape, "store": a.store, "step_s": round(step, 4),
            "beyond_local_pct_of_step": round(100 * (beside["stall_s"] - local["stall_s"]) / step, 1),
            "target_pct": "<= 10", "sync_beyond_local_pct_of_step": round(100 * upload_s / step, 1),
            "upload_mb_s": round(sync["checkpoint_bytes"] / upload_s / 1e6, 1) if upload_s > 0 else None}),
            flush=True)
    finally:
        if server is not None:
            server.stop()
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
