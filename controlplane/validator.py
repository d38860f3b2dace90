"""Checks uploaded files: a thread of the control plane that claims each `uploaded` file, streams it from the
artifact store through contract/datasets.py (the trainer's own line checks) and sets it `processed` with its stats
or `error` with its first problems, each with its line.

It wakes on `ft_files` (a trigger on insert, migration 0011; the control plane's one LISTEN loop hands it over) and
looks anyway every POLL_SECONDS. A claim is a lease (db/filechecks.py), renewed while the file is read, not a lock held
open: a control plane that dies mid-check leaves the file `uploaded`, and the next one claims it again once the
lease has run out. A file deleted during its check is left deleted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from contract import datasets
from contract.files import FileStatus
from controlplane.loop import WokenLoop
from controlplane.settings import ControlPlaneSettings
from db import filechecks
from db.engine import session_scope
from db.notify import FILES, Notifications
from store.layout import file_key
from store.objects import NotFound, Store

log = logging.getLogger(__name__)

LEASE_SECONDS = 120.0
RENEW_SECONDS = 30.0  # well within the lease: a slow store read between renewals does not lose it


class Validator(WokenLoop):
    name = "checking files"
    log = log

    def __init__(self, settings: ControlPlaneSettings, notifications: Notifications | None = None,
                 store: Store | None = None) -> None:
        super().__init__(FILES, notifications)
        self.store = store or settings.store()

    def step(self) -> int:
        """Check every file waiting for it; returns how many were checked."""
        checked = 0
        while not self._stopping.is_set():
            with session_scope() as session:
                claimed = filechecks.claim(session, lease_seconds=LEASE_SECONDS)
            if claimed is None:
                return checked
            self.check(claimed)
            checked += 1
        return checked

    def check(self, claimed: filechecks.Claimed) -> None:
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
            filechecks.finish(session, file_id=file_id, status=status, fmt=fmt, stats=stats, errors=errors)

    def _renewing(self, chunks: Iterable[bytes], file_id: str) -> Iterator[bytes]:
        renewed = time.monotonic()
        for chunk in chunks:
            if time.monotonic() - renewed >= RENEW_SECONDS:
                with session_scope() as session:
                    filechecks.renew(session, file_id=file_id, lease_seconds=LEASE_SECONDS)
                renewed = time.monotonic()
            yield chunk
