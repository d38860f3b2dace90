"""A stand-in rank for tests/test_spare.py, run the two ways the worker starts ranks: by the DeepSpeed launcher
(`python -m tests.spare_probe`) and forked by a warm trainer (worker/spare.py, `entry`). It writes what a rank can
see of its start (environment, arguments, working directory, module state, limits) to `--out`/rank<R>.json, then
leaves a mark in its module and its environment, and optionally sleeps with a child of its own."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from worker.spare import WARM_MODULES

MARK: str | None = None  # set by a rank; a later attempt's rank must not find it


def main(argv: list[str]) -> int:
    global MARK
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--exit", type=int, default=0)
    a = p.parse_args(argv)
    # What the trainer imports before it could look at its environment (an import may set variables of its own).
    for name in WARM_MODULES:
        importlib.import_module(name)
    rank = int(os.environ.get("RANK", "-1"))
    seen = {"env": dict(os.environ), "argv": sys.argv[1:], "cwd": os.getcwd(), "mark": MARK, "pid": os.getpid(),
            "ppid": os.getppid(), "pgid": os.getpgid(0), "umask": os.umask(0o022),
            "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)), "local_rank": a.local_rank,
            "sched": os.sched_getscheduler(0),
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "sys_path0": sys.path[0]}
    MARK = f"rank {rank} of {a.out}"
    os.environ["SPARE_PROBE_LEAK"] = MARK
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"rank{rank}.json").write_text(json.dumps(seen))
    if a.sleep:
        child = subprocess.Popen(["sleep", str(a.sleep)])
        (a.out / f"child{rank}.pid").write_text(str(child.pid))
        time.sleep(a.sleep)
    return a.exit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
