"""What a checkpoint costs training: the step-time stall at a save when the upload to the artifact store runs beside
training, against the local save alone and against a save that waits for its upload (a synchronous save).

`python -m bench.checkpoint_stall [--shape demo|llama1b] [--store s3|file] [--steps 40] [--every 10]` runs the
real trainer under the DeepSpeed launcher on the same job once per mode, each in a fresh folder:

- `none`: no checkpoint at all;
- `local`: no store; the save is DeepSpeed's save on the node's disk (what every mode does first);
- `beside`: the store set; each node's first process uploads the checkpoint while training goes on (a thread
  that hands the bytes to its `store.push` process);
- `sync`: the same, but the save returns only once the upload is committed (trainer/checkpoint.py's measuring seam).

A mode written `MODE@N` runs with OMP_NUM_THREADS=N in the ranks, a variant summarized on its own: the trainer keeps
an operator's pool size, so `beside@16` on a 16-core host is the loop with torch's pool on every core, where by
default an accelerator's loop runs on one thread (trainer/threads.py).

`--shape demo` is `make demo`'s job (the tiny Llama, two CPU processes); `llama1b` is the Llama-3.2-1B shape of
bench/run_trainer.py (ZeRO-2, bf16, one GPU). The store is a moto S3 server this script starts (`s3`) or a folder
(`file`).

Each run is measured against itself, so neither a slow minute of the machine between runs nor a local save that
takes longer in one run than in another (a 17 GB write meeting the page cache) moves the figure. From the run's
events (the trainer reports progress every step for the first ten, then about once a second; the `checkpoint`
event says how long the save's own parts took):

- `step_s`: the median time of one step between step `--skip` (the first steps compile and warm the allocator)
  and the first save;
- `stall_s`: (the time from step `--skip` to step `--steps` − those steps × `step_s`) / `saves`: what one save,
  and whatever runs beside the steps after it, adds to training; `saves` are the saves inside that window (steps
  `every`, 2×`every`, … below `--steps`; the save after the last step is outside it);
- `save_s`: the local save itself (DeepSpeed's save, the local commit), as the trainer timed it, per save;
- `waited_s`: the time a save waited for the previous checkpoint's upload, per save (part of the stall);
- `beyond_local_s` = `stall_s` − `save_s`, and `beyond_local_pct_of_step` = `beyond_local_s` / `step_s` × 100:
  the issue's figure for `beside` (target ≤ 10); for `local` it is the method's own residual (about 0); for
  `sync` it is the upload and commit, which the synchronous save waits for;
- `upload_s`: how long the upload and commit took (beside training for `beside`);
- `overlap_cost_s` (and `overlap_cost_pct_of_step`): per save, the time the steps that ran beside its upload took
  beyond as many of the run's clean steps (`clean_step_s`, the median of every step that ran beside no save and no
  upload), over the uploads that ended before the last step (`overlap_saves`). The local save is not in it, and an
  error in the clean step time is multiplied only by `overlap_steps`, not by every step of the window. `local` gets
  the `--window` seconds after its save instead: its figure is the method's residual (what the page cache writing
  the save back costs, for one);
- `loop_s`: the time from the `started` event to the last step's progress; the summary's `vs_local_loop_s` for
  `beside` and `sync` compares runs with each other instead: (`loop_s` − `saves` × `save_s`) less the same for
  `local`, per save. It carries the runs' differences in start-up and step time, which the in-run figure does not.

With `--repeats`, rounds of every mode in turn; the summary line gives medians. `--summarize A.jsonl B.jsonl …`
prints the summary of run lines that several invocations wrote (one device call holds one or two rounds). Each run
prints its own line as it ends (`"figure": "checkpoint stall run"`), so a cut-off run keeps what it measured. A
run's folder and its objects in a folder store are removed once measured: a 1B checkpoint is ~17 GB.
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
from contract.storage import StoreConfig
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


def gpu_spec(work: Path, shape: str, steps: int, every: int, micro: int) -> RunSpec:
    from bench.run_trainer import build_run, parser

    # A fixed micro batch (32 is what the job's `auto` probe picks for the 1B shape on an H200; 16 fits an H100's
    # memory), without the probe's start-up.
    args = parser().parse_args(["--model", shape, "--zero", "2", "--steps", str(steps), "--micro", str(micro),
                                "--work", str(work)])
    run = RunSpec.model_validate_json(build_run(args, work).read_text())
    # One checkpoint kept: a 1B full fine-tune's checkpoint is ~17 GB, and the store holds a copy of it.
    run.job.spec.checkpointing = run.job.spec.checkpointing.model_copy(update={"every_steps": every, "keep_last": 1})
    return run


def run_mode(mode: str, base: RunSpec, work: Path, store: StoreConfig | None, gpus: int,
             threads: int | None = None) -> list[dict[str, Any]]:
    job_dir = work / mode
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(parents=True)
    paths: dict[str, Any] = {"job_dir": str(job_dir), "checkpoint_dir": str(job_dir / "checkpoints"),
                             "output_dir": str(job_dir / "output")}
    if store is not None and mode != "local":
        paths["store"] = {"config": store, "job_id": f"job_{uuid.uuid4().hex[:20]}"}
    spec = base.model_copy(update={"paths": RunPaths.model_validate(paths)})
    spec_file = job_dir / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop(SYNC_UPLOAD_ENV, None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch sizes its intra-op pool by it at start
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


def in_run(events: list[dict[str, Any]], steps: int, skip: int, every: int | None,
           window_s: float) -> dict[str, Any]:
    """The run against itself: its step time before the first save, and what each save in the window added."""
    ts = {e["step"]: e["ts"] for e in events if e.get("event") == EventKind.PROGRESS}
    saves = len(range(every, steps, every)) if every else 0
    # Progress comes every step for the first ten, then about once a second: an interval may hold several steps.
    seen = sorted(s for s in ts if s >= skip)
    before = [(b - a, ts[b] - ts[a]) for a, b in itertools.pairwise(seen) if not every or b <= every]
    if not before or skip not in ts or steps not in ts:
        raise SystemExit(f"no progress events at steps {skip} and {steps} with a step between them")
    step = statistics.median(dt / n for n, dt in before)
    row: dict[str, Any] = {"saves": saves, "step_s": round(step, 4), "loop_s": round(loop_seconds(events, steps), 3)}
    if not saves:
        return row
    marks = [e for e in events if e.get("event") == EventKind.CHECKPOINT and e["step"] < steps]
    if len(marks) != saves:
        raise SystemExit(f"{len(marks)} checkpoint events in the window, where {saves} saves were made")
    stall = ((ts[steps] - ts[skip]) - (steps - skip) * step) / saves
    save = statistics.mean(e["save_s"] for e in marks)
    row.update(stall_s=round(stall, 3), save_s=round(save, 3),
               waited_s=round(statistics.mean(e["waited_s"] for e in marks), 3),
               beyond_local_s=round(stall - save, 3),
               beyond_local_pct_of_step=round(100 * (stall - save) / step, 1))
    if "upload_s" in marks[0]:
        row["upload_s"] = round(statistics.median(e["upload_s"] for e in marks), 3)
    # The raw timings, so `--summarize` can run the estimators again over a device call's lines.
    row["progress_ts"] = {b: round(ts[b] - ts[skip], 3) for b in seen if b <= steps}
    row["checkpoint_ts"] = [round(e["ts"] - ts[skip], 3) for e in marks]
    row["save_steps"] = [e["step"] for e in marks]
    row["window_s"] = window_s
    row.update(overlap_of(row))
    return row


def overlap_of(row: dict[str, Any]) -> dict[str, Any]:
    """`overlap` over a run line's raw timings."""
    ts = {int(step): t for step, t in row["progress_ts"].items()}
    return overlap(ts, row["save_steps"], row["checkpoint_ts"], "upload_s" in row, row["window_s"])


