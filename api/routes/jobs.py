"""Jobs: submit, list, read, cancel, and read a job's events and logs."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import StringConstraints

from api import feeds
from api.access import Scope
from api.deps import CallerDep, JobForCaller, JobId, RedisDep, SettingsDep, job_for_caller, owner_of, scoped
from api.errors import ApiError, ErrorCode, responses
from api.guards import StrictJSONRoute
from api.schemas import DeepSpeedConfig, EventPage, Job, JobCreate, JobList, JobStatusName
from api.services import jobs as service
from api.services import webhooks
from api.services.estimate import DryRun
from api.services.paths import server_paths
from contract.codes import EventKind
from db import idempotency, reads

# Every route may answer these: the key and its scope are checked, the body measured and the stores reached.
COMMON = (401, 403, 413, 422, 503)
router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=StrictJSONRoute,
                   responses=responses(*COMMON))



class JSONBytes(Response):
    """A body that is JSON already (built by Postgres): sent as it is, with no serialisation pass."""

    media_type = "application/json"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# job_events.seq is a Postgres INTEGER: a larger cursor can match nothing, and Postgres refuses to compare it.
MAX_SEQ = 2**31 - 1
# What `POST /jobs` makes (api/services/jobs.py new_id): a list cursor of another form is a 422, one of no job a 404.
JOB_ID_PATTERN = r"^job_[0-9a-f]{20}$"
# An event id from 0 to MAX_SEQ (leading zeros allowed, at most 10 digits), or empty: the header's whole rule.
LAST_EVENT_ID_PATTERN = (r"^(?:[0-9]{0,9}|[01][0-9]{9}|20[0-9]{8}|21[0-3][0-9]{7}|214[0-6][0-9]{6}|2147[0-3][0-9]{5}"
                         r"|21474[0-7][0-9]{4}|214748[0-2][0-9]{3}|2147483[0-5][0-9]{2}|21474836[0-3][0-9]"
                         r"|214748364[0-7])$")

Cursor = Annotated[int, Query(ge=0, le=MAX_SEQ, description="Events after this id (0: from the start)")]
EventType = Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,32}$")]
READ, WRITE = scoped(Scope.JOBS_READ), scoped(Scope.JOBS_WRITE)


DRY_RUN_ANSWER = {200: {"model": DryRun, "description": "With `dry_run=true`: the job as it would be stored, its "
                                                      "memory estimate, where it fits, and its duration"}}


@router.post("", status_code=201, response_model=Job, responses={**responses(409, 429), **DRY_RUN_ANSWER},
             openapi_extra=WRITE)
async def create_job(spec: JobCreate, settings: SettingsDep, caller: CallerDep,
                     dry_run: Annotated[bool, Query(description=(
                         "Validate and resolve exactly as a submit does (the same 422s), estimate GPU and host "
                         "memory, fit and duration, and create nothing"))] = False,
                     idempotency_key: Annotated[str | None, Header(
                         alias=idempotency.HEADER, pattern=r"^[\x21-\x7e]{1,255}$",
                         description="Makes retries safe: a retry with the same key and body gets the first answer "
                                     "again (no second job); the same key with another body is a 409. Per owner, "
                                     "kept at least 24 h")] = None) -> Response:
    """Submits a job under the key's owner, within the owner's quota (429 `quota_exceeded` beyond it)."""
    # Its URL is looked up here, off the schema's synchronous validation: a slow resolver must not hold the loop.
    await webhooks.check_job(spec=spec, caller=caller, settings=settings)
    if dry_run:
        nodes = json.loads(await reads.nodes(settings.lease_grace_seconds))["data"]
        answer = await service.dry_run(settings=settings, spec=spec, caller=caller, nodes=nodes)
        return JSONBytes(server_paths(settings).json(answer.model_dump_json().encode()))
    status, body = await service.create(settings=settings, spec=spec, caller=caller, idempotency_key=idempotency_key)
    return JSONBytes(server_paths(settings).json(body), status_code=status)


@router.get("", response_model=JobList, responses=responses(404), openapi_extra=READ)
async def list_jobs(caller: CallerDep, settings: SettingsDep,
                    status: Annotated[JobStatusName | None, Query()] = None,
                    queue: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = None,
                    owner: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description=(
                        "Only this owner's jobs (admin; other keys see only their own owner's)"))] = None,
                    limit: Annotated[int, Query(ge=1, le=200)] = 20,
                    after: Annotated[str | None, Query(pattern=JOB_ID_PATTERN, description=(
                        "The last id of the previous page: a job the caller can see (a job id of no such job is "
                        "a 404)"))] = None,
                    ) -> Response:
    """The caller's owner's jobs, newest first; an admin sees every owner's (or one's, with `owner`)."""
    if not caller.admin:
        if owner is not None and owner != caller.owner:
            raise ApiError(403, ErrorCode.FORBIDDEN, "listing another owner's jobs needs the scope 'admin'", "owner")
        owner = caller.owner
    return JSONBytes(server_paths(settings).json(
        await reads.jobs_page(status=status, queue=queue, limit=limit, after=after, owner=owner)))


@router.get("/{job_id}", response_model=Job, responses=responses(404), openapi_extra=READ)
async def get_job(job: JobForCaller) -> Response:
    return JSONBytes(job)  # its paths already as a client reads them (api/reads.py)


@router.get("/{job_id}/deepspeed-config", response_model=DeepSpeedConfig, responses=responses(404),
            openapi_extra=READ)
async def job_deepspeed_config(job: JobForCaller) -> Response:
    """The DeepSpeed config rendered for the job, to read or to run by hand with the same settings (an NVMe path
    relative to the NVMe root)."""
    return JSONBytes(json.dumps(json.loads(job)["resolved"]["deepspeed_config"]).encode())


@router.post("/{job_id}/cancel", status_code=202, response_model=Job, responses=responses(404, 409),
             openapi_extra=WRITE)
async def cancel_job(job_id: JobId, client: RedisDep, caller: CallerDep, settings: SettingsDep) -> Response:
    await service.cancel(client=client, job_id=job_id, caller=caller)
    # The same bytes a read gives (Postgres renders every job response, timestamps included).
    return JSONBytes(server_paths(settings).json(await reads.job(job_id)), status_code=202)


@router.get("/{job_id}/events", response_model=EventPage,
            responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                             "description": "A page of events, or with `Accept: text/event-stream` a live stream"},
                       **responses(404)}, openapi_extra=READ)
async def job_events(request: Request, job_id: JobId, caller: CallerDep, settings: SettingsDep, after: Cursor = 0,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                     type: Annotated[list[EventType] | None, Query(max_length=20,
                                                                   description="Only these event types")] = None,
                     # Not nullable: a header is present or not, and an empty one means none.
                     last_event_id: Annotated[str, Header(
                         alias="Last-Event-ID", pattern=LAST_EVENT_ID_PATTERN,
                         description=f"SSE resume point (an event id from 0 to {MAX_SEQ}; empty: none); wins over "
                                     "`after`")] = "",
                     ) -> Response:
    """A JSON page after a cursor, or with `Accept: text/event-stream` a live SSE stream."""
    if last_event_id:
        after = int(last_event_id)
    owner = owner_of(caller)
    # A worker names paths relative to the roots in what it reports; events stored before it did, too.
    paths = server_paths(settings)
    if "text/event-stream" in request.headers.get("accept", ""):
        # A job's owner never changes: checked once here, the feed (shared by every follower) needs no owner.
        await job_for_caller(job_id, caller)
        return StreamingResponse(feeds.follow(job_id, after, type, feeds.sse, paths.text),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONBytes(paths.json(await reads.events_page(job_id, after=after, limit=limit, types=type, owner=owner)))


# response_class=Response (no media type of its own) keeps the error responses documented as JSON, which
# they are; the 200 is plain text, declared here.
@router.get("/{job_id}/logs", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "The log as text; with `follow=true` streamed until the job ends"},
                       **responses(404)}, openapi_extra=READ)
async def job_logs(job_id: JobId, _: JobForCaller, settings: SettingsDep, follow: bool = False,
                   after: Cursor = 0) -> Response:
    """Every rank's output as plain text; `follow=true` streams until the job ends (`curl -N`)."""
    paths = server_paths(settings)
    if follow:
        return StreamingResponse(feeds.follow(job_id, after, [EventKind.LOG], feeds.log_line, paths.text),
                                 media_type="text/plain; charset=utf-8", headers=SSE_HEADERS)
    lines: list[str] = []
    while True:
        rows = await reads.events_after(job_id, after, 5000, [EventKind.LOG])
        if not rows:
            break
        lines += [feeds.log_line(feeds.event_of(r)) for r in rows]
        after = rows[-1][0]
    return PlainTextResponse(paths.text("".join(lines)))
