"""Resolve a job (batch sizes, `auto`, a raw DeepSpeed config) and render its DeepSpeed JSON.

Pure Python, no torch: the API runs it to validate and to show the user every value chosen, and the
trainer gets the same result. A raw DeepSpeed config is read as the pinned DeepSpeed reads it, field by field,
with DeepSpeed's own names, aliases, deprecated names, types and defaults (trainer/dsfields.py, a table built
from DeepSpeed's config models). Each field DeepSpeed accepts is merged into the job under one canonical name,
or refused with the true reason: it writes files, opens connections or imports code, DeepSpeed itself has
removed it, or it is a DeepSpeed feature this service does not run. A field DeepSpeed does not know is refused
with the closest known name. `"auto"` takes the job's value; a field the config leaves unset takes DeepSpeed's
default unless the job sets it. Where the service runs something other than what DeepSpeed would with the same
file, `notes` says so in one sentence.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError

from trainer import dsfields
from trainer.spec import MAX_BATCH, MAX_STEPS, JobSpec, ResolvedJob

AUTO = "auto"
DS = f"DeepSpeed {dsfields.version()}"

# Refused unless disabled: each would make DeepSpeed write files, talk to a service or run an autotuner on the
# node. A block with "enabled": false does nothing in DeepSpeed, so it is accepted (and not rendered).
DANGEROUS_KEYS: dict[str, str] = {
    "flops_profiler": "profiles the model and writes its report to the worker's log or output_file",
    "tensorboard": "writes event files on the worker; use the job's event stream",
    "wandb": "opens network connections to a logging service",
    "csv_monitor": "writes files on the worker",
    "comet": "opens network connections to a logging service",
    "autotuning": "launches extra training runs and writes result files",
    "data_efficiency": "reads curriculum-learning index files from paths on the worker",
}

# DeepSpeed features the trainer does not run. A value equal to DeepSpeed's default turns nothing on and passes.
UNRUN_TOP: dict[str, str] = {
    "compile": "DeepCompile (the job's own switch for torch.compile is the deepspeed.compile field)",
    "tensor_parallel": "automatic tensor parallelism",
    "pipeline": "pipeline parallelism",
    "hybrid_engine": "hybrid training/inference engine",
    "expert_parallel": "expert parallelism for mixture-of-experts models",
    "use_data_before_expert_parallelism": "expert-parallel process topology",
    "sequence_parallel_size": "sequence parallelism",
    "data_parallel_size": "data-parallel mesh of sequence parallelism",
    "torch_autocast": "torch.autocast mixed precision (the service's is deepspeed.precision)",
    "weight_quantization": "weight quantization",
    "data_types": "per-tensor data types",
    "checkpoint": "checkpoint engine options (the service writes, validates and loads its own checkpoints)",
    "datastates_ckpt": "DataStates asynchronous checkpointing",
    "managed_gradient_accumulation": "unmanaged gradient accumulation",
}
UNRUN_ZERO: dict[str, str] = {
    "zenflow": "ZenFlow optimizer offload",
    "leaf_module": "ZeRO-3 leaf modules chosen by class name",
}
UNRUN_OFFLOAD: dict[str, str] = {"super_offload": "SuperOffload for superchips"}
UNRUN_PRECISION: dict[str, str] = {
    "fp16_master_weights_and_grads": "fp16 master weights and gradients",
    "bf16_master_weights_and_grads": "bf16 master weights and gradients",
    "bf16_optimizer_states": "bf16 optimizer states",
}
# Accepted, not rendered, and said so: DeepSpeed's reading of them changes nothing the trainer does.
IGNORED_TOP: dict[str, str] = {
    "dataloader_drop_last": "it applies only to DeepSpeed's own data loader; the trainer batches the data itself",
    "vocabulary_size": "DeepSpeed only uses it for a warning",
}
MERGED_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
              "scheduler", "fp16", "bf16", "zero_optimization", "gradient_clipping", "activation_checkpointing"}
PASSTHROUGH_SECTIONS = {"comms_logger", "timers", "aio"}

OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW"}
OPTIMIZER_MERGED = {"lr", "betas", "eps", "weight_decay"}
SCHEDULER_TYPES = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}


@dataclass(frozen=True)
class Kind:
    """The service's own bound on a raw DeepSpeed field, checked on top of DeepSpeed's type: DeepSpeed reads
    these only at launch, so a wrong value found here is a 422 naming the field instead of a failed job."""

    type: Literal["bool", "int", "number", "size", "str"]
    lo: float = 0
    hi: float = 1e12
    choices: tuple[str, ...] = ()

    def problem(self, v: Any) -> str | None:
        if self.type == "bool":
            return None if isinstance(v, bool) else "must be true or false"
        if self.type == "str":
            if isinstance(v, str) and (not self.choices or v in self.choices):
                return None
            return "must be one of " + ", ".join(repr(c) for c in self.choices) if self.choices else "must be a string"
        number = _finite_number(v)
        # DeepSpeed's own schema reads sizes as integers but accepts JSON's 5e8 for them.
        whole = number and (isinstance(v, int) or (self.type == "size" and float(v).is_integer()))
        if self.type == "number" and number and self.lo <= v <= self.hi:
            return None
        if self.type in ("int", "size") and whole and self.lo <= v <= self.hi:
            return None
        what = "a number" if self.type == "number" else "an integer"
        return f"must be {what} from {_num(self.lo)} to {_num(self.hi)}"


BOOL = Kind("bool")
# A size DeepSpeed allocates a buffer of (ZeRO's reduce bucket is a torch.empty of reduce_bucket_size elements):
# beyond the bound the job could only fail at launch.
SIZE = Kind("size")
# A size DeepSpeed only compares counts against (a sub-group, a prefetch window, a persistence threshold): a larger
# one means "no limit", which DeepSpeed itself writes as the int64 maximum (stage3_model_persistence_threshold's
# default), so anything up to it costs nothing; the bound keeps it an integer torch and C++ can hold.
HINT = Kind("size", 0, 2**63 - 1)
DTYPE = Kind("str", choices=("fp16", "bf16", "fp32"))
PASSTHROUGH_KINDS: dict[str, Kind] = {
    "steps_per_print": Kind("size", 1), "wall_clock_breakdown": BOOL, "prescale_gradients": BOOL,
    "gradient_predivide_factor": Kind("number", 0, 1e6), "zero_allow_untested_optimizer": BOOL,
    "communication_data_type": DTYPE, "seq_parallel_communication_data_type": DTYPE,
    "zero_force_ds_cpu_optimizer": BOOL, "memory_breakdown": BOOL, "dump_state": BOOL, "disable_allgather": BOOL,
    "disable_python_gc": BOOL, "gradient_allreduce_op": Kind("str", choices=("mean", "sum")),
    "log_level": Kind("str", choices=("debug", "info", "warning", "error", "critical")),
}
# Keyed by DeepSpeed's canonical names (trainer/deepspeed_fields.json).
ZERO_KINDS: dict[str, Kind] = {
    "reduce_bucket_size": SIZE,
    **{k: HINT for k in ("allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size",
                         "stage3_max_live_parameters", "stage3_max_reuse_distance",
                         "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                         "stage3_module_granularity_threshold")},
    "zero_hpz_partition_size": Kind("int", 1, 1024),
}
OFFLOAD_KINDS: dict[str, Kind] = {
    "buffer_count": Kind("int", 1, 1024), "buffer_size": SIZE, "max_in_cpu": HINT, "ratio": Kind("number", 0, 1),
}
FP16_KINDS: dict[str, Kind] = {
    "loss_scale": Kind("number", 0, 2**32), "initial_scale_power": Kind("int", 0, 32),
    "loss_scale_window": Kind("int", 1, 1e9), "hysteresis": Kind("int", 1, 1e6),
    "min_loss_scale": Kind("number", 0, 2**32),
}
ACTIVATION_CKPT_KINDS: dict[str, Kind] = {
    "partition_activations": BOOL, "cpu_checkpointing": BOOL, "contiguous_memory_optimization": BOOL,
    "number_checkpoints": Kind("int", 1, 1e6), "synchronize_checkpoint_boundary": BOOL, "profile": BOOL,
}
AIO_KINDS: dict[str, Kind] = {"block_size": SIZE, "queue_depth": Kind("int", 1, 1024),
                              "intra_op_parallelism": Kind("int", 1, 1024), "single_submit": BOOL,
                              "overlap_events": BOOL, "use_gds": BOOL}
OPTIMIZER_KINDS: dict[str, Kind] = {"eps": Kind("number", 0, 1), "torch_adam": BOOL, "adam_w_mode": BOOL,
                                    "legacy_fusion": BOOL}
SCHEDULER_KINDS: dict[str, Kind] = {
    "warmup_min_lr": Kind("number", 0, 1), "warmup_type": Kind("str", choices=("log", "linear")),
    "total_num_steps": Kind("int", 1, 1e12), "warmup_min_ratio": Kind("number", 0, 1),
    "cos_min_ratio": Kind("number", 0, 1), "last_batch_iteration": Kind("int", -1, 1e12),
}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


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


@dataclass
class ResolveLimits:
    """Inputs to `auto` choices that depend on the deployment, not on the job."""

    # Tokens one process may hold in one micro batch when no probe has measured the device.
    auto_micro_batch_tokens: int = 16384


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.lower() == AUTO


def _explicit(model: Any, name: str) -> bool:
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


class _Merger:
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
        if _explicit(section, name) and current != value:
            self.err(raw_field, f"is {_show(value)} but {job_field} is {current!r}; remove one or make them equal",
                     "conflict")
            return
        setattr(section, name, value)
        self.set_by_config.add(job_field)

    def knob(self, field: str, value: Any, kind: Kind | None, ds: dsfields.Field | None = None) -> bool:
        """Whether a tuning value is kept: "auto" means DeepSpeed's default; DeepSpeed's type and the service's
        bound must both hold."""
        if _is_auto(value):
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
        hint = dsfields.closest(key, known)
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
        names = {n for f in dsfields.fields(section) for n in f.spec["names"]}
        seen: dict[str, str] = {}
        for key, value in block.items():
            message = dsfields.removed(section, key)
            if message:
                self.err(f"{where}.{key}", f"is not accepted: {DS} refuses it: {message}", "removed")
                continue
            f = dsfields.lookup(section, key)
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
            handle(dsfields.lookup(section, canonical) if target else f, f"{where}.{key}", value)

    # -- the walk --

    def run(self) -> None:
        aliases = dsfields.table()["top_level_aliases"]
        inert = set(dsfields.table()["inert_top_level"])
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
            message = dsfields.removed("", key)
            if message:
                self.err(key, f"is not accepted: {DS} refuses it: {message}", "removed")
            elif key in DANGEROUS_KEYS:
                self._dangerous(key, value)
            elif key in UNRUN_TOP:
                if value != dsfields.top_level_default(key):
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
                hint = dsfields.closest(key, dsfields.top_level_keys() | inert)
                self.err(key, f"is not a field {DS} knows" + (f"; did you mean {hint!r}?" if hint else "")
                         + f" (accepted: {', '.join(sorted(known))})", "unknown")
        self._finish()

    def _dangerous(self, key: str, value: Any) -> None:
        # Only an explicit "enabled": false is taken: a block that names an output path or a project but leaves
        # enabled unset was most likely meant to run.
        if not isinstance(value, dict) or value.get("enabled") is not False:
            self.err(key, f'is not accepted unless "enabled" is false: enabled, it {DANGEROUS_KEYS[key]}',
                     "dangerous")
        elif dsfields.has_section(key):
            self.model_block(key, key, value, lambda f, where, v: self.knob(where, v, None, f))

    # -- batch and clipping --

    def _batch_field(self, key: str, value: Any) -> None:
        if _is_auto(value):
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
        if _is_auto(v):
            if not _explicit(hp, "gradient_clipping"):
                self.notes.append(f'gradient_clipping is "auto": the job\'s {hp.gradient_clipping} applies.')
            return
        self._number("gradient_clipping", v, lambda x: self.adopt(
            hp, "gradient_clipping", x, "gradient_clipping", "hyperparameters.gradient_clipping"))

    def _number(self, field: str, v: Any, then: Any) -> None:
        if not _finite_number(v):
            self.err(field, f'must be a number or "auto", got {_show(v)}')
        else:
            then(float(v))

    # -- optimizer and scheduler --

    def _merge_optimizer(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("optimizer", f"must be an object, got {_show(v)}")
            return
        known = set(dsfields.dict_section_keys("optimizer")) | {"params"}
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
        defaults = dsfields.table()["adam_defaults"]
        accepted = OPTIMIZER_MERGED | set(dsfields.table()["adam_extra_params"])
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
            if _is_auto(pv):
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
                if not (isinstance(pv, list) and len(pv) == 2 and all(_finite_number(b) for b in pv)):
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
        known = set(dsfields.dict_section_keys("scheduler")) | {"params"}
        for k in v:
            if k not in known:
                self.unknown(f"scheduler.{k}", k, known, "scheduler")
        kind = v.get("type", "")
        schedulers = dsfields.table()["schedulers"]
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
            if _is_auto(pv):
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

        def handle(f: dsfields.Field, where: str, x: Any) -> None:
            if f.name == "enabled":
                if x is True or x is False or _is_auto(x):
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
        known = dsfields.dict_section_keys("activation_checkpointing")
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

        def handle(f: dsfields.Field, where: str, zv: Any) -> None:
            name = f.name
            if name == "stage":
                self.out.stage_given = True
                if _is_auto(zv):
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

        def handle(f: dsfields.Field, field: str, x: Any) -> None:
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
        known = dsfields.dict_section_keys("aio")
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
        if not out.stage_given and not _explicit(ds, "zero_stage"):
            ds.zero_stage = dsfields.lookup("zero_optimization", "stage").default  # type: ignore[union-attr]
            self.notes.append(f"zero_optimization.stage is unset: ZeRO stage {ds.zero_stage}, {DS}'s default.")
        if not out.clipping_given and not _explicit(hp, "gradient_clipping"):
            hp.gradient_clipping = float(dsfields.top_level_default("gradient_clipping"))
        adam = dsfields.table()["adam_defaults"]
        if out.optimizer_type is None:
            name = "AdamW" if hp.optimizer == "adamw" else f"optimizer {hp.optimizer}"
            self.notes.append(f"optimizer is unset: the job's {name} runs (lr {hp.learning_rate}, betas "
                              f"{list(hp.adam_betas)}, eps {adam['eps']}, weight_decay {hp.weight_decay}).")
        else:
            unset = {"lr": "learning_rate", "betas": "adam_betas", "weight_decay": "weight_decay"}
            for key, job_field in unset.items():
                from_scheduler = key == "lr" and "hyperparameters.learning_rate" in self.set_by_config
                if key not in out.optimizer_set and not _explicit(hp, job_field) and not from_scheduler:
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
        auto = [k for k, v in blocks.items() if _is_auto(v)]
        if len(on) == 2:
            self.err("bf16.enabled", f"and fp16.enabled are both true; {DS} refuses both at once", "conflict")
        elif on:
            self.adopt(ds, "precision", on[0], f"{on[0]}.enabled", "deepspeed.precision")
        elif auto:
            if not _explicit(ds, "precision"):
                self.notes.append(f'{" and ".join(k + ".enabled" for k in auto)} "auto": the job\'s precision '
                                  f"{ds.precision} applies (deepspeed.precision).")
        elif _explicit(ds, "precision"):
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
        defaults = dsfields.table()["schedulers"][kind]
        if "warmup_num_steps" not in params and not _explicit(hp, "warmup_steps"):
            hp.warmup_steps = int(defaults["warmup_num_steps"])
        if kind == "WarmupCosineLR" and "cos_min_ratio" not in params and not _explicit(hp, "min_lr_ratio"):
            hp.min_lr_ratio = float(defaults["cos_min_ratio"])
        if _is_auto(params.get("warmup_num_steps")) and not _explicit(hp, "warmup_steps"):
            self.notes.append(f'scheduler.params.warmup_num_steps is "auto": the job\'s {hp.warmup_steps} applies.')
        n = hp.warmup_steps
        warm = f"a linear warm-up over {n} steps from lr/{n} at the first step" if n else "no warm-up"
        shape = {"constant": "then holds lr", "linear": f"then decays linearly to {hp.min_lr_ratio} × lr",
                 "cosine": f"then decays along a cosine to {hp.min_lr_ratio} × lr"}[hp.lr_schedule]
        start = "warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr"
        start_value = params.get(start, defaults[start])
        warmup_type = params.get("warmup_type", defaults["warmup_type"])
        if _is_auto(warmup_type):
            warmup_type = defaults["warmup_type"]
        self.notes.append(
            f"scheduler {kind} is run by the trainer: {warm}, {shape} over the job's steps; {DS}'s {kind} would "
            f"warm up {'logarithmically' if warmup_type == 'log' else 'linearly'} from {start} "
            f"{defaults[start] if _is_auto(start_value) else start_value} at step 0.")
        if "total_num_steps" in params:
            self.notes.append("scheduler.params.total_num_steps is not used: the schedule spans the job's total "
                              "steps.")
        if params.get("last_batch_iteration", -1) not in (-1, AUTO):
            self.notes.append("scheduler.params.last_batch_iteration is not used: a resumed job continues its "
                              "schedule from its own checkpoint.")


def _finite_number(v: Any) -> bool:
    """A JSON number a 64-bit float holds. JSON integers have no size limit, and math.isfinite or float() raise
    OverflowError on one beyond the float range: such an integer is compared, never converted."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, int):
        return -sys.float_info.max <= v <= sys.float_info.max
    return math.isfinite(v)


