"""The hot reads of jobs, their events and the nodes, answered as JSON that Postgres builds.

A job row already holds its JSON documents (request, resolved, progress, ...) as JSONB; rebuilding them as
Python objects and validating them again on every dashboard poll was where the API's time went. Here one
query returns the response's bytes. The shapes are the documented ones (api/schemas.py): `Job` for one
job, `JobSummary` (no `request` and `resolved`, the bulk of a job) for each row of a list.

Every read takes the caller's `owner` (None: an admin, who sees every owner): it is one more condition
in the same query, never a second one, and another owner's job is simply not found (NotFound).
"""

from __future__ import annotations

from typing import Any

import orjson

from contract.codes import UNFINISHED_STATUSES, JobStatus, sql_list
from contract.protocol import NodeState
from db import keyset
from db import pool as pg
from db.errors import NotFound

# Progress keys every reader may rely on, null until the trainer reports them.
PROGRESS_DEFAULTS = ('\'{"step": 0, "total_steps": null, "epoch": null, "loss": null, '
                     '"tokens_per_second": null, "eta_seconds": null}\'::jsonb')
SUMMARY_FIELDS = (f"'id', id, 'name', name, 'owner', owner, 'status', status, 'attempt', attempt, 'queue', queue, "
                  f"'progress', {PROGRESS_DEFAULTS} || progress, 'error', error, 'created_at', created_at, "
                  "'started_at', started_at, 'finished_at', finished_at, 'checkpoints', checkpoints, "
                  "'output', output, 'description', description, "
                  "'metadata', metadata, 'placement', placement, 'queued_reason', "
                  f"CASE WHEN status = '{JobStatus.QUEUED.value}' THEN queued_reason END")
JOB_JSON = f"json_build_object({SUMMARY_FIELDS}, 'request', request, 'resolved', resolved)::text"
SUMMARY_JSON = f"json_build_object({SUMMARY_FIELDS})::text"
EVENT_JSON = ("(data || jsonb_build_object('id', seq, 'type', type, 'attempt', attempt, "
              "'created_at', created_at))::text")


def not_found(job_id: str) -> NotFound:
    return NotFound(f"no job with id {job_id!r}", "id")


# Two texts per read, with and without the owner: each is prepared once per connection with a plan of its own.
JOB_BY_ID = f"SELECT {JOB_JSON} FROM jobs WHERE id = $1"
JOB_BY_ID_AND_OWNER = JOB_BY_ID + " AND owner = $2"
JOB_WITH_OWNER = f"SELECT owner, {JOB_JSON} FROM jobs WHERE id = $1"
EXISTS = "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1)"
EXISTS_FOR_OWNER = "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1 AND owner = $2)"


async def job(job_id: str, owner: str | None = None) -> bytes:
    text = await (pg.fetchval(JOB_BY_ID, job_id) if owner is None
                  else pg.fetchval(JOB_BY_ID_AND_OWNER, job_id, owner))
    if text is None:
        raise not_found(job_id)
    return text.encode()


async def job_with_owner(job_id: str) -> tuple[str, bytes] | None:
    row = await pg.fetchrow(JOB_WITH_OWNER, job_id)
    return None if row is None else (row[0], row[1].encode())


async def exists(job_id: str, owner: str | None = None) -> bool:
    return bool(await (pg.fetchval(EXISTS, job_id) if owner is None else pg.fetchval(EXISTS_FOR_OWNER, job_id, owner)))


CURSOR = "SELECT seq FROM jobs WHERE id = $1"
CURSOR_FOR_OWNER = CURSOR + " AND owner = $2"


async def job_rows(shape: str, *, limit: int, after: str | None, owner: str | None, status: str | None = None,
                   queue: str | None = None, metadata: dict[str, str] | None = None) -> tuple[list[str], bool]:
    """The one page query of the job lists (`GET /jobs` with SUMMARY_JSON, `/v1/fine_tuning/jobs` with JOB_JSON):
    newest first, `limit` rows of `shape` after the job `after`, and whether more follow. A keyset page on (owner,
    seq), (status, seq), (queue, seq) or seq. `metadata`: jobs whose metadata holds every pair ({}: jobs with none;
    None: no filter). The cursor is a job the caller can see, or NotFound (another owner's job as an unknown one):
    ids are random, so an id of no row names no place in the list."""
    page = keyset.Page()
    if after is not None:
        cursor = await (pg.fetchval(CURSOR, after) if owner is None else pg.fetchval(CURSOR_FOR_OWNER, after, owner))
        if cursor is None:
            raise NotFound(f"no job {after!r} to page after; pass the last id of the previous page", "after")
        page.where_(f"seq < {page.arg(cursor)}")
    for column, value in (("owner", owner), ("status", status), ("queue", queue)):
        page.equal(column, value)
    if metadata == {}:
        page.where_("metadata = '{}'::jsonb")
    elif metadata:
        page.where_(f"metadata @> {page.arg(orjson.dumps(metadata).decode())}::jsonb")
    rows = [r[0] for r in await pg.fetch(page.sql(shape, "jobs", "seq DESC", limit), *page.args)]
    return rows[:limit], len(rows) > limit