def overlap(ts: dict[int, float], save_steps: list[int], commits: list[float], uploads: bool,
            window_s: float) -> dict[str, Any]:
    """The steps that ran while an upload did, against the run's clean steps (those that ran beside no save and no
    upload). Unlike `stall_s`, an error in the clean step time is multiplied only by the steps the upload
    overlapped, not by every step of the window, and the local save is not in it at all.

    A save ends about one step before the first progress after it; its upload ends at its `checkpoint` event (the
    commit). A run with no upload (`local`) gets a window of `window_s` after each save instead: what the same steps
    cost there (the page cache writing the save back, for one) is the method's residual. Only windows that closed
    before the last step are counted; the steps of one still open are neither clean nor counted.
    """
    seen = sorted(ts)
    pairs = [(a, b, b - a, ts[b] - ts[a]) for a, b in itertools.pairwise(seen)]
    before = [dt / n for a, b, n, dt in pairs if b <= save_steps[0]]
    if not before:
        return {}
    step0 = statistics.median(before)
    windows = []
    for save, commit in zip(save_steps, commits, strict=True):
        after = min((b for b in seen if b > save), default=None)
        if after is None:
            break
        start = ts[after] - step0
        windows.append((after, commit if uploads else start + window_s))
    inside: list[list[tuple[int, float]]] = [[] for _ in windows]
    clean = []
    for a, b, n, dt in pairs:
        if any(a <= save < b for save in save_steps):
            continue  # the interval that holds the save itself
        k = next((k for k, (after, end) in enumerate(windows) if a >= after and ts[a] < end), None)
        if k is None:
            clean.append(dt / n)
        else:
            inside[k].append((n, dt))
    closed = [rows for (_, end), rows in zip(windows, inside, strict=True) if end <= ts[seen[-1]] and rows]
    if not closed or len(clean) < 3:
        return {"overlap_saves": len(closed)}
    step = statistics.median(clean)
    steps_in = sum(n for rows in closed for n, _ in rows)
    cost = sum(dt - n * step for rows in closed for n, dt in rows) / len(closed)
    return {"overlap_saves": len(closed), "overlap_steps": steps_in, "clean_steps": len(clean),
            "clean_step_s": round(step, 4),
            "overlap_step_s": round(sum(dt for rows in closed for _, dt in rows) / steps_in, 4),
            "overlap_cost_s": round(cost, 3), "overlap_cost_pct_of_step": round(100 * cost / step, 1)}


