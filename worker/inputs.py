"""A job's stored inputs on this node: each file the submit resolved (contract/spec.py `StoredInput`, and the
files of a base model a continued fine-tune names, `StoredModel`) is fetched from the artifact store into the
node's cache (store/cache.py) and the run spec is pointed at the local copies, so the trainer reads paths as it
always did. A base model that is a job's checkpoint is made a model folder first (worker/from_checkpoint.py).
Every node of a job fetches its own copy: no node reads another's disk."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from contract.codes import FailureCode
from contract.spec import JobSpec, RunSpec, StoredModel
from store.cache import NodeCache
from store.checkpoints import tag_for
from store.objects import error_line
from worker.process import PROJECT_ROOT, project_env
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class InputUnavailable(Exception):
    """A stored input could not be fetched: the store is unreachable, the object is gone or its bytes changed."""

    code = FailureCode.INPUT_UNAVAILABLE


class BaseModelUnusable(InputUnavailable):
    """A checkpoint the job continues from was fetched but could not be made a model folder."""

    code = FailureCode.MODEL_LOAD_ERROR


def localize(settings: WorkerSettings, run_spec: RunSpec, holds: ExitStack, model_dir: Path) -> RunSpec:
    """Fetch every stored input; returns `run_spec` with its fields naming the local copies, which stay held (not
    evictable) until `holds` closes. A base model's export is linked into `model_dir` under its own names; a base
    model's checkpoint is linked into a folder beside it, from which `model_dir` is written."""
    job = run_spec.job
    if not job.inputs and job.base_model is None:
        return run_spec
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

    data: dict[str, str] = {}
    for field, found in job.inputs.items():
        name = field.removeprefix("data.")
        data[name] = str(local(f"{field}: stored file {found.file_id}", found.key, found.sha256, found.bytes))
        log.info("%s: %s is %s", field, found.file_id, data[name])
    spec = job.spec.model_copy(update={"data": job.spec.data.model_copy(update=data)})
    base = job.base_model
    if base is None:
        return _with_spec(run_spec, spec)
    what, folder = f"job {base.job_id}'s export", model_dir
    gathered = model_dir.with_name(f"{model_dir.name}-checkpoint")
    if base.step is not None:
        # A checkpoint's files are gathered as the tag folder DeepSpeed wrote, then made the model folder.
        what, folder = f"job {base.job_id}'s checkpoint at step {base.step}", gathered / tag_for(base.step)
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.rmtree(gathered, ignore_errors=True)
    for f in base.files:
        path = local(f"model.name_or_path: {f.path} of {what}", f.key, f.sha256, f.bytes)
        link = folder / f.path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    if base.step is not None:
        try:
            _model_from_checkpoint(settings, base, folder, model_dir)
        finally:
            shutil.rmtree(gathered, ignore_errors=True)  # links only: the cache keeps the files
    log.info("model: %s is %s", what, model_dir)
    return _with_spec(run_spec, spec.model_copy(update={
        "model": spec.model.model_copy(update={"name_or_path": str(model_dir)})}))


def _with_spec(run_spec: RunSpec, spec: JobSpec) -> RunSpec:
    return run_spec.model_copy(update={"job": run_spec.job.model_copy(update={"spec": spec})})


def _model_from_checkpoint(settings: WorkerSettings, base: StoredModel, tag_dir: Path, model_dir: Path) -> None:
    """The model folder of a checkpoint, built by a process of its own (worker/from_checkpoint.py): torch and the
    weights' memory stay out of the worker."""
    done = subprocess.run([settings.python or sys.executable, "-m", "worker.from_checkpoint", str(tag_dir),
                           str(model_dir)], cwd=PROJECT_ROOT, env=project_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise BaseModelUnusable(f"model.name_or_path: job {base.job_id}'s checkpoint at step {base.step} could not be "
                                f"made a model: {last}")

