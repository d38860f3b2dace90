"""One client for the artifact store, on obstore (Rust's object_store): the same calls for every backend (a local
folder, S3: store/backends/), multipart uploads of streamed bytes that are aborted when the stream fails (nothing
half-written is left or listed), ranged reads, and an async twin of each call for the API's event loop.

Every upload goes through `put` or `put_async`, which hash the bytes on the way: the store's answer for a key is
its size and SHA-256, computed once, here.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError

from contract.storage import StoreConfig
from store.backends import backend_for

# Parts of a multipart upload, and a read's chunks: large enough for S3's minimum part (5 MiB) and throughput,
# small enough that a process streaming many files holds little.
CHUNK_BYTES = 8 << 20
NotFound = FileNotFoundError
# What a call raises when the store cannot answer (unreachable, refused, timed out, a local disk's error): obstore's
# own errors and the OSErrors its local store and our file reads raise. A caller that retries catches these.
StoreError = (BaseError, OSError)


class TooLarge(Exception):
    """The bytes went past the limit the caller set; nothing was stored."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit


class AlreadyExists(Exception):
    """A write made only where the key was free found it taken; nothing was written."""


@dataclass(frozen=True)
class Stored:
    key: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Listed:
    key: str
    bytes: int


def _hashed(chunks: Iterable[bytes], digest: Any, limit: int | None) -> Iterator[bytes]:
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if limit is not None and total > limit:
            raise TooLarge(limit)
        digest.update(chunk)
        yield chunk


async def _hashed_async(chunks: AsyncIterable[bytes], digest: Any, limit: int | None) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if limit is not None and total > limit:
            raise TooLarge(limit)
        digest.update(chunk)
        yield chunk


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


