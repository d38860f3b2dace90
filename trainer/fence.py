"""Fencing on the job's shared storage: a superseded attempt never commits a checkpoint or an export.

The worker that starts attempt N raises the job's fence to N (the file `FENCE` in the job directory)
before it launches the trainer. The trainer writes every checkpoint and its export into a place of its
own attempt and commits it (a rename into the job's `checkpoints/` or `output/`, then the marker) only
after reading a fence no newer than its attempt. An older attempt that is still alive when a newer one
starts therefore leaves its half-written state in its own staging folders, where nobody reads it.

Hosts that share no disk share the artifact store: the worker takes the job over there too
(`jobs/<job id>/fences/`), and rank 0 checks it (`check_store`) before it writes a checkpoint's manifest, the
commit in the store (trainer/uploader.py). That check cannot be atomic with the write; what a superseded attempt
writes after it passed is past the attempt's cut, which every reader of the store honours (store/checkpoints.py).

This is the second line of defence: the guard that owns the attempt's processes ends them as soon as it
cannot prove the attempt current (worker/guard.py), before the control plane starts the next attempt.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from contract.codes import FailureCode
from store import checkpoints as stored
from store.objects import Store
from trainer.errors import TrainerError

FENCE_FILE = "FENCE"
STAGING = re.compile(r"^\.(?:[a-z]+-)?attempt-(\d+)$")


class Superseded(TrainerError):
    """A newer attempt of this job exists: this one must stop without committing anything."""

    code = FailureCode.SUPERSEDED


def current(job_dir: Path) -> int:
    """The newest attempt the workers have started (0 before the first)."""
    try:
        return int((job_dir / FENCE_FILE).read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def raise_to(job_dir: Path, attempt: int) -> int:
    """Make `attempt` the fence unless a newer one is there already; returns the fence after the call.

    Written to a temporary file and renamed, so a reader never sees a half-written number.
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    now = current(job_dir)
    if now >= attempt:
        return now
    tmp = job_dir / f".{FENCE_FILE}.{attempt}.{os.getpid()}"
    tmp.write_text(str(attempt))
    os.replace(tmp, job_dir / FENCE_FILE)
    return attempt


def check_store(store: Store, job_id: str, attempt: int, what: str) -> None:
    """The store's fence: raises Superseded when a worker started a newer attempt of the job on any host."""
    newest = stored.read_fence(store, job_id).attempt
    if newest > attempt:
        raise Superseded(f"attempt {attempt} was superseded by attempt {newest}; it does not commit {what}")


class Fence:
    """The fence as one attempt sees it."""

    def __init__(self, job_dir: Path, attempt: int) -> None:
        self.job_dir, self.attempt = job_dir, attempt

    def check(self, what: str) -> None:
        newest = current(self.job_dir)
        if newest > self.attempt:
            raise Superseded(f"attempt {self.attempt} was superseded by attempt {newest}; it does not commit {what}")

    def staging(self, parent: Path, kind: str = "") -> Path:
        """This attempt's own folder under `parent` (hidden: readers of `parent` never list it)."""
        return parent / f".{kind + '-' if kind else ''}attempt-{self.attempt}"

    def remove_older_staging(self, parent: Path) -> list[Path]:
        """Staging folders that earlier attempts left when they were killed: never committed, never read."""
        removed = []
        if parent.is_dir():
            for path in parent.iterdir():
                m = STAGING.match(path.name)
                if m and int(m.group(1)) < self.attempt:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed
