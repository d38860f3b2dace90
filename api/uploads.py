"""`POST /files`: a multipart/form-data body streamed into the artifact store as it arrives.

The body is parsed by python-multipart's streaming parser, fed one received chunk at a time, and the file part's
bytes go straight into `Store.put_async`, which hashes them and stores them as a multipart upload: the API holds
one chunk of the file at a time, never the file. Starlette's `request.form()` would spool the whole file to a
temporary file first, and the request's body limit (api/guards.py BodyLimit) is not applied to this route for the
same reason; the limits here count the bytes themselves, so no Content-Length, too large, too small or absent,
changes what is stored.

Nothing is left behind by a refused upload: past the size limit, on a body cut short, on a client that leaves, the
store's multipart upload is aborted; the row is inserted only after the object is stored whole, and the object is
deleted again if a later field is refused or the insert fails.
"""

from __future__ import annotations

import asyncio
import logging
import unicodedata
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header
from starlette.requests import ClientDisconnect, Request

from api.access import Principal
from api.errors import ApiError, ErrorCode, invalid, store_unavailable
from api.settings import ApiSettings
from contract.files import FileFormat, FilePurpose
from contract.problems import FieldError
from db import files
from db.errors import StoredBytesExceeded
from store.layout import file_key
from store.objects import Store, TooLarge

log = logging.getLogger(__name__)

FILE, PURPOSE, FORMAT = "file", "purpose", "format"
MAX_FIELD_BYTES = 1024  # purpose and format are short words
MAX_FILENAME_CHARS = 255
# The parts beside the file are small: a declared length beyond the file limit by more than this cannot fit.
FORM_OVERHEAD_BYTES = 1 << 20
# A client that sends nothing for this long has left without closing; its upload is aborted.
IDLE_SECONDS = 300.0
PURPOSES = tuple(p.value for p in FilePurpose)
FORMATS = tuple(f.value for f in FileFormat)


def bad(field: str, message: str) -> ApiError:
    return invalid([FieldError(field, message)])


def truncated(field: str) -> ApiError:
    return ApiError(400, ErrorCode.INVALID_REQUEST, f"{field}: the multipart body ended before its closing boundary "
                    "(cut short); nothing was stored", field)


def too_large(limit: int) -> ApiError:
    return ApiError(413, ErrorCode.PAYLOAD_TOO_LARGE, f"the file is larger than {limit} bytes, the limit; nothing "
                    "was stored", FILE)


class FormStream:
    """The events of a multipart body, in order, as its chunks arrive: ("part", name, filename), ("data", bytes),
    ("end",); None once the closing boundary was read. A body that stops before it raises the 400."""

    def __init__(self, chunks: AsyncIterator[bytes], boundary: bytes) -> None:
        self.chunks = chunks
        self.events: deque[tuple[Any, ...]] = deque()
        self.ended = False
        self.part: str | None = None  # the name of the part being read, for the 400 of a body cut short
        self._field = b""
        self._value = b""
        self._headers: dict[bytes, bytes] = {}
        self.parser = MultipartParser(boundary, callbacks={
            "on_part_begin": self._begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._data,
            "on_part_end": lambda: self.events.append(("end",)), "on_end": self._end})

    def _begin(self) -> None:
        self._headers = {}

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("latin-1")
        filename = options.get(b"filename")
        self.events.append(("part", name, filename))

    def _data(self, data: bytes, start: int, end: int) -> None:
        self.events.append(("data", bytes(data[start:end])))

    def _end(self) -> None:
        self.ended = True

    async def next(self) -> tuple[Any, ...] | None:
        while not self.events:
            if self.ended:
                return None
            try:
                chunk = await asyncio.wait_for(anext(self.chunks), IDLE_SECONDS)
            except StopAsyncIteration:
                raise truncated(self.part or "body") from None
            except ClientDisconnect:
                raise ApiError(400, ErrorCode.INVALID_REQUEST, "the client closed the connection before the body "
                               "ended; nothing was stored", self.part or "body") from None
            except asyncio.TimeoutError:
                raise ApiError(400, ErrorCode.INVALID_REQUEST, f"nothing was received for {IDLE_SECONDS:.0f} s; the "
                               "upload was abandoned", self.part or "body") from None
            try:
                self.parser.write(chunk)
            except MultipartParseError as exc:
                raise ApiError(400, ErrorCode.INVALID_REQUEST, f"{self.part or 'body'}: not a valid multipart body "
                               f"({exc})", self.part or "body") from None
        event = self.events.popleft()
        if event[0] == "part":
            self.part = event[1] or "body"
        return event


