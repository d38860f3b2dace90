"""API keys: create, list, revoke. The API's /keys routes and the operator's CLI (`python -m api.admin.keys`) both call
these; the secret is made by the caller (api/access.py), which passes its hash and shown prefix only."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from contract.codes import AuditAction
from db import audit, keyset
from db import pool as pg
from db.errors import Invalid, NotFound

MAX_DAYS = 100 * 366  # a farther expiry means none; the bound keeps dates near Python's year 9999 out

COLUMNS = "id, prefix, owner, scopes, name, created_at, created_by, expires_at, last_used_at, revoked_at, secret_hash"
INSERT = f"""
INSERT INTO api_keys (id, secret_hash, prefix, owner, scopes, name, expires_at, created_by, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now()) RETURNING {COLUMNS}"""
CURSOR = "SELECT created_at, id FROM api_keys WHERE id = $1"
LOCK = f"SELECT {COLUMNS} FROM api_keys WHERE id = $1 FOR UPDATE"
REVOKE = f"UPDATE api_keys SET revoked_at = now() WHERE id = $1 RETURNING {COLUMNS}"


def new_id() -> str:
    return "key_" + secrets.token_hex(8)


def view(key: Any) -> dict[str, Any]:
    """The key's fields without its secret (the Key schema)."""
    return {"id": key["id"], "prefix": key["prefix"], "owner": key["owner"], "scopes": list(key["scopes"]),
            "name": key["name"], "created_at": key["created_at"], "created_by": key["created_by"],
            "expires_at": key["expires_at"], "last_used_at": key["last_used_at"],
            "revoked": key["revoked_at"] is not None, "revoked_at": key["revoked_at"]}


def check_expiry(expires_at: datetime | None) -> None:
    if expires_at is None:
        return
    if expires_at.tzinfo is None:
        raise Invalid("needs a time zone (say, 2027-01-01T00:00:00Z)", "expires_at")
    now = datetime.now(timezone.utc)
    if expires_at <= now:
        raise Invalid("is in the past; give a future time or null for no expiry", "expires_at")
    if expires_at.year >= 9000 or (expires_at - now).days > MAX_DAYS:
        raise Invalid(f"is more than {MAX_DAYS} days away; give null for no expiry", "expires_at")


async def create(*, owner: str, scopes: list[str], secret_hash: bytes, prefix: str, name: str = "",
                 expires_at: datetime | None = None, actor: audit.Actor) -> dict[str, Any]:
    """A new key's row (the Key schema's fields); `actor` None is the operator's CLI."""
    check_expiry(expires_at)
    scopes = sorted(set(scopes))
    try:
        async with (await pg.pool()).acquire() as conn, conn.transaction():
            row = await conn.fetchrow(INSERT, new_id(), secret_hash, prefix, owner, scopes, name, expires_at,
                                      actor["key_id"] if actor else None)
            await audit.record(conn, actor, AuditAction.KEY_CREATE, row["id"], {
                "owner": owner, "scopes": scopes, "name": name,
                "expires_at": expires_at.isoformat() if expires_at else None})
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc
    return view(row)


async def listing(*, owner: str | None, limit: int, after: str | None) -> dict[str, Any]:
    """Newest first, `limit` keys after the key `after` (NotFound where it is no key)."""
    page = keyset.Page()
    if after is not None:
        cursor = await pg.fetchrow(CURSOR, after)
        if cursor is None:
            raise NotFound(f"no key {after!r} to page after; pass the last id of the previous page", "after")
        page.where_(f"(created_at, id) < ({page.arg(cursor['created_at'])}, {page.arg(cursor['id'])})")
    page.equal("owner", owner)
    rows = await pg.fetch(page.sql(COLUMNS, "api_keys", "created_at DESC, id DESC", limit), *page.args)
    return {"data": [view(k) for k in rows[:limit]], "has_more": len(rows) > limit}


async def revoke(*, key_id: str, actor: audit.Actor) -> tuple[dict[str, Any], bytes]:
    """Revoked from the commit on; every API process drops it from its cache (the table's trigger notifies).
    Returns the key's fields and its secret's hash (to drop from this process's cache). Twice changes nothing."""
    try:
        async with (await pg.pool()).acquire() as conn, conn.transaction():
            row = await conn.fetchrow(LOCK, key_id)
            if row is None:
                raise NotFound(f"no key with id {key_id!r}", "id")
            if row["revoked_at"] is None:
                row = await conn.fetchrow(REVOKE, key_id)
                await audit.record(conn, actor, AuditAction.KEY_REVOKE, key_id, {"owner": row["owner"]})
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc
    return view(row), bytes(row["secret_hash"])


LOOKUP = ("SELECT id, owner, scopes, expires_at, secret_hash FROM api_keys "
          "WHERE secret_hash = $1 AND revoked_at IS NULL")
TOUCH = ("UPDATE api_keys SET last_used_at = now() WHERE id = $1 "
         "AND (last_used_at IS NULL OR last_used_at < now() - interval '55 seconds')")
# Any key with the admin scope that works now.
ADMIN_KEY_EXISTS = ("SELECT EXISTS (SELECT 1 FROM api_keys WHERE $1 = ANY(scopes) AND revoked_at IS NULL "
                    "AND (expires_at IS NULL OR expires_at > now()))")


async def lookup(secret_hash: bytes) -> Any:
    """The unrevoked key with this hash (id, owner, scopes, expires_at, secret_hash), or None."""
    rows = await pg.fetch(LOOKUP, secret_hash)
    return rows[0] if rows else None


async def touch(key_id: str) -> None:
    """Record the key's use (at most about once a minute per key)."""
    await pg.fetchval(TOUCH, key_id)


async def scope_holder_exists(scope: str) -> bool:
    """Whether a working (unrevoked, unexpired) key holds `scope`."""
    return bool(await pg.fetchval(ADMIN_KEY_EXISTS, scope))
