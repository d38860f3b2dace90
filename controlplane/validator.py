"""Checks uploaded files: a thread of the control plane that claims each `uploaded` file, streams it from the
artifact store through contract/datasets.py (the trainer's own line checks) and sets it `processed` with its stats
or `error` with its first problems, each with its line.

It wakes on `ft_files` (a trigger on insert, migration 0011; the control plane's one LISTEN loop hands it over) and
looks anyway every POLL_SECONDS. A claim is a lease (db/files.py), renewed while the file is read, not a lock held
open: a control plane that dies mid-check leaves the file `uploaded`, and the next one claims it again once the
lease has run out. A file deleted during its check is left deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

from contract import datasets
from contract.files import FileStatus
from controlplane.ingest import first_line
from controlplane.settings import ControlPlaneSettings
from db import files
from db.engine import session_scope
from db.notify import FILES, Notifications
from store.layout import file_key
from store.objects import NotFound, Store

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
LEASE_SECONDS = 120.0
RENEW_SECONDS = 30.0  # well within the lease: a slow store read between renewals does not lose it
RETRY_MAX_SECONDS = 5.0


class Validator:
    def __init__(self, settings: ControlPlaneSettings, notifications: Notifications | None = None,
                 store: Store | None = None) -> None:
        """`notifications`: the control plane's LISTEN loop, which wakes it on `ft_files`; without one it only
        looks every POLL_SECONDS."""
        self.store = store or settings.store()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._woken = threading.Event()
        if notifications is not None:
            notifications.subscribe(FILES, self._woken.set)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="validator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._woken.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_SECONDS + 1)

    def step(self) -> int:
        """Check every file waiting for it; returns how many were checked."""
        checked = 0
        while not self._stopping.is_set():
            with session_scope() as session:
                claimed = files.claim(session, lease_seconds=LEASE_SECONDS)
            if claimed is None:
                return checked
            self.check(claimed)
            checked += 1
        return checked

    def check(self, claimed: files.Claimed) -> None:
        try:
            found = datasets.scan(self._renewing(self.store.iter(file_key(claimed.id)), claimed.id), claimed.format)
        except NotFound:
            # Deleted meanwhile (then the result changes nothing), or lost from the store.
            self._finish(claimed.id, FileStatus.ERROR, claimed.format, None,
                         [{"line": None, "message": "the stored bytes are missing; upload the file again"}])
            return
        if found.problems:
            self._finish(claimed.id, FileStatus.ERROR, found.format, None, [p.as_dict() for p in found.problems])
        else:
            self._finish(claimed.id, FileStatus.PROCESSED, found.format, found.stats(), None)
        log.info("file %s checked: %s", claimed.id,
                 f"{len(found.problems)} problem(s)" if found.problems else f"{found.examples} examples")

    def _finish(self, file_id: str, status: FileStatus, fmt: str | None, stats: dict[str, object] | None,
                errors: list[dict[str, object]] | None) -> None:
        with session_scope() as session:
            files.finish(session, file_id=file_id, status=status, fmt=fmt, stats=stats, errors=errors)

    def _renewing(self, chunks: Iterable[bytes], file_id: str) -> Iterator[bytes]:
        renewed = time.monotonic()
        for chunk in chunks:
            if time.monotonic() - renewed >= RENEW_SECONDS:
                with session_scope() as session:
                    files.renew(session, file_id=file_id, lease_seconds=LEASE_SECONDS)
                renewed = time.monotonic()
            yield chunk

    def _run(self) -> None:
        pause = 0.5
        while not self._stopping.is_set():
            # Cleared before the pass: an upload during it is served by the next pass, at once.
            self._woken.clear()
            try:
                self.step()
            except Exception as exc:  # Postgres or the store away: the claimed file's lease runs out; look again
                log.warning("checking files failed (%s); retrying in %.1f s", first_line(exc), pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, RETRY_MAX_SECONDS)
                continue
            pause = 0.5
            self._woken.wait(POLL_SECONDS)
