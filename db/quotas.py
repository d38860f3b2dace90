"""Quotas per owner: how many unfinished jobs, and how many GPUs among them, one owner may hold, and how many
bytes its uploaded files may take in the store.

An admin sets them (`PUT /owners/{owner}/quota`); an owner without a row, or a null field, takes the
service's default (`defaults`, the API's settings). What an owner holds is kept as counters in `owner_usage`,
which triggers on `jobs` and `files` update in the transaction of every write that changes them (migration
0014). A submit (db/jobs.py) or an upload (db/files.py) under a quota locks its owner's counter row in the
statement that inserts, compares it with the limit and inserts only within it; the insert's trigger then adds to
the row it holds, so two submits cannot both take the last slot, and the check costs one row whatever the owner
holds. Submits of other owners do not wait for it. How a row and the defaults combine is written here once, for
the submits and for the reads.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from contract.codes import AuditAction
from db import audit
from db import pool as pg

Limits = tuple[int | None, int | None]

ROW = "SELECT max_active_jobs, max_gpus, max_stored_bytes FROM owner_quotas WHERE owner = $1"
USAGE = "SELECT active_jobs, gpus, stored_bytes FROM owner_usage WHERE owner = $1"
# A submit or an upload that found no counter row for its owner (none of its jobs or files was ever written, or
# a recount found it held nothing) makes it and tries again: a lock needs a row to lock.
ENSURE_USAGE = "INSERT INTO owner_usage (owner) VALUES ($1) ON CONFLICT (owner) DO NOTHING"
PUT = """
INSERT INTO owner_quotas (owner, max_active_jobs, max_gpus, max_stored_bytes, updated_at) VALUES ($1, $2, $3, $4, now())
ON CONFLICT (owner) DO UPDATE SET max_active_jobs = EXCLUDED.max_active_jobs, max_gpus = EXCLUDED.max_gpus,
    max_stored_bytes = EXCLUDED.max_stored_bytes, updated_at = EXCLUDED.updated_at"""


def effective(row: Any, defaults: Limits) -> Limits:
    """The limits in effect: the row's fields (max_active_jobs, max_gpus) where set, else the defaults."""
    jobs = row["max_active_jobs"] if row is not None and row["max_active_jobs"] is not None else defaults[0]
    gpus = row["max_gpus"] if row is not None and row["max_gpus"] is not None else defaults[1]
    return jobs, gpus


async def ensure_usage(conn: asyncpg.Connection, owner: str) -> None:
    await conn.execute(ENSURE_USAGE, owner)


async def get(*, owner: str, defaults: Limits, stored_default: int | None) -> dict[str, Any]:
    try:
        async with (await pg.pool()).acquire() as conn:
            return await _get(conn, owner, defaults, stored_default)
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc


async def _get(conn: asyncpg.Connection, owner: str, defaults: Limits, stored_default: int | None) -> dict[str, Any]:
    row = await conn.fetchrow(ROW, owner)
    usage = await conn.fetchrow(USAGE, owner)
    count, used, stored = (usage["active_jobs"], usage["gpus"], usage["stored_bytes"]) if usage else (0, 0, 0)
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
        raise pg.unavailable(exc) from exc