def _divisors_desc(n: int) -> list[int]:
    """Every divisor of n, largest first, in O(sqrt n): divisors come in pairs d, n // d."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _resolve_batch(spec: JobSpec, world: int, raw_batch: dict[str, int | None], limits: ResolveLimits,
                   errors: list[FieldError], notes: list[str], merger: _Merger | None = None) -> tuple[int, int, int]:
    hp = spec.hyperparameters
    g_raw = raw_batch["train_batch_size"]
    m_raw = raw_batch["train_micro_batch_size_per_gpu"]
    a = raw_batch["gradient_accumulation_steps"]
    if merger is not None and not _explicit(hp, "global_batch_size"):
        if g_raw is None and "train_batch_size" in merger.batch_auto:
            notes.append(f'train_batch_size is "auto": the job\'s global batch {hp.global_batch_size} applies.')
        elif g_raw is None and m_raw is None and not merger.batch_auto:
            notes.append(f"the config sets no batch size ({DS} needs train_batch_size or "
                         f"train_micro_batch_size_per_gpu): the job's global batch {hp.global_batch_size} applies.")
        elif g_raw is None and m_raw is not None and a is None and m_raw * world <= MAX_BATCH:
            # DeepSpeed derives the global batch from the micro batch alone, with no accumulation.
            a = 1

    if g_raw is not None and _explicit(hp, "global_batch_size") and g_raw != hp.global_batch_size:
        errors.append(FieldError("deepspeed.config.train_batch_size",
                                 f"is {g_raw} but hyperparameters.global_batch_size is {hp.global_batch_size}; "
                                 "remove one or make them equal", "conflict"))
        return hp.global_batch_size, 1, 1
    m_hp = hp.micro_batch_size if isinstance(hp.micro_batch_size, int) else None
    if m_raw is not None and m_hp is not None and m_raw != m_hp:
        errors.append(FieldError("deepspeed.config.train_micro_batch_size_per_gpu",
                                 f"is {m_raw} but hyperparameters.micro_batch_size is {m_hp}; "
                                 "remove one or make them equal", "conflict"))
        return hp.global_batch_size, 1, 1
    m = m_raw if m_raw is not None else m_hp
    g_explicit = g_raw is not None or _explicit(hp, "global_batch_size")
    g = g_raw if g_raw is not None else hp.global_batch_size

    if m is not None and a is not None:
        implied = m * a * world
        if implied > MAX_BATCH:
            # The product is stored as the job's global batch, which the trainer re-validates against the bound.
            errors.append(FieldError("deepspeed.config.gradient_accumulation_steps",
                                     f"train_micro_batch_size_per_gpu ({m}) × gradient_accumulation_steps ({a}) × "
                                     f"processes ({world}) = {implied}, above the largest global batch {MAX_BATCH}",
                                     "bound"))
            return min(g, MAX_BATCH), 1, 1
        if g_explicit and implied != g:
            field = "deepspeed.config.train_batch_size" if g_raw is not None else "hyperparameters.global_batch_size"
            fixes = [f"set train_batch_size to {implied}"]
            if g % (m * world) == 0:
                fixes.append(f"or gradient_accumulation_steps to {g // (m * world)}")
            errors.append(FieldError(
                field,
                f"train_batch_size ({g}) must equal train_micro_batch_size_per_gpu ({m}) × "
                f"gradient_accumulation_steps ({a}) × processes ({world}) = {implied}; " + " ".join(fixes), "batch"))
            return g, m, a
        if not g_explicit:
            notes.append(f"global batch {implied} = micro {m} × accumulation {a} × processes {world}")
        return implied, m, a

    if g % world:
        # Name the field the user wrote: the raw config's value wins over the job's when both are given.
        field = "deepspeed.config.train_batch_size" if g_raw is not None else "hyperparameters.global_batch_size"
        errors.append(FieldError(field,
                                 f"{g} is not divisible by the number of processes ({world}); "
                                 f"use a multiple of {world}", "batch"))
        return g, 1, 1
    per_rank = g // world
    if m is not None:
        if per_rank % m:
            ok = [d for d in _divisors_desc(per_rank)][:4]
            field = ("deepspeed.config.train_micro_batch_size_per_gpu" if m_raw is not None
                     else "hyperparameters.micro_batch_size")
            errors.append(FieldError(field,
                                     f"{m} does not divide the per-process batch {per_rank} "
                                     f"(global {g} / {world} processes); accepted: "
                                     f"{', '.join(map(str, ok))} or \"auto\"", "batch"))
            return g, m, 1
        return g, m, per_rank // m
    if a is not None:
        if per_rank % a:
            errors.append(FieldError("deepspeed.config.gradient_accumulation_steps",
                                     f"{a} does not divide the per-process batch {per_rank} (global {g} / {world})",
                                     "batch"))
            return g, 1, a
        m = per_rank // a
        notes.append(f"micro batch auto: {m} = per-process batch {per_rank} / accumulation {a}")
        return g, m, a
    cap = max(1, limits.auto_micro_batch_tokens // hp.seq_len)
    m = next(d for d in _divisors_desc(per_rank) if d <= cap)
    if g_raw is not None and m != per_rank:
        notes.append(f"train_batch_size {g} with no micro batch: {DS} would run micro {per_rank} × accumulation 1 "
                     f"per process; the job runs micro {m} × accumulation {per_rank // m}, the same global batch.")
    notes.append(f"micro batch auto: {m}, the largest divisor of the per-process batch {per_rank} that keeps "
                 f"micro × seq_len ({m * hp.seq_len}) within the {limits.auto_micro_batch_tokens}-token budget; "
                 f"accumulation {per_rank // m} keeps the global batch {g}")
    return g, m, per_rank // m




def render(spec: JobSpec, g: int, m: int, a: int, merger: _Merger | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for a resolved job: everything DeepSpeed reads comes from here.

    Without a raw config the service's own tuning choices fill ZeRO's block; with one, DeepSpeed's defaults
    do (nothing the config left unset is written), so the job runs as DeepSpeed would run that file.
    """
    hp, ds = spec.hyperparameters, spec.deepspeed
    raw = merger.out if merger else None
    adam = dsfields.table()["adam_defaults"]
    params: dict[str, Any] = {"lr": hp.learning_rate, "betas": list(hp.adam_betas), "eps": adam["eps"],
                              "weight_decay": hp.weight_decay}
    optimizer: dict[str, Any] = {"type": "AdamW", "params": params}
    if raw:
        params.update(raw.optimizer_extra)
        optimizer["type"] = raw.optimizer_type or "AdamW"
        if "legacy_fusion" in params:
            optimizer["legacy_fusion"] = params.pop("legacy_fusion")
    cfg: dict[str, Any] = {
        "train_batch_size": g,
        "train_micro_batch_size_per_gpu": m,
        "gradient_accumulation_steps": a,
        "optimizer": optimizer,
        "gradient_clipping": hp.gradient_clipping,
        # Progress goes through the trainer's own events; DeepSpeed's periodic prints would only add noise.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if hp.optimizer != "adamw":
        # The trainer hands DeepSpeed its own optimizer (trainer/optim.py): a config optimizer beside it is an
        # error in DeepSpeed, and ZeRO refuses an optimizer it has not tested unless told it may.
        del cfg["optimizer"]
        cfg["zero_allow_untested_optimizer"] = True
    if ds.precision == "bf16":
        cfg["bf16"] = {"enabled": True, **(raw.bf16_extra if raw else {})}
        if hp.optimizer == "adamw_bf16":
            # ZeRO then keeps its master partitions, gradients and the optimizer's moments in bf16.
            cfg["bf16"].update({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    elif ds.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1, **(raw.fp16_extra if raw else {})}
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1 and not raw:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True})
    if ds.zero_stage == 3 and not raw:
        # Lets DeepSpeed's save_16bit_model write one consolidated state dict.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(ds, key)
        if device != "none":
            block: dict[str, Any] = {"device": device, "pin_memory": True}
            if device == "nvme":
                block["nvme_path"] = ds.nvme_path
            if raw:
                block.update(raw.offload_extra[key])
            zero[key] = block
    if raw:
        zero.update(raw.zero_extra)
        cfg.update(raw.passthrough)
    cfg["zero_optimization"] = zero
    return cfg


