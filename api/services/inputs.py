"""What a job reads from the artifact store: data fields that name stored files (`file_…` from POST /files), each a
processed file of the caller's, and a model that names a succeeded job of the caller's (continued fine-tuning).
The submit records what it found (contract/spec.py `StoredInput`, `StoredModel`), so every node fetches and checks
exactly the bytes that were validated or exported (worker/inputs.py)."""

from __future__ import annotations

import orjson

from contract.codes import JobStatus
from contract.files import FileStatus
from contract.problems import FieldError
from contract.spec import ResolvedJob, StoredInput, StoredModel, StoredModelFile, is_file_id, is_job_id
from db import files, reads
from db.errors import NotFound
from store.layout import file_key

# A LoRA job's export holds the adapter and, in this folder, the merged model a next job can continue from.
MERGED = "merged/"

FIELDS = ("train", "validation")


async def resolve(resolved: ResolvedJob, owner: str) -> list[FieldError]:
    """Record what `resolved` reads from the store; returns what is wrong."""
    return await _data(resolved, owner) + await _base_model(resolved, owner)


async def _base_model(resolved: ResolvedJob, owner: str) -> list[FieldError]:
    """A model named by a job id: that job must be the caller's, succeeded, with its export in the store."""
    name = resolved.spec.model.name_or_path
    if not is_job_id(name):
        return []
    field = "model.name_or_path"
    try:
        job = orjson.loads(await reads.job(name, owner))
    except NotFound:
        return [FieldError(field, f"there is no job {name!r} of yours to continue from")]
    output = job.get("output") or {}
    if job["status"] != JobStatus.SUCCEEDED or not output.get("store"):
        return [FieldError(field, f"job {name} is {job['status']} with no export in the store; only a succeeded "
                                  "job's model can be continued from")]
    listed = [f for f in output.get("files", []) if isinstance(f, dict)]
    merged = [f for f in listed if f["path"].startswith(MERGED)]
    prefix = output["store"].rstrip("/")
    resolved.base_model = StoredModel(job_id=name, files=[
        StoredModelFile(path=f["path"].removeprefix(MERGED), key=f"{prefix}/{f['path']}", bytes=f["bytes"],
                        sha256=f["sha256"]) for f in (merged or listed)])
    return []


async def _data(resolved: ResolvedJob, owner: str) -> list[FieldError]:
    """Record the stored inputs of `resolved`'s data fields and take the data format from them where the spec
    left it unset. Another owner's file is reported as no file at all."""
    errors: list[FieldError] = []
    data = resolved.spec.data
    formats: dict[str, str] = {}
    for name in FIELDS:
        value = getattr(data, name)
        if value is None or not is_file_id(value):
            continue
        field = f"data.{name}"
        try:
            found = await files.get_for_owner(owner, value)
        except NotFound:
            errors.append(FieldError(field, f"there is no file {value!r} of yours; upload one with POST /files"))
            continue
        if found["status"] != FileStatus.PROCESSED:
            why = " (its validation found errors: GET /files/{id} lists them)" if found["status"] == FileStatus.ERROR \
                else " (validation has not finished yet)"
            errors.append(FieldError(field, f"file {value} is {found['status']}; only a processed file can be "
                                            f"trained on{why.replace('{id}', value)}"))
            continue
        formats[field] = found["format"]
        resolved.inputs[field] = StoredInput(file_id=value, key=file_key(value), bytes=found["bytes"],
                                             sha256=found["sha256"])
    if not formats:
        return errors
    if "format" in data.model_fields_set:
        errors += [FieldError("data.format", f"is {data.format!r} but {field} is a {fmt} file")
                   for field, fmt in formats.items() if fmt != data.format]
    elif len(set(formats.values())) > 1:
        errors.append(FieldError("data.validation", f"is a {formats['data.validation']} file but data.train is a "
                                                    f"{formats['data.train']} file"))
    else:
        data.format = next(iter(formats.values()))  # type: ignore[assignment]
    return errors
