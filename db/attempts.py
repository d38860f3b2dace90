"""A job's attempts: the jobs a worker holds, moving a job to its next attempt, and the reaper's verdicts on an
attempt whose worker is gone (controlplane/reaper.py) or whose task message a Redis lost (the re-drive).

`next_attempt` is the one place a job goes back to the queue as a new attempt: the reaper's requeue of a lost or
released worker, its re-drive after a Redis data loss, and the scheduler's take-back from a node that went away
(db/placement.py) all call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Row, and_, func, or_, select
from sqlalchemy.orm import Session

from contract.codes import ACTIVE_STATUSES, EventKind, FailureCode, JobStatus
from db import journal
from db.models import Job, JobEvent

# What a lost worker's state event says; counted to tell how many attempts lost their worker.
LOST = "lost"
RELEASED = "released"
# A job committed but not marked sent may be in the dispatcher's hands right now: a re-drive leaves it alone this long.
UNSENT_GRACE_SECONDS = 5


def _now() -> datetime:
    return datetime.now(timezone.utc)


def locked(session: Session, job_id: str) -> Job | None:
    """The job's row, locked (FOR UPDATE) until the transaction ends; None if there is none."""
    return session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()


def next_attempt(session: Session, job: Job, reason: str, *, keep_placement: bool = False) -> int:
    """Put the locked `job` back in the queue as its next attempt, unsent, and say why in its log; returns the new
    attempt. Its placement is dropped (the scheduler places the attempt afresh) unless `keep_placement`: a
    re-drive sends the new attempt to the nodes the old one was placed on."""
    previous = job.attempt
    job.attempt = previous + 1
    job.status = JobStatus.QUEUED
    job.dispatched_at = None
    if not keep_placement:
        job.placement = None
    journal.append(session, job, EventKind.STATE,
                  {"status": JobStatus.QUEUED, "reason": reason, "previous_attempt": previous})
    return job.attempt


def active(session: Session) -> list[Row[Any]]:
    """The columns the reaper needs (id, attempt, status, placement) of the jobs a worker holds: a pass must not
    grow with the queue (a queue of 100,000 jobs cost a pass seconds)."""
    return list(session.execute(select(Job.id, Job.attempt, Job.status, Job.placement)
                                .where(Job.status.in_(ACTIVE_STATUSES))))


def running(session: Session, *, limit: int = 1000) -> list[Row[Any]]:
    """(id, owner, queue, progress) of the jobs a worker holds, oldest first: the running jobs' figures."""
    return list(session.execute(select(Job.id, Job.owner, Job.queue, Job.progress)
                                .where(Job.status.in_(ACTIVE_STATUSES)).order_by(Job.seq).limit(limit)))


def _losses(session: Session, job_id: str) -> int:
    return int(session.scalar(select(func.count()).select_from(JobEvent).where(
        JobEvent.job_id == job_id, JobEvent.type == EventKind.STATE, JobEvent.data["status"].astext == LOST)) or 0)


@dataclass(frozen=True)
class Reaped:
    """What `reap` did: the job's status after it, and, where it was requeued, why and as which attempt."""

    status: JobStatus
    reason: str = ""
    attempt: int = 0


def reap(session: Session, job_id: str, attempt: int, *, max_attempts: int,
         released: dict[str, Any] | None = None) -> Reaped | None:
    """The attempt's worker is gone: requeue the job as its next attempt, or end it (cancelled where it was being
    cancelled, failed once `max_attempts` attempts lost their worker). `released` is what a worker that handed the
    job back said: that is no loss. None where the job moved on meanwhile."""
    job = locked(session, job_id)
    if job is None or job.attempt != attempt or job.status not in ACTIVE_STATUSES:
        return None  # it moved on while we looked
    if job.status == JobStatus.CANCELLING:
        job.status, job.finished_at = JobStatus.CANCELLED, _now()
        journal.append(session, job, EventKind.STATE,
                      {"status": JobStatus.CANCELLED, "reason": "worker lost while cancelling"})
        return Reaped(JobStatus.CANCELLED)
    # Workers lost, not attempt numbers: a re-drive after a Redis data loss also takes a new attempt.
    losses = (0 if released is not None else 1) + _losses(session, job_id)
    if released is None and losses >= max_attempts:
        job.status, job.finished_at = JobStatus.FAILED, _now()
        job.error = {"code": FailureCode.WORKER_LOST,
                     "message": f"the worker stopped heartbeating on attempt {attempt}; {losses} of "
                                f"{max_attempts} allowed attempts lost their worker"}
        journal.append(session, job, EventKind.STATE, {"status": JobStatus.FAILED, "error": job.error})
        return Reaped(JobStatus.FAILED)
    if released is not None:
        journal.append(session, job, EventKind.STATE, {"status": RELEASED, **released})
        why = "requeued after its worker handed it back"
        if released.get("reason"):
            why += f": {released['reason']}"  # a deploy's shutdown, or its node's disk full before the launch
    else:
        journal.append(session, job, EventKind.STATE, {"status": LOST, "reason": "worker stopped heartbeating"})
        why = "requeued after worker loss"
    # Its slots are free (its ranks are gone by now): the scheduler places the next attempt afresh.
    return Reaped(JobStatus.QUEUED, why, next_attempt(session, job, why))


def db_now(session: Session) -> datetime:
    """The database's clock."""
    return session.scalar(select(func.now()))


def redrive(session: Session, *, lost_at: datetime, lost_at_db: datetime, now_db: datetime,
            skip: set[str]) -> list[tuple[str, int]]:
    """Send again, each as its next attempt, the queued jobs whose task messages may have been in a Redis that
    lost its data at `lost_at` (this host's clock; `lost_at_db`: the database's), but not those in `skip`; returns
    (job id, new attempt) of each. Commits."""
    # Which task messages may have been in the lost data: those sent before the loss was noticed.
    # The dispatcher sends, then commits dispatched_at (its clock, right after the send) and with it
    # updated_at (the database's clock, after the send). Sending again a job whose message in
    # fact survived costs one attempt number; missing one leaves it queued forever.
    sent_before = and_(Job.dispatched_at.is_not(None),
                       or_(Job.updated_at <= lost_at_db, Job.dispatched_at <= lost_at))
    # Never marked sent: the send failed or the commit after it did. Once the dispatcher is surely
    # done with it, a new attempt is safer than the same one, whose claim key may have gone with the data.
    # A job the scheduler has not placed was never sent: it has nothing to lose.
    unsent = and_(Job.dispatched_at.is_(None), Job.placement.is_not(None), Job.updated_at <= lost_at_db,
                  Job.updated_at < now_db - timedelta(seconds=UNSENT_GRACE_SECONDS))
    query = select(Job).where(Job.status == JobStatus.QUEUED, or_(sent_before, unsent))
    if skip:
        query = query.where(Job.id.not_in(skip))
    jobs = list(session.scalars(query.order_by(Job.seq).with_for_update(skip_locked=True)))
    for job in jobs:
        next_attempt(session, job, "sent again: Redis lost its data, and the job's task message with it",
                     keep_placement=True)
    session.commit()
    return [(job.id, job.attempt) for job in jobs]