def optimizer_problems(spec: JobSpec, merger: _Merger | None) -> list[FieldError]:
    """Why the job's optimizer cannot run with its DeepSpeed settings (read after a raw config's merge)."""
    hp, ds = spec.hyperparameters, spec.deepspeed
    if hp.optimizer == "adamw":
        return []
    field, name = "hyperparameters.optimizer", f'"{hp.optimizer}"'
    errors: list[FieldError] = []
    if ds.precision != "bf16":
        errors.append(FieldError(field, f'{name} keeps the master weights in bf16, so it needs deepspeed.precision '
                                        f'"bf16" (got "{ds.precision}"); set precision to "bf16" or optimizer to '
                                        '"adamw"', "conflict"))
    if ds.zero_stage == 0:
        errors.append(FieldError(field, f"{name} needs ZeRO stage 1, 2 or 3 (got stage 0): only {DS}'s ZeRO "
                                        "optimizers keep master weights in bf16; set deepspeed.zero_stage to 1, 2 or 3 "
                                        'or optimizer to "adamw"', "conflict"))
    if ds.offload_optimizer != "none":
        errors.append(FieldError(field, f"{name} is the trainer's own optimizer, and {DS} steps offloaded optimizer "
                                        f'state only with its own CPU Adam (got offload_optimizer '
                                        f'"{ds.offload_optimizer}"); set deepspeed.offload_optimizer to "none" or '
                                        'optimizer to "adamw" (accepted with offload: "adamw")', "conflict"))
    if merger is not None and merger.out.optimizer_type is not None:
        errors.append(FieldError("deepspeed.config.optimizer",
                                 f"sets {DS}'s optimizer, but hyperparameters.optimizer is {name}, which the trainer "
                                 'builds itself; remove the optimizer block or set optimizer to "adamw"', "conflict"))
    return errors


