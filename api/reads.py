"""The hot reads of jobs and their events, answered as JSON that Postgres builds.

A job row already holds its JSON documents (request, resolved, progress, ...) as JSONB; rebuilding them as
Python objects and validating them again on every dashboard poll was where the API's time went. Here one
query returns the response's bytes. The shapes are the documented ones (api/schemas.py): `Job` for one
job, `JobSummary` (no `request` and `resolved`, the bulk of a job) for each row of a list.
"""

from __future__ import annotations

from typing import Any

from api import pg
from api.errors import ApiError, ErrorCode, invalid
from trainer.dsconfig import FieldError

# Progress keys every reader may rely on, null until the trainer reports them.
PROGRESS_DEFAULTS = ('\'{"step": 0, "total_steps": null, "epoch": null, "loss": null, '
                     '"tokens_per_second": null, "eta_seconds": null}\'::jsonb')
SUMMARY_FIELDS = (f"'id', id, 'name', name, 'status', status, 'attempt', attempt, 'queue', queue, "
                  f"'progress', {PROGRESS_DEFAULTS} || progress, 'error', error, 'created_at', created_at, "
                  "'started_at', started_at, 'finished_at', finished_at, 'checkpoints', checkpoints, "
                  "'output', output, 'metadata', metadata")
JOB_JSON = f"json_build_object({SUMMARY_FIELDS}, 'request', request, 'resolved', resolved)::text"
SUMMARY_JSON = f"json_build_object({SUMMARY_FIELDS})::text"
EVENT_JSON = ("(data || jsonb_build_object('id', seq, 'type', type, 'attempt', attempt, "
              "'created_at', created_at))::text")


def not_found(job_id: str) -> ApiError:
    return ApiError(404, ErrorCode.NOT_FOUND, f"no job with id {job_id!r}", "id")


async def job(job_id: str) -> bytes:
    text = await pg.fetchval(f"SELECT {JOB_JSON} FROM jobs WHERE id = $1", job_id)
    if text is None:
        raise not_found(job_id)
    return text.encode()


async def exists(job_id: str) -> bool:
    return bool(await pg.fetchval("SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1)", job_id))


async def jobs_page(*, status: str | None, queue: str | None, limit: int, after: str | None) -> bytes:
    """Newest first, `limit` rows after the job `after`: a keyset page on (status, seq), (queue, seq) or seq."""
    where, args = [], []
    if after is not None:
        cursor = await pg.fetchval("SELECT seq FROM jobs WHERE id = $1", after)
        if cursor is None:
            raise invalid([FieldError("after", f"{after!r} is not a job id; pass the last id of the previous page")])
        args.append(cursor)
        where.append(f"seq < ${len(args)}")
    for column, value in (("status", status), ("queue", queue)):
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


async def events_after(job_id: str, after: int, limit: int, types: list[str] | None) -> list[Any]:
    """(seq, type, attempt, json, rank, line) of the job's events after `after`, in order."""
    sql = (f"SELECT seq, type, attempt, {EVENT_JSON}, data->>'rank', data->>'line' FROM job_events "
           "WHERE job_id = $1 AND seq > $2 " + ("AND type = ANY($4::text[]) " if types else "")
           + "ORDER BY seq LIMIT $3")
    return list(await pg.fetch(sql, job_id, after, limit, *([types] if types else [])))


async def events_page(job_id: str, *, after: int, limit: int, types: list[str] | None) -> bytes:
    rows = await events_after(job_id, after, limit + 1, types)
    if not rows and not await exists(job_id):
        raise not_found(job_id)
    page = rows[:limit]
    next_after = page[-1][0] if page else after
    return (b'{"data":[' + ",".join(r[3] for r in page).encode() + b'],"has_more":'
            + (b"true" if len(rows) > limit else b"false") + b',"next_after":' + str(next_after).encode() + b"}")
