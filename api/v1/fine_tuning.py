"""OpenAI's fine-tuning jobs over the service's own jobs: create, list, read, cancel, and a job's events and
checkpoints (docs/openai.md). The same jobs, owners, keys and quotas as /jobs: a job made here is a native job."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Query, Request

from api.access import Scope
from api.deps import CallerDep, JobId, RedisDep, SettingsDep, StoreDep, job_for_caller, owner_of, scoped
from api.errors import ApiError, ErrorCode
from api.guards import StrictJSONRoute
from api.services import checkpoints as checkpoint_store
from api.services import jobs as native
from api.v1 import names, service
from api.v1.errors import PREFIX, responses
from api.v1.hyperparameters import FineTuningJobCreate, bad_request
from api.v1.job_schemas import (
    FineTuningJob,
    FineTuningJobCheckpointList,
    FineTuningJobEventList,
    FineTuningJobList,
)
from contract.codes import EventKind
from db import finetuning as store
from db import idempotency
from db.errors import NotFound

router = APIRouter(prefix=f"{PREFIX}/fine_tuning/jobs", tags=["openai: fine-tuning"], route_class=StrictJSONRoute,
                   responses=responses(400, 401, 403, 404, 503))
READ, WRITE = scoped(Scope.JOBS_READ), scoped(Scope.JOBS_WRITE)
# Raw output lines are the native log's (GET /jobs/{id}/logs), not OpenAI events.
LEFT_OUT = [EventKind.LOG.value]
Limit = Annotated[int, Query(ge=1, le=100)]
METADATA_PARAM = "metadata"


def not_this_job(param: str, message: str) -> ApiError:
    """A well-formed cursor of another job's: no place in this job's list (the schema states the form, not whose)."""
    return ApiError(404, ErrorCode.NOT_FOUND, message, param)


async def _job(job_id: str, caller: Any) -> dict[str, Any]:
    try:
        return orjson.loads(await job_for_caller(job_id, caller))
    except NotFound:
        raise service.not_found(job_id) from None


@router.post("", response_model=FineTuningJob, responses=responses(409, 413, 429), openapi_extra=WRITE)
async def create_job(body: FineTuningJobCreate, settings: SettingsDep, caller: CallerDep,
                     idempotency_key: Annotated[str | None, Header(
                         alias=idempotency.HEADER, pattern=r"^[\x21-\x7e]{1,255}$")] = None) -> dict[str, Any]:
    """Creates a job under the key's owner, as POST /jobs does (the same checks and quota)."""
    _, job = await service.create(settings=settings, body=body, caller=caller, idempotency_key=idempotency_key)
    return job


def metadata_filter(request: Request) -> dict[str, str] | None:
    """The `metadata[k]=v` pairs of the query (as the SDK sends a metadata filter); `metadata=null`: jobs with
    none."""
    pairs: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        if key == METADATA_PARAM:
            if value != "null":
                raise bad_request(METADATA_PARAM, "filter with metadata[key]=value, or metadata=null for jobs "
                                                  "without metadata")
            return {}
        if key.startswith(METADATA_PARAM + "[") and key.endswith("]"):
            pairs[key[len(METADATA_PARAM) + 1:-1]] = value
    return pairs or None


@router.get("", response_model=FineTuningJobList, openapi_extra=READ)
async def list_jobs(request: Request, settings: SettingsDep, caller: CallerDep, limit: Limit = 20,
                    after: Annotated[str | None, Query(pattern=f"^{names.JOB_ID}$", description=(
                        "The last id of the previous page (a job id of no job of yours is a 404)"))] = None,
                    ) -> dict[str, Any]:
    """The caller's owner's jobs (an admin's: every owner's), newest first; `metadata[k]=v` filters."""
    jobs, has_more = await store.jobs_page(owner=owner_of(caller), limit=limit, after=after,
                                           metadata=metadata_filter(request))
    return {"object": "list", "data": await service.views(settings, jobs), "has_more": has_more}


@router.get("/{job_id}", response_model=FineTuningJob, openapi_extra=READ)
async def get_job(job_id: JobId, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    return (await service.views(settings, [await _job(job_id, caller)]))[0]


@router.post("/{job_id}/cancel", response_model=FineTuningJob, responses=responses(409), openapi_extra=WRITE)
async def cancel_job(job_id: JobId, client: RedisDep, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    try:
        await native.cancel(client=client, job_id=job_id, caller=caller)
    except NotFound:
        raise service.not_found(job_id) from None
    return (await service.views(settings, [await _job(job_id, caller)]))[0]


@router.get("/{job_id}/events", response_model=FineTuningJobEventList, openapi_extra=READ)
async def job_events(job_id: JobId, caller: CallerDep, limit: Limit = 20,
                     after: Annotated[str | None, Query(pattern=names.EVENT_ID, description=(
                         "The last event id of the previous page: older events follow (an event id of another "
                         "job is a 404)"))] = None) -> dict[str, Any]:
    """The job's events, newest first, as OpenAI pages them (its output lines are at GET /jobs/{id}/logs)."""
    await _job(job_id, caller)
    before = names.MAX_SEQ
    if after is not None:
        seq = names.event_seq(after, job_id)
        if seq is None:
            raise not_this_job("after", f"{after!r} is an event id of another job than {job_id}; pass the last id "
                                        "of the previous page")
        before = min(seq, names.MAX_SEQ)  # seq is an INTEGER: a larger id is after every event
    rows, has_more = await store.events_newest_first(job_id, before=before, limit=limit, leave_out=LEFT_OUT)
    return {"object": "list", "data": [service.event_view(job_id, *r) for r in rows], "has_more": has_more}


@router.get("/{job_id}/checkpoints", response_model=FineTuningJobCheckpointList, openapi_extra=READ)
async def job_checkpoints(job_id: JobId, caller: CallerDep, storage: StoreDep, limit: Limit = 10,
                          after: Annotated[str | None, Query(pattern=names.CHECKPOINT_ID, description=(
                              "The last checkpoint id of the previous page: older checkpoints follow (a checkpoint "
                              "id of another job is a 404)"))] = None) -> dict[str, Any]:
    """The job's committed checkpoints in the artifact store, newest first."""
    job = await _job(job_id, caller)
    manifests = sorted(await checkpoint_store.list_for(store=storage, job_id=job_id), key=lambda m: m.step,
                       reverse=True)
    if after is not None:
        step = names.checkpoint_step(after, job_id)
        if step is None:
            raise not_this_job("after", f"{after!r} is a checkpoint id of another job than {job_id}")
        manifests = [m for m in manifests if m.step < step]
    page, has_more = manifests[:limit], len(manifests) > limit
    steps = [m.step for m in page]
    losses = await store.losses_at(job_id, steps)
    figures = await service.dpo_figures_at(job_id, steps) if service.is_dpo(job) else {}
    lineage = (await store.lineage([job_id])).get(job_id)
    data = [service.checkpoint_view(job, lineage, m, losses.get(m.step, (None, None)), figures.get(m.step, {}))
            for m in page]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

