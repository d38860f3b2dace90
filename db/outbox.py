"""The webhook outbox row an appended job event makes: which event announces it, to which URL, with what payload.
Pure: both processes append events (db/events.py `append_async` in the API, db/journal.py in the control plane),
and both compute the row here; the deliverer sends it (controlplane/deliverer.py, db/deliveries.py)."""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

from contract.codes import TERMINAL_STATUSES, EventKind, JobStatus, WebhookEvent
from core import webhooks

if TYPE_CHECKING:
    import asyncpg


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


async def delivery_async(conn: asyncpg.Connection, job: JobView, kind: str, data: dict[str, Any],
                         seq: int) -> tuple[Any, ...]:
    """`delivery` in the API's transaction on `conn`, its six values all None where there is none."""
    url = None
    if event_type(job, kind, data) is not None and not job_url(job):
        url = await owner_url(conn, job.owner)
    return delivery(job, kind, data, seq, lambda: url) or NO_DELIVERY
