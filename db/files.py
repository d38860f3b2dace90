"""Uploaded files: the API's insert (within the owner's quota of stored bytes), reads, pages and delete on its
asyncpg pool, and the control plane's claim and result on its SQLAlchemy session.

A row is written only after its object is stored whole (api/routes/files.py), so every row names an object with
the size and SHA-256 it records. The validator (controlplane/validator.py) claims a file for a lease rather than
holding a lock while it reads: a long check holds no transaction open, a delete during it is not made to wait, and
a file whose control plane died is claimed again once the lease has run out.

Every read takes the caller's `owner` (None: an admin, who sees every owner's): another owner's file is not
found, never forbidden.
"""

from __future__ import annotations

import secrets
from typing import Any

import asyncpg
import orjson

from contract.codes import UNFINISHED_STATUSES, AuditAction, sql_list
from contract.files import FileStatus
from db import audit, keyset, quotas
from db import pool as pg
from db.errors import FileInUse, Invalid, NotFound, StoredBytesExceeded

COLUMNS = "id, owner, filename, bytes, sha256, purpose, format, status, stats, errors, created_at"
# The owner's quota of stored bytes in effect (its row's, else the service's default, $8; null: no limit) and,
# where one is in force, its counter row (db/quotas.py), locked until the commit: two uploads that each fit
# cannot together pass it. The row is inserted only within the quota, with its audit entry ($9, $10: who); the
# insert's trigger adds its bytes to the counter. The answer is the row (its id null where refused), the use it
# was measured against (null where a quota is in force but the owner has no counter row yet) and the quota.
INSERT = f"""
WITH quota AS (
    SELECT coalesce(q.max_stored_bytes, $8::bigint) AS max_bytes
    FROM (SELECT 1) AS one LEFT JOIN owner_quotas AS q ON q.owner = $2
), usage AS (
    SELECT u.stored_bytes FROM owner_usage AS u
    WHERE u.owner = $2 AND EXISTS (SELECT 1 FROM quota WHERE max_bytes IS NOT NULL)
    FOR NO KEY UPDATE OF u
), file AS (
    INSERT INTO files (id, owner, filename, bytes, sha256, purpose, format, status, created_at, updated_at)
    SELECT $1::text, $2::text, $3::text, $4::bigint, $5::text, $6::text, $7::text, '{FileStatus.UPLOADED.value}',
           now(), now()
    FROM quota LEFT JOIN usage ON true
    WHERE quota.max_bytes IS NULL OR usage.stored_bytes + $4::bigint <= quota.max_bytes
    RETURNING {COLUMNS}
), audited AS (
    {audit.INSERT}
    SELECT now(), $9, $10, '{AuditAction.FILE_UPLOAD.value}', id,
           jsonb_build_object('owner', owner, 'filename', filename, 'bytes', bytes, 'sha256', sha256) FROM file
)
SELECT file.*, usage.stored_bytes AS used, quota.max_bytes FROM quota LEFT JOIN usage ON true LEFT JOIN file ON true"""
# A recount (migration 0014) may remove the counter row between the statement that found none and the one that
# made it: tried again, but not for ever.
INSERT_TRIES = 3
BY_ID = f"SELECT {COLUMNS} FROM files WHERE id = $1"
BY_ID_AND_OWNER = BY_ID + " AND owner = $2"
CURSOR = "SELECT created_at, id FROM files WHERE id = $1"
CURSOR_FOR_OWNER = CURSOR + " AND owner = $2"
LOCK = f"SELECT {COLUMNS} FROM files WHERE id = $1 FOR UPDATE"
LOCK_FOR_OWNER = f"SELECT {COLUMNS} FROM files WHERE id = $1 AND owner = $2 FOR UPDATE"
# Jobs that have not ended and name the file as their data: the file must outlive them.
USERS = (f"SELECT id FROM jobs WHERE status IN {sql_list(UNFINISHED_STATUSES)} "
         "AND (request->'data'->>'train' = $1 OR request->'data'->>'validation' = $1) ORDER BY seq LIMIT 5")
DELETE = "DELETE FROM files WHERE id = $1"
FOR_JOB = "SELECT id, status, sha256, bytes, format FROM files WHERE id = $1 AND owner = $2"
# A submit's hold on the files its job names, until it commits: a delete (FOR UPDATE above) waits for it and then
# finds the job, or ran first and the submit finds no file. KEY SHARE, the weakest lock a delete conflicts with,
# leaves the validator's status update and other submits unblocked.
HOLD_FOR_JOB = "SELECT id, status FROM files WHERE id = ANY($1::text[]) AND owner = $2 ORDER BY id FOR KEY SHARE"


def new_id() -> str:
    return "file_" + secrets.token_hex(12)


def view(row: Any) -> dict[str, Any]:
    """The File schema's fields."""
    out = {k: row[k] for k in ("id", "owner", "filename", "bytes", "sha256", "purpose", "format", "status",
                               "created_at")}
    out["stats"] = orjson.loads(row["stats"]) if row["stats"] is not None else None
    out["errors"] = orjson.loads(row["errors"]) if row["errors"] is not None else None
    return out


