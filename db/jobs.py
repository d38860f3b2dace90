"""Job writes of the API: submit and cancel, each one transaction, and the two small reads a live feed needs.

A submit is filed under its owner, counted against the owner's quota and, with an Idempotency-Key, recorded for
retries, all in the transaction that inserts the row: a refused submit leaves nothing behind, and a stored answer
always names a job that exists. The row, its first event (with its webhook delivery, as every appended event)
and its audit entry are one statement: one round trip.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from contract.codes import TERMINAL_STATUSES, AuditAction, EventKind, JobStatus
from db import audit, events, files, idempotency, jsonw, outbox, quotas, reads
from db import pool as pg
from db.errors import Conflict, NotFound, QuotaExceeded

# The owner's limits in effect (its quota row's fields where set, else the service's defaults: $10 jobs, $11 GPUs;
# null: no limit) and, where one is in force, its counter row (db/quotas.py), locked until the commit: a submit
# of the same owner waits here, then reads the count this one's insert left. The row is inserted only within the
# limits; the insert's trigger then adds it to the counter. The answer is the row's JSON (null where refused), the
# use it was measured against (null where a limit is in force but the owner has no counter row yet) and the limits.
# The row, its first event (naming who submitted it, with its delivery where one announces it) and its audit
# entry are one statement: all or nothing, in one round trip. The first event's delivery is $15 to $20
# (db/outbox.py `delivery`; all null: none), as `events.APPEND` writes it.
INSERT_JOB = f"""
WITH quota AS (
    SELECT coalesce(q.max_active_jobs, $10::bigint) AS max_jobs, coalesce(q.max_gpus, $11::bigint) AS max_gpus
    FROM (SELECT 1) AS one LEFT JOIN owner_quotas AS q ON q.owner = $8
), usage AS (
    SELECT u.active_jobs AS jobs, u.gpus FROM owner_usage AS u
    WHERE u.owner = $8 AND EXISTS (SELECT 1 FROM quota WHERE max_jobs IS NOT NULL OR max_gpus IS NOT NULL)
    FOR NO KEY UPDATE OF u
), job AS (
    INSERT INTO jobs (id, name, owner, gpus, priority, status, attempt, queue, request, resolved, progress,
                      checkpoints, metadata, event_seq, created_at, updated_at)
    SELECT $1, $2, $8, $9::int, $14::int, '{JobStatus.QUEUED.value}', 1, $3, $4::jsonb, $5::jsonb, $6::jsonb,
           '[]'::jsonb, $7::jsonb, 1, now(), now()
    FROM quota LEFT JOIN usage ON true
    WHERE (quota.max_jobs IS NULL OR usage.jobs + 1 <= quota.max_jobs)
      AND (quota.max_gpus IS NULL OR usage.gpus + $9::int <= quota.max_gpus)
    RETURNING *
), first_event AS (
    {events.INSERT}
    SELECT id, 1, 1, '{EventKind.STATE.value}',
           jsonb_build_object('status', '{JobStatus.QUEUED.value}', 'actor', $12::jsonb), NULL, now() FROM job
), delivery AS (
    {events.insert_delivery("job", job_id="id", seq="1", first=15)}
), audited AS (
    {audit.INSERT}
    SELECT now(), $13, $8, '{AuditAction.JOB_SUBMIT.value}', id,
           jsonb_build_object('name', name, 'queue', queue, 'gpus', gpus) FROM job
)
SELECT (SELECT {reads.JOB_JSON} FROM job), usage.jobs, usage.gpus, quota.max_jobs, quota.max_gpus
FROM quota LEFT JOIN usage ON true"""
# A recount (migration 0014) may remove an owner's counter row between the statement that found none and the one
# that made it: tried again, but not for ever.
INSERT_TRIES = 3


@dataclass(frozen=True, slots=True)
class NewJob:
    """A submit's row as the API resolved it; `gpus` is what a quota counts (every GPU of every node)."""

    id: str
    name: str
    owner: str
    queue: str
    gpus: int
    priority: int
    request: dict[str, Any]
    resolved: dict[str, Any]
    progress: dict[str, Any]
    metadata: dict[str, Any]
    # The stored files the job trains on (request field: file id), held against a delete until the row commits.
    files: dict[str, str] = field(default_factory=dict)


