"""Job writes: submit and cancel. Routes call these and nothing else; the statements are db/jobs.py's, sending to
the workers is the control plane's (controlplane/dispatcher.py).

A submit is validated and resolved here, then filed under the caller's owner, counted against the owner's quota
and, with an Idempotency-Key, recorded for retries, all in the transaction that inserts the row (db/jobs.py).
"""

from __future__ import annotations

import secrets
from typing import Any

import anyio
import redis

from api.access import Principal
from api.deps import store_of
from api.errors import invalid
from api.services import inputs, lengths
from api.services.estimate import DryRun, estimate, placement
from api.services.paths import check_locations
from api.settings import ApiSettings, quota_defaults
from contract.deepspeed import ResolveLimits, resolve
from contract.protocol import CANCEL_KEY_TTL, cancel_key
from contract.spec import JobSpec, ResolvedJob
from db import idempotency
from db import jobs as store


def new_id() -> str:
    return "job_" + secrets.token_hex(10)


async def prepare(*, settings: ApiSettings, spec: JobSpec, owner: str,
                  files_found: dict[str, dict[str, Any]] | None = None) -> tuple[dict[str, Any], ResolvedJob]:
    """What a submit checks and resolves (and a dry run, through the same function, so both refuse alike): the
    request as sent and its resolution, or a 422 naming every bad field. `files_found`: file rows the caller
    already read in this request, by id."""
    request = spec.model_dump(mode="json", exclude_unset=True)
    resolved = resolve(spec, limits=ResolveLimits(auto_micro_batch_tokens=settings.auto_micro_batch_tokens))
    errors = check_locations(resolved.spec, settings)
    errors += await inputs.resolve(resolved, owner, store_of(settings), files_found or {})
    if not errors:
        errors = await lengths.check(resolved, store_of(settings))
    if errors:
        raise invalid(errors)
    return request, resolved


async def dry_run(*, settings: ApiSettings, spec: JobSpec, caller: Principal,
                  nodes: list[dict[str, Any]]) -> DryRun:
    """A submit up to its resolution, then an estimate instead of the insert: no row, event, audit entry, quota
    use or idempotency record. `nodes`: the cluster as GET /nodes shows it."""
    request, resolved = await prepare(settings=settings, spec=spec, owner=caller.owner)
    r = resolved.spec.resources
    job = dict(name=spec.name, owner=caller.owner, queue=spec.resources.queue, gpus=r.num_gpus * r.num_nodes,
               request=request, resolved=resolved.model_dump(mode="json"))
    found = estimate(resolved)
    return DryRun(owner=caller.owner, job=job, estimate=found,
                  placement=placement(nodes, r.queue, r.num_nodes, r.num_gpus, found.gpu_bytes_per_device),
                  pairs=await lengths.survey(resolved, store_of(settings)))


async def create(*, settings: ApiSettings, spec: JobSpec, caller: Principal, idempotency_key: str | None = None,
                 files_found: dict[str, dict[str, Any]] | None = None) -> tuple[int, bytes]:
    """Validate and resolve, then commit the row and its first event under the caller's owner and quota: the
    control plane's dispatcher sends it to the workers (woken by the row's trigger), so a submit never waits
    on Redis or the broker. Returns the status and JSON to answer with: for a retry with the same
    Idempotency-Key and body, those of the first answer."""
    request, resolved = await prepare(settings=settings, spec=spec, owner=caller.owner, files_found=files_found)
    job_id = new_id()
    resources = resolved.spec.resources
    job = store.NewJob(id=job_id, name=spec.name, queue=spec.resources.queue, request=request,
                       resolved=resolved.model_dump(mode="json"),
                       progress={"step": 0, "total_steps": spec.hyperparameters.max_steps}, metadata=spec.metadata,
                       # What a quota counts: every GPU of the job, on all its nodes.
                       owner=caller.owner, gpus=resources.num_gpus * resources.num_nodes, priority=resources.priority,
                       files={name: found.file_id for name, found in resolved.inputs.items()})
    return await store.submit(
        job=job, actor=caller.actor(), defaults=quota_defaults(settings),
        idempotency_key=idempotency_key, keep_hours=settings.idempotency_hours,
        request_hash=idempotency.request_hash(request) if idempotency_key is not None else b"")


async def cancel(*, client: redis.Redis, job_id: str, caller: Principal) -> None:
    """Cancel the caller's job (any owner's for an admin): a 404 where it is not the caller's, a 409 where it has
    ended. The workers are told first (Redis): if the commit fails, the worker still stops and reports it."""

    async def tell_workers(job: str, attempt: int) -> None:
        await anyio.to_thread.run_sync(lambda: client.set(cancel_key(job), attempt, ex=CANCEL_KEY_TTL))

    await store.cancel(job_id=job_id, owner=None if caller.admin else caller.owner, actor=caller.actor(),
                       tell_workers=tell_workers)
