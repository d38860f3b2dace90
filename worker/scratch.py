"""The node's job folders that no attempt uses any more, swept so that finished jobs do not fill the node's disk.

A job's folder on a node is scratch (worker/attempt.py `node_job_dir`): its checkpoints and export are in the artifact
store. Left alone, the folders of finished jobs would fill a small disk until the node announced it full and was
placed on no more (worker/node.py `disk_state`).

In use means locked. The supervisor of an attempt holds a shared `flock` on the job's lock file,
`<jobs root>/.locks/<job id>.lock`, from before it makes the folder until it has reported the attempt's end (`in_use`).
A flock, not a set in memory: several worker processes of one host may share one jobs root (the test stack's do), and
a worker frozen by SIGSTOP still holds it. The lock file lies outside the folder so that removing the folder leaves
it. The sweep takes an exclusive lock without waiting: obtained, no attempt uses the folder, which is removed under
that lock; a supervisor that starts meanwhile waits for it, then makes its folder anew.

What is swept (`Sweeper`): folders idle for FT_SCRATCH_RETENTION_SECONDS, and, while the disk has less room than
twice FT_NODE_MIN_FREE_BYTES, idle folders oldest first until it has that room again. Nothing where the store is a
folder that is the jobs root, lies in it or holds it: its objects would be among what is swept.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from core.serverpaths import store_folder
from worker.node import disk_state
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

LOCKS = ".locks"  # a dot-name: the sweep passes over it, as over anything that is not a job's folder
# Retention is a matter of hours: reading every folder's age at each heartbeat would be wasted work. Room is read at
# every beat, since a disk can fill between two of these.
RETENTION_SWEEP_SECONDS = 300.0
WAIT_SECONDS = 0.05  # between two tries of a supervisor whose folder a sweep is removing
PRESSURE_FACTOR = 2  # a sweep under pressure frees up to this many times the node's minimum


def lock_file(jobs_root: Path, job_id: str) -> Path:
    return jobs_root / LOCKS / f"{job_id}.lock"


def _locked(path: Path, how: int) -> int | None:
    """An open descriptor of `path` that holds the flock `how` (with LOCK_NB: None while another holds a conflicting
    one). The lock is on the file that `path` names when this returns: a sweep unlinks the file it holds, and a lock
    taken on that unlinked file meanwhile would exclude nothing, so it is taken again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            named = os.stat(path)
        except FileNotFoundError:
            named = None
        held = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


