"""Streaming an object of the artifact store to a client, whole (200) or one byte range (206), so a large file
never sits in the API's memory and an interrupted download resumes where it stopped (`Range: bytes=N-`).

One range per request: that is what download tools send; a multi-range request gets the whole object, which
RFC 9110 allows.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from api.errors import ApiError, ErrorCode
from store.objects import Store

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeNotSatisfiable(ApiError):
    def __init__(self, size: int) -> None:
        super().__init__(416, ErrorCode.INVALID_REQUEST, f"the range lies outside the object's {size} bytes",
                         "Range", headers={"Content-Range": f"bytes */{size}"})


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of the one range `header` asks for, None for the whole object; raises RangeNotSatisfiable."""
    if not header:
        return None
    found = _RANGE.match(header.strip())
    if found is None or found.group(1) == found.group(2) == "":
        return None  # not a single byte range: the whole object
    first, last = found.group(1), found.group(2)
    if first == "":  # the last N bytes
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
        if last != "" and int(last) < start:
            return None  # an invalid range is ignored (RFC 9110 14.2)
    if start >= size or start >= end:
        raise RangeNotSatisfiable(size)
    return start, end


def stream(store: Store, key: str, size: int, range_header: str | None, *, media_type: str,
           filename: str | None = None, sha256: str | None = None) -> StreamingResponse:
    """The object at `key` (of `size` bytes) as the answer to a GET with `range_header`."""
    span = byte_range(range_header, size)
    headers = {"Accept-Ranges": "bytes"}
    if filename:
        headers["Content-Disposition"] = f"attachment; filename*=UTF-8''{_quote(filename)}"
    if sha256:
        # The whole object's digest, on a part too: a client that resumed checks the file it assembled.
        headers["X-Content-SHA256"] = sha256
    if span is None:
        headers["Content-Length"] = str(size)
        return StreamingResponse(_chunks(store, key, 0, None), media_type=media_type, headers=headers)
    start, end = span
    headers["Content-Length"] = str(end - start)
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    return StreamingResponse(_chunks(store, key, start, end), status_code=206, media_type=media_type,
                             headers=headers)


async def _chunks(store: Store, key: str, start: int, end: int | None) -> AsyncIterator[bytes]:
    async for chunk in store.iter_async(key, start, end):
        yield chunk


def _quote(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")
