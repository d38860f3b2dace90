"""Where the launched ranks build and cache DeepSpeed's C++/CUDA ops, and the build locks a killed build left.

`worker.prebuild` builds into the same folder before any job runs; an attempt that ended badly releases the
locks no live process holds.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from worker.settings import WorkerSettings


def extensions_dir(settings: WorkerSettings) -> Path:
    """Where the launched ranks build and cache DeepSpeed's ops: TORCH_EXTENSIONS_DIR where the operator set
    it, else one folder per Python installation, since ops built against one installation's sources are
    rebuilt (slowly, under a lock) by another. `worker.prebuild` builds into the same folder."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return Path(settings.extensions_dir).expanduser() / tag


def _open_paths() -> set[str] | None:
    """The paths of the files some process on this host has open (read from /proc), None where it cannot
    tell. Another user's processes cannot be read; they do not build into this user's folder."""
    paths: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    return paths


def release_stale_build_locks(folder: Path) -> list[Path]:
    """A rank killed while building an op leaves torch's build lock behind, and every later job on this
    node would wait on it forever. A live build keeps its lock file open (torch's FileBaton holds the fd
    until it removes the file), so only a lock no process holds open is stale: another process's build,
    or a rank loading an op, keeps its lock. Where /proc cannot tell, nothing is removed."""
    locks: dict[Path, int] = {}
    for lock in folder.glob("*/lock"):
        try:
            locks[lock] = lock.stat().st_ino
        except FileNotFoundError:
            continue
    held = _open_paths() if locks else None
    if held is None:
        return []
    stale: list[Path] = []
    for lock, inode in locks.items():
        try:
            # Not held, and still the file read before /proc was: one removed meanwhile may be a new build's.
            if str(lock.resolve()) not in held and lock.stat().st_ino == inode:
                lock.unlink()
                stale.append(lock)
        except FileNotFoundError:
            continue
    return stale
