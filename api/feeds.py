"""Live followers of a job, fanned out in memory: one reader per job and process, any number of followers.

A `Feed` reads the job's durable event log (the ordered copy the ingester writes) when the database
notifies that the job gained events (`ft_events`, a trigger of migration 0003; quick polling stands in
while the listening connection is down) and keeps the newest events in a bounded buffer; every
follower of the job reads that buffer at its own pace with its own cursor, so followers cost no
database connection while they wait and the database sees O(jobs) queries, not O(followers). A
follower that starts before the buffer, or falls behind it, catches up with paged
queries of its own and then joins. A follower that is slow only delays itself; one that disconnects is
cancelled by the server. Resuming after `Last-Event-ID` is exact: the cursor is the event's sequence
number, and a follower sends each sequence number once, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from contract.codes import TERMINAL_STATUSES
from db import jobs, reads
from db import pool as pg
from db.errors import Unavailable

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # while notifications are not flowing
# With them flowing a feed reads when notified; this look covers a notification lost in a reconnection.
NOTIFIED_POLL_SECONDS = 2.0
CHANNEL = "ft_events"
BATCH = 500
BUFFER = 4096  # events kept per job; an older cursor is served from the database
KEEPALIVE_SECONDS = 15.0
# A feed wakes its waiting followers at least this often, so each can send its keep-alive on time.
TICK_SECONDS = 5.0
# Followers woken per event-loop turn. An event wakes every follower of the job in this process; woken all at
# once they would run ahead of any request that arrived meanwhile (/healthz, GET /jobs/{id}), which would wait
# for the whole fan-out. In batches, a request waits for one batch.
WAKE_BATCH = 64
IDLE_SECONDS = 5.0  # a feed without followers stops after this
# While Postgres is unreachable, readers wait and retry, backing off up to RETRY_MAX_SECONDS, for as long
# as the follower stays: a cleanly ended stream would tell it the job has ended.
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    type: str
    attempt: int
    json: str
    rank: str | None
    line: str | None
    frame: str  # the SSE frame, rendered once for every follower


def event_of(row: tuple) -> Event:
    seq, kind, attempt, text, rank, line = row
    return Event(seq, kind, attempt, text, rank, line, f"id: {seq}\nevent: {kind}\ndata: {text}\n\n")


class Feed:
    """The live tail of one job's events in this process."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.buffer: deque[Event] = deque(maxlen=BUFFER)
        self.last_seq: int | None = None  # the newest sequence number read; None until the first read
        self.ended = False  # the job had ended before the last read, which found nothing new
        self.followers = 0
        self._waiters: list[asyncio.Future[None]] = []  # one per waiting follower: no task or timer each
        self._ticked = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"feed {self.job_id}")

    def since(self, after: int) -> list[Event] | None:
        """Buffered events after `after`, or None when the buffer no longer reaches back that far."""
        if self.last_seq is None:
            return None
        if after >= self.last_seq:
            return []
        if not self.buffer or self.buffer[0].seq > after + 1:
            return None
        start = after + 1 - self.buffer[0].seq  # sequence numbers are gap-free per job
        return list(self.buffer)[start:] if start > 0 else list(self.buffer)

    async def changed(self) -> None:
        """Until the feed has read new events or seen the job end, or TICK_SECONDS have passed."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    async def _announce(self) -> None:
        # Taken in one step, after the buffer was updated: a follower that starts waiting from here on looked
        # at the new buffer first, and waits for the next announcement.
        waiters, self._waiters = self._waiters, []
        self._ticked = time.monotonic()
        for i, waiter in enumerate(waiters, 1):
            if not waiter.done():  # done: its follower was cancelled (the client left) while it waited
                waiter.set_result(None)
            if i % WAKE_BATCH == 0:
                await asyncio.sleep(0)  # this batch runs, and whatever request came in, before the next

    async def _run(self) -> None:
        delay = RETRY_FIRST_SECONDS
        idle_since: float | None = None
        while True:
            if self._waiters and time.monotonic() - self._ticked >= TICK_SECONDS:
                await self._announce()  # nothing new: the followers look at their keep-alive
            if self.followers == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > IDLE_SECONDS:
                    _FEEDS.pop(self.job_id, None)
                    return
            else:
                idle_since = None
            # Cleared before the read: a notification that arrives during it makes the next wait return at once.
            self._wake.clear()
            try:
                got = await self._poll()
            except (*pg.UNREACHABLE, Unavailable) as exc:
                log.warning("Postgres unreachable while following job %s (%s); retrying", self.job_id,
                            type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            except Exception:  # a feed that died would leave its followers waiting for ever
                log.exception("reading job %s's events failed; retrying", self.job_id)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            delay = RETRY_FIRST_SECONDS
            if got < BATCH:
                try:
                    wait = NOTIFIED_POLL_SECONDS if pg.listening(CHANNEL) else POLL_SECONDS
                    await asyncio.wait_for(self._wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass

    async def _poll(self) -> int:
        if self.last_seq is None:
            newest = await jobs.newest_seq(self.job_id)
            start = max(0, newest - BUFFER)
        else:
            start = self.last_seq
        # The status first: if the job had ended before the events were read, no event can follow them.
        status = await jobs.status(self.job_id)
        rows = await reads.events_after(self.job_id, start, BATCH, None)
        self.buffer.extend(event_of(r) for r in rows)
        first_read = self.last_seq is None
        self.last_seq = rows[-1][0] if rows else start
        ended = (status is None or status in TERMINAL_STATUSES) and not rows
        if rows or first_read or ended != self.ended:
            self.ended = ended
            await self._announce()
        return len(rows)


_FEEDS: dict[str, Feed] = {}
_subscribed = False


def _subscribe_once() -> None:
    global _subscribed
    if not _subscribed:
        pg.subscribe(CHANNEL, _notified, on_connect=_wake_all)
        _subscribed = True


def _notified(job_id: str) -> None:
    feed = _FEEDS.get(job_id)
    if feed is not None:
        feed.wake()


def _wake_all() -> None:
    for feed in list(_FEEDS.values()):
        feed.wake()


def feed_for(job_id: str) -> Feed:
    _subscribe_once()
    feed = _FEEDS.get(job_id)
    if feed is None:
        feed = _FEEDS[job_id] = Feed(job_id)
    feed.start()
    return feed


async def _catch_up(job_id: str, after: int, types: list[str] | None) -> list[Event]:
    """One page from the database for a follower behind the buffer, waiting out an outage."""
    delay = RETRY_FIRST_SECONDS
    while True:
        try:
            return [event_of(r) for r in await reads.events_after(job_id, after, BATCH, types)]
        except Unavailable:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)


async def follow(job_id: str, after: int, types: list[str] | None, render: Callable[[Event], str],
                 shown: Callable[[str], str] = str) -> AsyncIterator[str]:
    """Rendered events after `after` until the job has ended and every event was sent; `shown` rewrites each
    chunk as a client may see it (api/services/paths.server_paths)."""
    wanted = set(types) if types else None
    feed = feed_for(job_id)
    feed.followers += 1
    last_sent = time.monotonic()
    try:
        while True:
            batch = feed.since(after) if feed.last_seq is not None else []
            if batch is None:  # behind the buffer: a page from the database, then look again
                batch = await _catch_up(job_id, after, types)
                if not batch:  # nothing of the wanted types up to what the feed has read
                    after = max(after, feed.last_seq or 0)
                    continue
            if batch:
                # One write for what this follower is behind by (up to a page), not one per event.
                batch = batch[:BATCH]
                chunk = "".join(render(e) for e in batch if wanted is None or e.type in wanted)
                after = batch[-1].seq
                if chunk:
                    yield shown(chunk)
                    last_sent = time.monotonic()
                continue
            if feed.ended and feed.last_seq is not None and after >= feed.last_seq:
                return
            if render is sse and time.monotonic() - last_sent > KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"  # an SSE comment: keeps proxies from closing an idle stream
                last_sent = time.monotonic()
            # Nothing awaited since since() looked, so no announcement can have been missed.
            await feed.changed()
    finally:
        feed.followers -= 1


def sse(event: Event) -> str:
    return event.frame


def log_line(event: Event) -> str:
    who = "launcher" if event.rank is None else f"rank {event.rank}"
    return f"[attempt {event.attempt}][{who}] {event.line or ''}\n"
