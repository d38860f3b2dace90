"""A job's stored inputs on this node: each file the submit resolved (contract/spec.py `StoredInput`) is fetched
from the artifact store into the node's cache (store/cache.py) and the run spec's data field is pointed at the
local copy, so the trainer reads a path as it always did. Every node of a job fetches its own copy: no node
reads another's disk."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from contract.spec import StoredInput
from store.cache import NodeCache
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class InputUnavailable(Exception):
    """A stored input could not be fetched: the store is unreachable, the object is gone or its bytes changed."""


def localize(settings: WorkerSettings, run_spec: dict[str, Any], inputs: dict[str, StoredInput],
          holds: ExitStack) -> None:
    """Fetch every input and rewrite `run_spec`'s fields to the local copies; the copies stay held (not evictable)
    until `holds` closes."""
    if not inputs:
        return
    store = settings.store()
    cache = NodeCache(Path(settings.cache_root).expanduser().resolve(), settings.cache_max_bytes)
    data = run_spec["job"]["spec"]["data"]
    for field, found in inputs.items():
        try:
            path, hold = cache.hold(store, found.key, found.sha256, found.bytes)
        except (OSError, ValueError) as exc:
            raise InputUnavailable(f"{field}: stored file {found.file_id} could not be fetched from the store "
                                   f"({store.where}): {_first_line(exc)}") from exc
        holds.callback(hold.close)
        data[field.removeprefix("data.")] = str(path)
        log.info("%s: %s is %s", field, found.file_id, path)


def _first_line(exc: BaseException) -> str:
    # The store client's errors carry a multi-line debug dump after the sentence that says what failed.
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
