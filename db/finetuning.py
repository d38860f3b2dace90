"""The reads the OpenAI-compatible face (api/v1/) needs beyond the native ones: jobs paged with a metadata filter,
events newest first, the loss at each checkpoint's step, the succeeded jobs that are models, and each job's
lineage (the base model a chain of continued fine-tunes started from, and the job it continues).

Every read takes the caller's `owner` (None: an admin, who sees every owner's), as db/reads.py's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from contract.codes import EventKind, JobStatus
from db import pool as pg
from db import reads

# The job a job continues from is its model (`job_…`, contract/spec.py `is_job_id`), or the job before the `@` of a
# checkpoint's name (`job_…@step-N`, `checkpoint_ref`); a chain is followed at most this far, which no real chain
# of continued fine-tunes comes near.
MAX_CHAIN = 64
MODEL_OF = "request->'model'->>'name_or_path'"
LINEAGE = f"""
WITH RECURSIVE chain (start, model, depth) AS (
    SELECT id, {MODEL_OF}, 0 FROM jobs WHERE id = ANY($1::text[])
    UNION ALL
    SELECT c.start, p.{MODEL_OF}, c.depth + 1 FROM chain AS c JOIN jobs AS p ON p.id = split_part(c.model, '@', 1)
    WHERE c.depth < {MAX_CHAIN}
), roots AS (
    SELECT DISTINCT ON (start) start, model FROM chain ORDER BY start, depth DESC
)
SELECT r.start, r.model, p.id, p.name, p.owner
FROM roots AS r JOIN jobs AS s ON s.id = r.start LEFT JOIN jobs AS p ON p.id = split_part(s.{MODEL_OF}, '@', 1)"""


@dataclass(frozen=True, slots=True)
class Lineage:
    base: str  # the model the first job of the chain started from
    parent_id: str | None = None  # the job this one continues from
    parent_name: str | None = None
    parent_owner: str | None = None


async def lineage(job_ids: list[str]) -> dict[str, Lineage]:
    if not job_ids:
        return {}
    rows = await pg.fetch(LINEAGE, job_ids)
    return {r[0]: Lineage(base=r[1], parent_id=r[2], parent_name=r[3], parent_owner=r[4]) for r in rows}


async def jobs_page(*, owner: str | None, limit: int, after: str | None,
                    metadata: dict[str, str] | None) -> tuple[list[dict[str, Any]], bool]:
    """Whole jobs (request and resolved included), newest first, after the job `after`, whose metadata holds
    every pair of `metadata` ({}: jobs with no metadata; None: no filter): db/reads.py's page in its other shape."""
    rows, has_more = await reads.job_rows(reads.JOB_JSON, limit=limit, after=after, owner=owner, metadata=metadata)
    return [orjson.loads(r) for r in rows], has_more


EVENT_ROW = "seq, type, created_at, data"
EVENTS_NEWEST = (f"SELECT {EVENT_ROW} FROM job_events WHERE job_id = $1 AND seq < $2 AND type <> ALL($3::text[]) "
                 "ORDER BY seq DESC LIMIT $4")


async def events_newest_first(job_id: str, *, before: int, limit: int,
                              leave_out: list[str]) -> tuple[list[Any], bool]:
    """(seq, type, created_at, data) of the job's events before `before`, newest first, but those of the kinds
    in `leave_out`; and whether older ones follow. The caller has checked the job is the caller's."""
    rows = await pg.fetch(EVENTS_NEWEST, job_id, before, leave_out, limit + 1)
    return [(r[0], r[1], r[2], orjson.loads(r[3])) for r in rows[:limit]], len(rows) > limit


# The last training loss reported at or before each step, and the validation loss measured at it.
LOSS_AT = f"""
SELECT s, (SELECT (data->>'loss')::float8 FROM job_events
           WHERE job_id = $1 AND type = '{EventKind.PROGRESS.value}' AND (data->>'step')::bigint <= s
             AND jsonb_typeof(data->'loss') = 'number' ORDER BY seq DESC LIMIT 1),
          (SELECT (data->>'loss')::float8 FROM job_events
           WHERE job_id = $1 AND type = '{EventKind.EVAL.value}' AND (data->>'step')::bigint = s
             AND jsonb_typeof(data->'loss') = 'number' ORDER BY seq DESC LIMIT 1)
FROM unnest($2::bigint[]) AS s"""


async def losses_at(job_id: str, steps: list[int]) -> dict[int, tuple[float | None, float | None]]:
    """(train loss, validation loss) at each step."""
    if not steps:
        return {}
    return {int(r[0]): (r[1], r[2]) for r in await pg.fetch(LOSS_AT, job_id, steps)}


# A fine-tuned model is a succeeded job; listed newest first, at most this many.
MAX_MODELS = 1000
SUCCEEDED = (f"SELECT id, name, owner, finished_at FROM jobs WHERE status = '{JobStatus.SUCCEEDED.value}' "
             f"AND ($1::text IS NULL OR owner = $1) ORDER BY seq DESC LIMIT {MAX_MODELS}")


async def succeeded(owner: str | None) -> list[Any]:
    """(id, name, owner, finished_at) of the succeeded jobs, newest first."""
    return list(await pg.fetch(SUCCEEDED, owner))
