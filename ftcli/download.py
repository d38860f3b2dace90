"""`ft download`: a succeeded job's export into a folder, through the API (no store credentials).

A few files at once; each one goes into `<name>.part` first. A file up to one chunk (64 MiB by default) comes in one
request, continued from the `.part` file's size with a `Range` request when it is interrupted. A larger one comes in
chunks, a few at once over their own connections (one `Range` request each), each written at its offset into the
`.part` file, with `<name>.part.chunks` naming the chunks that arrived whole: a later run fetches only the others.
This run retries a broken connection; a later run picks up the `.part`. Every file is hashed and checked against
the SHA-256 the export's manifest recorded before it takes its name: a mismatch deletes it and downloads it once
more from the start, and a second mismatch fails. A file already there with the right digest is skipped, so running
it again after a success does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ftcli.http import Api, CliError, error_of

CHUNK_BYTES = 1 << 20
# A file larger than this comes in chunks of it, CONNECTIONS at once: the API streams one request from the store at
# about the speed of one core, and a few requests in flight fill a link one cannot.
RANGE_CHUNK_BYTES = 64 << 20
CONNECTIONS = 4
# Broken connections one file (or one chunk) survives in one run, each resumed from what arrived.
RETRIES = 3
PART = ".part"
CHUNKS = ".chunks"


@dataclass
class Fetched:
    path: str
    bytes: int
    sha256: str
    status: str  # downloaded, continued (from a .part file) or present (already there and verified)
    transferred: int = 0  # bytes this run fetched


def target_of(dest: Path, path: str) -> Path:
    """Where the export's `path` goes under `dest`; a path that would leave it is refused (the API lists only
    relative paths inside the export, but a client does not write where a server tells it to without checking)."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or any(p in ("..", ".") for p in parts) or "\\" in path:
        raise CliError(f"the export lists {path!r}, which is not a path inside {dest}", code="invalid_path")
    return dest.joinpath(*parts)


UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str, field: str) -> int:
    """`64M`, `512K`, `1048576`: a size in bytes, at least one KiB (a chunk is a request: smaller ones cost more
    than they carry)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in UNITS else ""
    try:
        size = int(raw.removesuffix(unit)) * UNITS[unit] if raw else 0
    except ValueError:
        size = 0
    if size < 1024:
        raise CliError(f"{text!r} is not a size of at least 1K (bytes, or with K, M, G: 64M)", code="invalid",
                       field=field)
    return size


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# Told how many bytes of the file are on disk so far (it can go down: a mismatch or a server that ignored Range).
Seen = Callable[[int], None]


def fetch_one(api: Api, entry: dict[str, Any], dest: Path, seen: Seen, *, chunk_bytes: int = RANGE_CHUNK_BYTES,
              connections: int = CONNECTIONS) -> Fetched:
    path, size, sha256 = str(entry["path"]), int(entry["bytes"]), str(entry["sha256"])
    target = target_of(dest, path)
    if target.is_file() and target.stat().st_size == size and sha256_of(target) == sha256:
        seen(size)
        return Fetched(path, size, sha256, "present")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + PART)
    chunks = target.with_name(target.name + PART + CHUNKS)
    resumed = part.is_file() and 0 < part.stat().st_size <= size
    transferred = 0
    for attempt in (1, 2):
        if size > chunk_bytes:
            transferred += _fill_chunks(api, str(entry["url"]), part, chunks, size, chunk_bytes, connections, seen)
        else:
            transferred += _fill(api, str(entry["url"]), part, size, seen)
        got = sha256_of(part)
        if got == sha256:
            part.replace(target)
            chunks.unlink(missing_ok=True)
            return Fetched(path, size, sha256, "continued" if resumed and attempt == 1 else "downloaded",
                           transferred)
        # The bytes on disk are not the export's (a stale .part, a corrupted chunk or transfer): start again once.
        part.unlink()
        chunks.unlink(missing_ok=True)
        seen(0)
    raise CliError(f"{path}: downloaded twice, and its SHA-256 was {got} the second time where the export's "
                   f"manifest says {sha256}; nothing was kept", code="checksum_mismatch", field="sha256")


def _done_chunks(part: Path, chunks: Path, size: int, chunk_bytes: int) -> set[int]:
    """The chunks an earlier run left whole in `part`: those its list names, or, where a one-request run left the
    `.part` (no list), those inside the prefix it holds. A list that does not fit this file is not trusted."""
    if not part.is_file():
        return set()
    count = -(-size // chunk_bytes)
    if not chunks.is_file():
        have = part.stat().st_size
        return set(range(min(have, size) // chunk_bytes)) if have <= size else set()
    try:
        listed = json.loads(chunks.read_text())
        if listed["bytes"] == size and listed["chunk_bytes"] == chunk_bytes and part.stat().st_size == size:
            return {int(i) for i in listed["done"] if 0 <= int(i) < count}
    except (ValueError, KeyError, TypeError):
        pass
    return set()


def _fill_chunks(api: Api, url: str, part: Path, chunks: Path, size: int, chunk_bytes: int, connections: int,
                 seen: Seen) -> int:
    """Brings `part` to the file's `size` bytes chunk by chunk, `connections` chunks at once, skipping those an
    earlier run left whole; returns the bytes fetched."""
    done = _done_chunks(part, chunks, size, chunk_bytes)
    count = -(-size // chunk_bytes)
    lock = threading.Lock()
    arrived = {i: min(chunk_bytes, size - i * chunk_bytes) for i in done}
    fetched = [0]

    def record() -> None:
        # Under `lock`: written aside and renamed, so a run killed now leaves the list before or after, never half.
        tmp = chunks.with_name(chunks.name + ".tmp")
        tmp.write_text(json.dumps({"bytes": size, "chunk_bytes": chunk_bytes, "done": sorted(done)}))
        tmp.replace(chunks)

    with lock:
        record()  # before the .part grows to its full size: a .part without a list is a one-request prefix
    with part.open("r+b" if part.is_file() else "wb") as f:
        f.truncate(size)
    seen(sum(arrived.values()))
    fd = os.open(part, os.O_WRONLY)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    try:
        with httpx.Client(base_url=api.url, headers=api.headers(), limits=limits,
                          timeout=httpx.Timeout(api.timeout, read=api.timeout)) as client:

            def one(i: int) -> None:
                start, end = i * chunk_bytes, min(size, (i + 1) * chunk_bytes)
                got = _fetch_range(client, url, fd, start, end, part,
                                   lambda n: _arrive(lock, arrived, i, n, seen))
                with lock:
                    fetched[0] += got
                    done.add(i)
                    record()

            with ThreadPoolExecutor(max_workers=max(1, connections)) as pool:
                list(pool.map(one, [i for i in range(count) if i not in done]))
    finally:
        os.close(fd)
    return fetched[0]


def _arrive(lock: threading.Lock, arrived: dict[int, int], i: int, n: int, seen: Seen) -> None:
    with lock:
        arrived[i] = n
        seen(sum(arrived.values()))


def _fetch_range(client: httpx.Client, url: str, fd: int, start: int, end: int, part: Path,
                 seen: Seen) -> int:
    """Bytes [start, end) of the file at their offset in `fd`, retried from what arrived when a connection breaks;
    returns the bytes fetched."""
    failures, have, fetched = 0, start, 0
    while have < end:
        try:
            with client.stream("GET", url, headers={"Range": f"bytes={have}-{end - 1}"}) as r:
                if r.status_code != 206:
                    r.read()
                    if r.status_code == 200:
                        raise CliError(f"{url}: the server ignored the Range of a chunk; nothing was written",
                                       code="no_range")
                    raise error_of(r)
                for chunk in r.iter_bytes(CHUNK_BYTES):
                    chunk = chunk[: end - have]  # never past the chunk, whatever the server sends
                    os.pwrite(fd, chunk, have)
                    have += len(chunk)
                    fetched += len(chunk)
                    seen(have - start)
            if have < end:
                failures += 1  # the connection closed early: continue from what arrived
        except httpx.HTTPError as exc:
            failures += 1
            if failures > RETRIES:
                raise CliError(f"{url}: bytes {start}-{end - 1} broke {failures} times "
                               f"({exc or type(exc).__name__}); run it again to continue from {part}",
                               code="unreachable") from None
            time.sleep(min(2 ** failures, 10))
            continue
        if failures > RETRIES:
            raise CliError(f"{url}: the server closed bytes {start}-{end - 1} early {failures} times; run it again "
                           f"to continue from {part}", code="unreachable")
    return fetched


def _fill(api: Api, url: str, part: Path, size: int, seen: Seen) -> int:
    """Brings `part` to `size` bytes, continuing from what it holds; returns the bytes fetched."""
    if part.is_file() and part.stat().st_size > size:
        part.unlink()  # longer than the file: not a prefix of it
    failures, fetched = 0, 0
    while True:
        have = part.stat().st_size if part.is_file() else 0
        seen(have)
        if have == size:
            return fetched
        try:
            with httpx.stream("GET", api.url + url, headers=api.headers({"Range": f"bytes={have}-"} if have else None),
                              timeout=api.timeout) as r:
                if r.status_code not in (200, 206):
                    r.read()
                    raise error_of(r)
                if r.status_code == 200:
                    have = 0  # the whole file came back, not the rest of it
                with part.open("r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    for chunk in r.iter_bytes(CHUNK_BYTES):
                        f.write(chunk)
                        have += len(chunk)
                        fetched += len(chunk)
                        seen(have)
            if have >= size:
                return fetched
            failures += 1  # the connection closed early: continue from what arrived
        except httpx.HTTPError as exc:
            failures += 1
            if failures > RETRIES:
                raise CliError(f"{url}: the download broke {failures} times ({exc or type(exc).__name__}); run "
                               f"it again to continue from {part}", code="unreachable") from None
            time.sleep(min(2 ** failures, 10))
        if failures > RETRIES:
            raise CliError(f"{url}: the server closed the download early {failures} times; run it again to "
                           f"continue from {part}", code="unreachable")


def checkpoint_listing(api: Api, job_id: str, step: int) -> dict[str, Any]:
    """A committed checkpoint's files, as the export's listing is shaped (each with the URL that serves it)."""
    found = next((c for c in api.json("GET", f"/jobs/{job_id}/checkpoints")["data"] if c["step"] == step), None)
    if found is None:
        raise CliError(f"job {job_id} has no committed checkpoint at step {step} (`GET /jobs/{job_id}/checkpoints` "
                       "lists them)", code="not_found", field="--checkpoint")
    files = [{**f, "url": f"/jobs/{job_id}/checkpoints/{step}/{f['path']}"} for f in found["files"]]
    return {"files": files, "bytes": found["bytes"]}


def download(api: Api, job_id: str, dest: Path, *, parallel: int, console: Console | None,
             checkpoint: int | None = None, chunk_bytes: int = RANGE_CHUNK_BYTES,
             connections: int = CONNECTIONS) -> list[Fetched]:
    """The export (or, with `checkpoint`, that committed checkpoint) into `dest`: `parallel` files at once, a file
    larger than `chunk_bytes` in chunks of it, `connections` at once."""
    listing = api.json("GET", f"/jobs/{job_id}/output") if checkpoint is None else \
        checkpoint_listing(api, job_id, checkpoint)
    files = listing["files"]
    for entry in files:
        target_of(dest, str(entry["path"]))  # every path checked before anything is written
    dest.mkdir(parents=True, exist_ok=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=console, disable=console is None, transient=False)
    with progress:
        total = progress.add_task(f"{job_id}: {len(files)} files", total=listing["bytes"])

        on_disk: dict[str, int] = {}

        def one(entry: dict[str, Any]) -> Fetched:
            task: TaskID = progress.add_task(str(entry["path"]), total=int(entry["bytes"]))

            def seen(n: int) -> None:
                on_disk[str(entry["path"])] = n
                progress.update(task, completed=n)
                progress.update(total, completed=sum(on_disk.values()))

            done = fetch_one(api, entry, dest, seen, chunk_bytes=chunk_bytes, connections=connections)
            progress.update(task, visible=False)
            return done

        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            return list(pool.map(one, files))
