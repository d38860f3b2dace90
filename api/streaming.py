"""Live readers of a job's durable event log: Server-Sent Events and a followed plain-text log.

Both read Postgres (the ordered copy the ingester writes), so a reader that reconnects with
Last-Event-ID continues exactly after the last event it saw, with no gap and no duplicate, even
after Redis lost its data.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from api.db import session_scope
from api.errors import database_unreachable
from api.models import TERMINAL, Job, JobEvent
from api.services import events

log = logging.getLogger(__name__)

POLL_SECONDS = 0.3
KEEPALIVE_SECONDS = 15.0
BATCH = 500
# While Postgres is unreachable a stream waits and retries, backing off up to RETRY_MAX_SECONDS, for as
# long as the reader stays: a restart or failover then costs the reader nothing. It never ends the stream
# for an outage, since a cleanly ended stream tells the reader the job has ended.
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 5.0


def _read(job_id: str, after: int, types: list[str] | None) -> tuple[list[JobEvent], bool]:
    """Events after `after`, and whether the job had ended before they were read (then none can follow)."""
    with session_scope() as session:
        status = session.scalar(select(Job.status).where(Job.id == job_id))
        rows = events.page(session, job_id, after=after, limit=BATCH, types=types)
        return rows, status in TERMINAL


async def follow(job_id: str, after: int, types: list[str] | None,
                 render: Callable[[JobEvent], str]) -> AsyncIterator[str]:
    """Yields rendered events after `after` until the job has ended and every event was sent."""
    last_sent = time.monotonic()
    outage_since: float | None = None
    delay = RETRY_FIRST_SECONDS
    while True:
        try:
            rows, ended = await anyio.to_thread.run_sync(_read, job_id, after, types)
        except SQLAlchemyError as exc:
            if not database_unreachable(exc):
                raise
            now = time.monotonic()
            if outage_since is None:
                outage_since = now
                log.warning("Postgres unreachable while following job %s; retrying", job_id)
            if render is sse and now - last_sent > KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"
                last_sent = now
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)
            continue
        if outage_since is not None:
            log.warning("Postgres reachable again after %.0f s; job %s's stream continues after event %d",
                        time.monotonic() - outage_since, job_id, after)
            outage_since, delay = None, RETRY_FIRST_SECONDS
        for row in rows:
            after = row.seq
            yield render(row)
            last_sent = time.monotonic()
        if rows:
            continue
        if ended:
            return
        if render is sse and time.monotonic() - last_sent > KEEPALIVE_SECONDS:
            yield ": keep-alive\n\n"  # an SSE comment: keeps proxies from closing an idle stream
            last_sent = time.monotonic()
        await asyncio.sleep(POLL_SECONDS)


def sse(row: JobEvent) -> str:
    data = json.dumps(events.public(row), default=str)
    return f"id: {row.seq}\nevent: {row.type}\ndata: {data}\n\n"


def log_line(row: JobEvent) -> str:
    return events.log_text(row) + "\n"
