"""A job's committed checkpoints, read from the artifact store's manifests (store/checkpoints.py): the list, and
each file streamed whole or by byte range. Only the files a manifest names are served."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from api import ranges
from api.access import Scope
from api.deps import JobForCaller, JobId, StoreDep, scoped
from api.errors import ApiError, ErrorCode, responses
from api.schemas import CheckpointFile, CheckpointList, StoredCheckpoint
from api.services import checkpoints as service

router = APIRouter(prefix="/jobs", tags=["checkpoints"], responses=responses(401, 403, 404, 503))
READ = scoped(Scope.JOBS_READ)
Step = Annotated[int, PathParam(ge=0, le=10**12, description="The checkpoint's step")]


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, openapi_extra=READ)
async def list_checkpoints(job_id: JobId, job: JobForCaller, store: StoreDep) -> CheckpointList:
    found = await service.list_for(store=store, job_id=job_id)
    return CheckpointList(data=[
        StoredCheckpoint(step=m.step, attempt=m.attempt, bytes=m.bytes, created_at=m.created_at,  # type: ignore[arg-type]
                   files=[CheckpointFile(path=f.path, bytes=f.bytes, sha256=f.sha256) for f in m.files])
        for m in found])


@router.get("/{job_id}/checkpoints/{step}/{path:path}", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes"},
                       206: {"description": "The byte range asked for"},
                       416: {"description": "The range lies outside the file"}}, openapi_extra=READ)
async def checkpoint_file(job_id: JobId, step: Step, path: str, job: JobForCaller, store: StoreDep,
                          range_header: Annotated[str | None, Header(alias="Range")] = None) -> StreamingResponse:
    manifest = await service.get(store=store, job_id=job_id, step=step)
    if manifest is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"job {job_id} has no committed checkpoint at step {step}", "step")
    found = manifest.file(path)
    if found is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"checkpoint step {step} has no file {path!r}", "path")
    return ranges.stream(store, found.key, found.bytes, range_header, media_type="application/octet-stream",
                         filename=path.rsplit("/", 1)[-1], sha256=found.sha256)
