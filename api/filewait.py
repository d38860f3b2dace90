"""Waiting for the file validator's decision on a file the caller just uploaded: scripts upload and create a job at
once. The decision is notified on `ft_file_checked` (migration 0013) to this process's one LISTEN connection
(db/pool.py), which wakes the waiters of that file; while no connection listens, a waiter looks again every
POLL_SECONDS instead, and a reconnection wakes every waiter to look again (what was notified meanwhile is lost)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from contract.files import FileStatus
from db import files
from db import pool as pg
from db.errors import NotFound

CHANNEL = "ft_file_checked"
POLL_SECONDS = 0.2


class FileWaits:
    def __init__(self) -> None:
        self.waiting: dict[str, list[asyncio.Event]] = {}
        self.subscribed = False

    def _checked(self, file_id: str) -> None:
        for woken in self.waiting.get(file_id, ()):
            woken.set()

    def _reconnected(self) -> None:
        for events in self.waiting.values():
            for woken in events:
                woken.set()

    async def decided(self, owner: str, file_id: str, deadline: float) -> dict[str, Any] | None:
        """The caller's file row once the validator decided on it (or as it is at `deadline`, time.monotonic());
        None when the caller has no such file."""
        if not self.subscribed:
            # Lazily, from the first request: pg.subscribe needs the running event loop.
            self.subscribed = True
            pg.subscribe(CHANNEL, self._checked, on_connect=self._reconnected)
        while True:
            # Registered before the read: a decision committed after the read is notified to this event.
            woken = asyncio.Event()
            self.waiting.setdefault(file_id, []).append(woken)
            try:
                try:
                    row = await files.get_for_owner(owner, file_id)
                except NotFound:
                    return None
                left = deadline - time.monotonic()
                if row["status"] != FileStatus.UPLOADED or left <= 0:
                    return row
                try:
                    await asyncio.wait_for(woken.wait(), left if pg.listening(CHANNEL) else min(left, POLL_SECONDS))
                except asyncio.TimeoutError:
                    pass
            finally:
                events = self.waiting[file_id]
                events.remove(woken)
                if not events:
                    del self.waiting[file_id]


waits = FileWaits()
