"""Live readers of a job's durable event log: Server-Sent Events and a followed plain-text log.

Both read Postgres (the ordered copy the ingester writes), so a reader that reconnects with
Last-Event-ID continues exactly after the last event it saw, with no gap and no duplicate, even
after Redis lost its data.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import anyio
from sqlalchemy import select

from api.db import session_scope
from api.models import TERMINAL, Job, JobEvent
from api.services import events

POLL_SECONDS = 0.3
KEEPALIVE_SECONDS = 15.0
BATCH = 500


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
    while True:
        rows, ended = await anyio.to_thread.run_sync(_read, job_id, after, types)
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
