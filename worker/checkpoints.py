"""A job's committed checkpoint onto this node before the launch: the store's newest manifest whose objects are
all there, with the recorded sizes and SHA-256, downloaded into the local `checkpoints/step-K/` and marked
COMMITTED, so the trainer's resume (and its universal conversion for another world size) reads a local folder
as it always did. Every node of a job restores its own copy; no node reads another's disk.

The manifest is the commit (trainer/uploader.py): a local tag newer than the chosen manifest was never committed
in the store, so it is removed, and every node of the job resumes from the same step. A manifest naming an object
that is missing, of another size or another SHA-256 is never resumed from: the previous one is used, the job's log
says why, and the broken manifest is deleted so that nobody lists or tries it again.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store import checkpoints as stored
from store.locks import locked
from store.objects import Store

log = logging.getLogger(__name__)
COMMITTED = "COMMITTED"  # the marker trainer/checkpoint.py commits a tag folder with
UNIVERSAL_DIR = "universal"  # trainer/elastic.py's converted copies, one per tag
LOCK_FILE = ".restore.lock"

Say = Callable[[str, dict[str, Any]], None]


class Rejected(Exception):
    """This manifest cannot be resumed from; the message says why."""


def restore(store: Store, job_id: str, checkpoint_dir: Path, node_rank: int, say: Say) -> stored.Manifest | None:
    """The manifest this node will resume from (None: start afresh), its files in `checkpoint_dir`. Store errors
    propagate: the caller decides what an unreachable store means."""
    manifests, unreadable = stored.read_all(store, job_id)
    for key, why in unreadable:
        say(f"checkpoint manifest {key} is not resumed from: {why}",
            {"key": key, "reason": why})
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    # Two nodes of a job that share this folder (one host) restore one after the other: the second finds it done.
    with locked(checkpoint_dir / LOCK_FILE):
        chosen = None
        for manifest in manifests:
            try:
                where = _restore_one(store, manifest, checkpoint_dir, node_rank)
            except Rejected as exc:
                say(f"checkpoint step {manifest.step} ({manifest.key}) is not resumed from: {exc}; the previous "
                    "committed checkpoint is used", {"step": manifest.step, "key": manifest.key, "reason": str(exc)})
                store.delete(manifest.key)
                continue
            chosen = manifest
            log.info("job %s resumes from %s (%s)", job_id, manifest.key, where)
            break
        for tag_dir in _local_tags(checkpoint_dir):
            if chosen is None or tag_dir.name > chosen.tag:
                say(f"local checkpoint {tag_dir.name} was never committed to the store; it is not resumed from",
                    {"path": str(tag_dir)})
                shutil.rmtree(tag_dir, ignore_errors=True)
            elif tag_dir.name < chosen.tag:
                # Scratch: the store keeps the committed ones. Without this a node other than the first, whose
                # own saves leave its disk once uploaded, would keep one restored copy per attempt for good.
                shutil.rmtree(tag_dir, ignore_errors=True)
    return chosen


def _restore_one(store: Store, manifest: stored.Manifest, checkpoint_dir: Path, node_rank: int) -> str:
    tag_dir = checkpoint_dir / manifest.tag
    if _local_matches(tag_dir, manifest):
        return "this node's copy"
    for f in manifest.files:
        size = store.head(f.key)
        if size is None:
            raise Rejected(f"its object {f.key} is missing")
        if size != f.bytes:
            raise Rejected(f"its object {f.key} holds {size} bytes where {f.bytes} were recorded")
    fetch = checkpoint_dir / f".fetch-node{node_rank}-{manifest.tag}"
    shutil.rmtree(fetch, ignore_errors=True)
    try:
        for f in manifest.files:
            try:
                store.download(f.key, fetch / f.path, sha256=f.sha256)
            except FileNotFoundError as exc:
                raise Rejected(f"its object {f.key} is missing") from exc
            except ValueError as exc:  # the SHA-256 differs
                raise Rejected(str(exc)) from exc
        shutil.rmtree(tag_dir, ignore_errors=True)
        # A universal copy made from another checkpoint of this name would be loaded instead (trainer/elastic.py).
        shutil.rmtree(checkpoint_dir / UNIVERSAL_DIR / manifest.tag, ignore_errors=True)
        fetch.rename(tag_dir)
    finally:
        shutil.rmtree(fetch, ignore_errors=True)
    (tag_dir / COMMITTED).write_text(json.dumps({"step": manifest.step, "attempt": manifest.attempt,
                                                 "manifest": manifest.key}))
    return "downloaded"


def _local_matches(tag_dir: Path, manifest: stored.Manifest) -> bool:
    """This node already holds the checkpoint the manifest commits: the same step and attempt, every file there
    with its recorded size (node 0 of a single host wrote it itself)."""
    try:
        marker = json.loads((tag_dir / COMMITTED).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("step") != manifest.step or marker.get("attempt") != manifest.attempt:
        return False
    for f in manifest.files:
        path = tag_dir / f.path
        if not path.is_file() or path.stat().st_size != f.bytes:
            return False
    return True


def _local_tags(checkpoint_dir: Path) -> list[Path]:
    return sorted(p for p in checkpoint_dir.iterdir() if p.is_dir() and p.name.startswith("step-"))
