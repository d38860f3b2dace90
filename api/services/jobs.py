"""Job writes: submit and cancel. Routes call these and nothing else; sending to the workers is the
control plane's (controlplane/dispatcher.py).

A submit is filed under the caller's owner, counted against the owner's quota and, with an
Idempotency-Key, recorded for retries, all in the transaction that inserts the row: a refused submit
leaves nothing behind, and a stored answer always names a job that exists.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import Any

import orjson
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import reads
from api.access import Principal
from api.errors import ApiError, ErrorCode, invalid
from api.services.estimate import DryRun, estimate, placement
from api.services.paths import check_locations, root_path
from api.settings import ApiSettings
from contract.codes import TERMINAL_STATUSES, UNFINISHED_STATUSES, EventKind, JobStatus, sql_list
from contract.deepspeed import ResolveLimits, resolve
from contract.protocol import cancel_key
from contract.spec import JobSpec, ResolvedJob
from db import audit, events, idempotency
from db import pool as pg
from db.models import Job

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


# The owner's unfinished jobs and their GPUs (from the partial index ix_jobs_owner_unfinished), or nothing
# counted where no limit applies.
COUNT_USAGE = (f"SELECT count(*) AS jobs, coalesce(sum(gpus), 0) AS gpus FROM jobs "
               f"WHERE owner = $9 AND status IN {sql_list(UNFINISHED_STATUSES)}")
NO_USAGE = "SELECT 0::bigint AS jobs, 0::bigint AS gpus"
# The row, its first event (naming who submitted it) and its audit entry in one statement: all or nothing, in
# one round trip. The row is inserted only within the quota ($11 jobs, $12 GPUs; null: no limit); otherwise
# the answer is the use that refused it.
INSERT_JOB = """
WITH usage AS ({usage}), job AS (
    INSERT INTO jobs (id, name, owner, gpus, priority, status, attempt, queue, request, resolved, job_dir, progress,
                      checkpoints, metadata, event_seq, created_at, updated_at)
    SELECT $1, $2, $9, $10::int, $15::int, 'queued', 1, $3, $4::jsonb, $5::jsonb, $6, $7::jsonb, '[]'::jsonb,
           $8::jsonb, 1, now(), now()
    FROM usage
    WHERE ($11::bigint IS NULL OR usage.jobs + 1 <= $11) AND ($12::bigint IS NULL OR usage.gpus + $10::int <= $12)
    RETURNING *
), first_event AS (
    INSERT INTO job_events (job_id, seq, attempt, type, data, created_at)
    SELECT id, 1, 1, 'state', jsonb_build_object('status', 'queued', 'actor', $13::jsonb), now() FROM job
), audited AS (
    INSERT INTO audit_log (at, key_id, owner, action, subject, data)
    SELECT now(), $14, $9, 'job.submit', id, jsonb_build_object('name', name, 'queue', queue, 'gpus', gpus) FROM job
)
SELECT (SELECT {job_json} FROM job), usage.jobs, usage.gpus FROM usage"""
INSERT_COUNTED = INSERT_JOB.format(usage=COUNT_USAGE, job_json=reads.JOB_JSON)
INSERT_UNCOUNTED = INSERT_JOB.format(usage=NO_USAGE, job_json=reads.JOB_JSON)
# The owner's quota, read under a lock of the owner's own for the rest of the transaction: the next
# statement's snapshot then sees every job an earlier submit of the owner committed, so two submits
# cannot both take the last slot. Submits of other owners do not wait for it.
LOCK_OWNER = """
SELECT pg_advisory_xact_lock(hashtextextended('ft_quota:' || $1, 0)), q.max_active_jobs, q.max_gpus
FROM (SELECT 1) AS one LEFT JOIN owner_quotas AS q ON q.owner = $1"""
QUOTA_ROW = "SELECT max_active_jobs, max_gpus FROM owner_quotas WHERE owner = $1"


def to_json(value: Any) -> str:
    """orjson where it can; the standard library for integers beyond 64 bits (JSON and jsonb allow them)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))


def quota_exceeded(owner: str, limits: tuple[int | None, int | None], used: tuple[int, int], gpus: int) -> ApiError:
    """A 429 naming each limit the submit would pass, the owner's use and what the submit asked for."""
    (max_jobs, max_gpus), (jobs, used_gpus) = limits, used
    details = []
    if max_jobs is not None and jobs + 1 > max_jobs:
        details.append({"field": "max_active_jobs", "message": f"max_active_jobs is {max_jobs}; {owner} has {jobs} "
                        "unfinished jobs (queued or running); this submit is 1 more"})
    if max_gpus is not None and used_gpus + gpus > max_gpus:
        details.append({"field": "max_gpus", "message": f"max_gpus is {max_gpus}; {owner}'s unfinished jobs hold "
                        f"{used_gpus}; this submit asks for {gpus} (resources.num_gpus)"})
    return ApiError(429, ErrorCode.QUOTA_EXCEEDED, f"quota exceeded for owner {owner!r}: "
                    + "; ".join(d["message"] for d in details) + ". Wait for jobs to end, cancel some, or ask an "
                    "admin to raise the quota", details[0]["field"] if details else None, details)


def prepare(*, settings: ApiSettings, spec: JobSpec) -> tuple[dict[str, Any], ResolvedJob]:
    """What a submit checks and resolves (and a dry run, through the same function, so both refuse alike): the
    request as sent and its resolution, or a 422 naming every bad field."""
    request = spec.model_dump(mode="json", exclude_unset=True)
    resolved = resolve(spec, limits=ResolveLimits(auto_micro_batch_tokens=settings.auto_micro_batch_tokens))
    errors = check_locations(resolved.spec, settings)
    if errors:
        raise invalid(errors)
    _patch_nvme(resolved.deepspeed_config, resolved.spec.deepspeed.nvme_path)
    return request, resolved


