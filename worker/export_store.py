"""The export goes to the artifact store before a job may succeed: every file of the attempt's output folder under
`jobs/<id>/output/`, then the manifest `jobs/<id>/output.json` last, so a manifest's presence means the export is
whole. Clients download it through the API (api/routes/outputs.py), never from the node's disk.

While the store is unreachable the upload is retried with a growing pause, up to FT_STORE_RETRY_SECONDS. A cancel or a
newer attempt stops it between files and during each pause; the job's time limit stops it only during a pause (an
upload that is making progress finishes: the training ended within the limit, and its GPUs are free already).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.codes import FailureCode
from store.layout import output_manifest_key, output_prefix
from store.objects import Store, Stored, StoreError

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE"  # the trainer's local marker (trainer/export.py): the manifest is the store's
FIRST_PAUSE_SECONDS = 1.0
MAX_PAUSE_SECONDS = 30.0


class Interrupted(Exception):
    """The attempt was told to stop while uploading: `reason` is what Attempt.control() said, or the time limit."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Unreachable(Exception):
    """The store did not take the export within the bound."""


def local_files(output_dir: Path) -> list[str]:
    """Every file of the export, as paths relative to `output_dir` ('merged/model.safetensors' for a merged LoRA).
    Links are left out: the trainer writes none, and following one could publish a file from elsewhere on the node."""
    found = []
    for folder, _, names in os.walk(output_dir):  # does not descend into linked folders
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink() and path.is_file() and path != output_dir / COMPLETE:
                found.append(path.relative_to(output_dir).as_posix())
    return sorted(found)


def manifest(job_id: str, attempt: int, completion: dict[str, Any], stored: list[tuple[str, Stored]]) -> dict[str, Any]:
    files = [{"path": rel, "bytes": s.bytes, "sha256": s.sha256} for rel, s in stored]
    return {"job_id": job_id, "attempt": attempt, "format": completion.get("format", "huggingface"),
            "step": completion.get("step"), "final_loss": completion.get("final_loss"),
            "files": files, "bytes": sum(f["bytes"] for f in files)}


def output_of(job_id: str, completion: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    """What the succeeded state carries: the node's path (still useful on one machine), the manifest's files with
    their sizes and digests, and where the export is in the store."""
    return {**completion, "files": written["files"], "bytes": written["bytes"], "store": output_prefix(job_id),
            "manifest": output_manifest_key(job_id)}


def publish(store: Store, *, job_id: str, attempt: int, output_dir: Path, completion: dict[str, Any],
            give_up_after: float, interrupted: Callable[[], str | None], say: Callable[[str], None],
            deadline: float = float("inf")) -> dict[str, Any]:
    """Uploads the export and writes its manifest; returns the succeeded state's `output`. Raises Interrupted or
    Unreachable, after `give_up_after` seconds in which no call succeeded: a large export that takes longer to
    upload is not cut short by a blip near its end."""
    prefix, manifest_key = output_prefix(job_id), output_manifest_key(job_id)
    names = local_files(output_dir)
    done: dict[str, Stored] = {}
    cleared = False
    failing_since: float | None = None
    pause = FIRST_PAUSE_SECONDS
    while True:
        try:
            if not cleared:
                # An earlier attempt's manifest must not vouch for a mix of its files and this one's.
                store.delete(manifest_key)
                cleared = True
            for name in names:
                if name not in done:
                    _check(interrupted)
                    done[name] = store.put_file(prefix + name, output_dir / name)
                    failing_since, pause = None, FIRST_PAUSE_SECONDS
            listed = {item.key: item.bytes for item in store.list(prefix)}
            # A store that lost objects while it was down (or a restarted test server) has them uploaded again.
            lost = [n for n, s in done.items() if listed.get(prefix + n) != s.bytes]
            if lost:
                for name in lost:
                    del done[name]
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since >= give_up_after:
                    raise Unreachable(f"the artifact store {store.where} did not keep the export's files for "
                                      f"{give_up_after:.0f} s (FT_STORE_RETRY_SECONDS): {lost[0]} was missing")
                say(f"the store does not list {len(lost)} uploaded file(s) of the export ({lost[0]}, ...); "
                    f"uploading them again in {pause:.0f} s")
                _pause(pause, interrupted, deadline)
                pause = min(pause * 2, MAX_PAUSE_SECONDS)
                continue
            for key in listed.keys() - {prefix + n for n in names}:
                store.delete(key)  # an earlier attempt's file this export does not have
            written = manifest(job_id, attempt, completion, [(n, done[n]) for n in names])
            store.put_bytes(manifest_key, json.dumps(written, indent=1).encode())
            return output_of(job_id, completion, written)
        except StoreError as exc:
            first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            failing_since = failing_since or time.monotonic()
            left = failing_since + give_up_after - time.monotonic()
            if left <= 0:
                raise Unreachable(f"the artifact store {store.where} did not take the export for "
                                  f"{give_up_after:.0f} s (FT_STORE_RETRY_SECONDS): {first_line}") from exc
            wait = min(pause, left)
            log.warning("job %s attempt %s: store %s: %s; retrying in %.0f s", job_id, attempt, store.where,
                        first_line, wait)
            say(f"the artifact store {store.where} is unreachable ({first_line}); {len(done)}/{len(names)} files "
                f"uploaded; retrying in {wait:.0f} s")
            _pause(wait, interrupted, deadline)
            pause = min(pause * 2, MAX_PAUSE_SECONDS)


def _check(interrupted: Callable[[], str | None]) -> None:
    reason = interrupted()
    if reason is not None:
        raise Interrupted(reason)


def _pause(seconds: float, interrupted: Callable[[], str | None], deadline: float) -> None:
    end = time.monotonic() + seconds
    while True:
        _check(interrupted)
        if time.monotonic() >= deadline:
            raise Interrupted(FailureCode.TIME_LIMIT)
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))
