"""`/v1/files`: OpenAI's Files API over the service's own files (db/files.py, api/uploads.py): the same rows, the
same stored bytes, owners, scopes and quota of stored bytes as `/files`, in OpenAI's shapes (openai-python
`types/file_object.py`, `file_deleted.py`). Ids are the service's (`file_…`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from api import uploads
from api.access import Scope
from api.deps import CallerDep, SettingsDep, StoreDep, owner_of, scoped
from api.guards import StreamedBodyRoute, StrictJSONRoute
from api.ranges import stream
from api.schemas import FilePurposeName, FileStatusName
from api.services import files as deletion
from api.v1.errors import PREFIX, responses
from contract.files import FILE_ID_PATTERN, FileFormat, FilePurpose, FileStatus
from db import files as service
from store.layout import file_key

router = APIRouter(prefix=f"{PREFIX}/files", tags=["openai"], route_class=StrictJSONRoute,
                   responses=responses(400, 401, 403, 413, 503))
READ, WRITE = scoped(Scope.JOBS_READ), scoped(Scope.JOBS_WRITE)
# Any id a client may hold, OpenAI's (`file-…`) included: one that is not the service's is simply not found.
ANY_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,100}$"
FileId = Annotated[str, Path(pattern=ANY_ID_PATTERN, description="A file id, as `POST /v1/files` returned it")]
MAX_LIST = 10_000  # OpenAI's limit and default


class FileObject(BaseModel):
    id: str = Field(description="The service's id (`file_…`), the same under `/files`")
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix time, in seconds")
    filename: str
    purpose: FilePurposeName
    status: FileStatusName = Field(description="uploaded: waiting for the line check; processed: every line passed; "
                                               "error: see `status_details`")
    status_details: str | None = Field(description="Once in error: the first problems, each with its line")
    expires_at: int | None = Field(default=None, description="Always null: files are kept until deleted")


class FileObjectList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def problems(errors: list[dict[str, Any]] | None) -> str | None:
    """The line check's problems as one text, each with its line (a problem of the whole file has none)."""
    if not errors:
        return None
    return "; ".join(f"line {e['line']}: {e['message']}" if e["line"] is not None else f"the file {e['message']}"
                     for e in errors)


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """A native file (db/files.view) as OpenAI's FileObject; the statuses are the same words."""
    status = FileStatus(row["status"])
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"].timestamp()),
            "filename": row["filename"], "purpose": row["purpose"], "status": status.value,
            "status_details": problems(row["errors"]) if status is FileStatus.ERROR else None, "expires_at": None}


UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "additionalProperties": False,
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "JSONL: chat (`messages`) or prompt/completion"},
        "purpose": {"type": "string", "enum": [p.value for p in FilePurpose]},
        "format": {"type": "string", "enum": [f.value for f in FileFormat],
                   "description": "Not OpenAI's: how to read the file; absent: detected from its first line"},
    }}}}}}
BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


async def create_file(request: Request, settings: SettingsDep, store: StoreDep, caller: CallerDep) -> dict[str, Any]:
    """`client.files.create(file=..., purpose="fine-tune")`: stored under the key's owner, streamed, within its quota of
    stored bytes (429 `insufficient_quota`); then checked line by line (`status` becomes `processed` or `error`)."""
    return file_object(await uploads.receive(request, settings=settings, store=store, caller=caller))


# Added rather than decorated: a decorator cannot give one route its own class, and this one streams its body.
router.add_api_route("", create_file, methods=["POST"], response_model=FileObject,
                     route_class_override=StreamedBodyRoute, responses=responses(429),
                     openapi_extra={**WRITE, **UPLOAD_BODY})


@router.get("", response_model=FileObjectList, responses=responses(404), openapi_extra=READ)
async def list_files(caller: CallerDep,
                     after: Annotated[str | None, Query(pattern=FILE_ID_PATTERN, description=(
                         "The last id of the previous page (a file id of no file of yours is a 404)"))] = None,
                     limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = MAX_LIST,
                     order: Annotated[Literal["asc", "desc"], Query(description="By `created_at`")] = "desc",
                     purpose: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    """`client.files.list(...)`: the caller's owner's files (an admin's: every owner's)."""
    page = await service.page(owner=owner_of(caller), limit=limit, after=after, oldest_first=order == "asc",
                              purpose=purpose)
    data = [file_object(f) for f in page["data"]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": page["has_more"]}


@router.get("/{file_id}", response_model=FileObject, responses=responses(404), openapi_extra=READ)
async def retrieve_file(file_id: FileId, caller: CallerDep) -> dict[str, Any]:
    return file_object(await service.get(file_id=file_id, owner=owner_of(caller)))


@router.get("/{file_id}/content", response_class=Response,
            responses={200: {"content": BINARY, "description": "The file as uploaded"},
                       206: {"content": BINARY,
                             "description": "The one byte range `Range` asked for (Content-Range says which)"},
                       **responses(404, 416)}, openapi_extra=READ)
async def file_content(file_id: FileId, caller: CallerDep, store: StoreDep,
                       range_: Annotated[str | None, Header(alias="Range", max_length=200, description=(
                           "One byte range, e.g. bytes=0-1023 (not OpenAI's; resumes a download)"))] = None,
                       ) -> Response:
    """`client.files.content(id)`: the bytes, streamed from the store."""
    found = await service.get(file_id=file_id, owner=owner_of(caller))
    return stream(store, file_key(found["id"]), found["bytes"], range_, media_type="application/octet-stream",
                  filename=found["filename"], sha256=found["sha256"])


@router.delete("/{file_id}", response_model=FileDeleted, responses=responses(404, 409), openapi_extra=WRITE)
async def delete_file(file_id: FileId, caller: CallerDep, store: StoreDep) -> dict[str, Any]:
    """`client.files.delete(id)`: the row and the bytes; 409 `file_in_use` while a job that has not ended uses it."""
    gone = await deletion.delete(file_id=file_id, caller=caller, store=store)
    return {"id": gone["id"], "object": "file", "deleted": True}
