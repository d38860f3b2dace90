"""`ft download`: a succeeded job's export into a folder, through the API (no store credentials).

A few files at once; each one goes into `<name>.part` first and is continued from that file's size with a `Range`
request when a download is interrupted (this run retries a broken connection; a later run picks up the `.part`).
Every file is hashed and checked against the SHA-256 the export's manifest recorded before it takes its name: a
mismatch deletes it and downloads it once more from the start, and a second mismatch fails. A file already there
with the right digest is skipped, so running it again after a success does nothing.
"""

from __future__ import annotations

import hashlib
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
# Broken connections one file survives in one run, each resumed from the `.part` file's size.
RETRIES = 3
PART = ".part"


@dataclass
class Fetched:
    path: str
    bytes: int
    sha256: str
    status: str  # downloaded, continued (from a .part file) or present (already there and verified)


def target_of(dest: Path, path: str) -> Path:
    """Where the export's `path` goes under `dest`; a path that would leave it is refused (the API lists only
    relative paths inside the export, but a client does not write where a server tells it to without checking)."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or any(p in ("..", ".") for p in parts) or "\\" in path:
        raise CliError(f"the export lists {path!r}, which is not a path inside {dest}", code="invalid_path")
    return dest.joinpath(*parts)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# Told how many bytes of the file are on disk so far (it can go down: a mismatch or a server that ignored Range).
Seen = Callable[[int], None]


def fetch_one(api: Api, entry: dict[str, Any], dest: Path, seen: Seen) -> Fetched:
    path, size, sha256 = str(entry["path"]), int(entry["bytes"]), str(entry["sha256"])
    target = target_of(dest, path)
    if target.is_file() and target.stat().st_size == size and sha256_of(target) == sha256:
        seen(size)
        return Fetched(path, size, sha256, "present")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + PART)
    resumed = part.is_file() and 0 < part.stat().st_size <= size
    for attempt in (1, 2):
        _fill(api, str(entry["url"]), part, size, seen)
        got = sha256_of(part)
        if got == sha256:
            part.replace(target)
            return Fetched(path, size, sha256, "continued" if resumed and attempt == 1 else "downloaded")
        # The bytes on disk are not the export's (a stale .part, a corrupted transfer): start again once.
        part.unlink()
        seen(0)
    raise CliError(f"{path}: downloaded twice, and its SHA-256 was {got} the second time where the export's "
                   f"manifest says {sha256}; nothing was kept", code="checksum_mismatch", field="sha256")


def _fill(api: Api, url: str, part: Path, size: int, seen: Seen) -> None:
    """Brings `part` to `size` bytes, continuing from what it holds."""
    if part.is_file() and part.stat().st_size > size:
        part.unlink()  # longer than the file: not a prefix of it
    failures = 0
    while True:
        have = part.stat().st_size if part.is_file() else 0
        seen(have)
        if have == size:
            return
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
                        seen(have)
            if have >= size:
                return
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
             checkpoint: int | None = None) -> list[Fetched]:
    """The export (or, with `checkpoint`, that committed checkpoint) into `dest`."""
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

            done = fetch_one(api, entry, dest, seen)
            progress.update(task, visible=False)
            return done

        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            return list(pool.map(one, files))
