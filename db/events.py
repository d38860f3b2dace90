"""The durable event log: append with a per-job gap-free sequence (reads: api/reads.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from db import webhooks
from db.models import Job, JobEvent


def append(session: Session, job: Job, kind: str, data: dict[str, Any], *, attempt: int | None = None,
           source_id: str | None = None) -> JobEvent:
    """Add an event; `job` must be locked (FOR UPDATE) or new, so sequence numbers never collide."""
    job.event_seq += 1
    event = JobEvent(job_id=job.id, seq=job.event_seq, attempt=job.attempt if attempt is None else attempt,
                     type=kind, data=data, source_id=source_id)
    session.add(event)
    # In this same transaction: the event and the delivery that announces it commit together or not at all.
    webhooks.enqueue(session, job, kind, data, event.seq)
    return event
