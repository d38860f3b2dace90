"""Files: upload (streamed into the artifact store), list, read, download and delete. An owner's files are its
own: another owner's file is not found, as another owner's job is."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response

from api import uploads
from api.access import Scope
from api.deps import CallerDep, SettingsDep, StoreDep, owner_of, scoped
from api.errors import ApiError, ErrorCode, responses
from api.guards import StreamedBodyRoute, StrictJSONRoute
from api.ranges import stream
from api.schemas import OWNER_PATTERN, File, FileList
from api.services import files as deletion
from contract.files import FILE_ID_PATTERN, FileFormat, FilePurpose
from db import files as service
from store.layout import file_key

COMMON = (401, 403, 413, 422, 503)
router = APIRouter(prefix="/files", tags=["files"], route_class=StrictJSONRoute, responses=responses(*COMMON))
READ, WRITE = scoped(Scope.JOBS_READ), scoped(Scope.JOBS_WRITE)
FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN, description="A file id, as `POST /files` returned it")]

UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "additionalProperties": False,
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "The data; its filename is kept (the last part of its path)"},
        "purpose": {"type": "string", "enum": [p.value for p in FilePurpose]},
        "format": {"type": "string", "enum": [f.value for f in FileFormat],
                   "description": "How to read it (as a job's `data.format`); absent: detected from the first line"},
    }}}}}}

BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


async def upload_file(request: Request, settings: SettingsDep, store: StoreDep, caller: CallerDep) -> dict[str, Any]:
    """Stores a file under the key's owner, streamed: at most FT_MAX_FILE_BYTES (413 beyond), within the owner's
    quota of stored bytes (429 `quota_exceeded`). It is `uploaded` at once; the control plane then checks every line
    and sets it `processed` (with `stats`) or `error` (with the first problems, each with its line)."""
    return await uploads.receive(request, settings=settings, store=store, caller=caller)


# Added rather than decorated: a decorator cannot give one route its own class, and this one streams its body.
router.add_api_route("", upload_file, methods=["POST"], status_code=201, response_model=File,
                     route_class_override=StreamedBodyRoute, responses=responses(400, 415, 429),
                     openapi_extra={**WRITE, **UPLOAD_BODY})


@router.get("", response_model=FileList, responses=responses(404), openapi_extra=READ)
async def list_files(caller: CallerDep,
                     owner: Annotated[str | None, Query(pattern=OWNER_PATTERN, description=(
                         "Only this owner's files (admin; other keys see only their own owner's)"))] = None,
                     limit: Annotated[int, Query(ge=1, le=200)] = 20,
                     after: Annotated[str | None, Query(pattern=FILE_ID_PATTERN, description=(
                         "The last id of the previous page: a file the caller can see (a file id of no such file "
                         "is a 404)"))] = None,
                     ) -> dict[str, Any]:
    """The caller's owner's files, newest first; an admin sees every owner's (or one's, with `owner`)."""
    if not caller.admin:
        if owner is not None and owner != caller.owner:
            raise ApiError(403, ErrorCode.FORBIDDEN, "listing another owner's files needs the scope 'admin'", "owner")
        owner = caller.owner
    return await service.page(owner=owner, limit=limit, after=after)


@router.get("/{file_id}", response_model=File, responses=responses(404), openapi_extra=READ)
async def get_file(file_id: FileId, caller: CallerDep) -> dict[str, Any]:
    return await service.get(file_id=file_id, owner=owner_of(caller))


@router.get("/{file_id}/content", response_class=Response,
            responses={200: {"content": BINARY, "description": "The file as uploaded; X-Content-SHA256 is its digest"},
                       206: {"content": BINARY,
                             "description": "The one byte range `Range` asked for (Content-Range says which)"},
                       **responses(404, 416)}, openapi_extra=READ)
async def file_content(file_id: FileId, caller: CallerDep, store: StoreDep,
                       range_: Annotated[str | None, Header(alias="Range", max_length=200, description=(
                           "One byte range, e.g. bytes=0-1023 or bytes=1024- (resumes a download)"))] = None,
                       ) -> Response:
    """The file's bytes, whole or one byte range, streamed from the store."""
    found = await service.get(file_id=file_id, owner=owner_of(caller))
    return stream(store, file_key(file_id), found["bytes"], range_, media_type="application/octet-stream",
                  filename=found["filename"], sha256=found["sha256"])


@router.delete("/{file_id}", response_model=File, responses=responses(404, 409), openapi_extra=WRITE)
async def delete_file(file_id: FileId, caller: CallerDep, store: StoreDep) -> dict[str, Any]:
    """Deletes the file and its bytes; 409 `file_in_use` while a job that has not ended names it as its data."""
    return await deletion.delete(file_id=file_id, caller=caller, store=store)