def dry_run(*, settings: ApiSettings, spec: JobSpec, caller: Principal, nodes: list[dict[str, Any]]) -> DryRun:
    """A submit up to its resolution, then an estimate instead of the insert: no row, event, audit entry, quota
    use or idempotency record. `nodes`: the cluster as GET /nodes shows it."""
    request, resolved = prepare(settings=settings, spec=spec)
    r = resolved.spec.resources
    job = {"name": spec.name, "owner": caller.owner, "queue": spec.resources.queue,
           "gpus": r.num_gpus * r.num_nodes, "request": request, "resolved": resolved.model_dump(mode="json")}
    found = estimate(resolved)
    return DryRun(owner=caller.owner, job=job, estimate=found,
                  placement=placement(nodes, r.queue, r.num_nodes, r.num_gpus, found.gpu_bytes_per_device))


async def create(*, settings: ApiSettings, spec: JobSpec, caller: Principal,
                 idempotency_key: str | None = None) -> tuple[int, bytes]:
    """Validate and resolve, then commit the row and its first event under the caller's owner and quota: the
    control plane's dispatcher sends it to the workers (woken by the row's trigger), so a submit never waits
    on Redis or the broker. Returns the status and JSON to answer with: for a retry with the same
    Idempotency-Key and body, those of the first answer."""
    request, resolved = prepare(settings=settings, spec=spec)
    job_id = new_id()
    job_dir = str(root_path(settings.artifacts_root) / "jobs" / job_id)
    # What a quota counts: every GPU of the job, on all its nodes.
    owner, gpus = caller.owner, resolved.spec.resources.num_gpus * resolved.spec.resources.num_nodes
    args: list[Any] = [
        job_id, spec.name, spec.resources.queue, to_json(request), to_json(resolved.model_dump(mode="json")), job_dir,
        to_json({"step": 0, "total_steps": spec.hyperparameters.max_steps}), to_json(spec.metadata), owner, gpus]
    # After the quota limits ($11, $12): who submits ($13, $14) and the priority the scheduler orders by ($15).
    tail = [to_json(caller.actor()), caller.key_id, resolved.spec.resources.priority]
    defaults = (settings.quota_max_active_jobs, settings.quota_max_gpus)
    try:
        if idempotency_key is None and defaults == (None, None) and not await pg.fetch(QUOTA_ROW, owner):
            # Nothing to count and nothing to remember: the one statement, no transaction around it.
            row = (await pg.fetch(INSERT_UNCOUNTED, *args, None, None, *tail))[0]
            return 201, row[0].encode()
        async with (await pg.pool()).acquire() as conn, conn.transaction():
            if idempotency_key is not None:
                await idempotency.claim(conn, owner=owner, key=idempotency_key, settings=settings,
                                        hashed=idempotency.request_hash(request))
            lock = await conn.fetchrow(LOCK_OWNER, owner)
            limits = (lock["max_active_jobs"] if lock["max_active_jobs"] is not None else defaults[0],
                      lock["max_gpus"] if lock["max_gpus"] is not None else defaults[1])
            counted = limits != (None, None)
            body, jobs, used_gpus = await conn.fetchrow(INSERT_COUNTED if counted else INSERT_UNCOUNTED,
                                                        *args, *limits, *tail)
            if body is None:
                raise quota_exceeded(owner, limits, (jobs, used_gpus), gpus)
            if idempotency_key is not None:
                await idempotency.remember(conn, owner=owner, key=idempotency_key, job_id=job_id, status=201,
                                           body=body)
        return 201, body.encode()
    except idempotency.Replay as replay:
        return replay.status, replay.body
    except pg.UNREACHABLE as exc:
        raise pg.unavailable() from exc


def get(*, session: Session, job_id: str, owner: str | None = None, lock: bool = False) -> Job:
    """The job, or a 404; with `owner`, another owner's job is not found either (never a 403, which would
    say it exists)."""
    q = select(Job).where(Job.id == job_id)
    if owner is not None:
        q = q.where(Job.owner == owner)
    job = session.scalars(q.with_for_update() if lock else q).one_or_none()
    if job is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no job with id {job_id!r}", "id")
    return job


def cancel(*, session: Session, client: redis.Redis, job_id: str, caller: Principal) -> Job:
    job = get(session=session, job_id=job_id, owner=None if caller.admin else caller.owner, lock=True)
    if job.status in TERMINAL_STATUSES:
        raise ApiError(409, ErrorCode.CONFLICT, f"job {job_id} already ended as {job.status}; it cannot be cancelled",
                       "status")
    if job.status == JobStatus.CANCELLING:
        return job
    # Tell the workers first: if the commit below fails, the worker still stops and reports it.
    client.set(cancel_key(job.id), job.attempt, ex=CANCEL_KEY_TTL)
    actor, before = caller.actor(), job.status
    if job.status == JobStatus.QUEUED:
        job.status, job.finished_at = JobStatus.CANCELLED, now()
        events.append(session, job, EventKind.STATE, {"status": JobStatus.CANCELLED,
                                                      "reason": "cancelled before it started", "actor": actor})
    else:
        job.status = JobStatus.CANCELLING
        events.append(session, job, EventKind.STATE, {"status": JobStatus.CANCELLING, "actor": actor})
    audit.record(session, caller, "job.cancel", job.id, {"owner": job.owner, "status_before": before})
    session.commit()
    return job
