"""A job's data fields that name stored files (`file_…` from POST /files): each must be a processed file of the
caller's; the submit records what it found (contract/spec.py `StoredInput`), so every node fetches and checks
exactly the bytes that were validated (worker/inputs.py)."""

from __future__ import annotations

from contract.files import FileStatus
from contract.problems import FieldError
from contract.spec import ResolvedJob, StoredInput, is_file_id
from db import files
from db.errors import NotFound
from store.layout import file_key

FIELDS = ("train", "validation")


async def resolve(resolved: ResolvedJob, owner: str) -> list[FieldError]:
    """Record the stored inputs of `resolved`'s data fields and take the data format from them where the spec
    left it unset; returns what is wrong. Another owner's file is reported as no file at all."""
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
