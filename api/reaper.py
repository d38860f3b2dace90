"""Finds attempts whose worker stopped heartbeating and requeues them as the next attempt.

Also re-asserts the control keys every pass (current attempt, cancel requests), so a Redis that
restarted without its data cannot make workers lose track of their jobs, and re-sends jobs whose
enqueue failed after their row was committed.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import redis
from sqlalchemy import select

from api.db import session_scope
from api.models import ACTIVE, Job
from api.services import events
from api.services.jobs import CANCEL_KEY_TTL, now, send
from api.settings import ApiSettings
from worker.keys import attempt_key, cancel_key, lease_key

log = logging.getLogger(__name__)


class Reaper:
    def __init__(self, client: redis.Redis, settings: ApiSettings) -> None:
        self.r = client
        self.settings = settings
        self.missing_since: dict[tuple[str, int], float] = {}

    def step(self) -> list[str]:
        """One pass; returns the ids of jobs it requeued or ended."""
        with session_scope() as session:
            jobs = list(session.scalars(select(Job).where(Job.status.in_((*ACTIVE, "queued")))))
            pipe = self.r.pipeline(transaction=False)
            for job in jobs:
                pipe.set(attempt_key(job.id), job.attempt)
                if job.status == "cancelling":
                    pipe.set(cancel_key(job.id), job.attempt, ex=CANCEL_KEY_TTL)
            active = [j for j in jobs if j.status in ACTIVE]
            for job in active:
                pipe.exists(lease_key(job.id, job.attempt))
            replies = pipe.execute()[-len(active):] if active else []
        acted = []
        clock = time.monotonic()
        live = set()
        for job, alive in zip(active, replies, strict=True):
            key = (job.id, job.attempt)
            live.add(key)
            if alive:
                self.missing_since.pop(key, None)
                continue
            first = self.missing_since.setdefault(key, clock)
            if clock - first >= self.settings.lease_grace_seconds:
                if self._lost(job.id, job.attempt):
                    acted.append(job.id)
                self.missing_since.pop(key, None)
        self.missing_since = {k: v for k, v in self.missing_since.items() if k in live}
        self._resend_undispatched()
        return acted

    def _lost(self, job_id: str, attempt: int) -> bool:
        with session_scope() as session:
            job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
            if job.attempt != attempt or job.status not in ACTIVE:
                return False  # it moved on while we looked
            if job.status == "cancelling":
                job.status, job.finished_at = "cancelled", now()
                events.append(session, job, "state", {"status": "cancelled", "reason": "worker lost while cancelling"})
                return True
            if attempt >= self.settings.max_attempts:
                job.status, job.finished_at = "failed", now()
                job.error = {"code": "worker_lost",
                             "message": f"the worker stopped heartbeating on attempt {attempt} of "
                                        f"{self.settings.max_attempts}"}
                events.append(session, job, "state", {"status": "failed", "error": job.error})
                return True
            events.append(session, job, "state", {"status": "lost", "reason": "worker stopped heartbeating"})
            job.attempt = attempt + 1
            job.status = "queued"
            job.dispatched_at = None
            events.append(session, job, "state", {"status": "queued", "reason": "requeued after worker loss",
                                                  "previous_attempt": attempt})
            session.commit()
            log.warning("job %s lost its worker on attempt %d; requeued as attempt %d", job_id, attempt, attempt + 1)
            send(session=session, client=self.r, job=job)
            return True

    def _resend_undispatched(self) -> None:
        cutoff = now() - timedelta(seconds=5)
        with session_scope() as session:
            stuck = list(session.scalars(select(Job).where(Job.status == "queued", Job.dispatched_at.is_(None),
                                                           Job.updated_at < cutoff).with_for_update(skip_locked=True)))
            for job in stuck:
                send(session=session, client=self.r, job=job)
