"""Jobs: submit, list, read, cancel, and read a job's events and logs."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import StringConstraints

from api import feeds, reads
from api.deps import RedisDep, SessionDep, SettingsDep
from api.errors import invalid, responses
from api.guards import StrictJSONRoute
from api.schemas import EventPage, Job, JobCreate, JobList, JobStatus
from api.services import jobs as service
from trainer.dsconfig import FieldError

# Every route may answer these: the token is checked, the body measured and the stores reached for each.
COMMON = (401, 413, 422, 503)
router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=StrictJSONRoute,
                   responses=responses(*COMMON))



class JSONBytes(Response):
    """A body that is JSON already (built by Postgres): sent as it is, with no serialisation pass."""

    media_type = "application/json"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# job_events.seq is a Postgres INTEGER: a larger cursor can match nothing, and Postgres refuses to compare it.
MAX_SEQ = 2**31 - 1
ID_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"

JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job id, as `POST /jobs` returned it")]
Cursor = Annotated[int, Query(ge=0, le=MAX_SEQ, description="Events after this id (0: from the start)")]
EventType = Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,32}$")]


@router.post("", status_code=201, response_model=Job)
async def create_job(spec: JobCreate, settings: SettingsDep) -> Response:
    return JSONBytes(await service.create(settings=settings, spec=spec), status_code=201)


@router.get("", response_model=JobList)
async def list_jobs(status: Annotated[JobStatus | None, Query()] = None,
                    queue: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = None,
                    limit: Annotated[int, Query(ge=1, le=200)] = 20,
                    after: Annotated[str | None, Query(pattern=ID_PATTERN,
                                                       description="The last id of the previous page")] = None,
                    ) -> Response:
    return JSONBytes(await reads.jobs_page(status=status, queue=queue, limit=limit, after=after))


@router.get("/{job_id}", response_model=Job, responses=responses(404))
async def get_job(job_id: JobId) -> Response:
    return JSONBytes(await reads.job(job_id))


@router.post("/{job_id}/cancel", status_code=202, response_model=Job, responses=responses(404, 409))
def cancel_job(job_id: JobId, session: SessionDep, client: RedisDep) -> Response:
    service.cancel(session=session, client=client, job_id=job_id)
    # The same bytes a read gives (Postgres renders every job response, timestamps included).
    return JSONBytes(anyio.from_thread.run(reads.job, job_id), status_code=202)


@router.get("/{job_id}/events", response_model=EventPage,
            responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                             "description": "A page of events, or with `Accept: text/event-stream` a live stream"},
                       **responses(404)})
async def job_events(request: Request, job_id: JobId, after: Cursor = 0,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                     type: Annotated[list[EventType] | None, Query(max_length=20,
                                                                   description="Only these event types")] = None,
                     last_event_id: Annotated[str | None, Header(
                         alias="Last-Event-ID", pattern=r"^[0-9]{0,10}$",
                         description="SSE resume point (an event id; empty: none); wins over `after`")] = None,
                     ) -> Response:
    """A JSON page after a cursor, or with `Accept: text/event-stream` a live SSE stream."""
    if last_event_id:
        if int(last_event_id) > MAX_SEQ:
            raise invalid([FieldError("Last-Event-ID", f"must be an event id from 0 to {MAX_SEQ}")])
        after = int(last_event_id)
    if "text/event-stream" in request.headers.get("accept", ""):
        if not await reads.exists(job_id):
            raise reads.not_found(job_id)
        return StreamingResponse(feeds.follow(job_id, after, type, feeds.sse), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return JSONBytes(await reads.events_page(job_id, after=after, limit=limit, types=type))


# response_class=Response (no media type of its own) keeps the error responses documented as JSON, which
# they are; the 200 is plain text, declared here.
@router.get("/{job_id}/logs", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "The log as text; with `follow=true` streamed until the job ends"},
                       **responses(404)})
async def job_logs(job_id: JobId, follow: bool = False, after: Cursor = 0) -> Response:
    """Every rank's output as plain text; `follow=true` streams until the job ends (`curl -N`)."""
    if not await reads.exists(job_id):
        raise reads.not_found(job_id)
    if follow:
        return StreamingResponse(feeds.follow(job_id, after, ["log"], feeds.log_line),
                                 media_type="text/plain; charset=utf-8", headers=SSE_HEADERS)
    lines: list[str] = []
    while True:
        rows = await reads.events_after(job_id, after, 5000, ["log"])
        if not rows:
            break
        lines += [feeds.log_line(feeds.event_of(r)) for r in rows]
        after = rows[-1][0]
    return PlainTextResponse("".join(lines))