def not_found(file_id: str) -> NotFound:
    return NotFound(f"no file with id {file_id!r}", "id")


async def create(*, file_id: str, owner: str, filename: str, size: int, sha256: str, purpose: str,
                 fmt: str | None, quota_default: int | None, actor: audit.Actor) -> dict[str, Any]:
    """The row of a stored object, within the owner's quota of stored bytes (StoredBytesExceeded otherwise), with
    its audit entry: one statement."""
    try:
        async with (await pg.pool()).acquire() as conn:
            for _ in range(INSERT_TRIES):
                row = await conn.fetchrow(INSERT, file_id, owner, filename, size, sha256, purpose, fmt, quota_default,
                                          actor["key_id"] if actor else None, actor["owner"] if actor else None)
                if row["id"] is not None:
                    return view(row)
                if row["used"] is not None:
                    raise StoredBytesExceeded(owner, row["max_bytes"], int(row["used"]), size)
                await quotas.ensure_usage(conn, owner)
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc
    raise pg.unavailable()


QUOTA = ("SELECT coalesce((SELECT max_stored_bytes FROM owner_quotas WHERE owner = $1), $2::bigint), "
         "coalesce((SELECT stored_bytes FROM owner_usage WHERE owner = $1), 0)")


async def quota(*, owner: str, default: int | None) -> tuple[int | None, int]:
    """The owner's quota of stored bytes in effect (None: no limit) and what its files take now: an upload
    stops reading once it would pass it (the insert checks again, under the owner's counter row's lock)."""
    row = await pg.fetchrow(QUOTA, owner, default)
    assert row is not None
    return row[0], int(row[1])


async def get(*, file_id: str, owner: str | None) -> dict[str, Any]:
    row = await (pg.fetchrow(BY_ID, file_id) if owner is None else pg.fetchrow(BY_ID_AND_OWNER, file_id, owner))
    if row is None:
        raise not_found(file_id)
    return view(row)


async def get_for_owner(owner: str, file_id: str) -> Any:
    """(id, status, sha256, bytes, format) of the owner's file, for a job that names it; NotFound for a file that
    is not the owner's."""
    row = await pg.fetchrow(FOR_JOB, file_id, owner)
    if row is None:
        raise not_found(file_id)
    return row


async def hold_for_job(conn: asyncpg.Connection, owner: str, named: dict[str, str]) -> None:
    """Within a submit's transaction: lock the owner's files that `named` (field: file id) names against a delete
    until the job row commits, and check again that each is still there and processed (Invalid naming the field
    otherwise: the check before the transaction saw it, but a delete may have won since)."""
    found = {r["id"]: r["status"] for r in await conn.fetch(HOLD_FOR_JOB, sorted(set(named.values())), owner)}
    for field, file_id in named.items():
        status = found.get(file_id)
        if status is None:
            raise Invalid(f"there is no file {file_id!r} of yours (deleted while the job was submitted)", field)
        if status != FileStatus.PROCESSED:
            raise Invalid(f"file {file_id} is {status}; only a processed file can be trained on", field)


async def page(*, owner: str | None, limit: int, after: str | None, oldest_first: bool = False,
               purpose: str | None = None) -> dict[str, Any]:
    """Newest first (or oldest first), `limit` files after the file `after` (one the caller can see, or NotFound),
    of one purpose where given."""
    page = keyset.Page()
    if after is not None:
        cursor = await (pg.fetchrow(CURSOR, after) if owner is None else pg.fetchrow(CURSOR_FOR_OWNER, after, owner))
        if cursor is None:
            raise NotFound(f"no file {after!r} to page after; pass the last id of the previous page", "after")
        beyond = ">" if oldest_first else "<"
        page.where_(f"(created_at, id) {beyond} ({page.arg(cursor['created_at'])}, {page.arg(cursor['id'])})")
    page.equal("owner", owner)
    page.equal("purpose", purpose)
    order = "created_at, id" if oldest_first else "created_at DESC, id DESC"
    rows = await pg.fetch(page.sql(COLUMNS, "files", order, limit), *page.args)
    return {"data": [view(r) for r in rows[:limit]], "has_more": len(rows) > limit}


async def delete(*, file_id: str, owner: str | None, actor: audit.Actor) -> dict[str, Any]:
    """The row removed (the caller removes its object next); FileInUse while a job that has not ended names it."""
    try:
        async with (await pg.pool()).acquire() as conn, conn.transaction():
            row = await (conn.fetchrow(LOCK, file_id) if owner is None
                         else conn.fetchrow(LOCK_FOR_OWNER, file_id, owner))
            if row is None:
                raise not_found(file_id)
            users = [r["id"] for r in await conn.fetch(USERS, file_id)]
            if users:
                raise FileInUse(f"file {file_id!r} is the data of job(s) that have not ended ({', '.join(users)}); "
                                "cancel them or wait for them to end, then delete it", "id")
            await conn.execute(DELETE, file_id)
            await audit.record(conn, actor, AuditAction.FILE_DELETE, file_id, {"owner": row["owner"]})
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc
    return view(row)
