"""The loop the control plane's database-driven threads share: one pass (`step`) when a notification wakes it, or
every POLL_SECONDS anyway, so a lost notification or listener costs at most that; a failing pass (Postgres, Redis,
the broker or the store away) is retried with a doubling pause, never ends the thread."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from controlplane.ingest import first_line
from db.notify import Notifications

POLL_SECONDS = 1.0
RETRY_MAX_SECONDS = 5.0


class WokenLoop(ABC):
    name: str  # the thread's name, and what a failed pass's warning says was being done
    log: logging.Logger
    handled_message: str | None = None  # logged after a pass that handled something ("%d" is how many)

    def __init__(self, channel: str, notifications: Notifications | None) -> None:
        """`notifications`: the control plane's one LISTEN loop, which wakes this on `channel`; without one it
        only looks every POLL_SECONDS."""
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._woken = threading.Event()
        if notifications is not None:
            notifications.subscribe(channel, self._woken.set)

    @abstractmethod
    def step(self) -> int:
        """One pass; returns how many things it handled."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._woken.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_SECONDS + 1)

    def _run(self) -> None:
        pause = 0.5
        while not self._stopping.is_set():
            # Cleared before the pass: a notification during it is served by the next pass, at once.
            self._woken.clear()
            try:
                handled = self.step()
            except Exception as exc:  # an outage: wait and look again
                self.log.warning("%s failed (%s); retrying in %.1f s", self.name, first_line(exc), pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, RETRY_MAX_SECONDS)
                continue
            if handled and self.handled_message:
                self.log.info(self.handled_message, handled)
            pause = 0.5
            self._woken.wait(POLL_SECONDS)
