"""Merge a raw DeepSpeed config into a job: the part of resolving a job (contract/deepspeed/resolver.py) that
reads what the user wrote for DeepSpeed.

Pure Python, no torch: the API runs it to validate and to show the user every value chosen, and the
trainer gets the same result. A raw DeepSpeed config is read as the pinned DeepSpeed reads it, field by field,
with DeepSpeed's own names, aliases, deprecated names, types and defaults (contract/deepspeed/fields.py, a table built
from DeepSpeed's config models). Each field DeepSpeed accepts is merged into the job under one canonical name,
or refused with the true reason: it writes files, opens connections or imports code, DeepSpeed itself has
removed it, or it is a DeepSpeed feature this service does not run. A field DeepSpeed does not know is refused
with the closest known name. `"auto"` takes the job's value; a field the config leaves unset takes DeepSpeed's
default unless the job sets it. Where the service runs something other than what DeepSpeed would with the same
file, `notes` says so in one sentence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from contract.deepspeed import fields
from contract.deepspeed.policy import (
    ACTIVATION_CKPT_KINDS,
    AIO_KINDS,
    AUTO,
    BOOL,
    DANGEROUS_KEYS,
    DS,
    FP16_KINDS,
    IGNORED_TOP,
    MERGED_TOP,
    OFFLOAD_KINDS,
    OPTIMIZER_KINDS,
    OPTIMIZER_MERGED,
    OPTIMIZER_TYPES,
    PASSTHROUGH_KINDS,
    PASSTHROUGH_SECTIONS,
    SCHEDULER_KINDS,
    SCHEDULER_TYPES,
    UNRUN_OFFLOAD,
    UNRUN_PRECISION,
    UNRUN_TOP,
    UNRUN_ZERO,
    ZERO_KINDS,
    Kind,
    finite_number,
)
from contract.problems import FieldError
from contract.spec import MAX_BATCH, MAX_STEPS, JobSpec


def _show(v: Any) -> str:
    """A value for an error message: short, whatever the client sent."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _js(v: Any) -> str:
    return json.dumps(v)


@cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """Checks a raw value against the job field it sets, with that field's own type and bounds."""
    info = model.model_fields[name]
    return TypeAdapter(Annotated[info.annotation, info])


def is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.lower() == AUTO


def explicit(model: Any, name: str) -> bool:
    return name in model.model_fields_set


def _enabled(block: Any, default: Any) -> bool:
    return isinstance(block, dict) and block.get("enabled", default) is True


@dataclass
class _Raw:
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
    clipping_given: bool = False


