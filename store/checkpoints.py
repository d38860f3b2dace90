"""Committed checkpoints in the store: a checkpoint is committed when its manifest is written, and only then.

The trainer uploads a checkpoint's files under its attempt's staging prefix, then writes the manifest
`jobs/<job id>/checkpoints/step-K.json` naming every object with its bytes and SHA-256 (trainer/uploader.py);
the worker resumes a job from the newest manifest whose objects are all there and intact (worker/checkpoints.py);
the API lists and serves them (api/routes/checkpoints.py). The job's fence object (the newest attempt a worker
started) lets rank 0 on any host check that its attempt is still current before it commits.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any

from store import layout
from store.objects import Store

MANIFEST_FORMAT = 1
TAG_PREFIX = "step-"


def tag_for(step: int) -> str:
    """A checkpoint's tag: its folder's name on a node and its manifest's name in the store."""
    return f"{TAG_PREFIX}{step:08d}"


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative to the checkpoint's tag folder, as the trainer wrote it
    key: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    key: str
    step: int
    attempt: int
    tag: str
    created_at: str
    files: list[ManifestFile]
    trainer_state: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def order(self) -> tuple[int, int]:
        """Newer attempts first, then later steps: an attempt continues the timeline of the checkpoint it resumed
        from, so a newer attempt's commit supersedes whatever an older one committed past it."""
        return self.attempt, self.step

    def file(self, path: str) -> ManifestFile | None:
        return next((f for f in self.files if f.path == path), None)

    def to_json(self) -> bytes:
        body = {"format": MANIFEST_FORMAT, "step": self.step, "attempt": self.attempt, "tag": self.tag,
                "created_at": self.created_at, "bytes": self.bytes, "files": [asdict(f) for f in self.files],
                "trainer_state": self.trainer_state}
        return json.dumps(body, indent=1).encode()


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def safe_path(path: str) -> bool:
    """A relative path inside the tag folder: nothing a manifest names may land outside it on a node's disk."""
    p = PurePosixPath(path)
    return bool(path) and not p.is_absolute() and ".." not in p.parts and "\\" not in path and "\0" not in path


def parse(key: str, raw: bytes) -> Manifest:
    """The manifest stored at `key`; ValueError where it is not one."""
    try:
        body = json.loads(raw)
        files = [ManifestFile(str(f["path"]), str(f["key"]), int(f["bytes"]), str(f["sha256"]))
                 for f in body["files"]]
        found = Manifest(key, int(body["step"]), int(body["attempt"]), str(body["tag"]), str(body["created_at"]),
                         files, dict(body.get("trainer_state") or {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{key} is not a checkpoint manifest: {exc}") from exc
    bad = [f.path for f in files if not safe_path(f.path)]
    if bad:
        raise ValueError(f"{key} names paths outside its checkpoint: {bad[:3]}")
    return found


def is_manifest_key(job_id: str, key: str) -> bool:
    rest = key.removeprefix(layout.checkpoints_prefix(job_id))
    return rest != key and "/" not in rest and rest.startswith("step-") and rest.endswith(".json")


async def read_all_async(store: Store, job_id: str) -> list[Manifest]:
    """The API's view: every readable manifest, oldest step first."""
    found = []
    for item in await store.list_async(layout.checkpoints_prefix(job_id)):
        if not is_manifest_key(job_id, item.key):
            continue
        try:
            found.append(parse(item.key, await store.get_bytes_async(item.key)))
        except (FileNotFoundError, ValueError):
            continue  # pruned while we listed, or not a manifest: neither is a checkpoint to show
    return sorted(found, key=lambda m: (m.step, m.attempt))


async def read_async(store: Store, job_id: str, step: int) -> Manifest | None:
    key = layout.checkpoint_manifest_key(job_id, tag_for(step))
    try:
        return parse(key, await store.get_bytes_async(key))
    except (FileNotFoundError, ValueError):
        return None


def manifest_keys(store: Store, job_id: str) -> list[str]:
    return sorted(item.key for item in store.list(layout.checkpoints_prefix(job_id))
                  if is_manifest_key(job_id, item.key))


def read_all(store: Store, job_id: str) -> tuple[list[Manifest], list[tuple[str, str]]]:
    """Every readable manifest, newest first, and (key, why) for each that is not one."""
    found, unreadable = [], []
    for key in manifest_keys(store, job_id):
        try:
            found.append(parse(key, store.get_bytes(key)))
        except FileNotFoundError:
            continue  # pruned while we listed
        except ValueError as exc:
            unreadable.append((key, str(exc)))
    return sorted(found, key=lambda m: m.order, reverse=True), unreadable


# The fence: read, and raised only. Two workers of one job never start attempts at once (the control plane
# sends attempt N+1 only after attempt N's lease is gone), so read-then-write needs no compare-and-swap.
def read_fence(store: Store, job_id: str) -> int:
    try:
        return int(store.get_bytes(layout.fence_key(job_id)).decode().strip() or 0)
    except FileNotFoundError:
        return 0
    except ValueError:
        return 0


def raise_fence(store: Store, job_id: str, attempt: int) -> int:
    """Make `attempt` the job's fence unless a newer one is there; returns the fence after the call."""
    current = read_fence(store, job_id)
    if current >= attempt:
        return current
    store.put_bytes(layout.fence_key(job_id), str(attempt).encode())
    return attempt


def backoff(attempt: int, cap: float = 30.0) -> float:
    return float(min(cap, 0.5 * 2 ** min(attempt, 10)))


def sleep_backoff(attempt: int, stop: Any = None) -> None:
    """Sleep before retry number `attempt`; `stop` (a threading.Event) cuts it short."""
    delay = backoff(attempt)
    if stop is not None:
        stop.wait(delay)
    else:
        time.sleep(delay)
