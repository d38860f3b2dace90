"""The control plane's append to a job's event log (ingest, reaper, scheduler): db/events.py's `APPEND`, event and
webhook delivery in one statement, run in the ORM session's transaction, so the event, its delivery and the job's
changes commit together or not at all."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from db import jsonw, outbox
from db.engine import run, scalar
from db.events import APPEND
from db.models import Job


def append(session: Session, job: Job, kind: str, data: dict[str, Any], *, attempt: int | None = None,
           source_id: str | None = None) -> int:
    """The event and its delivery for the locked (FOR UPDATE) `job`, so sequence numbers never collide. Returns
    the sequence."""
    job.event_seq += 1
    seq = job.event_seq
    found = outbox.delivery(job, kind, data, seq, lambda: scalar(session, outbox.OWNER_URL, job.owner))
    run(session, APPEND, job.id, seq, job.attempt if attempt is None else attempt, kind, jsonw.dumps(data),
        source_id, *(found or outbox.NO_DELIVERY))
    return seq
