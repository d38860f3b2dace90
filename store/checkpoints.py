"""Committed checkpoints in the store: a checkpoint is committed when its manifest is written, and only then.

The trainer uploads a checkpoint's files under its attempt's staging prefix, then writes the manifest
`jobs/<job id>/checkpoints/step-K.attempt-N.json` naming every object with its bytes and SHA-256
(trainer/uploader.py); the worker resumes a job from the newest trusted manifest whose objects are all there and
intact (worker/checkpoints.py); the API lists and serves the trusted ones (api/routes/checkpoints.py).

The fence. The worker that starts attempt N lists the job's manifests, then writes `fences/attempt-N.json` once
(a create-only put: of two nodes of one attempt, the first wins and the other reads it), recording for each older
attempt the newest step it found committed: that attempt's cut. Rank 0 checks the fence before it commits, but a
check and a write are two requests to two keys, and no object store conditions a write on another key; so a
superseded attempt can still land a manifest after its check passed. The reader closes that gap: a manifest of
attempt A at step K is trusted only while no newer attempt started, or where K is within A's cut. An attempt
commits its steps in order, one at a time, so everything it committed before its successor listed is within the
cut, and everything after is past it, whenever it lands: never listed, resumed from or served.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any

from store import layout
from store.objects import AlreadyExists, Store

MANIFEST_FORMAT = 1
TAG_PREFIX = "step-"
# The folder of a tag holding the model's Hugging Face config, tokenizer and generation config: with DeepSpeed's
# weights beside it, what a job continued from this checkpoint builds its model from (worker/from_checkpoint.py).
HF_FOLDER = "hf"
HF_CONFIG = f"{HF_FOLDER}/config.json"


def tag_for(step: int) -> str:
    """A checkpoint's tag: its folder's name on a node and its manifest's name in the store."""
    return f"{TAG_PREFIX}{step:08d}"


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative to the checkpoint's tag folder, as the trainer wrote it
    key: str
    bytes: int
    sha256: str

    @classmethod
    def from_json(cls, f: dict[str, Any]) -> ManifestFile:
        """One entry of a manifest's (or a node's part list's) `files`; KeyError, TypeError or ValueError where
        it is not one."""
        return cls(str(f["path"]), str(f["key"]), int(f["bytes"]), str(f["sha256"]))


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
        files = [ManifestFile.from_json(f) for f in body["files"]]
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


def commit(store: Store, manifest: Manifest) -> None:
    """Write the manifest where nothing is yet: a retry whose first write landed finds it there, and nothing
    ever replaces a manifest."""
    try:
        store.put_bytes(manifest.key, manifest.to_json(), create=True)
    except AlreadyExists:
        pass


@dataclass(frozen=True)
class Fence:
    """The job's fence as the store holds it: the newest attempt a worker started (0: none yet) and, for each
    older attempt, its cut: the newest step of it that the attempt after it found committed."""

    attempt: int = 0
    cuts: dict[int, int] = field(default_factory=dict)

    def trusts(self, manifest: Manifest) -> bool:
        if manifest.attempt >= self.attempt:
            return True  # the current attempt's, or one started while the store was out of reach
        cut = self.cuts.get(manifest.attempt)
        return cut is not None and manifest.step <= cut

    def why_not(self, manifest: Manifest) -> str:
        return (f"attempt {manifest.attempt} wrote it after attempt {self.attempt} had taken over "
                f"(its last commit before then was step {self.cuts.get(manifest.attempt, 0)})")


