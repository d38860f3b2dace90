"""The hot reads of jobs and their events, answered as JSON that Postgres builds.

A job row already holds its JSON documents (request, resolved, progress, ...) as JSONB; rebuilding them as
Python objects and validating them again on every dashboard poll was where the API's time went. Here one
query returns the response's bytes. The shapes are the documented ones (api/schemas.py): `Job` for one
job, `JobSummary` (no `request` and `resolved`, the bulk of a job) for each row of a list.

Every read takes the caller's `owner` (None: an admin, who sees every owner): it is one more condition
in the same query, never a second one, and another owner's job is simply not found.
"""

from __future__ import annotations

from typing import Any

from api import pg
from api.errors import ApiError, ErrorCode, invalid
from trainer.dsconfig import FieldError

# Progress keys every reader may rely on, null until the trainer reports them.
PROGRESS_DEFAULTS = ('\'{"step": 0, "total_steps": null, "epoch": null, "loss": null, '
                     '"tokens_per_second": null, "eta_seconds": null}\'::jsonb')
SUMMARY_FIELDS = (f"'id', id, 'name', name, 'owner', owner, 'status', status, 'attempt', attempt, 'queue', queue, "
                  f"'progress', {PROGRESS_DEFAULTS} || progress, 'error', error, 'created_at', created_at, "
                  "'started_at', started_at, 'finished_at', finished_at, 'checkpoints', checkpoints, "
                  "'output', output, 'metadata', metadata")
JOB_JSON = f"json_build_object({SUMMARY_FIELDS}, 'request', request, 'resolved', resolved)::text"
SUMMARY_JSON = f"json_build_object({SUMMARY_FIELDS})::text"
EVENT_JSON = ("(data || jsonb_build_object('id', seq, 'type', type, 'attempt', attempt, "
              "'created_at', created_at))::text")


def not_found(job_id: str) -> ApiError:
    return ApiError(404, ErrorCode.NOT_FOUND, f"no job with id {job_id!r}", "id")


# Two texts per read, with and without the owner: each is prepared once per connection with a plan of its own.
JOB_BY_ID = f"SELECT {JOB_JSON} FROM jobs WHERE id = $1"
JOB_BY_ID_AND_OWNER = JOB_BY_ID + " AND owner = $2"
EXISTS = "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1)"
EXISTS_FOR_OWNER = "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1 AND owner = $2)"


async def job(job_id: str, owner: str | None = None) -> bytes:
    text = await (pg.fetchval(JOB_BY_ID, job_id) if owner is None
                  else pg.fetchval(JOB_BY_ID_AND_OWNER, job_id, owner))
    if text is None:
        raise not_found(job_id)
    return text.encode()


async def exists(job_id: str, owner: str | None = None) -> bool:
    return bool(await (pg.fetchval(EXISTS, job_id) if owner is None else pg.fetchval(EXISTS_FOR_OWNER, job_id, owner)))


async def jobs_page(*, status: str | None, queue: str | None, limit: int, after: str | None,
                    owner: str | None = None) -> bytes:
    """Newest first, `limit` rows after the job `after`: a keyset page on (owner, seq), (status, seq),
    (queue, seq) or seq. The cursor is a job the caller can see, or it is refused like an unknown one."""
    where, args = [], []
    if after is not None:
        cursor = await (pg.fetchval("SELECT seq FROM jobs WHERE id = $1", after) if owner is None
                        else pg.fetchval("SELECT seq FROM jobs WHERE id = $1 AND owner = $2", after, owner))
        if cursor is None:
            raise invalid([FieldError("after", f"{after!r} is not a job id; pass the last id of the previous page")])
        args.append(cursor)
        where.append(f"seq < ${len(args)}")
    for column, value in (("owner", owner), ("status", status), ("queue", queue)):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    args.append(limit + 1)
    sql = (f"SELECT {SUMMARY_JSON} FROM jobs {'WHERE ' + ' AND '.join(where) if where else ''} "
           f"ORDER BY seq DESC LIMIT ${len(args)}")
    rows = [r[0] for r in await pg.fetch(sql, *args)]
    has_more = len(rows) > limit
    return b'{"data":[' + ",".join(rows[:limit]).encode() + b'],"has_more":' + (b"true" if has_more else b"false") \
        + b"}"


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
