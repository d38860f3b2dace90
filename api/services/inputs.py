"""What a job reads from the artifact store: data fields that name stored files (`file_…` from POST /files), each a
processed file of the caller's, and a model that names a succeeded job of the caller's or a committed checkpoint of
a job of the caller's (continued fine-tuning). The submit records what it found (contract/spec.py `StoredInput`,
`StoredModel`), so every node fetches and checks exactly the bytes that were validated, exported or committed
(worker/inputs.py)."""

from __future__ import annotations

from typing import Any

import orjson

from api.services import checkpoints
from contract import datasets
from contract.codes import JobStatus, Method
from contract.files import FileFormat, FileStatus
from contract.problems import FieldError
from contract.spec import (
    ResolvedJob,
    StoredInput,
    StoredModel,
    StoredModelFile,
    checkpoint_ref,
    is_file_id,
    is_job_id,
)
from db import files, reads
from db.errors import NotFound
from store.checkpoints import HF_CONFIG, HF_FOLDER
from store.layout import file_key
from store.objects import Store

# A LoRA job's export holds the adapter and, in this folder, the merged model a next job can continue from.
MERGED = "merged/"

FIELDS = ("train", "validation")


MODEL_FIELD = "model.name_or_path"


async def resolve(resolved: ResolvedJob, owner: str, store: Store,
                  files_found: dict[str, dict[str, Any]] | None = None) -> list[FieldError]:
    """Record what `resolved` reads from the store; returns what is wrong. `files_found`: the caller's file rows
    this request already read, by id (a `/v1` create read them while it waited for their check)."""
    errors = await _data(resolved, owner, files_found or {})
    errors += await _base_model(resolved, owner)
    return errors + await _checkpoint(resolved, owner, store)


async def _base_model(resolved: ResolvedJob, owner: str) -> list[FieldError]:
    """A model named by a job id: that job must be the caller's, succeeded, with its export in the store."""
    name = resolved.spec.model.name_or_path
    if not is_job_id(name):
        return []
    field = MODEL_FIELD
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


def _weights_or_model_files(path: str) -> bool:
    """What a model is made of in a checkpoint's files: DeepSpeed's model and optimizer states (the fp32 weights
    of a ZeRO job are in the latter) and the trainer's `hf/` folder; not the RNG states or the trainer's state."""
    return ("/" not in path and path.endswith(".pt")) or path.startswith(f"{HF_FOLDER}/")


async def _checkpoint(resolved: ResolvedJob, owner: str, store: Store) -> list[FieldError]:
    """A model named as a checkpoint (`job_…@step-N`): a job of the caller's, in any state, that committed a
    checkpoint at step N which a model can be made of. Only trusted manifests count (store/checkpoints.py)."""
    ref = checkpoint_ref(resolved.spec.model.name_or_path)
    if ref is None:
        return []
    job_id, step = ref
    try:
        job = orjson.loads(await reads.job(job_id, owner))
    except NotFound:
        return [FieldError(MODEL_FIELD, f"there is no job {job_id!r} of yours to continue from")]
    spec = job["resolved"]["spec"]
    if spec.get("lora"):
        return [FieldError(MODEL_FIELD, f"job {job_id} trains a LoRA adapter: its checkpoints hold the adapter's "
                                        "training state beside frozen base weights, not a model to continue from; "
                                        f"continue from the job itself ({job_id!r}) once it has succeeded")]
    stages = spec["resources"]["pipeline_stages"]
    if stages > 1:
        return [FieldError(MODEL_FIELD, f"job {job_id} trains in {stages} pipeline stages: its checkpoints are "
                                        "split by layer and only resume that job; continue from the job itself "
                                        f"({job_id!r}) once it has succeeded")]
    committed = await checkpoints.list_for(store=store, job_id=job_id)
    found = next((m for m in reversed(committed) if m.step == step), None)
    if found is None:
        steps = ", ".join(str(m.step) for m in committed) or "none yet"
        return [FieldError(MODEL_FIELD, f"job {job_id} has no committed checkpoint at step {step} (committed: "
                                        f"{steps}; GET /jobs/{job_id}/checkpoints lists them)")]
    if found.file(HF_CONFIG) is None:
        return [FieldError(MODEL_FIELD, f"job {job_id}'s checkpoint at step {step} was saved without the model's "
                                        "config and tokenizer; continue from a checkpoint saved with them or from "
                                        "the job's export")]
    resolved.base_model = StoredModel(job_id=job_id, step=step, files=[
        StoredModelFile(path=f.path, key=f.key, bytes=f.bytes, sha256=f.sha256)
        for f in found.files if _weights_or_model_files(f.path)])
    return []


async def _data(resolved: ResolvedJob, owner: str, files_found: dict[str, dict[str, Any]]) -> list[FieldError]:
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
            found = files_found.get(value) or await files.get_for_owner(owner, value)
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
    preference = FileFormat.PREFERENCE.value
    if "format" in data.model_fields_set:
        errors += [FieldError("data.format", datasets.format_conflict(data.format, fmt, field)
                              or f"is {data.format!r} but {field} is a {fmt} file")
                   for field, fmt in formats.items() if fmt != data.format]
    elif resolved.spec.method.type == Method.DPO or preference in formats.values():
        # The method decides which shape the files must have; each file of the other is refused at its field.
        wanted = preference if resolved.spec.method.type == Method.DPO else None
        errors += [FieldError(field, f"is a {fmt} file; " + (
            f"a {Method.DPO.value} job trains on preference pairs: {datasets.NEEDS_PREFERENCE}" if wanted else
            f"{datasets.NEEDS_SUPERVISED}, or set method.type to {Method.DPO.value!r} to train on its pairs"))
                   for field, fmt in formats.items() if (fmt == preference) != bool(wanted)]
        if not errors:
            data.format = next(iter(formats.values()))  # type: ignore[assignment]
    elif len(set(formats.values())) > 1:
        errors.append(FieldError("data.validation", f"is a {formats['data.validation']} file but data.train is a "
                                                    f"{formats['data.train']} file"))
    else:
        data.format = next(iter(formats.values()))  # type: ignore[assignment]
    return errors