def checkpoint_bytes(folder: Path) -> int | None:
    tags = sorted(folder.glob("step-*"))
    return sum(f.stat().st_size for f in tags[-1].rglob("*") if f.is_file()) if tags else None


def summarize(runs: dict[str, list[dict[str, Any]]], shape: str, store: str) -> dict[str, Any]:
    """Medians over the runs of each mode, and the comparisons between modes."""
    summary: dict[str, Any] = {"figure": "checkpoint stall", "shape": shape, "store": store,
                               "runs": {mode: len(rows) for mode, rows in runs.items()}, "target_beside_pct": "<= 10"}
    for mode, rows in runs.items():
        summary[mode] = {key: round(statistics.median(r[key] for r in rows), 4)
                         for key in rows[0]
                         if isinstance(rows[0][key], (int, float)) and all(key in r for r in rows)}
    local = summary.get("local")
    for mode in ("beside", "sync"):
        # The runs compared with each other instead: each loop less its own local saves, against `local`'s.
        if local and mode in summary and local.get("saves"):
            row, n = summary[mode], local["saves"]
            row["vs_local_loop_s"] = round(((row["loop_s"] - n * row["save_s"])
                                            - (local["loop_s"] - n * local["save_s"])) / n, 3)
    sync = summary.get("sync", {})
    if sync.get("beyond_local_s", 0) > 0 and sync.get("checkpoint_bytes"):
        summary["sync_upload_mb_s"] = round(sync["checkpoint_bytes"] / sync["beyond_local_s"] / 1e6, 1)
    return summary


