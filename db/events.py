"""The durable event log: append with a per-job gap-free sequence, and the webhook delivery that announces the
event in the same transaction (reads: db/reads.py).

`INSERT` is the one text of an event's insert: the API's `append_async` (asyncpg) runs it in `APPEND` with the
outbox row, and the submit's statement (db/jobs.py) composes it with a SELECT from the job it inserts. The control
plane's `append` keeps its ORM session: the event is an ORM object of its batch, the delivery the same outbox row
(db/webhooks.py `delivery`), so both sides announce the same events alike.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import asyncpg

from db import jsonw, webhooks

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from db.models import Job, JobEvent

INSERT = "INSERT INTO job_events (job_id, seq, attempt, type, data, source_id, created_at)"
# The event ($1 to $6) and, where $7 (the delivery's id) is not null, its webhook delivery ($7 to $12).
APPEND = f"""
WITH event AS (
    {INSERT} VALUES ($1, $2, $3, $4, $5::jsonb, $6, now())
    RETURNING job_id, seq
), delivery AS (
    INSERT INTO webhook_deliveries (id, job_id, owner, event_seq, event, url, receiver, payload, next_attempt_at)
    SELECT $7::text, job_id, $8, seq, $9, $10, $11, $12::jsonb, now() FROM event WHERE $7::text IS NOT NULL
    ON CONFLICT ON CONSTRAINT uq_webhook_deliveries_job_event DO NOTHING
)
SELECT seq FROM event"""


async def append_async(conn: asyncpg.Connection, job: SimpleNamespace, kind: str, data: dict[str, Any], *,
                       attempt: int | None = None, source_id: str | None = None) -> int:
    """Within the caller's transaction: the event `job.event_seq` names (the caller has locked the row and
    counted it) and its delivery. `job` holds the row as it is now (db/jobs.py). Returns the sequence."""
    seq = job.event_seq
    url = None
    if webhooks.event_type(job, kind, data) is not None and not webhooks.job_url(job):
        url = await webhooks.owner_url(conn, job.owner)
    found = webhooks.delivery(job, kind, data, seq, lambda: url)
    await conn.execute(APPEND, job.id, seq, job.attempt if attempt is None else attempt, kind, jsonw.dumps(data),
                       source_id, *(found or webhooks.NO_DELIVERY))
    return seq


def append(session: Session, job: Job, kind: str, data: dict[str, Any], *, attempt: int | None = None,
               source_id: str | None = None) -> JobEvent:
    """Add an event to an ORM session; `job` must be locked (FOR UPDATE) or new, so sequence numbers never
    collide. The control plane's append (ingest, reaper, scheduler)."""
    from db.models import JobEvent

    job.event_seq += 1
    event = JobEvent(job_id=job.id, seq=job.event_seq, attempt=job.attempt if attempt is None else attempt,
                     type=kind, data=data, source_id=source_id)
    session.add(event)
    # In this same transaction: the event and the delivery that announces it commit together or not at all.
    webhooks.enqueue(session, job, kind, data, event.seq)
    return event

