"""Job store operations: create, list, get, cancel. Routes call these and nothing else."""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.dispatch import dispatch, run_spec
from api.errors import ApiError, ErrorCode, invalid
from api.models import TERMINAL, Job
from api.services import events
from api.services.paths import check_locations
from api.settings import ApiSettings
from trainer.dsconfig import ResolveLimits, resolve
from trainer.spec import JobSpec
from worker.keys import cancel_key

log = logging.getLogger(__name__)
CANCEL_KEY_TTL = 30 * 24 * 3600


def now() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return "job_" + secrets.token_hex(10)


def to_public(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "name": job.name, "status": job.status, "attempt": job.attempt, "queue": job.queue,
        "progress": job.progress or {}, "error": job.error, "created_at": job.created_at,
        "started_at": job.started_at, "finished_at": job.finished_at, "request": job.request,
        "resolved": job.resolved, "checkpoints": job.checkpoints or [], "output": job.output,
        "metadata": job.job_metadata or {},
    }


def _patch_nvme(ds_config: dict[str, Any], nvme_path: str | None) -> None:
    for key in ("offload_optimizer", "offload_param"):
        block = ds_config.get("zero_optimization", {}).get(key)
        if block and block.get("device") == "nvme":
            block["nvme_path"] = nvme_path


def create(*, session: Session, client: redis.Redis, settings: ApiSettings, spec: JobSpec) -> Job:
    """Validate and resolve, commit the row, then enqueue: the row exists before any worker can see it."""
    request = spec.model_dump(mode="json", exclude_unset=True)
    resolved = resolve(spec, limits=ResolveLimits(auto_micro_batch_tokens=settings.auto_micro_batch_tokens))
    errors = check_locations(resolved.spec, settings)
    if errors:
        raise invalid(errors)
    _patch_nvme(resolved.deepspeed_config, resolved.spec.deepspeed.nvme_path)
    job_id = new_id()
    job_dir = str(Path(settings.artifacts_root).resolve() / "jobs" / job_id)
    job = Job(id=job_id, name=spec.name, status="queued", attempt=1, queue=spec.resources.queue,
              request=request, resolved=resolved.model_dump(mode="json"), job_dir=job_dir,
              progress={"step": 0, "total_steps": spec.hyperparameters.max_steps}, checkpoints=[],
              job_metadata=spec.metadata, event_seq=0)
    session.add(job)
    session.flush()
    events.append(session, job, "state", {"status": "queued"})
    session.commit()
    send(session=session, client=client, job=job)
    return job


def send(*, session: Session, client: redis.Redis, job: Job) -> None:
    """Enqueue the job's current attempt; on failure the reaper retries (dispatched_at stays empty)."""
    try:
        dispatch(client, job_id=job.id, attempt=job.attempt, job_dir=job.job_dir,
                 run=run_spec(job.job_dir, job.resolved), queue=job.queue)
    except Exception:
        log.exception("could not enqueue job %s; the reaper will retry", job.id)
        return
    job.dispatched_at = now()
    session.commit()


def get(*, session: Session, job_id: str, lock: bool = False) -> Job:
    q = select(Job).where(Job.id == job_id)
    job = session.scalars(q.with_for_update() if lock else q).one_or_none()
    if job is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no job with id {job_id!r}", "id")
    return job


def cancel(*, session: Session, client: redis.Redis, job_id: str) -> Job:
    job = get(session=session, job_id=job_id, lock=True)
    if job.status in TERMINAL:
        raise ApiError(409, ErrorCode.CONFLICT, f"job {job_id} already ended as {job.status}; it cannot be cancelled",
                       "status")
    if job.status == "cancelling":
        return job
    # Tell the workers first: if the commit below fails, the worker still stops and reports it.
    client.set(cancel_key(job.id), job.attempt, ex=CANCEL_KEY_TTL)
    if job.status == "queued":
        job.status, job.finished_at = "cancelled", now()
        events.append(session, job, "state", {"status": "cancelled", "reason": "cancelled before it started"})
    else:
        job.status = "cancelling"
        events.append(session, job, "state", {"status": "cancelling"})
    session.commit()
    return job