def summarize_files(paths: list[str], window_s: float) -> None:
    """The summary of run lines other invocations printed (a device call fits a round or two, not five)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    shape = store = ""
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if row.get("figure") == "checkpoint stall run":
                shape, store, mode = row.pop("shape"), row.pop("store"), row.pop("mode")
                row.pop("figure")
                if threads := row.pop("threads", None):
                    mode = f"{mode}@{threads}"
                if "progress_ts" in row and "save_steps" not in row:
                    # Lines written before the run line named them: a save is one of the longest intervals.
                    ts = {int(step): t for step, t in row["progress_ts"].items()}
                    gaps = sorted(itertools.pairwise(sorted(ts)), key=lambda ab: ts[ab[1]] - ts[ab[0]])
                    row["save_steps"] = sorted(a for a, _ in gaps[-row["saves"]:])
                    row["window_s"] = window_s
                if "save_steps" in row:
                    row.update(overlap_of(row))
                runs.setdefault(mode, []).append(row)
    order = sorted(runs, key=lambda m: (MODES.index(m.partition("@")[0]), m))
    print(json.dumps(summarize({m: runs[m] for m in order}, shape, store)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="demo", help="demo (CPU, two processes) or a bench/shapes.py GPU shape")
    p.add_argument("--store", choices=["s3", "file"], default="s3")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="rounds of every mode; each figure is the median")
    p.add_argument("--skip", type=int, default=5, help="steps before the in-run step time is measured")
    p.add_argument("--modes", default=",".join(MODES),
                   help="a subset of " + ",".join(MODES) + ", in order; MODE@N: with OMP_NUM_THREADS=N")
    p.add_argument("--window", type=float, default=20.0,
                   help="seconds after a save that a run without an upload measures as its overlap (the residual)")
    p.add_argument("--micro", type=int, default=32, help="a GPU shape's micro batch (global batch 32)")
    p.add_argument("--work", default=None)
    p.add_argument("--store-root", default=None, help="the folder store's folder (default: under --work)")
    p.add_argument("--summarize", nargs="+", metavar="JSONL", help="only summarize these files' run lines")
    a = p.parse_args()
    if a.summarize:
        return summarize_files(a.summarize, a.window)
    work = Path(a.work or tempfile.mkdtemp(prefix="ft-ckpt-stall-"))
    work.mkdir(parents=True, exist_ok=True)
    store_root = Path(a.store_root) if a.store_root else work / "store"
    server = None
    try:
        if a.shape == "demo":
            base, gpus = demo_spec(work, a.steps, a.every), 2
        else:
            base, gpus = gpu_spec(work, a.shape, a.steps, a.every, a.micro), 1
        if a.store == "s3":
            from tests.s3_support import CREDENTIALS, S3Server

            os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
            server = S3Server(work)
            store = server.config(server.bucket(), "bench")
        else:
            store = StoreConfig(url=f"file://{store_root}")
        # In the order given: a device call cut off by its limit keeps the modes that ran first.
        modes = [m for m in a.modes.split(",") if m.partition("@")[0] in MODES]
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for _ in range(a.repeats):  # rounds of every mode in turn, so a slow minute of the machine hits all alike
            for variant in modes:
                mode, _, n = variant.partition("@")
                threads = int(n) if n else None
                spec = base
                if mode == "none":
                    spec = base.model_copy(deep=True)
                    spec.job.spec.checkpointing.every_steps = None
                events = run_mode(mode, spec, work, store, gpus, threads)
                row = in_run(events, a.steps, a.skip, None if mode == "none" else a.every, a.window)
                row["checkpoint_bytes"] = checkpoint_bytes(work / mode / "checkpoints")
                runs[variant].append(row)
                print(json.dumps({"figure": "checkpoint stall run", "shape": a.shape, "store": a.store, "mode": mode,
                                  "threads": threads, **row}), flush=True)
                shutil.rmtree(work / mode, ignore_errors=True)
                if a.store == "file":
                    shutil.rmtree(store_root, ignore_errors=True)
        print(json.dumps(summarize(runs, a.shape, a.store)), flush=True)
    finally:
        if server is not None:
            server.stop()
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
