"""A job's stored inputs on this node: each file the submit resolved (contract/spec.py `StoredInput`, and the
files of a base model a continued fine-tune names, `StoredModel`) is fetched from the artifact store into the
node's cache (store/cache.py) and the run spec is pointed at the local copies, so the trainer reads paths as it
always did. Every node of a job fetches its own copy: no node
reads another's disk."""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from contract.spec import ResolvedJob
from store.cache import NodeCache
from store.objects import error_line
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class InputUnavailable(Exception):
    """A stored input could not be fetched: the store is unreachable, the object is gone or its bytes changed."""


def localize(settings: WorkerSettings, run_spec: dict[str, Any], job: ResolvedJob, holds: ExitStack,
             model_dir: Path) -> None:
    """Fetch every stored input and rewrite `run_spec`'s fields to the local copies; the copies stay held (not
    evictable) until `holds` closes. A base model's files are linked into `model_dir` under their own names."""
    if not job.inputs and job.base_model is None:
        return
    store = settings.store()
    cache = NodeCache(Path(settings.cache_root).expanduser().resolve(), settings.cache_max_bytes)

    def local(what: str, key: str, sha256: str, size: int) -> Path:
        try:
            path, hold = cache.hold(store, key, sha256, size)
        except (OSError, ValueError) as exc:
            raise InputUnavailable(f"{what} could not be fetched from the store ({store.where}): "
                                   f"{error_line(exc)}") from exc
        holds.callback(hold.close)
        return path

    data = run_spec["job"]["spec"]["data"]
    for field, found in job.inputs.items():
        data[field.removeprefix("data.")] = str(local(f"{field}: stored file {found.file_id}", found.key,
                                                      found.sha256, found.bytes))
        log.info("%s: %s is %s", field, found.file_id, data[field.removeprefix("data.")])
    if job.base_model is not None:
        shutil.rmtree(model_dir, ignore_errors=True)
        for f in job.base_model.files:
            path = local(f"model.name_or_path: {f.path} of job {job.base_model.job_id}'s export", f.key, f.sha256,
                         f.bytes)
            link = model_dir / f.path
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
        run_spec["job"]["spec"]["model"]["name_or_path"] = str(model_dir)
        log.info("model: job %s's export is %s", job.base_model.job_id, model_dir)