def _pipeline_problems(spec: JobSpec, merger: _Merger | None) -> list[FieldError]:
    """A raw config may set the ZeRO stage after the job's own fields were checked (trainer/stages.py)."""
    stage = spec.deepspeed.zero_stage
    if merger is None or stage < 2:
        return []
    return [FieldError("deepspeed.config.zero_optimization.stage",
                       f"is {stage}, but resources.pipeline_stages {spec.resources.pipeline_stages} needs ZeRO stage "
                       "0 or 1: DeepSpeed's pipeline engine does not partition gradients or parameters; set the "
                       "stage to 1 or pipeline_stages to 1", "conflict")]


def resolve(spec: JobSpec, *, limits: ResolveLimits | None = None) -> ResolvedJob:
    """Make every choice a job leaves open, or raise SpecError naming each bad field."""
    limits = limits or ResolveLimits()
    spec = spec.model_copy(deep=True)
    errors: list[FieldError] = []
    notes: list[str] = []
    merger: _Merger | None = None
    raw_batch: dict[str, int | None] = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None,
                                        "gradient_accumulation_steps": None}
    if spec.deepspeed.config is not None:
        merger = _Merger(spec, copy.deepcopy(spec.deepspeed.config))
        merger.run()
        errors += merger.errors
        notes += merger.notes
        raw_batch = merger.batch
        # Re-check the cross-field rules on the merged values (the raw config may set stage and offload).
        ds = spec.deepspeed
        if ds.offload_param != "none" and ds.zero_stage != 3:
            errors.append(FieldError(
                "deepspeed.config.zero_optimization.offload_param",
                f"needs ZeRO stage 3 (got stage {ds.zero_stage}): only stage 3 partitions parameters; "
                "set zero_optimization.stage to 3 or remove offload_param", "conflict"))
        zero_errors = any(e.field.startswith("deepspeed.config.zero_optimization") for e in errors)
        # Only for an otherwise valid block: a misspelt key there is the error worth reading first.
        if ds.offload_optimizer != "none" and ds.zero_stage == 0 and not zero_errors:
            errors.append(FieldError(
                "deepspeed.config.zero_optimization.offload_optimizer",
                "needs ZeRO stage 1, 2 or 3 (got stage 0, DeepSpeed's default): at stage 0 DeepSpeed ignores it; "
                "set zero_optimization.stage or remove offload_optimizer", "conflict"))
        ratio = merger.out.offload_extra["offload_optimizer"].get("ratio", 1.0)
        field = "deepspeed.config.zero_optimization.offload_optimizer.ratio"
        if ratio < 1.0 and (ds.zero_stage != 3 or ds.offload_optimizer != "cpu"):
            errors.append(FieldError(field, f"below 1 splits the optimizer between GPU and CPU, which only ZeRO "
                                            f"stage 3 with offload_optimizer \"cpu\" does (got stage "
                                            f"{ds.zero_stage}, offload_optimizer {ds.offload_optimizer!r}); "
                                            "set zero_optimization.stage to 3 or remove ratio", "conflict"))
        for key in ("offload_optimizer", "offload_param"):
            if getattr(ds, key) == "nvme" and not ds.nvme_path:
                errors.append(FieldError(f"deepspeed.config.zero_optimization.{key}.nvme_path",
                                         'offload to "nvme" needs nvme_path, a directory under the NVMe root'))
    errors += optimizer_problems(spec, merger)
    world = spec.resources.num_gpus * spec.resources.num_nodes  # every node runs num_gpus ranks
    stages = spec.resources.pipeline_stages
    if stages > 1:
        # The batch is split over the data-parallel ranks only; each pipeline runs its micro batches in turn.
        errors += _pipeline_problems(spec, merger)
        notes.append(f"pipeline_stages {stages}: data-parallel degree {max(1, world // stages)} = {world} processes "
                     f"/ {stages} stages; the batch fields below count data-parallel ranks as processes")
    dp = world // stages if world % stages == 0 else world
    g, m, a = _resolve_batch(spec, dp, raw_batch, limits, errors, notes, merger)
    hp = spec.hyperparameters
    if hp.max_steps is not None and hp.warmup_steps > hp.max_steps:
        errors.append(FieldError("hyperparameters.warmup_steps",
                                 f"{hp.warmup_steps} is more than max_steps ({hp.max_steps})", "bound"))
    ck = spec.checkpointing
    if ck.every_steps is not None and hp.max_steps is not None and ck.every_steps > hp.max_steps:
        notes.append(f"checkpointing.every_steps {ck.every_steps} > max_steps {hp.max_steps}: only the final export")
    if errors:
        raise SpecError(errors)
    auto = hp.micro_batch_size == AUTO and raw_batch["train_micro_batch_size_per_gpu"] is None \
        and raw_batch["gradient_accumulation_steps"] is None
    hp.micro_batch_size = m
    hp.global_batch_size = g
    cfg = render(spec, g, m, a, merger)
    # The last word before a 201: what DeepSpeed's own parser checks, at this job's world size.
    problems = dsfields.check_rendered(cfg, dp)
    if problems:
        raise SpecError([FieldError("deepspeed.config", f"{DS} would refuse the rendered config: {p}", "value")
                         for p in problems])
    return ResolvedJob(spec=spec, world_size=world, micro_batch_size=m, gradient_accumulation_steps=a,
                       deepspeed_config=cfg, notes=notes, micro_batch_auto=auto)
