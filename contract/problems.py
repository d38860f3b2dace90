"""What is wrong with a request, field by field: the one error shape every layer reports a bad field with
(the job spec's checks, the DeepSpeed merge, keys, webhooks, paths), and the API turns into a 422."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FieldError:
    field: str
    message: str
    # Why: "unknown", "dangerous", "unrun", "removed" (by DeepSpeed), "batch", "value" (DeepSpeed would refuse the
    # value too), "bound" (the service's own limit), "conflict" (two fields that cannot both hold).
    kind: str = "value"


class SpecError(ValueError):
    """One or more fields of a job are invalid; each names the field and what is accepted."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))
