"""What committing one checkpoint to the store costs in CPU: the uploading thread's own CPU time, and the S3 server's.

`python -m bench.commit_cost [--store s3|file] [--commits 20]` saves one real checkpoint of `make demo`'s job
(the tiny Llama, two CPU processes, ZeRO-2) with the trainer under the DeepSpeed launcher, then commits that
folder `--commits` times through the trainer's own uploader (trainer/uploader.py: upload, fence check, manifest,
`keep_last` 2 pruning) to a folder store or to a moto S3 server this script starts, one commit at a time in a
thread, as the trainer runs it. One JSON line per store, over the commits after the first (which creates the
bucket's first keys):

- `thread_cpu_ms`: the median CPU time of the uploading thread per commit (`time.thread_time`): what the commit
  takes from the training process itself (the part lists, the fence, the manifest, pruning);
- `push_cpu_ms`: the median CPU time (user + system) of the `store.push` process that moves the bytes (one
  process for all commits, as in the trainer: its start-up falls in the first commit): what the upload takes from
  the host's cores beside training, outside the training process;
- `wall_ms`: the median wall time per commit;
- `server_cpu_ms`: the median CPU time (user + system) the S3 server process spent per commit; on a real
  deployment that is another machine's, on this one it shares the training's cores;
- `requests`: the requests the S3 server logged per commit (median).

The stall a save adds to training beyond the local save (bench/checkpoint_stall.py) cannot be below the CPU the
upload takes where every core is training, as on this 2-core machine; these figures say how much that is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.checkpoint_stall import demo_spec, run_mode
from contract.storage import StoreConfig
from store.objects import Store
from trainer.uploader import Pending, Uploads


def push_cpu() -> float:
    """CPU seconds of this process's `store.push` child so far (0 before it started)."""
    total = 0.0
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "store.push" in child.cmdline():
                total += sum(child.cpu_times()[:2])
    return total


def commit_times(store: Store, tag_dir: Path, commits: int, server: Any) -> list[dict[str, float]]:
    files = sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*") if p.is_file())
    uploads = Uploads(store, "job_commitcost", 1, rank=0, local_rank=0, node_rank=0, num_nodes=1)
    proc = psutil.Process(server.proc.pid) if server is not None else None
    log = server.log_path if server is not None else None
    rows: list[dict[str, float]] = []

    def one(step: int, into: dict[str, float]) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        pushed = push_cpu()
        pending = Pending(f"step-{step:08d}", step, {"step": step}, tag_dir, files, 2, str(tag_dir))
        uploads._run(pending)
        into["thread_cpu_ms"] = (time.thread_time() - cpu) * 1e3
        into["push_cpu_ms"] = (push_cpu() - pushed) * 1e3
        into["wall_ms"] = (time.perf_counter() - wall) * 1e3

    for i in range(commits):
        row: dict[str, float] = {}
        before = sum(proc.cpu_times()[:2]) if proc else 0.0
        lines = log.read_text(errors="replace").count("\n") if log else 0
        thread = threading.Thread(target=one, args=((i + 1) * 10, row))
        with contextlib.redirect_stdout(io.StringIO()):  # the uploader's `checkpoint` events
            thread.start()
            thread.join()
        if proc is not None and log is not None:
            time.sleep(0.05)  # the server's last log line and CPU tick
            row["server_cpu_ms"] = (sum(proc.cpu_times()[:2]) - before) * 1e3
            row["requests"] = log.read_text(errors="replace").count("\n") - lines
        rows.append(row)
    uploads.finish(10)  # ends its store.push process
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", choices=["s3", "file", "both"], default="both")
    p.add_argument("--commits", type=int, default=20)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-commit-cost-"))
    try:
        run_mode("local", demo_spec(work, 10, 10), work, None, 2)
        tag_dir = sorted((work / "local" / "checkpoints").glob("step-*"))[-1]
        size = sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file())
        count = sum(1 for f in tag_dir.rglob("*") if f.is_file())
        for kind in (["file", "s3"] if a.store == "both" else [a.store]):
            server = None
            if kind == "s3":
                from tests.s3_support import CREDENTIALS, S3Server

                os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
                server = S3Server(work)
                store = Store(server.config(server.bucket(), "bench"))
            else:
                store = Store(StoreConfig(url=f"file://{work / 'store'}"))
            try:
                rows = commit_times(store, tag_dir, a.commits, server)[1:]
            finally:
                if server is not None:
                    server.stop()
            out: dict[str, Any] = {"figure": "checkpoint commit cost", "store": kind, "checkpoint_bytes": size,
                                   "files": count, "commits": len(rows)}
            for name in ("thread_cpu_ms", "push_cpu_ms", "wall_ms", "server_cpu_ms", "requests"):
                if name in rows[0]:
                    out[name] = round(statistics.median(r[name] for r in rows), 1)
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
