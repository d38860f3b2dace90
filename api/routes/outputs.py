"""A job's export: the list of its files, and each file streamed from the artifact store through the API (whole,
or one byte range to resume), so clients need no store credentials."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from api import ranges
from api.access import Scope
from api.deps import JobForCaller, StoreDep, scoped
from api.errors import ApiError, ErrorCode, responses, store_unavailable
from api.schemas import OutputList
from api.services import outputs as service
from store.objects import StoreError

router = APIRouter(prefix="/jobs", tags=["outputs"], responses=responses(401, 403, 404, 422, 503))
READ = scoped(Scope.JOBS_READ)

FilePath = Annotated[str, PathParam(max_length=4096, description="A file's `path` as `GET /jobs/{id}/output` lists it")]


@router.get("/{job_id}/output", response_model=OutputList, openapi_extra=READ)
async def list_output(job: JobForCaller) -> OutputList:
    """The files of a succeeded job's export, each with its size, SHA-256 and download URL; 404 `no_output`
    while the job has none."""
    return service.listing(job)


@router.get("/{job_id}/output/{path:path}", openapi_extra=READ, response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}, "description": "The whole file"},
                       206: {"content": {"application/octet-stream": {}}, "description": "The range asked for"},
                       416: {"description": "The range lies outside the file"}})
async def download_output(job: JobForCaller, path: FilePath, store: StoreDep,
                          range_: Annotated[str | None, Header(alias="Range")] = None) -> StreamingResponse:
    """One file of the export; `Range: bytes=N-` resumes an interrupted download (206). `X-Content-SHA256` is the
    whole file's digest."""
    key, size, sha256 = service.file_of(job, path)
    try:
        found = await store.head_async(key)
    except StoreError as exc:
        raise store_unavailable(exc) from None
    if found != size:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"path: {path!r} is listed in the export but missing from the "
                       "artifact store", "path")
    return ranges.stream(store, key, size, range_, media_type="application/octet-stream",
                         filename=path.rsplit("/", 1)[-1], sha256=sha256)