class Merger:
    """Walks a raw DeepSpeed config and folds each field into the job spec, collecting errors and notes."""

    def __init__(self, spec: JobSpec, raw: dict[str, Any]) -> None:
        self.spec = spec
        self.raw = raw
        self.errors: list[FieldError] = []
        self.notes: list[str] = []
        self.out = _Raw()
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
            value = _field_adapter(type(section), name).validate_python(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = "".join(f"[{p}]" for p in first["loc"])
            self.err(raw_field, f"{first['msg']}{' at ' + where if where else ''} (it sets {job_field}), "
                                f"got {_show(value)}", "bound")
            return
        current = getattr(section, name)
        if explicit(section, name) and current != value:
            self.err(raw_field, f"is {_show(value)} but {job_field} is {current!r}; remove one or make them equal",
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
            self.err(field, f"{problem}, as {DS} requires, got {_show(value)}", "value")
            return False
        problem = kind.problem(value) if kind is not None else None
        if problem:
            self.err(field, f"{problem}, got {_show(value)}", "bound")
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
            self.err(where, f"must be an object, got {_show(block)}")
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

    # -- the walk --

    def run(self) -> None:
        aliases = fields.table()["top_level_aliases"]
        inert = set(fields.table()["inert_top_level"])
        for key, value in self.raw.items():
            if key.startswith("_"):
                continue  # a comment: DeepSpeed ignores keys it does not read
            if key in aliases:
                canonical = aliases[key]
                if canonical in self.raw:
                    self.err(key, f"and {canonical} are two names of one field; {DS} reads {canonical} and ignores "
                                  f"{key}, keep one", "conflict")
                    continue
                self.notes.append(f"{key} is {DS}'s old name of {canonical}, rendered as {canonical}.")
                key = canonical
            message = fields.removed("", key)
            if message:
                self.err(key, f"is not accepted: {DS} refuses it: {message}", "removed")
            elif key in DANGEROUS_KEYS:
                self._dangerous(key, value)
            elif key in UNRUN_TOP:
                if value != fields.top_level_default(key):
                    self.err(key, f"is {DS}'s {UNRUN_TOP[key]}, which this service does not run", "unrun")
            elif key in MERGED_TOP:
                getattr(self, f"_merge_{key}")(value)
            elif key in PASSTHROUGH_KINDS:
                if self.knob(key, value, PASSTHROUGH_KINDS[key]):
                    self.out.passthrough[key] = value
            elif key in PASSTHROUGH_SECTIONS:
                getattr(self, f"_pass_{key}")(value)
            elif key in IGNORED_TOP:
                self.notes.append(f"{key} is not rendered: {IGNORED_TOP[key]}.")
            elif key in inert:
                self.notes.append(f"{key} is not rendered: {DS} reads no such key and would ignore it.")
            else:
                known = MERGED_TOP | set(PASSTHROUGH_KINDS) | PASSTHROUGH_SECTIONS
                hint = fields.closest(key, fields.top_level_keys() | inert)
                self.err(key, f"is not a field {DS} knows" + (f"; did you mean {hint!r}?" if hint else "")
                         + f" (accepted: {', '.join(sorted(known))})", "unknown")
        self._finish()

    def _dangerous(self, key: str, value: Any) -> None:
        # Only an explicit "enabled": false is taken: a block that names an output path or a project but leaves
        # enabled unset was most likely meant to run.
        if not isinstance(value, dict) or value.get("enabled") is not False:
            self.err(key, f'is not accepted unless "enabled" is false: enabled, it {DANGEROUS_KEYS[key]}',
                     "dangerous")
        elif fields.has_section(key):
            self.model_block(key, key, value, lambda f, where, v: self.knob(where, v, None, f))

    # -- batch and clipping --

    def _batch_field(self, key: str, value: Any) -> None:
        if is_auto(value):
            self.batch_auto.add(key)
            return
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BATCH:
            self.err(key, f'must be an integer from 1 to {MAX_BATCH} or "auto", got {_show(value)}', "bound")
            return
        self.batch[key] = value

    def _merge_train_batch_size(self, v: Any) -> None:
        self._batch_field("train_batch_size", v)

    def _merge_train_micro_batch_size_per_gpu(self, v: Any) -> None:
        self._batch_field("train_micro_batch_size_per_gpu", v)

    def _merge_gradient_accumulation_steps(self, v: Any) -> None:
        self._batch_field("gradient_accumulation_steps", v)

    def _merge_gradient_clipping(self, v: Any) -> None:
        self.out.clipping_given = True
        hp = self.spec.hyperparameters
        if is_auto(v):
            if not explicit(hp, "gradient_clipping"):
                self.notes.append(f'gradient_clipping is "auto": the job\'s {hp.gradient_clipping} applies.')
            return
        self._number("gradient_clipping", v, lambda x: self.adopt(
            hp, "gradient_clipping", x, "gradient_clipping", "hyperparameters.gradient_clipping"))

    def _number(self, field: str, v: Any, then: Any) -> None:
        if not finite_number(v):
            self.err(field, f'must be a number or "auto", got {_show(v)}')
        else:
            then(float(v))

    # -- optimizer and scheduler --

    def _merge_optimizer(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("optimizer", f"must be an object, got {_show(v)}")
            return
        known = set(fields.dict_section_keys("optimizer")) | {"params"}
        for k in v:
            if k not in known:
                self.unknown(f"optimizer.{k}", k, known, "optimizer")
        kind = v.get("type", "AdamW")
        if not isinstance(kind, str):
            self.err("optimizer.type", f"must be an optimizer name such as \"AdamW\", got {_show(kind)}")
            return
        if kind.lower() not in OPTIMIZER_TYPES:
            self.err("optimizer.type", f"{kind!r} is an optimizer this service does not run; it trains with Adam or "
                                       "AdamW (accepted: Adam, AdamW)", "unrun")
            return
        self.out.optimizer_type = OPTIMIZER_TYPES[kind.lower()]
        if "legacy_fusion" in v and self.knob("optimizer.legacy_fusion", v["legacy_fusion"], BOOL):
            self.out.optimizer_extra["legacy_fusion"] = v["legacy_fusion"]
        params = v.get("params") or {}
        if not isinstance(params, dict):
            self.err("optimizer.params", f"must be an object, got {_show(params)}")
            return
        defaults = fields.table()["adam_defaults"]
        accepted = OPTIMIZER_MERGED | set(fields.table()["adam_extra_params"])
        hp = self.spec.hyperparameters
        for k, pv in params.items():
            field = f"optimizer.params.{k}"
            if k in ("bias_correction", "amsgrad", "set_grad_none", "max_grad_norm"):
                self._optimizer_special(field, k, pv, defaults)
                continue
            if k not in accepted:
                self.unknown(field, k, accepted, f"{kind}'s params")
                continue
            self.out.optimizer_set.add(k)
            if is_auto(pv):
                self.out.optimizer_auto.append(k)
            elif k in OPTIMIZER_KINDS:
                if self.knob(field, pv, OPTIMIZER_KINDS[k]):
                    self.out.optimizer_extra[k] = pv
            elif k == "lr":
                self._number(field, pv, lambda x: self.adopt(
                    hp, "learning_rate", x, "optimizer.params.lr", "hyperparameters.learning_rate"))
            elif k == "weight_decay":
                self._number(field, pv, lambda x: self.adopt(
                    hp, "weight_decay", x, "optimizer.params.weight_decay", "hyperparameters.weight_decay"))
            elif k == "betas":
                if not (isinstance(pv, list) and len(pv) == 2 and all(finite_number(b) for b in pv)):
                    self.err(field, f"must be a list of two numbers, got {_show(pv)}")
                else:
                    self.adopt(hp, "adam_betas", pv, field, "hyperparameters.adam_betas")

    def _optimizer_special(self, field: str, k: str, v: Any, defaults: dict[str, Any]) -> None:
        if k == "max_grad_norm":
            self.err(field, f"is not an optimizer parameter in {DS}, which warns and ignores it; clip with "
                            "gradient_clipping", "unrun")
        elif not isinstance(v, bool):
            self.err(field, f"must be true or false, got {_show(v)}")
        elif v == defaults.get(k, v):
            self.notes.append(f"{field} is {_js(v)}, DeepSpeed's default; it is not rendered.")
        elif k == "amsgrad":
            self.err(field, f"true is refused by {DS}'s FusedAdam, which has no AMSGrad variant", "unrun")
        else:
            self.err(field, f"{_js(v)} is an Adam setting this service does not run (torch's AdamW, which CPU jobs "
                            "use, has no switch for it)", "unrun")

    def _merge_scheduler(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("scheduler", f"must be an object, got {_show(v)}")
            return
        known = set(fields.dict_section_keys("scheduler")) | {"params"}
        for k in v:
            if k not in known:
                self.unknown(f"scheduler.{k}", k, known, "scheduler")
        kind = v.get("type", "")
        schedulers = fields.table()["schedulers"]
        if not isinstance(kind, str) or kind not in schedulers and kind.lower() not in SCHEDULER_TYPES:
            self.err("scheduler.type", f"{_show(kind)} is not a {DS} scheduler; accepted: WarmupLR, WarmupDecayLR, "
                                       "WarmupCosineLR")
            return
        if kind.lower() not in SCHEDULER_TYPES:
            self.err("scheduler.type", f"{kind} is a {DS} scheduler this service does not run; accepted: WarmupLR, "
                                       "WarmupDecayLR, WarmupCosineLR", "unrun")
            return
        canonical = next(n for n in schedulers if n.lower() == kind.lower())
        hp = self.spec.hyperparameters
        self.adopt(hp, "lr_schedule", SCHEDULER_TYPES[kind.lower()], "scheduler.type", "hyperparameters.lr_schedule")
        params = v.get("params") or {}
        if not isinstance(params, dict):
            self.err("scheduler.params", f"must be an object, got {_show(params)}")
            return
        accepted = set(schedulers[canonical]) | ({"total_num_steps"} if canonical != "WarmupLR" else set())
        given: dict[str, Any] = {}
        for k, pv in params.items():
            field = f"scheduler.params.{k}"
            if k not in accepted:
                self.unknown(field, k, accepted, f"{canonical}'s params")
                continue
            given[k] = pv
            if is_auto(pv):
                continue
            if k == "warmup_num_steps":
                # DeepSpeed's schedulers refuse a warm-up that is not a positive integer.
                if isinstance(pv, bool) or not isinstance(pv, int) or not 1 <= pv <= MAX_STEPS:
                    self.err(field, f"must be an integer from 1 to {MAX_STEPS}, got {_show(pv)}",
                             "value" if isinstance(pv, int) and pv < 1 else "bound")
                else:
                    self.adopt(hp, "warmup_steps", pv, field, "hyperparameters.warmup_steps")
            elif k == "warmup_max_lr":
                self._number(field, pv, lambda x: self.adopt(
                    hp, "learning_rate", x, "scheduler.params.warmup_max_lr", "hyperparameters.learning_rate"))
            elif k == "cos_min_ratio":
                if self.knob(field, pv, SCHEDULER_KINDS[k]):
                    self.adopt(hp, "min_lr_ratio", pv, field, "hyperparameters.min_lr_ratio")
            else:
                self.knob(field, pv, SCHEDULER_KINDS[k])
        self.out.scheduler = {"type": canonical, "params": given}

    # -- precision, activation checkpointing, ZeRO --

    def _merge_fp16(self, v: Any) -> None:
        self._merge_precision("fp16", v)

    def _merge_bf16(self, v: Any) -> None:
        self._merge_precision("bf16", v)

    def _merge_precision(self, key: str, v: Any) -> None:
        extra = self.out.fp16_extra if key == "fp16" else self.out.bf16_extra
        state: dict[str, Any] = {"enabled": False}

        def handle(f: fields.Field, where: str, x: Any) -> None:
            if f.name == "enabled":
                if x is True or x is False or is_auto(x):
                    state["enabled"] = x
                else:
                    self.err(where, f'must be true, false or "auto", got {_show(x)}')
            elif f.name in UNRUN_PRECISION:
                if x is not f.default and self.knob(where, x, None, f):
                    self.err(where, f"is {DS}'s {UNRUN_PRECISION[f.name]}, which this service does not run",
                             "unrun")
            elif self.knob(where, x, FP16_KINDS.get(f.name), f):
                extra[f.name] = x

        self.model_block(key, key, v, handle)
        self.out.precision_blocks[key] = state["enabled"]

    def _merge_activation_checkpointing(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("activation_checkpointing", f"must be an object, got {_show(v)}")
            return
        known = fields.dict_section_keys("activation_checkpointing")
        for k, x in v.items():
            if k not in known:
                self.unknown(f"activation_checkpointing.{k}", k, set(known), "activation_checkpointing")
            elif x is not None:
                self.knob(f"activation_checkpointing.{k}", x, ACTIVATION_CKPT_KINDS.get(k))
        self.adopt(self.spec.deepspeed, "activation_checkpointing", True, "activation_checkpointing",
                   "deepspeed.activation_checkpointing")
        self.notes.append("activation_checkpointing turns on the model's own gradient checkpointing; its settings "
                          "are for models that call deepspeed.checkpointing, which the trainer's models do not, so "
                          "they are not rendered.")

    def _merge_zero_optimization(self, v: Any) -> None:
        self.out.zero_given = True
        ds = self.spec.deepspeed

        def handle(f: fields.Field, where: str, zv: Any) -> None:
            name = f.name
            if name == "stage":
                self.out.stage_given = True
                if is_auto(zv):
                    return
                # bool is an int in Python (True == 1): refuse it explicitly.
                if isinstance(zv, bool) or zv not in (0, 1, 2, 3):
                    self.err("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {_show(zv)}")
                else:
                    self.adopt(ds, "zero_stage", int(zv), "zero_optimization.stage", "deepspeed.zero_stage")
            elif name in ("offload_optimizer", "offload_param"):
                self._merge_offload(name, where, zv)
            elif name in ("cpu_offload", "cpu_offload_param"):
                pass  # handled as their replacement: see model_block
            elif name in UNRUN_ZERO:
                if zv is not None:
                    self.err(where, f"is {DS}'s {UNRUN_ZERO[name]}, which this service does not run", "unrun")
            elif self.knob(where, zv, ZERO_KINDS.get(name), f):
                self.out.zero_extra[name] = zv

        if isinstance(v, dict):
            # DeepSpeed's deprecated booleans set the offload blocks they were replaced by.
            v = dict(v)
            for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
                if old in v and new not in v and isinstance(v[old], bool):
                    v[new] = {"device": "cpu"} if v.pop(old) else None
                    self.notes.append(f"zero_optimization.{old} is {DS}'s deprecated name of {new}, rendered as "
                                      f"{new}.")
        self.model_block("zero_optimization", "zero_optimization", v, handle)

    def _merge_offload(self, key: str, where: str, v: Any) -> None:
        if v is None:
            return
        if not isinstance(v, dict):
            self.err(where, f'must be an object such as {{"device": "cpu"}}, got {_show(v)}')
            return
        device = v.get("device", "none")
        if not isinstance(device, str) or device not in ("none", "cpu", "nvme"):
            self.err(f"{where}.device", f'must be "none", "cpu" or "nvme", got {_show(device)}')
            return
        extra: dict[str, Any] = {}

        def handle(f: fields.Field, field: str, x: Any) -> None:
            if f.name in ("device", "nvme_path"):
                return
            if f.name in UNRUN_OFFLOAD:
                if x is not f.default and self.knob(field, x, None, f):
                    self.err(field, f"is {DS}'s {UNRUN_OFFLOAD[f.name]}, which this service does not run", "unrun")
            elif self.knob(field, x, OFFLOAD_KINDS.get(f.name), f):
                extra[f.name] = x

        self.model_block(f"zero_optimization.{key}", where, v, handle)
        if v.get("nvme_path") is not None:
            self.adopt(self.spec.deepspeed, "nvme_path", v["nvme_path"], f"{where}.nvme_path", "deepspeed.nvme_path")
        self.adopt(self.spec.deepspeed, key, device, f"{where}.device", f"deepspeed.{key}")
        self.out.offload_extra[key] = extra

    # -- sections passed through as DeepSpeed reads them --

    def _pass_comms_logger(self, v: Any) -> None:
        self._pass_model("comms_logger", v)

    def _pass_timers(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("timers", f"must be an object, got {_show(v)}")
            return
        for k in v:
            if k != "throughput":
                self.unknown(f"timers.{k}", k, {"throughput"}, "timers")
        if "throughput" in v:
            self.model_block("timers.throughput", "timers.throughput", v["throughput"],
                             lambda f, where, x: self.knob(where, x, None, f))
        if not any(e.field.startswith("deepspeed.config.timers") for e in self.errors):
            self.out.passthrough["timers"] = v

    def _pass_model(self, key: str, v: Any) -> None:
        before = len(self.errors)
        self.model_block(key, key, v, lambda f, where, x: self.knob(where, x, None, f))
        if len(self.errors) == before:
            self.out.passthrough[key] = v

    def _pass_aio(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("aio", f"must be an object, got {_show(v)}")
            return
        known = fields.dict_section_keys("aio")
        before = len(self.errors)
        for k, x in v.items():
            if k not in known:
                self.unknown(f"aio.{k}", k, set(known), "aio")
            else:
                self.knob(f"aio.{k}", x, AIO_KINDS.get(k))
        if len(self.errors) == before:
            self.out.passthrough["aio"] = v

    # -- what the config left unset or "auto" --

    def _finish(self) -> None:
        spec, out = self.spec, self.out
        hp, ds = spec.hyperparameters, spec.deepspeed
        self._finish_precision()
        if not out.stage_given and not explicit(ds, "zero_stage"):
            ds.zero_stage = fields.lookup("zero_optimization", "stage").default  # type: ignore[union-attr]
            self.notes.append(f"zero_optimization.stage is unset: ZeRO stage {ds.zero_stage}, {DS}'s default.")
        if not out.clipping_given and not explicit(hp, "gradient_clipping"):
            hp.gradient_clipping = float(fields.top_level_default("gradient_clipping"))
        adam = fields.table()["adam_defaults"]
        if out.optimizer_type is None:
            name = "AdamW" if hp.optimizer == "adamw" else f"optimizer {hp.optimizer}"
            self.notes.append(f"optimizer is unset: the job's {name} runs (lr {hp.learning_rate}, betas "
                              f"{list(hp.adam_betas)}, eps {adam['eps']}, weight_decay {hp.weight_decay}).")
        else:
            unset = {"lr": "learning_rate", "betas": "adam_betas", "weight_decay": "weight_decay"}
            for key, job_field in unset.items():
                from_scheduler = key == "lr" and "hyperparameters.learning_rate" in self.set_by_config
                if key not in out.optimizer_set and not explicit(hp, job_field) and not from_scheduler:
                    setattr(hp, job_field, tuple(adam[key]) if key == "betas" else adam[key])
            if out.optimizer_auto:
                values = {"lr": hp.learning_rate, "betas": list(hp.adam_betas), "eps": adam["eps"],
                          "weight_decay": hp.weight_decay}
                shown = ", ".join(f"{k} {values.get(k, 'default')}" for k in out.optimizer_auto)
                self.notes.append(f'optimizer.params {", ".join(out.optimizer_auto)} are "auto": the job\'s values '
                                  f"apply ({shown}).")
        self._finish_scheduler()

    def _finish_precision(self) -> None:
        blocks, ds = self.out.precision_blocks, self.spec.deepspeed
        on = [k for k, v in blocks.items() if v is True]
        auto = [k for k, v in blocks.items() if is_auto(v)]
        if len(on) == 2:
            self.err("bf16.enabled", f"and fp16.enabled are both true; {DS} refuses both at once", "conflict")
        elif on:
            self.adopt(ds, "precision", on[0], f"{on[0]}.enabled", "deepspeed.precision")
        elif auto:
            if not explicit(ds, "precision"):
                self.notes.append(f'{" and ".join(k + ".enabled" for k in auto)} "auto": the job\'s precision '
                                  f"{ds.precision} applies (deepspeed.precision).")
        elif explicit(ds, "precision"):
            if ds.precision != "fp32":
                self.notes.append(f"the config enables neither fp16 nor bf16, so {DS} would train in fp32; "
                                  f"deepspeed.precision {ds.precision} applies.")
        else:
            ds.precision = "fp32"
            self.notes.append(f"the config enables neither fp16 nor bf16: the job trains in fp32, as {DS} would.")

    def _finish_scheduler(self) -> None:
        hp, sched = self.spec.hyperparameters, self.out.scheduler
        if sched is None:
            if "scheduler" not in self.raw:
                self.notes.append(f"scheduler is unset: the job's {hp.lr_schedule} schedule runs, with "
                                  f"{hp.warmup_steps} warm-up steps.")
            return
        kind, params = sched["type"], sched["params"]
        defaults = fields.table()["schedulers"][kind]
        if "warmup_num_steps" not in params and not explicit(hp, "warmup_steps"):
            hp.warmup_steps = int(defaults["warmup_num_steps"])
        if kind == "WarmupCosineLR" and "cos_min_ratio" not in params and not explicit(hp, "min_lr_ratio"):
            hp.min_lr_ratio = float(defaults["cos_min_ratio"])
        if is_auto(params.get("warmup_num_steps")) and not explicit(hp, "warmup_steps"):
            self.notes.append(f'scheduler.params.warmup_num_steps is "auto": the job\'s {hp.warmup_steps} applies.')
        n = hp.warmup_steps
        warm = f"a linear warm-up over {n} steps from lr/{n} at the first step" if n else "no warm-up"
        shape = {"constant": "then holds lr", "linear": f"then decays linearly to {hp.min_lr_ratio} × lr",
                 "cosine": f"then decays along a cosine to {hp.min_lr_ratio} × lr"}[hp.lr_schedule]
        start = "warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr"
        start_value = params.get(start, defaults[start])
        warmup_type = params.get("warmup_type", defaults["warmup_type"])
        if is_auto(warmup_type):
            warmup_type = defaults["warmup_type"]
        self.notes.append(
            f"scheduler {kind} is run by the trainer: {warm}, {shape} over the job's steps; {DS}'s {kind} would "
            f"warm up {'logarithmically' if warmup_type == 'log' else 'linearly'} from {start} "
            f"{defaults[start] if is_auto(start_value) else start_value} at step 0.")
        if "total_num_steps" in params:
            self.notes.append("scheduler.params.total_num_steps is not used: the schedule spans the job's total "
                              "steps.")
        if params.get("last_batch_iteration", -1) not in (-1, AUTO):
            self.notes.append("scheduler.params.last_batch_iteration is not used: a resumed job continues its "
                              "schedule from its own checkpoint.")
