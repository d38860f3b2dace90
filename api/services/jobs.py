"""Job writes: submit and cancel. Routes call these and nothing else; sending to the workers is the
control plane's (api/dispatcher.py)."""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import Any

import orjson
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import pg, reads
from api.errors import ApiError, ErrorCode, invalid
from api.models import TERMINAL, Job
from api.services import events
from api.services.paths import check_locations, root_path
from api.settings import ApiSettings
from trainer.dsconfig import ResolveLimits, resolve
from trainer.spec import JobSpec
from worker.keys import cancel_key

CANCEL_KEY_TTL = 30 * 24 * 3600


def now() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return "job_" + secrets.token_hex(10)


def _patch_nvme(ds_config: dict[str, Any], nvme_path: str | None) -> None:
    for key in ("offload_optimizer", "offload_param"):
        block = ds_config.get("zero_optimization", {}).get(key)
        if block and block.get("device") == "nvme":
            block["nvme_path"] = nvme_path


# The row and its first event in one statement: both or neither, in one round trip.
INSERT_JOB = f"""
WITH job AS (
    INSERT INTO jobs (id, name, status, attempt, queue, request, resolved, job_dir, progress, checkpoints,
                      metadata, event_seq, created_at, updated_at)
    VALUES ($1, $2, 'queued', 1, $3, $4::jsonb, $5::jsonb, $6, $7::jsonb, '[]'::jsonb, $8::jsonb, 1, now(), now())
    RETURNING *
), first_event AS (
    INSERT INTO job_events (job_id, seq, attempt, type, data, created_at)
    SELECT id, 1, 1, 'state', '{{"status": "queued"}}'::jsonb, now() FROM job
)
SELECT {reads.JOB_JSON} FROM job"""


def to_json(value: Any) -> str:
    """orjson where it can; the standard library for integers beyond 64 bits (JSON and jsonb allow them)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))


async def create(*, settings: ApiSettings, spec: JobSpec) -> bytes:
    """Validate and resolve, then commit the row and its first event: the control plane's dispatcher sends
    it to the workers (woken by the row's trigger), so a submit never waits on Redis or the broker.
    Returns the new job as the JSON the API answers with."""
    request = spec.model_dump(mode="json", exclude_unset=True)
    resolved = resolve(spec, limits=ResolveLimits(auto_micro_batch_tokens=settings.auto_micro_batch_tokens))
    errors = check_locations(resolved.spec, settings)
    if errors:
        raise invalid(errors)
    _patch_nvme(resolved.deepspeed_config, resolved.spec.deepspeed.nvme_path)
    job_id = new_id()
    job_dir = str(root_path(settings.artifacts_root) / "jobs" / job_id)
    body = await pg.fetchval(
        INSERT_JOB, job_id, spec.name, spec.resources.queue, to_json(request),
        to_json(resolved.model_dump(mode="json")), job_dir,
        to_json({"step": 0, "total_steps": spec.hyperparameters.max_steps}), to_json(spec.metadata))
    return body.encode()


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