def clean_filename(raw: bytes | None) -> str:
    """The name to keep: the last part of the path a client sent, refused where it holds a NUL, a control
    character or a `..` part, or is not UTF-8."""
    if raw is None:
        return "upload"
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(FILE, "the filename is not UTF-8") from None
    if "\x00" in name:
        raise bad(FILE, "the filename holds a NUL character")
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise bad(FILE, "the filename holds a control character")
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise bad(FILE, "the filename holds a '..' path part; send the file's own name")
    base = parts[-1].strip()
    if base in ("", "."):
        raise bad(FILE, "the filename names no file (it is empty or ends with a path separator)")
    if len(base) > MAX_FILENAME_CHARS:
        raise bad(FILE, f"the filename is longer than {MAX_FILENAME_CHARS} characters")
    return base


def boundary_of(request: Request) -> bytes:
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data":
        raise ApiError(415, ErrorCode.INVALID_REQUEST, "send the file as multipart/form-data (fields: file, purpose, "
                       "format), e.g. curl -F file=@data.jsonl -F purpose=fine-tune", "Content-Type")
    boundary = options.get(b"boundary", b"")
    if not boundary or len(boundary) > 200:
        raise ApiError(415, ErrorCode.INVALID_REQUEST, "the multipart/form-data Content-Type names no usable "
                       "boundary", "Content-Type")
    return boundary


async def _field(form: FormStream, name: str) -> str:
    value = b""
    while (event := await form.next()) is not None and event[0] == "data":
        value += event[1]
        if len(value) > MAX_FIELD_BYTES:
            raise bad(name, f"is longer than {MAX_FIELD_BYTES} bytes")
    try:
        return value.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise bad(name, "is not UTF-8 text") from None


def _check(name: str, value: str) -> str:
    accepted = PURPOSES if name == PURPOSE else FORMATS
    if value not in accepted:
        raise bad(name, f"{value[:60]!r} is not accepted; accepted: {', '.join(accepted)}")
    return value


async def receive(request: Request, *, settings: ApiSettings, store: Store, caller: Principal) -> dict[str, Any]:
    """Store the upload's file and insert its row; the file object (the File schema)."""
    boundary = boundary_of(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_file_bytes + FORM_OVERHEAD_BYTES:
        raise too_large(settings.max_file_bytes)
    limit, used = await files.quota(owner=caller.owner, default=settings.quota_max_stored_bytes)
    room = None if limit is None else max(0, limit - used)
    cap = settings.max_file_bytes if room is None else min(settings.max_file_bytes, room)
    form = FormStream(request.stream(), boundary)
    file_id = files.new_id()
    stored = None
    filename = ""
    fields: dict[str, str] = {}
    try:
        while (event := await form.next()) is not None:
            kind, name = event[0], event[1] if len(event) > 1 else None
            if kind != "part":
                continue
            if name == FILE:
                if stored is not None:
                    raise bad(FILE, "send one file per upload")
                filename = clean_filename(event[2])
                stored = await _store(form, store, file_id, cap, settings.max_file_bytes, caller.owner, limit, used)
            elif name in (PURPOSE, FORMAT):
                fields[name] = _check(name, await _field(form, name))
            else:
                raise bad(str(name or "body")[:60], "is not a known field; send file, purpose and format")
        if stored is None:
            raise bad(FILE, "is required: the file's bytes as a multipart part named 'file'")
        if PURPOSE not in fields:
            raise bad(PURPOSE, f"is required; accepted: {', '.join(PURPOSES)}")
        return await files.create(file_id=file_id, owner=caller.owner, filename=filename, size=stored.bytes,
                                  sha256=stored.sha256, purpose=fields[PURPOSE], fmt=fields.get(FORMAT),
                                  quota_default=settings.quota_max_stored_bytes, actor=caller.actor())
    except BaseException:
        if stored is not None:
            await _forget(store, file_id)
        raise


async def _store(form: FormStream, store: Store, file_id: str, cap: int, max_file_bytes: int, owner: str,
                 limit: int | None, used: int) -> Any:
    # What stopped the stream, kept here: the store may wrap what its iterator raised.
    failure: list[BaseException] = []

    async def data() -> AsyncIterator[bytes]:
        try:
            while (event := await form.next()) is not None and event[0] == "data":
                yield event[1]
            if event is None:
                raise truncated(FILE)
        except BaseException as exc:
            failure.append(exc)
            raise

    try:
        return await store.put_async(file_key(file_id), data(), limit=cap)
    except BaseException as exc:
        cause = failure[0] if failure else exc
        if isinstance(cause, TooLarge):
            if cap < max_file_bytes and limit is not None:
                raise StoredBytesExceeded(owner, limit, used, None) from None
            raise too_large(max_file_bytes) from None
        if failure:
            raise cause from None  # the request's own fault, raised as-is or wrapped by the store
        if isinstance(exc, Exception):
            # The store refused or failed the write (a missing bucket, a part it lost): nothing was kept, and
            # the client may send the same file again.
            raise store_unavailable(exc, "written") from None
        raise


async def _forget(store: Store, file_id: str) -> None:
    try:
        await store.delete_async(file_key(file_id))
    except Exception as exc:  # an object without a row is invisible to clients; the log names it for an operator
        log.warning("could not delete the object of refused upload %s: %s", file_id, type(exc).__name__)
