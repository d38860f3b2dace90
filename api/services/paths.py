"""Checks a job's model and data locations against the configured roots and makes them absolute; a client reads
them relative to the roots again (`server_paths`), and a refusal names them as the client did."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from api.settings import ApiSettings
from contract.problems import FieldError
from contract.spec import JobSpec, checkpoint_ref, is_file_id, is_job_id
from contract.stages import local_family_problem
from core.serverpaths import ServerPaths, store_folder

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@lru_cache(maxsize=32)
def root_path(root: str) -> Path:
    """A configured root, resolved once per process (the settings do not change while it runs)."""
    return Path(root).resolve()


@lru_cache(maxsize=8)
def _server_paths(model_root: str, data_root: str, nvme_root: str, artifacts_root: str, store_url: str) -> ServerPaths:
    return ServerPaths([(model_root, ""), (data_root, ""), (nvme_root, ""), (artifacts_root, "<artifacts>"),
                        (store_folder(store_url), "<store>")])


def server_paths(settings: ApiSettings) -> ServerPaths:
    """What the API shows of the service's roots: a job's resolved spec holds its model and data as absolute paths
    (what the trainer runs from), its checkpoints and export their node folders; a client reads them relative to
    their roots, as it named them (docs/api.md, "Server paths")."""
    return _server_paths(settings.model_root, settings.data_root, settings.nvme_root, settings.artifacts_root,
                         settings.store_url)


def _under(root: Path, candidate: str) -> Path | None:
    """The real path of candidate (relative to root, or absolute) if it stays inside root."""
    path = Path(candidate)
    try:
        full = (path if path.is_absolute() else root / path).resolve()
    except (OSError, RuntimeError):  # a symlink loop: nothing a job can use
        return None
    return full if full == root or root in full.parents else None


def _exists(path: Path, *, directory: bool) -> bool:
    """is_dir/is_file, but False where the OS refuses the name (a component over 255 bytes raises
    ENAMETOOLONG instead of answering, which made a long path a 500)."""
    try:
        return path.is_dir() if directory else path.is_file()
    except OSError:
        return False


def _as_named(root: Path, value: str) -> str:
    """A location as a message shows it: relative to its root. A client never sees where a root is on the server
    (core/serverpaths.py), not even where it sent an absolute path under it."""
    path = Path(value)
    if path.is_absolute() and (path == root or root in path.parents):
        return str(path.relative_to(root))
    return value


def _file_under(root_s: str, value: str, field: str, errors: list[FieldError]) -> str | None:
    root = root_path(root_s)
    full = _under(root, value)
    if full is None:
        errors.append(FieldError(field, f"{value!r} is outside the data root; give a path relative to it"))
        return None
    if not _exists(full, directory=False):
        errors.append(FieldError(field, f"{_as_named(root, value)!r} does not exist under the data root"))
        return None
    return str(full)


def check_locations(spec: JobSpec, settings: ApiSettings) -> list[FieldError]:
    """Rewrites spec's model and data locations in place to absolute paths; returns what is wrong."""
    errors: list[FieldError] = []
    model_root = root_path(settings.model_root)
    name = spec.model.name_or_path
    stored = is_job_id(name) or checkpoint_ref(name) is not None
    local = None if stored else _under(model_root, name)
    if stored:
        pass  # a job's export or checkpoint, checked against the caller's jobs (api/services/inputs.py)
    elif local is not None and _exists(local, directory=True):
        spec.model.name_or_path = str(local)
        stages = spec.resources.pipeline_stages
        problem = local_family_problem(local, stages) if stages > 1 else None
        if problem:
            errors.append(FieldError("resources.pipeline_stages", f"{stages} stages: {problem}"))
    elif name.startswith(("/", ".", "~")):
        where = "is outside" if local is None else "does not exist under"
        errors.append(FieldError("model.name_or_path", f"{_as_named(model_root, name)!r} {where} the model root; "
                                                       "give a directory relative to it"))
    elif not HUB_ID.match(name):
        errors.append(FieldError("model.name_or_path",
                                 f"{name!r} is neither a directory under the model root nor a hub id such as "
                                 "'org/name'"))
    elif not settings.allow_hub_models:
        errors.append(FieldError("model.name_or_path",
                                 f"{name!r} is not a directory under the model root, and hub models are disabled "
                                 "on this service (FT_ALLOW_HUB_MODELS)"))
    if spec.model.trust_remote_code:
        allowed = {m.strip() for m in settings.trust_remote_code_models.split(",") if m.strip()}
        if name not in allowed:
            errors.append(FieldError("model.trust_remote_code",
                                     f"is not allowed for {name!r}: the operator must list the model in "
                                     "FT_TRUST_REMOTE_CODE_MODELS before its own code may run"))
    data = spec.data
    # A file id is a stored file, checked against the caller's files (api/services/inputs.py), not the disk.
    train = None if is_file_id(data.train) else _file_under(settings.data_root, data.train, "data.train", errors)
    if train:
        data.train = train
    if data.validation is not None and not is_file_id(data.validation):
        val = _file_under(settings.data_root, data.validation, "data.validation", errors)
        if val:
            data.validation = val
    ds = spec.deepspeed
    if ds.nvme_path is not None:
        full = _under(root_path(settings.nvme_root), ds.nvme_path)
        if full is None:
            errors.append(FieldError("deepspeed.nvme_path", f"{ds.nvme_path!r} is outside the NVMe root; give a "
                                                            "path relative to it"))
        else:
            ds.nvme_path = str(full)
    return errors
