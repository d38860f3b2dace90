"""A node's copies of stored objects (uploaded files, exported models), so a job reads its inputs from local disk
and a second job on the same inputs downloads nothing.

Entries are keyed by their SHA-256 and verified after download, so a corrupt or half-written copy is never
used. The folder is bounded: before a download, the least recently used entries are evicted until the new one
fits. An entry a job is reading is held (a shared lock on it) and is never evicted under it; two slots fetching
the same object at once download it once (an exclusive lock per entry while it is fetched).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO

from store.locks import locked
from store.objects import Store


class CacheFull(Exception):
    """The object does not fit even with every unused entry evicted."""


class NodeCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.entries = root / "sha256"
        self.entries.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.entries / sha256

    def hold(self, store: Store, key: str, sha256: str, size: int) -> tuple[Path, IO[bytes]]:
        """The local copy of `key` and an open handle that holds it (keep it open while the copy is read; closing
        it lets the copy be evicted). Downloads it where it is not here; raises ValueError where the downloaded
        bytes are not `sha256`, CacheFull where it cannot fit."""
        path = self.path(sha256)
        with locked(self.entries / f".{sha256}.lock"):
            if not path.is_file():
                self._make_room(size)
                store.download(key, path, sha256=sha256)
            hold = path.open("rb")
            fcntl.flock(hold, fcntl.LOCK_SH)
        now = time.time()
        os.utime(path, (now, now))  # used now: the last to be evicted
        return path, hold

    def _make_room(self, size: int) -> None:
        if size > self.max_bytes:
            raise CacheFull(f"{size} bytes do not fit in the node's cache of {self.max_bytes} bytes "
                            "(FT_CACHE_MAX_BYTES)")
        entries = []
        for p in self.entries.iterdir():
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        used = sum(e[1] for e in entries)
        for _, bytes_, p in sorted(entries):
            if used + size <= self.max_bytes:
                return
            if self._evict(p):
                used -= bytes_
        if used + size > self.max_bytes:
            raise CacheFull(f"{size} bytes do not fit in the node's cache: {used} of {self.max_bytes} bytes "
                            "(FT_CACHE_MAX_BYTES) are held by running jobs")

    @staticmethod
    def _evict(path: Path) -> bool:
        """Delete `path` unless a job holds it."""
        try:
            with path.open("rb") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                path.unlink(missing_ok=True)
                return True
        except FileNotFoundError:
            return True
