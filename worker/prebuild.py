"""Build DeepSpeed's C++/CUDA ops once, at install time, into the folder the launched ranks use.

DeepSpeed compiles an op the first time a rank loads it, under a file lock, inside the job. On a small
node that first build takes minutes of a job's time limit, and a build killed half-way (a cancel, a
time limit) leaves the lock behind for every later job. Building here, before any job runs, keeps
compilers out of jobs: the ranks find the ops already built and load them.

    python -m worker.prebuild            # the ops this node's accelerator uses
    python -m worker.prebuild --print-dir
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from worker.settings import WorkerSettings
from worker.supervisor import extensions_dir, release_stale_build_locks

log = logging.getLogger("worker.prebuild")

# The ops a rank can load: CPU Adam for optimizer offload, async I/O for NVMe offload (needs libaio), and
# on CUDA FusedAdam for the optimizer.
OPS_BY_ACCELERATOR = {"cpu": ["CPUAdamBuilder", "AsyncIOBuilder"],
                      "cuda": ["FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder"]}


def build_ops(folder: Path) -> dict[str, float]:
    """Load (building if needed) every op for this accelerator; returns seconds per op."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    names = OPS_BY_ACCELERATOR.get(accelerator.device_name(), [])
    timings: dict[str, float] = {}
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            log.warning("%s cannot be built on this node; jobs that need it will fail with its reason", name)
            continue
        started = time.monotonic()
        builder.load(verbose=False)
        timings[name] = round(time.monotonic() - started, 1)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-dir", action="store_true", help="print the ops folder and exit")
    args = parser.parse_args(argv)
    folder = extensions_dir(WorkerSettings())
    if args.print_dir:
        print(folder)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder.mkdir(parents=True, exist_ok=True)
    # Install time runs no job on this installation, so a lock here was left by a killed build.
    for lock in release_stale_build_locks(folder):
        log.info("removed a build lock a killed build left: %s", lock)
    timings = build_ops(folder)
    log.info("DeepSpeed ops ready in %s: %s", folder,
             ", ".join(f"{k} ({v} s)" for k, v in timings.items()) or "none needed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
