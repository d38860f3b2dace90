"""The state a raw DeepSpeed config's merge builds up, and the checks every section of it uses: take a raw value
into a job field (`adopt`), keep a tuning value (`knob`), read a block with DeepSpeed's own field model
(`model_block`). contract/deepspeed/merge.py walks the config; each merge_*.py module merges its sections."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from contract.deepspeed import fields
from contract.deepspeed.policy import AUTO, DS, Kind, finite_number
from contract.problems import FieldError
from contract.spec import JobSpec


def show(v: Any) -> str:
    """A value for an error message: short, whatever the client sent."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def js(v: Any) -> str:
    return json.dumps(v)


@cache
def field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """Checks a raw value against the job field it sets, with that field's own type and bounds."""
    info = model.model_fields[name]
    return TypeAdapter(Annotated[info.annotation, info])


def is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.lower() == AUTO


def explicit(model: Any, name: str) -> bool:
    return name in model.model_fields_set


@dataclass
class Merged:
    """What the raw config said, section by section, after merging: the render and the notes read it."""

    passthrough: dict[str, Any] = field(default_factory=dict)
    zero_extra: dict[str, Any] = field(default_factory=dict)
    offload_extra: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"offload_optimizer": {}, "offload_param": {}})
    fp16_extra: dict[str, Any] = field(default_factory=dict)
    bf16_extra: dict[str, Any] = field(default_factory=dict)
    optimizer_type: str | None = None
    optimizer_extra: dict[str, Any] = field(default_factory=dict)
    optimizer_set: set[str] = field(default_factory=set)
    optimizer_auto: list[str] = field(default_factory=list)
    scheduler: dict[str, Any] | None = None
    precision_blocks: dict[str, Any] = field(default_factory=dict)
    zero_given: bool = False
    stage_given: bool = False
    top_given: set[str] = field(default_factory=set)  # the ADOPTED_TOP keys the config gave


class MergeState:
    """What a merge holds while it walks a raw config: the job spec it folds fields into, errors and notes."""

    def __init__(self, spec: JobSpec, raw: dict[str, Any]) -> None:
        self.spec = spec
        self.raw = raw
        self.errors: list[FieldError] = []
        self.notes: list[str] = []
        self.out = Merged()
        self.batch: dict[str, int | None] = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None,
                                             "gradient_accumulation_steps": None}
        self.batch_auto: set[str] = set()
        # Job fields the raw config set (so that "unset" defaults do not overwrite them).
        self.set_by_config: set[str] = set()

    # -- helpers --

    def err(self, field: str, message: str, kind: str = "value") -> None:
        self.errors.append(FieldError(f"deepspeed.config.{field}", message, kind))

    def adopt(self, section: BaseModel, name: str, value: Any, raw_field: str, job_field: str) -> None:
        """Take a raw value unless the job set the same thing explicitly to something else.

        The value is held to the job field's own type and bounds first: assignment bypasses validation.
        """
        try:
            value = field_adapter(type(section), name).validate_python(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = "".join(f"[{p}]" for p in first["loc"])
            self.err(raw_field, f"{first['msg']}{' at ' + where if where else ''} (it sets {job_field}), "
                                f"got {show(value)}", "bound")
            return
        current = getattr(section, name)
        if explicit(section, name) and current != value:
            self.err(raw_field, f"is {show(value)} but {job_field} is {current!r}; remove one or make them equal",
                     "conflict")
            return
        setattr(section, name, value)
        self.set_by_config.add(job_field)

    def knob(self, field: str, value: Any, kind: Kind | None, ds: fields.Field | None = None) -> bool:
        """Whether a tuning value is kept: "auto" means DeepSpeed's default; DeepSpeed's type and the service's
        bound must both hold."""
        if is_auto(value):
            self.notes.append(f'{field} is "auto": DeepSpeed\'s default applies.')
            return False
        problem = ds.problem(value) if ds is not None else None
        if problem:
            self.err(field, f"{problem}, as {DS} requires, got {show(value)}", "value")
            return False
        problem = kind.problem(value) if kind is not None else None
        if problem:
            self.err(field, f"{problem}, got {show(value)}", "bound")
            return False
        return True

    def unknown(self, field: str, key: str, known: set[str] | list[str], where: str) -> None:
        hint = fields.closest(key, known)
        self.err(field, f"is not a field {DS} knows in {where}" + (f"; did you mean {hint!r}?" if hint else "")
                 + f" (accepted: {', '.join(sorted(known))})", "unknown")

    def model_block(self, section: str, where: str, block: Any,
                    handle: Any) -> None:
        """A section DeepSpeed reads with one of its models: each key resolved to DeepSpeed's canonical name
        (aliases and deprecated names included), two names of one field refused as DeepSpeed refuses them,
        unknown keys refused with the closest name; `handle(field, canonical, value)` takes the rest."""
        if not isinstance(block, dict):
            self.err(where, f"must be an object, got {show(block)}")
            return
        names = {n for f in fields.fields(section) for n in f.spec["names"]}
        seen: dict[str, str] = {}
        for key, value in block.items():
            message = fields.removed(section, key)
            if message:
                self.err(f"{where}.{key}", f"is not accepted: {DS} refuses it: {message}", "removed")
                continue
            f = fields.lookup(section, key)
            if f is None:
                self.unknown(f"{where}.{key}", key, names, where)
                continue
            target = f.deprecated_for
            canonical = f.name if target is None else (target or f.name)
            if canonical in seen:
                self.err(f"{where}.{key}",
                         f"and {where}.{seen[canonical]} both set {canonical}; {DS} refuses two names of one "
                         "field together, keep one", "conflict")
                continue
            seen[canonical] = key
            if target == "":
                self.notes.append(f"{where}.{key} is deprecated in {DS}, which only warns about it and ignores it; "
                                  "it is not rendered.")
                continue
            if key != canonical and target is None:
                self.notes.append(f"{where}.{key} is {DS}'s alias of {canonical}, rendered as {canonical}.")
            elif target:
                self.notes.append(f"{where}.{key} is {DS}'s deprecated name of {canonical}, rendered as "
                                  f"{canonical}.")
            handle(fields.lookup(section, canonical) if target else f, f"{where}.{key}", value)

    def number(self, field: str, v: Any, then: Any) -> None:
        """`then(float(v))` for a finite number, else an error naming the field."""
        if not finite_number(v):
            self.err(field, f'must be a number or "auto", got {show(v)}')
        else:
            then(float(v))
