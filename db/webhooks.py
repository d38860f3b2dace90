"""Webhooks in the database: owners' secrets and default URLs, the outbox rows each job event adds, and the
reads that show deliveries on a job.

An owner's signing secret is stored sealed (core/secretbox.py): the column holds ciphertext under
FT_SECRETS_KEY, `secret_prefix` the few characters shown to tell secrets apart, and the secret itself is in the
answer that made it only.

A delivery row is written by `db/events.py`'s `APPEND` with every event it appends (`delivery` gives its values), so
the row commits or rolls back with the event it tells about (the ingester's batch, a cancel, the reaper's
requeue): no state change goes unannounced and no announcement has no state change. The control plane's
deliverer (controlplane/deliverer.py) sends them.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg
import psycopg
from sqlalchemy import text

from contract.codes import TERMINAL_STATUSES, AuditAction, EventKind, JobStatus, WebhookEvent
from core import secretbox, webhooks
from db import audit
from db import pool as pg
from db.errors import NotFound
from db.sqltext import named

if TYPE_CHECKING:
    from core.settings import StoreSettings


class JobView(Protocol):
    """What a delivery needs of its job: an ORM Job, or a row read by db/jobs.py."""

    id: str
    name: str
    owner: str
    queue: str
    status: str
    attempt: int
    request: dict[str, Any] | None
    error: dict[str, Any] | None
    output: Any


def new_id() -> str:
    return "whd_" + secrets.token_hex(10)


def event_type(job: JobView, kind: str, data: dict[str, Any]) -> str | None:
    """The webhook event an appended job event is, or None. State events count only where the row now has
    that state: an event the ingester kept but ignored (the job had ended) or a duplicate announces nothing."""
    if kind == EventKind.CHECKPOINT:
        return WebhookEvent.CHECKPOINT if data.get("committed") and job.status not in TERMINAL_STATUSES else None
    if kind != EventKind.STATE or "ignored" in data:
        return None
    status = data.get("status")
    if status == JobStatus.QUEUED and "previous_attempt" in data and job.status == JobStatus.QUEUED:
        return WebhookEvent.REQUEUED
    if status in (JobStatus.RUNNING, *TERMINAL_STATUSES) and job.status == status:
        return WebhookEvent(f"job.{status}")
    return None


# Where a failed state event's data holds the error: the field is spelled as the event kind is.
ERROR_FIELD = EventKind.ERROR.value


def _details(job: JobView, event: str, data: dict[str, Any]) -> dict[str, Any]:
    """What the receiver needs of the event; the job's full record is one `GET /jobs/{id}` away."""
    if event == WebhookEvent.CHECKPOINT:
        return {"step": data.get("step"), "path": data.get("path")}
    if event == WebhookEvent.FAILED:
        error = job.error or data.get(ERROR_FIELD) or {}
        return dict(error={"code": error.get("code"), "message": error.get("message")})
    if event == WebhookEvent.SUCCEEDED:
        return {"output": job.output}
    if event in (WebhookEvent.CANCELLED, WebhookEvent.REQUEUED):
        return {k: data[k] for k in ("reason", "previous_attempt") if k in data}
    return {}


def job_url(job: JobView) -> str | None:
    notifications = (job.request or {}).get("notifications") or {}
    return notifications.get("webhook_url") if isinstance(notifications, dict) else None


OWNER_URL = "SELECT url FROM webhook_owners WHERE owner = $1"
OWNER_URL_NAMED = text(named(OWNER_URL))
# The outbox row's values, in the order of db/events.py's APPEND ($7 to $12); all None: no delivery.
NO_DELIVERY: tuple[None, ...] = (None,) * 6


def delivery(job: JobView, kind: str, data: dict[str, Any], seq: int, owner_url: Any) -> tuple[Any, ...] | None:
    """The delivery that announces the event (id, owner, event, url, receiver, payload JSON), or None: none where
    the event announces nothing, or neither the job nor its owner names a URL. `owner_url()` reads the owner's
    default URL (asked only when it is needed)."""
    event = event_type(job, kind, data)
    if event is None:
        return None
    url = job_url(job) or owner_url()
    if not url:
        return None
    try:
        receiver = webhooks.target(url).receiver
    except webhooks.Refused:
        return None  # an owner default set around the API; the submit refuses such a job URL
    delivery_id = new_id()
    payload = {"id": delivery_id, "type": event, "created_at": datetime.now(timezone.utc).isoformat(),
               "job": {"id": job.id, "name": job.name, "owner": job.owner, "queue": job.queue, "status": job.status,
                       "attempt": job.attempt},
               "event_id": seq, "data": _details(job, event, data)}
    return delivery_id, job.owner, event, url, receiver, json.dumps(payload, default=str)


async def owner_url(conn: asyncpg.Connection, owner: str) -> str | None:
    return await conn.fetchval(OWNER_URL, owner)


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
        raise pg.unavailable() from exc
    return json.loads(row[0]), bool(row[1])


RESEAL_BATCH = 500


def reseal_all(settings: StoreSettings) -> tuple[int, int, dict[str, str]]:
    """Seal every stored webhook secret with the first key of FT_SECRETS_KEY (after a new key was put first;
    a plain one an older version wrote is sealed too): (changed, total, {owner: why} for rows no key opens).
    Rows are rewritten in batches, each locked while it changes, so it runs beside a serving API."""
    ring = secretbox.keyring(settings)
    changed = total = 0
    unreadable: dict[str, str] = {}
    after = ""
    with psycopg.connect(pg.dsn(settings.database_url), autocommit=True) as conn:
        while True:
            with conn.transaction():
                rows = conn.execute("SELECT owner, secret FROM webhook_owners WHERE owner > %s ORDER BY owner "
                                    "LIMIT %s FOR UPDATE", (after, RESEAL_BATCH)).fetchall()
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
                    conn.execute("UPDATE webhook_owners SET secret = %s, secret_prefix = %s WHERE owner = %s",
                                 (ring.seal(plain, context=context), plain[:webhooks.SHOWN_PREFIX], owner))
                    changed += 1
            total += len(rows)
            if len(rows) < RESEAL_BATCH:
                return changed, total, unreadable
            after = rows[-1][0]


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
