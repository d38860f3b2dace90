"""The control plane's one LISTEN loop: one thread and one psycopg connection that listen on every channel the
control plane wakes on, and hand each notification to whoever subscribed to its channel (the dispatcher on
`ft_dispatch`, the deliverer on `ft_webhooks`, the file validator on `ft_files`).

A subscriber's callback runs in this thread and must only wake its owner (set an event). After every
(re)connection every subscriber is woken once: what was notified while no connection listened is lost, so each
looks again (LISTEN first, then look: a row committed in between is either seen then or notified). A subscriber
also looks on its own every few seconds, so a lost notification or an outage of this loop costs at most that.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable

import psycopg
from psycopg import sql

from db.urls import dsn

log = logging.getLogger(__name__)

DISPATCH = "ft_dispatch"  # a row needs sending (migration 0003), or slots came free (0005)
WEBHOOKS = "ft_webhooks"  # a webhook delivery was inserted
FILES = "ft_files"  # a file was uploaded (migration 0011)
WAIT_SECONDS = 0.5  # how long one wait for a notification lasts: the longest a stop waits
RETRY_MAX_SECONDS = 5.0


class Notifications:
    def __init__(self, database_url: str) -> None:
        self.url = dsn(database_url)
        self._subscribers: dict[str, list[Callable[[], None]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def subscribe(self, channel: str, wake: Callable[[], None]) -> None:
        """Call `wake` (in this loop's thread) on each notification of `channel`; subscribe before `start`."""
        with self._lock:
            self._subscribers[channel].append(wake)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * WAIT_SECONDS + 1)

    def _wake(self, channels: list[str]) -> None:
        with self._lock:
            callbacks = [wake for channel in channels for wake in self._subscribers.get(channel, [])]
        for wake in callbacks:
            try:
                wake()
            except Exception:  # one subscriber's failure must not stop the others' wake-ups
                log.exception("waking a subscriber failed")

    def _run(self) -> None:
        pause = 0.5
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
                    with self._lock:
                        channels = sorted(self._subscribers)
                    for channel in channels:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self._wake(channels)  # what was notified before this connection listened
                    pause = 0.5
                    while not self._stopping.is_set():
                        got = {n.channel for n in conn.notifies(timeout=WAIT_SECONDS, stop_after=1)}
                        # What else arrived meanwhile wakes the same subscribers once, not once each.
                        got.update(n.channel for n in conn.notifies(timeout=0))
                        if got:
                            self._wake(sorted(got))
            except Exception as exc:  # Postgres away: the subscribers poll meanwhile; listen again once it is back
                text = str(exc).strip()
                log.warning("listening for notifications failed (%s: %s); retrying in %.1f s", type(exc).__name__,
                            text.splitlines()[0] if text else "", pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, RETRY_MAX_SECONDS)