@contextmanager
def in_use(jobs_root: Path, job_id: str, *, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """The job's folder is in use by this process while the block runs: no sweep of any process removes it. Waits
    while a sweep removes it, calling `waiting` between tries (the supervisor keeps its lease meanwhile)."""
    path = lock_file(jobs_root, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    while (fd := _locked(path, fcntl.LOCK_SH | fcntl.LOCK_NB)) is None:
        waiting()
        time.sleep(WAIT_SECONDS)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays for the next sweep to remove with the folder


def store_over(store_url: str, jobs_root: Path) -> Path | None:
    """The store's folder where it is the jobs root, lies in it or holds it; None otherwise (and for S3)."""
    folder = store_folder(store_url)
    if folder is None:
        return None
    store, root = Path(folder).resolve(), jobs_root.resolve()  # resolved as store/backends/file.py does
    return store if store == root or store.is_relative_to(root) or root.is_relative_to(store) else None


def last_used(folder: Path) -> float:
    """When the folder or one of its entries last changed (epoch s): an attempt writes below them all the time."""
    newest = folder.lstat().st_mtime
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return newest


class Sweeper:
    """The sweep of one node's jobs root. `disk` is what the node's heartbeat reads (worker/celery_app.py): the room
    left on the disk after this beat's sweep. Thread-safe: one sweep at a time; a beat that finds one under way only
    reads the disk."""

    def __init__(self, settings: WorkerSettings, min_free_bytes: int) -> None:
        self.root = settings.jobs_root
        self.retention_seconds = settings.scratch_retention_seconds
        self.min_free_bytes = min_free_bytes
        # What one beat may spend removing folders: the node's key and name lapse if its beats stop for a lease.
        self.beat_budget_seconds = settings.heartbeat_seconds
        self.store = store_over(settings.store_url, self.root)
        self._warned = False
        self._busy = threading.Lock()
        self._next_retention = 0.0  # monotonic: the first beat sweeps what an earlier run of the node left
        self._cut_short = False  # the last sweep ran out of its budget with folders still due
        self._failed: set[str] = set()  # folders whose removal failed: said once, not at every beat

    def disk(self) -> dict[str, Any]:
        """The node's disk as announced (worker/node.py `disk_state`), read after sweeping what is due."""
        if self._busy.acquire(blocking=False):
            try:
                now = time.monotonic()
                retention: float | None = None
                if now >= self._next_retention:
                    retention = self.retention_seconds
                self._sweep(retention, until=now + self.beat_budget_seconds)
                if retention is not None:
                    # Cut short, the next beat goes on with it.
                    self._next_retention = now if self._cut_short else now + RETENTION_SWEEP_SECONDS
            finally:
                self._busy.release()
        return disk_state(self.root, self.min_free_bytes)

    def read(self) -> dict[str, Any]:
        """The disk as `disk` announces it, without sweeping: what an attempt asks when its trainer died silently,
        which a sweep just before the question would answer for a disk other than the one the trainer saw."""
        return disk_state(self.root, self.min_free_bytes)

    def sweep(self, retention_seconds: float | None = None) -> list[str]:
        """Remove the idle folders unused for `retention_seconds` (the setting's where None), and more while the disk
        is short of room; returns the ids of the jobs whose folders went. Never raises."""
        with self._busy:
            return self._sweep(self.retention_seconds if retention_seconds is None else retention_seconds)

    def pressed(self) -> bool:
        """Whether the disk has less room than the sweep keeps free (or no inode left); False where it cannot tell."""
        state = disk_state(self.root, self.min_free_bytes)
        free = state["disk_free_bytes"]
        return free is not None and (state["disk_full"] or free < PRESSURE_FACTOR * self.min_free_bytes)

    def _sweep(self, retention_seconds: float | None, until: float = float("inf")) -> list[str]:
        self._cut_short = False
        if self.store is not None:
            if not self._warned:
                self._warned = True
                log.warning("the artifact store is the folder %s, which holds or lies in the node's jobs root %s: "
                            "idle job folders are not swept, since stored checkpoints would go with them",
                            self.store, self.root)
            return []
        try:
            return self._remove_idle(retention_seconds, until)
        except Exception:  # the heartbeat that runs it must go on
            log.exception("the sweep of idle job folders under %s failed", self.root)
            return []

    def _remove_idle(self, retention_seconds: float | None, until: float) -> list[str]:
        """`retention_seconds` None: only what the disk's room asks for."""
        cutoff = None if retention_seconds is None else time.time() - retention_seconds
        if cutoff is None and not self.pressed():
            return []  # the common beat: one statvfs, no listing
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []  # made by the node's first job
        folders: list[tuple[float, str]] = []
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                folders.append((last_used(Path(entry.path)), entry.name))
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._say(entry.name, "cannot read the job folder %s: %s", entry.path, exc)
        folders.sort()
        removed = []
        for used, name in folders:
            pressed = self.pressed()
            if not (pressed or (cutoff is not None and used < cutoff)):
                break  # oldest first: nothing after it is due either
            if time.monotonic() >= until:
                self._cut_short = True
                return removed
            # Under pressure any idle folder goes; otherwise only one that is still unused once locked.
            if self._remove(name, None if pressed else cutoff):
                removed.append(name)
        if cutoff is not None:
            self._remove_stray_locks()
        return removed

    def _remove(self, name: str, cutoff: float | None) -> bool:
        """Remove the job's folder unless an attempt holds it (or, given `cutoff`, it was used since: an attempt
        started and ended between the listing and the lock)."""
        folder = self.root / name
        path = lock_file(self.root, name)
        try:
            path.parent.mkdir(exist_ok=True)
            fd = _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._say(name, "cannot take the lock %s of the idle job folder %s: %s", path, folder, exc)
            return False
        if fd is None:
            return False  # in use
        try:
            if cutoff is not None and last_used(folder) >= cutoff:
                return False
            shutil.rmtree(folder)
        except FileNotFoundError:
            return False  # another sweep (or an operator) took it
        except OSError as exc:
            self._say(name, "cannot remove the idle job folder %s: %s", folder, exc)
            return False
        finally:
            # Unlinked before the lock is let go: a supervisor that locked the file between the two would hold a
            # lock on a name that the next sweep makes anew.
            with suppress(OSError):
                path.unlink(missing_ok=True)
            os.close(fd)
        self._failed.discard(name)
        log.info("removed the idle job folder %s", folder)
        return True

    def _remove_stray_locks(self) -> None:
        """Lock files whose job has no folder: a supervisor that ended before it made one leaves its file behind."""
        try:
            paths = list((self.root / LOCKS).glob("*.lock"))
        except OSError:
            return
        for path in paths:
            if (self.root / path.stem).exists():
                continue
            try:
                fd = _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            if fd is None:
                continue
            try:
                if not (self.root / path.stem).exists():
                    path.unlink(missing_ok=True)
            except OSError:
                pass  # left for the next sweep
            finally:
                os.close(fd)

    def _say(self, name: str, message: str, *args: object) -> None:
        level = logging.DEBUG if name in self._failed else logging.WARNING
        self._failed.add(name)
        log.log(level, message, *args)