def _fence_of(records: list[dict[str, Any]]) -> Fence:
    """Every attempt's record merged: an attempt's cut is the lowest any later attempt recorded (the first to take
    over from it found the least; a later one may have found a late write too)."""
    cuts: dict[int, int] = {}
    for record in records:
        for attempt, step in record["cuts"].items():
            cuts[int(attempt)] = min(int(step), cuts.get(int(attempt), int(step)))
    return Fence(max((int(r["attempt"]) for r in records), default=0), cuts)


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
        int(record["attempt"])
        return record if isinstance(record["cuts"], dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def read_fence(store: Store, job_id: str) -> Fence:
    records = []
    for item in store.list(layout.fences_prefix(job_id)):
        try:
            record = _parse_record(store.get_bytes(item.key))
        except FileNotFoundError:
            continue
        if record is not None:
            records.append(record)
    return _fence_of(records)


async def read_fence_async(store: Store, job_id: str) -> Fence:
    records = []
    for item in await store.list_async(layout.fences_prefix(job_id)):
        try:
            record = _parse_record(await store.get_bytes_async(item.key))
        except FileNotFoundError:
            continue
        if record is not None:
            records.append(record)
    return _fence_of(records)


def raise_fence(store: Store, job_id: str, attempt: int) -> Fence:
    """Take the job over for `attempt`, unless a newer one has: cut every older attempt not cut yet at the newest
    step it committed, as listed now, then write the record once. Returns the fence after the call."""
    before = read_fence(store, job_id)
    if before.attempt >= attempt:
        return before
    newest: dict[int, int] = {}
    for key in manifest_keys(store, job_id):
        found = _attempt_step(job_id, key)
        if found is not None and found[0] < attempt:
            newest[found[0]] = max(found[1], newest.get(found[0], 0))
    cuts = {a: newest.get(a, 0) for a in range(1, attempt) if a not in before.cuts}
    record = json.dumps({"attempt": attempt, "cuts": {str(a): s for a, s in cuts.items()}, "at": now()}).encode()
    try:
        store.put_bytes(layout.fence_key(job_id, attempt), record, create=True)
    except AlreadyExists:
        pass  # another node of this attempt took over first: its cut stands, and every node reads the same
    return read_fence(store, job_id)


def _attempt_step(job_id: str, key: str) -> tuple[int, int] | None:
    """(attempt, step) a manifest's key names."""
    name = key.removeprefix(layout.checkpoints_prefix(job_id)).removesuffix(".json")
    tag, _, attempt = name.partition(".attempt-")
    try:
        return int(attempt), int(tag.removeprefix(TAG_PREFIX))
    except ValueError:
        return None


async def read_all_async(store: Store, job_id: str) -> list[Manifest]:
    """The API's view: every trusted manifest, oldest step first."""
    fence = await read_fence_async(store, job_id)
    found = []
    for item in await store.list_async(layout.checkpoints_prefix(job_id)):
        if not is_manifest_key(job_id, item.key):
            continue
        try:
            manifest = parse(item.key, await store.get_bytes_async(item.key))
        except (FileNotFoundError, ValueError):
            continue  # pruned while we listed, or not a manifest: neither is a checkpoint to show
        if fence.trusts(manifest):
            found.append(manifest)
    return sorted(found, key=lambda m: (m.step, m.attempt))


async def read_async(store: Store, job_id: str, step: int) -> Manifest | None:
    """The trusted manifest of `step` (of the newest attempt, should two have committed it)."""
    found = [m for m in await read_all_async(store, job_id) if m.step == step]
    return found[-1] if found else None


def manifest_keys(store: Store, job_id: str) -> list[str]:
    return sorted(item.key for item in store.list(layout.checkpoints_prefix(job_id))
                  if is_manifest_key(job_id, item.key))


def read_all(store: Store, job_id: str) -> tuple[list[Manifest], list[tuple[str, str]]]:
    """Every trusted manifest, newest first, and (key, why) for each that is not one or is not trusted."""
    fence = read_fence(store, job_id)
    found, refused = [], []
    for key in manifest_keys(store, job_id):
        try:
            manifest = parse(key, store.get_bytes(key))
        except FileNotFoundError:
            continue  # pruned while we listed
        except ValueError as exc:
            refused.append((key, str(exc)))
            continue
        if fence.trusts(manifest):
            found.append(manifest)
        else:
            refused.append((key, fence.why_not(manifest)))
    return sorted(found, key=lambda m: m.order, reverse=True), refused


def backoff(attempt: int, cap: float = 30.0) -> float:
    return float(min(cap, 0.5 * 2 ** min(attempt, 10)))


def sleep_backoff(attempt: int, stop: Any = None) -> None:
    """Sleep before retry number `attempt`; `stop` (a threading.Event) cuts it short."""
    delay = backoff(attempt)
    if stop is not None:
        stop.wait(delay)
    else:
        time.sleep(delay)