async def jobs_page(*, status: str | None, queue: str | None, limit: int, after: str | None,
                    owner: str | None = None) -> bytes:
    """`GET /jobs`'s page: summaries, as one JSON body built without parsing a row."""
    rows, has_more = await job_rows(SUMMARY_JSON, limit=limit, after=after, owner=owner, status=status, queue=queue)
    return b'{"data":[' + ",".join(rows).encode() + b'],"has_more":' + (b"true" if has_more else b"false") + b"}"


async def events_after(job_id: str, after: int, limit: int, types: list[str] | None, *,
                       owner: str | None = None) -> list[Any]:
    """(seq, type, attempt, json, rank, line) of the job's events after `after`, in order; none where the
    job is not the owner's (the owner test runs once per query, as an init plan, not per row)."""
    args: list[Any] = [job_id, after, limit]
    where = "WHERE job_id = $1 AND seq > $2 "
    if types:
        args.append(types)
        where += f"AND type = ANY(${len(args)}::text[]) "
    if owner is not None:
        args.append(owner)
        where += f"AND EXISTS (SELECT 1 FROM jobs WHERE id = $1 AND owner = ${len(args)}) "
    sql = (f"SELECT seq, type, attempt, {EVENT_JSON}, data->>'rank', data->>'line' FROM job_events {where}"
           "ORDER BY seq LIMIT $3")
    return list(await pg.fetch(sql, *args))


async def events_page(job_id: str, *, after: int, limit: int, types: list[str] | None,
                      owner: str | None = None) -> bytes:
    rows = await events_after(job_id, after, limit + 1, types, owner=owner)
    if not rows and not await exists(job_id, owner):
        raise not_found(job_id)
    page = rows[:limit]
    next_after = page[-1][0] if page else after
    return (b'{"data":[' + ",".join(r[3] for r in page).encode() + b'],"has_more":'
            + (b"true" if len(rows) > limit else b"false") + b',"next_after":' + str(next_after).encode() + b"}")


# A node's state (contract.protocol.NodeState): lost (not seen for the grace period after its heartbeat key expired:
# it receives nothing), draining (its worker is shutting down), disk_full (the room left on its disk, as last
# announced, is below the node's threshold), or up. Its jobs and free slots are the placed jobs that have not ended,
# as the scheduler counts them.
NODES = f"""
SELECT coalesce(json_agg(json_build_object(
    'name', n.name, 'kind', n.kind, 'queues', n.queues, 'slots_total', n.slots,
    'slots_free', CASE WHEN n.last_seen >= now() - make_interval(secs => $1) AND NOT n.draining AND NOT n.disk_full
                       THEN n.slots - coalesce(h.used, 0) ELSE 0 END,
    'jobs', coalesce(h.jobs, '[]'::json), 'jobs_max', n.jobs_max, 'last_seen', n.last_seen,
    'disk_free_bytes', n.disk_free_bytes, 'warm_trainer', n.warm_trainer,
    'state', CASE WHEN n.last_seen < now() - make_interval(secs => $1) THEN '{NodeState.LOST.value}'
                  WHEN n.draining THEN '{NodeState.DRAINING.value}' WHEN n.disk_full THEN '{NodeState.DISK_FULL.value}'
                  ELSE '{NodeState.UP.value}' END) ORDER BY n.name), '[]'::json)::text
FROM nodes AS n LEFT JOIN LATERAL (
    SELECT sum(jsonb_array_length(p->'devices'))::int AS used,
           json_agg(json_build_object('id', j.id, 'status', j.status, 'devices', p->'devices') ORDER BY j.seq) AS jobs
    FROM jobs AS j, jsonb_array_elements(j.placement) AS p
    WHERE j.placement IS NOT NULL AND j.status IN {sql_list(UNFINISHED_STATUSES)}
      AND p->>'node' = n.name) AS h ON true"""


async def nodes(grace_seconds: float) -> bytes:
    return b'{"data":' + (await pg.fetchval(NODES, grace_seconds)).encode() + b"}"


JOBS_BY_STATE = "SELECT status, queue, count(*) FROM jobs GROUP BY status, queue"
OLDEST_QUEUED = ("SELECT queue, extract(epoch FROM now() - min(created_at))::float8 FROM jobs "
                 f"WHERE status = '{JobStatus.QUEUED.value}' GROUP BY queue")
READY = "SELECT 1 FROM jobs LIMIT 1"


async def job_counts() -> tuple[list[Any], list[Any]]:
    """(status, queue, count) of every job, and (queue, seconds) the oldest queued job of each queue has waited."""
    return list(await pg.fetch(JOBS_BY_STATE)), list(await pg.fetch(OLDEST_QUEUED))


async def ready() -> None:
    """Raises unless the database answers a read of the jobs table."""
    await (await pg.pool()).fetchval(READY, timeout=5)