async def submit(*, job: NewJob, actor: dict[str, str | None], defaults: quotas.Limits,
                 idempotency_key: str | None = None, request_hash: bytes = b"",
                 keep_hours: float = 24.0) -> tuple[int, bytes]:
    """Insert the job within its owner's quota (QuotaExceeded otherwise), with its first event and audit entry,
    its stored files locked and found processed in the same transaction (Invalid naming the field otherwise), so a
    file deleted at the same moment is either refused here or sees this job and refuses the delete. Returns the
    status and JSON to answer with: for a retry with the same Idempotency-Key and body, those of the first answer."""
    owner, gpus = job.owner, job.gpus
    args: list[Any] = [job.id, job.name, job.queue, jsonw.dumps(job.request), jsonw.dumps(job.resolved),
                       jsonw.dumps(job.progress), jsonw.dumps(job.metadata), owner, gpus]
    # After the quota's defaults ($10, $11): who submits ($12, $13), the priority the scheduler orders by ($14)
    # and the first event's delivery ($15 to $20).
    view = SimpleNamespace(id=job.id, name=job.name, owner=owner, queue=job.queue, status=JobStatus.QUEUED,
                           attempt=1, request=job.request, error=None, output=None, event_seq=1)
    first = {"status": JobStatus.QUEUED, "actor": actor}
    tail = [jsonw.dumps(actor), actor["key_id"], job.priority]
    try:
        async with (await pg.pool()).acquire() as conn:
            if idempotency_key is None and not job.files:
                # Nothing to remember and no file to hold: the one statement, no transaction around it.
                delivery = await _first_delivery(conn, view, first)
                return 201, (await _insert(conn, job, [*args, *defaults, *tail, *delivery])).encode()
            async with conn.transaction():
                if idempotency_key is not None:
                    await idempotency.claim(conn, owner=owner, key=idempotency_key, hashed=request_hash,
                                            keep_hours=keep_hours)
                if job.files:
                    await files.hold_for_job(conn, owner, job.files)
                delivery = await _first_delivery(conn, view, first)
                body = await _insert(conn, job, [*args, *defaults, *tail, *delivery])
                if idempotency_key is not None:
                    await idempotency.remember(conn, owner=owner, key=idempotency_key, job_id=job.id, status=201,
                                               body=body)
        return 201, body.encode()
    except idempotency.Replay as replay:
        return replay.status, replay.body
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc


async def _insert(conn: Any, job: NewJob, args: list[Any]) -> str:
    """INSERT_JOB's row as JSON, or QuotaExceeded with the limits and the use that refused it."""
    for _ in range(INSERT_TRIES):
        body, jobs, used_gpus, max_jobs, max_gpus = await conn.fetchrow(INSERT_JOB, *args)
        if body is not None:
            return body
        if jobs is not None:
            raise QuotaExceeded(job.owner, (max_jobs, max_gpus), (jobs, used_gpus), job.gpus)
        await quotas.ensure_usage(conn, job.owner)
    raise pg.unavailable()


async def _first_delivery(conn: Any, view: SimpleNamespace, data: dict[str, Any]) -> tuple[Any, ...]:
    """The submit's first event's delivery, decided as every appended event's is (db/outbox.py)."""
    return await outbox.delivery_async(conn, view, EventKind.STATE, data, 1)


LOCK_COLUMNS = ("id, name, owner, queue, status, attempt, request::text AS request_json, error::text AS error_json, "
                "output::text AS output_json, event_seq")
LOCK = f"SELECT {LOCK_COLUMNS} FROM jobs WHERE id = $1 FOR UPDATE"
LOCK_FOR_OWNER = f"SELECT {LOCK_COLUMNS} FROM jobs WHERE id = $1 AND owner = $2 FOR UPDATE"
SET_STATUS = f"""
UPDATE jobs SET status = $2::text, event_seq = event_seq + 1, updated_at = now(),
    finished_at = CASE WHEN $2::text = '{JobStatus.CANCELLED.value}' THEN now() ELSE finished_at END
WHERE id = $1 RETURNING event_seq"""


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


async def cancel(*, job_id: str, owner: str | None, actor: dict[str, str | None],
                 tell_workers: Callable[[str, int], Awaitable[None]]) -> None:
    """Cancel the job (with `owner`, only that owner's: another's is NotFound): a queued one is cancelled at once,
    a started one is `cancelling` until its worker stops. Conflict where it has ended already; nothing where it is
    cancelling. `tell_workers(job_id, attempt)` runs before the change commits: if the commit fails, the worker
    still stops and reports it."""
    try:
        async with (await pg.pool()).acquire() as conn, conn.transaction():
            row = await (conn.fetchrow(LOCK, job_id) if owner is None else conn.fetchrow(LOCK_FOR_OWNER, job_id, owner))
            if row is None:
                raise NotFound(f"no job with id {job_id!r}", "id")
            before = row["status"]
            if before in TERMINAL_STATUSES:
                raise Conflict(f"job {job_id} already ended as {before}; it cannot be cancelled", "status")
            if before == JobStatus.CANCELLING:
                return
            await tell_workers(job_id, row["attempt"])
            if before == JobStatus.QUEUED:
                status, data = JobStatus.CANCELLED, {"status": JobStatus.CANCELLED,
                                                     "reason": "cancelled before it started", "actor": actor}
            else:
                status, data = JobStatus.CANCELLING, {"status": JobStatus.CANCELLING, "actor": actor}
            seq = await conn.fetchval(SET_STATUS, job_id, status.value)
            job = SimpleNamespace(id=row["id"], name=row["name"], owner=row["owner"], queue=row["queue"],
                                  status=status.value, attempt=row["attempt"], request=_loads(row["request_json"]),
                                  error=_loads(row["error_json"]), output=_loads(row["output_json"]), event_seq=seq)
            await events.append_async(conn, job, EventKind.STATE, data)
            await audit.record(conn, actor, AuditAction.JOB_CANCEL, job_id,
                               {"owner": row["owner"], "status_before": before})
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc


NEWEST_SEQ = "SELECT coalesce(max(seq), 0) FROM job_events WHERE job_id = $1"
STATUS = "SELECT status FROM jobs WHERE id = $1"


async def newest_seq(job_id: str) -> int:
    """The job's last event's sequence number (0: none)."""
    return await (await pg.pool()).fetchval(NEWEST_SEQ, job_id)


async def status(job_id: str) -> str | None:
    """The job's status, or None where there is no such job."""
    return await (await pg.pool()).fetchval(STATUS, job_id)
