"""The durable event log: append with a per-job gap-free sequence, read pages after a cursor."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Job, JobEvent


def append(session: Session, job: Job, kind: str, data: dict[str, Any], *, attempt: int | None = None,
           source_id: str | None = None) -> JobEvent:
    """Add an event; `job` must be locked (FOR UPDATE) or new, so sequence numbers never collide."""
    job.event_seq += 1
    event = JobEvent(job_id=job.id, seq=job.event_seq, attempt=job.attempt if attempt is None else attempt,
                     type=kind, data=data, source_id=source_id)
    session.add(event)
    return event


def page(session: Session, job_id: str, *, after: int, limit: int, types: list[str] | None = None) -> list[JobEvent]:
    q = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after)
    if types:
        q = q.where(JobEvent.type.in_(types))
    return list(session.scalars(q.order_by(JobEvent.seq).limit(limit)))


def public(event: JobEvent) -> dict[str, Any]:
    return {**event.data, "id": event.seq, "type": event.type, "attempt": event.attempt,
            "created_at": event.created_at}


def log_text(event: JobEvent) -> str:
    rank = event.data.get("rank")
    who = "launcher" if rank is None else f"rank {rank}"
    return f"[attempt {event.attempt}][{who}] {event.data.get('line', '')}"
