"""Jobs: submit, list, read, cancel, and read a job's events and logs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import PlainTextResponse, StreamingResponse

from api import streaming
from api.deps import CurrentKey, RedisDep, SessionDep, SettingsDep
from api.schemas import EventPage, Job, JobCreate, JobList
from api.services import events
from api.services import jobs as service

router = APIRouter(prefix="/jobs", tags=["jobs"])

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("", status_code=201, response_model=Job)
def create_job(spec: JobCreate, session: SessionDep, client: RedisDep, settings: SettingsDep,
               _: CurrentKey) -> dict:
    job = service.create(session=session, client=client, settings=settings, spec=spec)
    return service.to_public(job)


@router.get("", response_model=JobList)
def list_jobs(session: SessionDep, _: CurrentKey, status: str | None = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 20, after: str | None = None) -> dict:
    rows, has_more = service.list_jobs(session=session, status=status, limit=limit, after=after)
    return {"data": [service.to_public(j) for j in rows], "has_more": has_more}


@router.get("/{job_id}", response_model=Job)
def get_job(job_id: str, session: SessionDep, _: CurrentKey) -> dict:
    return service.to_public(service.get(session=session, job_id=job_id))


@router.post("/{job_id}/cancel", status_code=202, response_model=Job)
def cancel_job(job_id: str, session: SessionDep, client: RedisDep, _: CurrentKey) -> dict:
    return service.to_public(service.cancel(session=session, client=client, job_id=job_id))


@router.get("/{job_id}/events", response_model=EventPage,
            responses={200: {"content": {"text/event-stream": {}}}})
def job_events(job_id: str, session: SessionDep, _: CurrentKey,
               after: Annotated[int, Query(ge=0)] = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
               type: Annotated[list[str] | None, Query()] = None,
               accept: Annotated[str | None, Header()] = None,
               last_event_id: Annotated[str | None, Header()] = None):
    """A JSON page after a cursor, or with `Accept: text/event-stream` a live SSE stream."""
    service.get(session=session, job_id=job_id)
    if accept and "text/event-stream" in accept:
        start = int(last_event_id) if last_event_id and last_event_id.isdigit() else after
        return StreamingResponse(streaming.follow(job_id, start, type, streaming.sse),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    rows = events.page(session, job_id, after=after, limit=limit + 1, types=type)
    data = [events.public(r) for r in rows[:limit]]
    return {"data": data, "has_more": len(rows) > limit, "next_after": data[-1]["id"] if data else after}


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(job_id: str, session: SessionDep, _: CurrentKey, follow: bool = False,
             after: Annotated[int, Query(ge=0)] = 0):
    """Every rank's output as plain text; `follow=true` streams until the job ends (`curl -N`)."""
    service.get(session=session, job_id=job_id)
    if follow:
        return StreamingResponse(streaming.follow(job_id, after, ["log"], streaming.log_line),
                                 media_type="text/plain; charset=utf-8", headers=SSE_HEADERS)
    lines: list[str] = []
    while True:
        rows = events.page(session, job_id, after=after, limit=5000, types=["log"])
        if not rows:
            break
        lines += [events.log_text(r) for r in rows]
        after = rows[-1].seq
    return PlainTextResponse("\n".join(lines) + ("\n" if lines else ""))
