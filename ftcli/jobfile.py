"""A job file and the `--set a.b=v` overrides applied to it before it is sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftcli.http import CliError


def parse_value(text: str) -> Any:
    """JSON where the value is JSON (numbers, true, null, lists, objects, quoted strings), else the text itself:
    `--set hyperparameters.learning_rate=1e-4` is a number, `--set name=my-run` a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def apply_set(job: dict[str, Any], assignment: str) -> None:
    path, sep, raw = assignment.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise CliError(f"--set {assignment!r}: expected a dotted field and a value, like "
                       "hyperparameters.learning_rate=1e-4", field="--set")
    node = job
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise CliError(f"--set {assignment!r}: {'.'.join(keys[:i + 1])} is not an object in the job file",
                           field=path)
        node = child
    node[keys[-1]] = parse_value(raw)


def load_job(path: Path, assignments: list[str]) -> dict[str, Any]:
    try:
        job = json.loads(path.read_text())
    except OSError as exc:
        raise CliError(f"cannot read the job file {path}: {exc.strerror}", field="job_file") from None
    except ValueError as exc:
        raise CliError(f"the job file {path} is not JSON: {exc}", field="job_file") from None
    if not isinstance(job, dict):
        raise CliError(f"the job file {path} must hold a JSON object", field="job_file")
    for assignment in assignments:
        apply_set(job, assignment)
    return job
