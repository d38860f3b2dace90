"""Quotas per owner: how many unfinished jobs, and how many GPUs among them, one owner may hold, and how many
bytes its uploaded files may take in the store.

An admin sets them (`PUT /owners/{owner}/quota`); an owner without a row, or a null field, takes the
service's default (`defaults`, the API's settings). They are enforced in the submit's own transaction
(db/jobs.py), under a lock per owner, so two submits cannot both take the last slot; the stored bytes likewise
in the upload's insert (db/files.py). What is counted (`USAGE`)
and how a row and the defaults combine (`effective`) are written here once, for the submit and for the reads.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from contract.codes import UNFINISHED_STATUSES, AuditAction, sql_list
from db import audit
from db import pool as pg

Limits = tuple[int | None, int | None]

# The owner's unfinished jobs and their GPUs (from the partial index ix_jobs_owner_unfinished), `{owner}` its
# parameter.
USAGE = ("SELECT count(*) AS jobs, coalesce(sum(gpus), 0) AS gpus FROM jobs "
         f"WHERE owner = {{owner}} AND status IN {sql_list(UNFINISHED_STATUSES)}")
ROW = "SELECT max_active_jobs, max_gpus, max_stored_bytes FROM owner_quotas WHERE owner = $1"
STORED = "SELECT coalesce(sum(bytes), 0)::bigint FROM files WHERE owner = $1"
# The owner's quota, read under a lock of the owner's own for the rest of the transaction: the next
# statement's snapshot then sees every job an earlier submit of the owner committed, so two submits
# cannot both take the last slot. Submits of other owners do not wait for it.
LOCK_OWNER = """
SELECT pg_advisory_xact_lock(hashtextextended('ft_quota:' || $1, 0)), q.max_active_jobs, q.max_gpus
FROM (SELECT 1) AS one LEFT JOIN owner_quotas AS q ON q.owner = $1"""
PUT = """
INSERT INTO owner_quotas (owner, max_active_jobs, max_gpus, max_stored_bytes, updated_at) VALUES ($1, $2, $3, $4, now())
ON CONFLICT (owner) DO UPDATE SET max_active_jobs = EXCLUDED.max_active_jobs, max_gpus = EXCLUDED.max_gpus,
    max_stored_bytes = EXCLUDED.max_stored_bytes, updated_at = EXCLUDED.updated_at"""


def effective(row: Any, defaults: Limits) -> Limits:
    """The limits in effect: the row's fields (max_active_jobs, max_gpus) where set, else the defaults."""
    jobs = row["max_active_jobs"] if row is not None and row["max_active_jobs"] is not None else defaults[0]
    gpus = row["max_gpus"] if row is not None and row["max_gpus"] is not None else defaults[1]
    return jobs, gpus


async def has_row(conn: asyncpg.Connection, owner: str) -> bool:
    return bool(await conn.fetch(ROW, owner))


async def lock(conn: asyncpg.Connection, owner: str, defaults: Limits) -> Limits:
    """Within a submit's transaction: the owner's lock taken, the limits in effect."""
    return effective(await conn.fetchrow(LOCK_OWNER, owner), defaults)


async def get(*, owner: str, defaults: Limits, stored_default: int | None) -> dict[str, Any]:
    try:
        async with (await pg.pool()).acquire() as conn:
            return await _get(conn, owner, defaults, stored_default)
    except pg.UNREACHABLE as exc:
        raise pg.unavailable() from exc


async def _get(conn: asyncpg.Connection, owner: str, defaults: Limits, stored_default: int | None) -> dict[str, Any]:
    row = await conn.fetchrow(ROW, owner)
    count, used = await conn.fetchrow(USAGE.format(owner="$1"), owner)
    stored = await conn.fetchval(STORED, owner)
    jobs, gpus = effective(row, defaults)
    stored_set = row["max_stored_bytes"] if row else None
    return {"owner": owner, "max_active_jobs": jobs, "max_gpus": gpus,
            "max_stored_bytes": stored_set if stored_set is not None else stored_default,
            "set": {"max_active_jobs": row["max_active_jobs"] if row else None,
                    "max_gpus": row["max_gpus"] if row else None, "max_stored_bytes": stored_set},
            "usage": {"active_jobs": int(count), "gpus": int(used), "stored_bytes": int(stored)}}


async def put(*, owner: str, max_active_jobs: int | None, max_gpus: int | None, max_stored_bytes: int | None,
              actor: audit.Actor, defaults: Limits, stored_default: int | None) -> dict[str, Any]:
    """Replace the owner's quota. Lowering it below the current use refuses new submits; it ends no job."""
    try:
        async with (await pg.pool()).acquire() as conn:
            async with conn.transaction():
                await conn.execute(PUT, owner, max_active_jobs, max_gpus, max_stored_bytes)
                await audit.record(conn, actor, AuditAction.QUOTA_SET, owner, {
                    "max_active_jobs": max_active_jobs, "max_gpus": max_gpus, "max_stored_bytes": max_stored_bytes})
            return await _get(conn, owner, defaults, stored_default)
    except pg.UNREACHABLE as exc:
        raise pg.unavailable() from exc
