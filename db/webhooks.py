"""Webhooks in the database as the API serves them: owners' secrets and default URLs, and the reads that show a
job's deliveries (the outbox row an event adds is db/outbox.py's).

An owner's signing secret is stored sealed (core/secretbox.py): the column holds ciphertext under
FT_SECRETS_KEY, `secret_prefix` the few characters shown to tell secrets apart, and the secret itself is in the
answer that made it only.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import asyncpg

from contract.codes import AuditAction
from core import secretbox, webhooks
from db import audit
from db import pool as pg
from db.errors import NotFound

if TYPE_CHECKING:
    from core.settings import StoreSettings


OWNER_HAS_SECRET = "SELECT EXISTS (SELECT 1 FROM webhook_owners WHERE owner = $1)"


async def owner_has_secret(owner: str) -> bool:
    return bool(await pg.fetchval(OWNER_HAS_SECRET, owner))


OWNER_JSON = ("json_build_object('owner', owner, 'url', url, 'secret_prefix', secret_prefix, "
              "'created_at', created_at, 'rotated_at', rotated_at, 'updated_at', updated_at)::text")
GET_OWNER = f"SELECT {OWNER_JSON} FROM webhook_owners WHERE owner = $1"
# Created with a secret on first use; `rotate` replaces the secret. Whether the stored secret is the one this call
# made says whether to show it (two first PUTs at once: only the one whose secret was kept shows one); each sealing
# draws a fresh nonce, so two calls never seal alike.
PUT_OWNER = f"""
INSERT INTO webhook_owners AS w (owner, url, secret, secret_prefix) VALUES ($1, $2, $3, $5)
ON CONFLICT (owner) DO UPDATE SET url = EXCLUDED.url, updated_at = now(),
    secret = CASE WHEN $4 THEN EXCLUDED.secret ELSE w.secret END,
    secret_prefix = CASE WHEN $4 THEN EXCLUDED.secret_prefix ELSE w.secret_prefix END,
    rotated_at = CASE WHEN $4 THEN now() ELSE w.rotated_at END
RETURNING {OWNER_JSON}, secret = $3"""


async def get_owner(owner: str) -> dict[str, Any]:
    """The owner's webhook settings (never the secret), or NotFound."""
    found = await pg.fetchval(GET_OWNER, owner)
    if found is None:
        raise NotFound(f"owner {owner!r} has no webhook settings; PUT them first", "owner")
    return {**json.loads(found), "secret": None}


async def put_owner(*, owner: str, url: str | None, rotate: bool, sealed: str, prefix: str,
                    actor: audit.Actor) -> tuple[dict[str, Any], bool]:
    """Set the owner's default URL and store `sealed` where the owner has no secret yet or `rotate` asks: the
    settings, and whether `sealed` was stored."""
    try:
        async with (await pg.pool()).acquire() as conn, conn.transaction():
            row = await conn.fetchrow(PUT_OWNER, owner, url, sealed, rotate, prefix)
            await audit.record(conn, actor, AuditAction.WEBHOOK_SET, owner, {"url": url, "secret_made": bool(row[1])})
    except pg.UNREACHABLE as exc:
        raise pg.unavailable(exc) from exc
    return json.loads(row[0]), bool(row[1])


RESEAL_BATCH = 500


RESEAL_READ = "SELECT owner, secret FROM webhook_owners WHERE owner > $1 ORDER BY owner LIMIT $2 FOR UPDATE"
RESEAL_WRITE = "UPDATE webhook_owners SET secret = $2, secret_prefix = $3 WHERE owner = $1"


async def reseal_all(settings: StoreSettings) -> tuple[int, int, dict[str, str]]:
    """Seal every stored webhook secret with the first key of FT_SECRETS_KEY (after a new key was put first;
    a plain one an older version wrote is sealed too): (changed, total, {owner: why} for rows no key opens).
    Rows are rewritten in batches, each locked while it changes, so it runs beside a serving API."""
    ring = secretbox.keyring(settings)
    changed = total = 0
    unreadable: dict[str, str] = {}
    after = ""
    conn = await asyncpg.connect(pg.dsn(settings.database_url), timeout=5)
    try:
        while True:
            async with conn.transaction():
                rows = await conn.fetch(RESEAL_READ, after, RESEAL_BATCH)
                for owner, stored in rows:
                    if ring.sealed_with_first(stored):
                        continue
                    context = secretbox.webhook_context(owner)
                    try:
                        plain = stored if stored.startswith(webhooks.SECRET_PREFIX) else \
                            ring.open(stored, context=context)
                    except secretbox.Unreadable as exc:
                        unreadable[owner] = str(exc)
                        continue
                    await conn.execute(RESEAL_WRITE, owner, ring.seal(plain, context=context),
                                       plain[:webhooks.SHOWN_PREFIX])
                    changed += 1
            total += len(rows)
            if len(rows) < RESEAL_BATCH:
                return changed, total, unreadable
            after = rows[-1][0]
    finally:
        await conn.close()


DELIVERY_JSON = """json_build_object(
    'id', id, 'event', event, 'event_id', event_seq, 'url', url, 'status', status, 'attempts', attempts,
    'next_attempt_at', CASE WHEN status = 'pending' THEN next_attempt_at END, 'last_attempt_at', last_attempt_at,
    'last_status_code', last_status_code, 'last_error', last_error, 'delivered_at', delivered_at,
    'created_at', created_at)::text"""


async def deliveries(*, job_id: str, owner: str | None, after: int, limit: int) -> bytes:
    """The job's deliveries in event order after the event id `after`; a 404 where the job is not the caller's."""
    args: list[Any] = [job_id, after, limit + 1]
    sql = f"SELECT event_seq, {DELIVERY_JSON} FROM webhook_deliveries WHERE job_id = $1 AND event_seq > $2"
    if owner is not None:
        args.append(owner)
        sql += " AND EXISTS (SELECT 1 FROM jobs WHERE id = $1 AND owner = $4)"
    rows = await pg.fetch(sql + " ORDER BY event_seq LIMIT $3", *args)
    if not rows:
        exists = "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1" + (" AND owner = $2)" if owner else ")")
        if not await pg.fetchval(exists, *([job_id, owner] if owner else [job_id])):
            raise NotFound(f"no job with id {job_id!r}", "id")
    page = rows[:limit]
    next_after = page[-1][0] if page else after
    return (b'{"data":[' + ",".join(r[1] for r in page).encode() + b'],"has_more":'
            + (b"true" if len(rows) > limit else b"false") + b',"next_after":' + str(next_after).encode() + b"}")
