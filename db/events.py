"""The durable event log: append with a per-job gap-free sequence, and the webhook delivery that announces the
event in the same transaction (reads: db/reads.py).

`INSERT` is the one text of an event's insert: the API's `append_async` (asyncpg) runs it in `APPEND` with the
outbox row, and the submit's statement (db/jobs.py) composes it with a SELECT from the job it inserts. The control
plane's append (db/journal.py) runs the same `APPEND` in its session, so both sides write an event and announce it
with one statement.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from db import jsonw, outbox

if TYPE_CHECKING:
    import asyncpg

INSERT = "INSERT INTO job_events (job_id, seq, attempt, type, data, source_id, created_at)"


def insert_delivery(source: str, *, job_id: str, seq: str, first: int) -> str:
    """The one text of an event's webhook delivery insert (db/outbox.py `delivery` gives its six values): the job
    and event from `source` (a CTE: its `job_id` and `seq` columns as named), the values from ${first} to
    ${first + 5}; nothing where the first (the delivery's id) is null."""
    p = [f"${first + i}" for i in range(6)]
    return (f"INSERT INTO webhook_deliveries (id, job_id, owner, event_seq, event, url, receiver, payload, "
            f"next_attempt_at)\n    SELECT {p[0]}::text, {job_id}, {p[1]}, {seq}, {p[2]}, {p[3]}, {p[4]}, "
            f"{p[5]}::jsonb, now() FROM {source} WHERE {p[0]}::text IS NOT NULL")


# The event ($1 to $6) and, where $7 (the delivery's id) is not null, its webhook delivery ($7 to $12).
APPEND = f"""
WITH event AS (
    {INSERT} VALUES ($1, $2, $3, $4, $5::jsonb, $6, now())
    RETURNING job_id, seq
), delivery AS (
    {insert_delivery("event", job_id="job_id", seq="seq", first=7)}
    ON CONFLICT ON CONSTRAINT uq_webhook_deliveries_job_event DO NOTHING
)
SELECT seq FROM event"""


async def append_async(conn: asyncpg.Connection, job: SimpleNamespace, kind: str, data: dict[str, Any], *,
                       attempt: int | None = None, source_id: str | None = None) -> int:
    """Within the caller's transaction: the event `job.event_seq` names (the caller has locked the row and
    counted it) and its delivery. `job` holds the row as it is now (db/jobs.py). Returns the sequence."""
    seq = job.event_seq
    found = await outbox.delivery_async(conn, job, kind, data, seq)
    await conn.execute(APPEND, job.id, seq, job.attempt if attempt is None else attempt, kind, jsonw.dumps(data),
                       source_id, *found)
    return seq