class Store:
    """The store `config` names, its URL's scheme picking the backend (store/backends/); BadConfig where none can
    open it. Nothing is contacted before the first call."""

    def __init__(self, config: StoreConfig) -> None:
        opened = backend_for(config).build(config)
        self._store: Any = opened.store
        self.where = opened.where  # for messages
        self._root = opened.root
        # What another process is given to open this same store from any folder (store/push.py, the run spec).
        self.config = config.model_copy(update={"url": opened.url})

    def __repr__(self) -> str:
        return f"Store({self.where!r})"

    # Writes: streamed, hashed, all or nothing.
    def put(self, key: str, chunks: Iterable[bytes], *, limit: int | None = None) -> Stored:
        digest = hashlib.sha256()
        counted = _Counted(_hashed(chunks, digest, limit))
        obstore.put(self._store, key, counted, chunk_size=CHUNK_BYTES)
        return Stored(key, counted.total, digest.hexdigest())

    async def put_async(self, key: str, chunks: AsyncIterable[bytes], *, limit: int | None = None) -> Stored:
        digest = hashlib.sha256()
        counted = _CountedAsync(_hashed_async(chunks, digest, limit))
        await obstore.put_async(self._store, key, counted, chunk_size=CHUNK_BYTES)
        return Stored(key, counted.total, digest.hexdigest())

    def put_file(self, key: str, path: Path) -> Stored:
        if path.stat().st_size <= CHUNK_BYTES:
            # One request rather than a multipart upload's three: a checkpoint or an export is mostly small files.
            return self.put_bytes(key, path.read_bytes())
        return self.put(key, _file_chunks(path))

    def put_bytes(self, key: str, data: bytes, *, create: bool = False) -> Stored:
        """`create`: only where no object is at `key` (AlreadyExists otherwise), atomically: of two writers, one
        wins. The folder store and S3 (If-None-Match) both honour it."""
        try:
            obstore.put(self._store, key, data, mode="create" if create else "overwrite")
        except AlreadyExistsError as exc:
            raise AlreadyExists(key) from exc
        return Stored(key, len(data), hashlib.sha256(data).hexdigest())

    # Reads.
    def head(self, key: str) -> int | None:
        """The object's size, or None where there is none."""
        try:
            return int(obstore.head(self._store, key)["size"])
        except FileNotFoundError:
            return None

    async def head_async(self, key: str) -> int | None:
        try:
            return int((await obstore.head_async(self._store, key))["size"])
        except FileNotFoundError:
            return None

    def get_bytes(self, key: str) -> bytes:
        return bytes(obstore.get(self._store, key).bytes())

    async def get_bytes_async(self, key: str) -> bytes:
        return bytes(await (await obstore.get_async(self._store, key)).bytes_async())

    def iter(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The object's bytes [start, end) in chunks; raises NotFound."""
        if self._root is not None:
            yield from _read_file(self._root / key, start, end)
            return
        found = obstore.get(self._store, key, options=_range(start, end))
        for chunk in found.stream(min_chunk_size=CHUNK_BYTES):
            yield bytes(chunk)

    async def iter_async(self, key: str, start: int = 0, end: int | None = None) -> AsyncIterator[bytes]:
        if self._root is not None:
            chunks = _read_file(self._root / key, start, end)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield chunk
            return
        found = await obstore.get_async(self._store, key, options=_range(start, end))
        async for chunk in found.stream(min_chunk_size=CHUNK_BYTES):
            yield bytes(chunk)

    def download(self, key: str, dest: Path, *, sha256: str | None = None) -> Stored:
        """The object into `dest`, whole or not at all (a temporary file beside it, renamed), its SHA-256
        checked where given: a mismatch raises ValueError and leaves nothing."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        digest = hashlib.sha256()
        total = 0
        try:
            with part.open("wb") as f:
                for chunk in self.iter(key):
                    digest.update(chunk)
                    total += len(chunk)
                    f.write(chunk)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ValueError(f"{key}: SHA-256 {digest.hexdigest()} where {sha256} was recorded")
            part.replace(dest)
        finally:
            part.unlink(missing_ok=True)
        return Stored(key, total, digest.hexdigest())

    def list(self, prefix: str) -> list[Listed]:
        return [Listed(m["path"], int(m["size"])) for page in obstore.list(self._store, prefix)
                for m in page]

    async def list_async(self, prefix: str) -> list[Listed]:
        return [Listed(m["path"], int(m["size"])) async for page in obstore.list(self._store, prefix)
                for m in page]

    # Deletes: a missing key is already gone.
    def delete(self, key: str) -> None:
        try:
            obstore.delete(self._store, key)
        except FileNotFoundError:
            pass

    async def delete_async(self, key: str) -> None:
        try:
            await obstore.delete_async(self._store, key)
        except FileNotFoundError:
            pass

    def delete_many(self, keys: Sequence[str]) -> None:
        """One request per 1,000 keys where the store takes a batch (S3's DeleteObjects); the folder store deletes
        them one by one."""
        if not keys:
            return
        try:
            obstore.delete(self._store, list(keys))
        except FileNotFoundError:  # the folder store's batch stops at a missing file: the rest one by one
            for key in keys:
                self.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        keys = [item.key for item in self.list(prefix)]
        self.delete_many(keys)
        return len(keys)


def _read_file(path: Path, start: int, end: int | None) -> Iterator[bytes]:
    with path.open("rb") as f:  # FileNotFoundError, as obstore raises for a missing key
        f.seek(start)
        left = None if end is None else end - start
        while left is None or left > 0:
            chunk = f.read(CHUNK_BYTES if left is None else min(CHUNK_BYTES, left))
            if not chunk:
                return
            if left is not None:
                left -= len(chunk)
            yield chunk


def error_line(exc: BaseException) -> str:
    """A store error in one line: the client's errors carry a multi-line debug dump after the sentence that says
    what failed."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _range(start: int, end: int | None) -> dict[str, Any] | None:
    if start == 0 and end is None:
        return None
    return {"range": (start, end) if end is not None else {"offset": start}}


class _Counted:
    """An iterator that counts the bytes it passes on."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self.total = 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks:
            self.total += len(chunk)
            yield chunk


class _CountedAsync:
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self.total = 0

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            self.total += len(chunk)
            yield chunk
