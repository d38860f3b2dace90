"""Resolve a job (batch sizes, `auto`, a raw DeepSpeed config) and render its DeepSpeed JSON.

Pure Python, no torch: the API runs it to validate and to show the user every value chosen, and the
trainer gets the same result. A raw DeepSpeed config is read field by field: known fields are checked
and merged into the job, `"auto"` is resolved, contradictions are refused with the fix, and anything
that writes files, opens connections or imports code is refused.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError

from trainer.spec import MAX_BATCH, MAX_STEPS, JobSpec, ResolvedJob

AUTO = "auto"

# Fields that would make DeepSpeed write files, talk to a service or run an autotuner on the node.
DANGEROUS_KEYS: dict[str, str] = {
    "flops_profiler": "writes profiler output files on the worker",
    "tensorboard": "writes event files and is a logging backend; use the job's event stream",
    "wandb": "opens network connections to a logging service",
    "csv_monitor": "writes files on the worker",
    "comet": "opens network connections to a logging service",
    "monitor_config": "configures logging backends that write files or open connections",
    "autotuning": "launches extra training runs and writes result files",
    "comms_logger": "writes communication logs on the worker",
    "nebula": "writes checkpoints to a service outside the job's directory",
    "elasticity": "changes the batch size at run time, which breaks exact resume",
    "data_efficiency": "imports data pipelines by name",
    "compression_training": "imports and rewrites model modules",
    "aio": "tunes NVMe I/O; set offload with deepspeed.offload_optimizer/offload_param instead",
}

PASSTHROUGH_TOP = {"steps_per_print", "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
                   "zero_allow_untested_optimizer", "communication_data_type", "seq_parallel_communication_data_type"}
MERGED_TOP = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
              "scheduler", "fp16", "bf16", "zero_optimization", "gradient_clipping", "activation_checkpointing"}

ZERO_TUNING = {"overlap_comm", "reduce_scatter", "contiguous_gradients", "reduce_bucket_size",
               "allgather_bucket_size", "allgather_partitions", "round_robin_gradients", "sub_group_size",
               "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
               "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
               "gather_16bit_weights_on_model_save", "memory_efficient_linear", "load_from_fp32_weights",
               "elastic_checkpoint", "ignore_unused_parameters", "zero_hpz_partition_size", "zero_quantized_weights",
               "zero_quantized_gradients", "use_multi_rank_bucket_allreduce"}
ZERO_MERGED = {"stage", "offload_optimizer", "offload_param"}
OFFLOAD_KEYS = {"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "fast_init",
                "pipeline_read", "pipeline_write", "ratio"}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"}
OPTIMIZER_TYPES = {"adam": "AdamW", "adamw": "AdamW"}
OPTIMIZER_PARAMS = {"lr", "weight_decay", "betas", "eps", "torch_adam", "adam_w_mode"}
SCHEDULER_TYPES = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
SCHEDULER_PARAMS = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                    "warmup_min_ratio", "cos_min_ratio", "last_batch_iteration"}
ACTIVATION_CKPT_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}


@dataclass(frozen=True)
class Kind:
    """What one raw DeepSpeed field must hold: DeepSpeed reads these only at launch, so a wrong type found
    here is a 422 naming the field instead of a failed job minutes later."""

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
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        # DeepSpeed's own schema reads sizes as integers but accepts JSON's 5e8 for them.
        whole = number and (isinstance(v, int) or (self.type == "size" and float(v).is_integer()))
        if self.type == "number" and number and self.lo <= v <= self.hi:
            return None
        if self.type in ("int", "size") and whole and self.lo <= v <= self.hi:
            return None
        what = "a number" if self.type == "number" else "an integer"
        return f"must be {what} from {_num(self.lo)} to {_num(self.hi)}"


BOOL = Kind("bool")
SIZE = Kind("size")
DTYPE = Kind("str", choices=("fp16", "bf16", "fp32"))
PASSTHROUGH_KINDS: dict[str, Kind] = {
    "steps_per_print": Kind("int", 1), "wall_clock_breakdown": BOOL, "prescale_gradients": BOOL,
    "gradient_predivide_factor": Kind("number", 0, 1e6), "zero_allow_untested_optimizer": BOOL,
    "communication_data_type": DTYPE, "seq_parallel_communication_data_type": DTYPE,
}
ZERO_KINDS: dict[str, Kind] = {
    **{k: BOOL for k in ("overlap_comm", "reduce_scatter", "contiguous_gradients", "allgather_partitions",
                         "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
                         "gather_16bit_weights_on_model_save", "memory_efficient_linear", "load_from_fp32_weights",
                         "elastic_checkpoint", "ignore_unused_parameters", "zero_quantized_weights",
                         "zero_quantized_gradients", "use_multi_rank_bucket_allreduce")},
    **{k: SIZE for k in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
                         "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                         "stage3_param_persistence_threshold")},
    "zero_hpz_partition_size": Kind("int", 1, 1024),
}
OFFLOAD_KINDS: dict[str, Kind] = {
    "pin_memory": BOOL, "buffer_count": Kind("int", 1, 1024), "buffer_size": SIZE, "max_in_cpu": SIZE,
    "fast_init": BOOL, "pipeline_read": BOOL, "pipeline_write": BOOL, "ratio": Kind("number", 0, 1),
}
FP16_KINDS: dict[str, Kind] = {
    "auto_cast": BOOL, "loss_scale": Kind("number", 0, 2**32), "initial_scale_power": Kind("int", 0, 32),
    "loss_scale_window": Kind("int", 1, 1e9), "hysteresis": Kind("int", 1, 1e6), "consecutive_hysteresis": BOOL,
    "min_loss_scale": Kind("number", 0, 2**32),
}
ACTIVATION_CKPT_KINDS: dict[str, Kind] = {
    "partition_activations": BOOL, "cpu_checkpointing": BOOL, "contiguous_memory_optimization": BOOL,
    "number_checkpoints": Kind("int", 1, 1e6), "synchronize_checkpoint_boundary": BOOL, "profile": BOOL,
}
# Optimizer and scheduler fields the job does not take over: still checked, then left to the trainer's defaults.
OPTIMIZER_KINDS: dict[str, Kind] = {"eps": Kind("number", 0, 1), "torch_adam": BOOL, "adam_w_mode": BOOL}
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


@cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """Checks a raw value against the job field it sets, with that field's own type and bounds."""
    info = model.model_fields[name]
    return TypeAdapter(Annotated[info.annotation, info])


@dataclass
class FieldError:
    field: str
    message: str


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


class _Merger:
    """Walks a raw DeepSpeed config and folds each field into the job spec, collecting errors."""

    def __init__(self, spec: JobSpec, raw: dict[str, Any]) -> None:
        self.spec = spec
        self.raw = raw
        self.errors: list[FieldError] = []
        self.notes: list[str] = []
        self.passthrough: dict[str, Any] = {}
        self.zero_extra: dict[str, Any] = {}
        self.offload_extra: dict[str, dict[str, Any]] = {"offload_optimizer": {}, "offload_param": {}}
        self.fp16_extra: dict[str, Any] = {}
        self.batch: dict[str, int | None] = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None,
                                             "gradient_accumulation_steps": None}

    def err(self, field: str, message: str) -> None:
        self.errors.append(FieldError(f"deepspeed.config.{field}", message))

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
                                f"got {_show(value)}")
            return
        current = getattr(section, name)
        if _explicit(section, name) and current != value:
            self.err(raw_field, f"is {_show(value)} but {job_field} is {current!r}; remove one or make them equal")
            return
        setattr(section, name, value)

    def knob(self, field: str, value: Any, kind: Kind) -> bool:
        """Whether a tuning value is kept: "auto" means DeepSpeed's default, a wrong one is an error."""
        if _is_auto(value):
            self.notes.append(f"{field}: auto resolved to DeepSpeed's default")
            return False
        problem = kind.problem(value)
        if problem:
            self.err(field, f"{problem}, got {_show(value)}")
            return False
        return True

    def section(self, field: str, value: Any, accepted: set[str] | dict[str, Kind]) -> dict[str, Any] | None:
        """A nested object, its unknown keys refused; None (and an error) when it is not an object."""
        if not isinstance(value, dict):
            self.err(field, f"must be an object, got {_show(value)}")
            return None
        for k in value:
            if k not in accepted:
                self.err(f"{field}.{k}", f"is not accepted; accepted: {', '.join(sorted(accepted))}")
        return value

    def run(self) -> None:
        for key, value in self.raw.items():
            if key in DANGEROUS_KEYS:
                self.err(key, f"is not accepted: it {DANGEROUS_KEYS[key]}")
            elif key in PASSTHROUGH_TOP:
                if self.knob(key, value, PASSTHROUGH_KINDS[key]):
                    self.passthrough[key] = value
            elif key in MERGED_TOP:
                getattr(self, f"_merge_{key}")(value)
            else:
                accepted = sorted(PASSTHROUGH_TOP | MERGED_TOP)
                self.err(key, f"is not a known DeepSpeed field; accepted: {', '.join(accepted)}")

    def _batch_field(self, key: str, value: Any) -> None:
        if _is_auto(value):
            return
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BATCH:
            self.err(key, f'must be an integer from 1 to {MAX_BATCH} or "auto", got {_show(value)}')
            return
        self.batch[key] = value

    def _merge_train_batch_size(self, v: Any) -> None:
        self._batch_field("train_batch_size", v)

    def _merge_train_micro_batch_size_per_gpu(self, v: Any) -> None:
        self._batch_field("train_micro_batch_size_per_gpu", v)

    def _merge_gradient_accumulation_steps(self, v: Any) -> None:
        self._batch_field("gradient_accumulation_steps", v)

    def _merge_gradient_clipping(self, v: Any) -> None:
        if _is_auto(v):
            return
        self._number("gradient_clipping", v, lambda x: self.adopt(
            self.spec.hyperparameters, "gradient_clipping", x, "gradient_clipping",
            "hyperparameters.gradient_clipping"))

    def _merge_optimizer(self, v: Any) -> None:
        v = self.section("optimizer", v, {"type", "params"})
        if v is None:
            return
        kind = v.get("type", "AdamW")
        if not isinstance(kind, str) or kind.lower() not in OPTIMIZER_TYPES:
            self.err("optimizer.type", f"{_show(kind)} is not supported; accepted: Adam, AdamW")
        params = self.section("optimizer.params", v.get("params") or {}, OPTIMIZER_PARAMS)
        if params is None:
            return
        hp = self.spec.hyperparameters
        for k, pv in params.items():
            field = f"optimizer.params.{k}"
            if k not in OPTIMIZER_PARAMS or _is_auto(pv):
                continue
            if k in OPTIMIZER_KINDS:
                self.knob(field, pv, OPTIMIZER_KINDS[k])
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

    def _number(self, field: str, v: Any, then: Any) -> None:
        if not _finite_number(v):
            self.err(field, f'must be a number or "auto", got {_show(v)}')
        else:
            then(float(v))

    def _merge_scheduler(self, v: Any) -> None:
        v = self.section("scheduler", v, {"type", "params"})
        if v is None:
            return
        kind = v.get("type", "")
        schedule = SCHEDULER_TYPES.get(kind.lower()) if isinstance(kind, str) else None
        if schedule is None:
            self.err("scheduler.type", f"{_show(kind)} is not supported; accepted: WarmupLR, WarmupDecayLR, "
                                       "WarmupCosineLR")
            return
        hp = self.spec.hyperparameters
        self.adopt(hp, "lr_schedule", schedule, "scheduler.type", "hyperparameters.lr_schedule")
        params = self.section("scheduler.params", v.get("params") or {}, SCHEDULER_PARAMS)
        if params is None:
            return
        for k, pv in params.items():
            field = f"scheduler.params.{k}"
            if k not in SCHEDULER_PARAMS or _is_auto(pv):
                continue
            if k == "warmup_num_steps":
                if isinstance(pv, bool) or not isinstance(pv, int) or not 0 <= pv <= MAX_STEPS:
                    self.err(field, f"must be an integer from 0 to {MAX_STEPS}, got {_show(pv)}")
                else:
                    self.adopt(hp, "warmup_steps", pv, field, "hyperparameters.warmup_steps")
            elif k == "warmup_max_lr":
                self._number(field, pv, lambda x: self.adopt(
                    hp, "learning_rate", x, "scheduler.params.warmup_max_lr", "hyperparameters.learning_rate"))
            elif self.knob(field, pv, SCHEDULER_KINDS[k]) and k == "total_num_steps":
                self.notes.append("scheduler.params.total_num_steps ignored: the schedule spans the job's total steps")
        # The trainer owns the schedule (it must span the steps the data yields), so no block is rendered.

    def _merge_precision(self, key: str, v: Any) -> None:
        v = self.section(key, v, FP16_KEYS)
        if v is None:
            return
        kept = {k: x for k, x in v.items() if k in FP16_KINDS and self.knob(f"{key}.{k}", x, FP16_KINDS[k])}
        enabled = v.get("enabled", False)
        ds = self.spec.deepspeed
        if enabled is True:
            self.adopt(ds, "precision", key, f"{key}.enabled", "deepspeed.precision")
        elif not (enabled is False or _is_auto(enabled)):
            self.err(f"{key}.enabled", f'must be true, false or "auto", got {_show(enabled)}')
        if key == "fp16":
            self.fp16_extra = kept

    def _merge_fp16(self, v: Any) -> None:
        self._merge_precision("fp16", v)

    def _merge_bf16(self, v: Any) -> None:
        self._merge_precision("bf16", v)

    def _merge_activation_checkpointing(self, v: Any) -> None:
        v = self.section("activation_checkpointing", v, ACTIVATION_CKPT_KEYS)
        if v is None:
            return
        for k, x in v.items():
            if k in ACTIVATION_CKPT_KINDS and x is not None:
                self.knob(f"activation_checkpointing.{k}", x, ACTIVATION_CKPT_KINDS[k])
        self.adopt(self.spec.deepspeed, "activation_checkpointing", True, "activation_checkpointing",
                   "deepspeed.activation_checkpointing")

    def _merge_zero_optimization(self, v: Any) -> None:
        v = self.section("zero_optimization", v, ZERO_TUNING | ZERO_MERGED)
        if v is None:
            return
        ds = self.spec.deepspeed
        for k, zv in v.items():
            if k == "stage":
                # bool is an int in Python (True == 1): refuse it explicitly.
                if isinstance(zv, bool) or zv not in (0, 1, 2, 3):
                    self.err("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {_show(zv)}")
                else:
                    self.adopt(ds, "zero_stage", int(zv), "zero_optimization.stage", "deepspeed.zero_stage")
            elif k in ("offload_optimizer", "offload_param"):
                self._merge_offload(k, zv)
            elif k in ZERO_TUNING and self.knob(f"zero_optimization.{k}", zv, ZERO_KINDS[k]):
                self.zero_extra[k] = zv

    def _merge_offload(self, key: str, v: Any) -> None:
        if v is None:
            return
        if not isinstance(v, dict):
            self.err(f"zero_optimization.{key}", f'must be an object such as {{"device": "cpu"}}, got {_show(v)}')
            return
        device = v.get("device", "none")
        if not isinstance(device, str) or device not in ("none", "cpu", "nvme"):
            self.err(f"zero_optimization.{key}.device", f'must be "none", "cpu" or "nvme", got {_show(device)}')
            return
        self.section(f"zero_optimization.{key}", v, OFFLOAD_KEYS)
        if "nvme_path" in v:
            self.adopt(self.spec.deepspeed, "nvme_path", v["nvme_path"], f"zero_optimization.{key}.nvme_path",
                       "deepspeed.nvme_path")
        self.adopt(self.spec.deepspeed, key, device, f"zero_optimization.{key}.device", f"deepspeed.{key}")
        self.offload_extra[key] = {k: x for k, x in v.items()
                                   if k in OFFLOAD_KINDS and self.knob(f"zero_optimization.{key}.{k}", x,
                                                                       OFFLOAD_KINDS[k])}


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _divisors_desc(n: int) -> list[int]:
    """Every divisor of n, largest first, in O(sqrt n): divisors come in pairs d, n // d."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _resolve_batch(spec: JobSpec, world: int, raw_batch: dict[str, int | None], limits: ResolveLimits,
                   errors: list[FieldError], notes: list[str]) -> tuple[int, int, int]:
    hp = spec.hyperparameters
    g_raw = raw_batch["train_batch_size"]
    m_raw = raw_batch["train_micro_batch_size_per_gpu"]
    a = raw_batch["gradient_accumulation_steps"]

    if g_raw is not None and _explicit(hp, "global_batch_size") and g_raw != hp.global_batch_size:
        errors.append(FieldError("deepspeed.config.train_batch_size",
                                 f"is {g_raw} but hyperparameters.global_batch_size is {hp.global_batch_size}; "
                                 "remove one or make them equal"))
        return hp.global_batch_size, 1, 1
    m_hp = hp.micro_batch_size if isinstance(hp.micro_batch_size, int) else None
    if m_raw is not None and m_hp is not None and m_raw != m_hp:
        errors.append(FieldError("deepspeed.config.train_micro_batch_size_per_gpu",
                                 f"is {m_raw} but hyperparameters.micro_batch_size is {m_hp}; "
                                 "remove one or make them equal"))
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
                                     f"processes ({world}) = {implied}, above the largest global batch {MAX_BATCH}"))
            return min(g, MAX_BATCH), 1, 1
        if g_explicit and implied != g:
            field = "deepspeed.config.train_batch_size" if g_raw is not None else "hyperparameters.global_batch_size"
            fixes = [f"set train_batch_size to {implied}"]
            if g % (m * world) == 0:
                fixes.append(f"or gradient_accumulation_steps to {g // (m * world)}")
            errors.append(FieldError(
                field,
                f"train_batch_size ({g}) must equal train_micro_batch_size_per_gpu ({m}) × "
                f"gradient_accumulation_steps ({a}) × processes ({world}) = {implied}; " + " ".join(fixes)))
            return g, m, a
        if not g_explicit:
            notes.append(f"global batch {implied} = micro {m} × accumulation {a} × processes {world}")
        return implied, m, a

    if g % world:
        # Name the field the user wrote: the raw config's value wins over the job's when both are given.
        field = "deepspeed.config.train_batch_size" if g_raw is not None else "hyperparameters.global_batch_size"
        errors.append(FieldError(field,
                                 f"{g} is not divisible by the number of processes ({world}); "
                                 f"use a multiple of {world}"))
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
                                     f"{', '.join(map(str, ok))} or \"auto\""))
            return g, m, 1
        return g, m, per_rank // m
    if a is not None:
        if per_rank % a:
            errors.append(FieldError("deepspeed.config.gradient_accumulation_steps",
                                     f"{a} does not divide the per-process batch {per_rank} (global {g} / {world})"))
            return g, 1, a
        m = per_rank // a
        notes.append(f"micro batch auto: {m} = per-process batch {per_rank} / accumulation {a}")
        return g, m, a
    cap = max(1, limits.auto_micro_batch_tokens // hp.seq_len)
    m = next(d for d in _divisors_desc(per_rank) if d <= cap)
    notes.append(f"micro batch auto: {m}, the largest divisor of the per-process batch {per_rank} that keeps "
                 f"micro × seq_len ({m * hp.seq_len}) within the {limits.auto_micro_batch_tokens}-token budget; "
                 f"accumulation {per_rank // m} keeps the global batch {g}")
    return g, m, per_rank // m


def render(spec: JobSpec, g: int, m: int, a: int, merger: _Merger | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for a resolved job: everything DeepSpeed reads comes from here."""
    hp, ds = spec.hyperparameters, spec.deepspeed
    cfg: dict[str, Any] = {
        "train_batch_size": g,
        "train_micro_batch_size_per_gpu": m,
        "gradient_accumulation_steps": a,
        "optimizer": {"type": "AdamW", "params": {"lr": hp.learning_rate, "betas": list(hp.adam_betas),
                                                  "eps": 1e-8, "weight_decay": hp.weight_decay}},
        "gradient_clipping": hp.gradient_clipping,
        # Progress goes through the trainer's own events; DeepSpeed's periodic prints would only add noise.
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif ds.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1, **(merger.fp16_extra if merger else {})}
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage >= 1:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True})
    if ds.zero_stage == 3:
        # Lets the trainer export one consolidated 16-bit state dict without a separate conversion step.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(ds, key)
        if device != "none":
            block: dict[str, Any] = {"device": device, "pin_memory": True}
            if device == "nvme":
                block["nvme_path"] = ds.nvme_path
            if merger:
                block.update(merger.offload_extra[key])
            zero[key] = block
    if merger:
        zero.update(merger.zero_extra)
        cfg.update(merger.passthrough)
    cfg["zero_optimization"] = zero
    return cfg


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
                "set zero_optimization.stage to 3 or remove offload_param"))
        ratio = merger.offload_extra["offload_optimizer"].get("ratio", 1.0)
        field = "deepspeed.config.zero_optimization.offload_optimizer.ratio"
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            errors.append(FieldError(field, f"must be a number from 0 to 1 (the share of the optimizer state "
                                            f"kept on the CPU), got {ratio!r}"))
        elif ratio < 1.0 and (ds.zero_stage != 3 or ds.offload_optimizer != "cpu"):
            errors.append(FieldError(field, f"below 1 splits the optimizer between GPU and CPU, which only ZeRO "
                                            f"stage 3 with offload_optimizer \"cpu\" does (got stage "
                                            f"{ds.zero_stage}, offload_optimizer {ds.offload_optimizer!r}); "
                                            "set zero_optimization.stage to 3 or remove ratio"))
        for key in ("offload_optimizer", "offload_param"):
            if getattr(ds, key) == "nvme" and not ds.nvme_path:
                errors.append(FieldError(f"deepspeed.config.zero_optimization.{key}.nvme_path",
                                         'offload to "nvme" needs nvme_path, a directory under the NVMe root'))
    world = spec.resources.num_gpus
    g, m, a = _resolve_batch(spec, world, raw_batch, limits, errors, notes)
    hp = spec.hyperparameters
    if hp.max_steps is not None and hp.warmup_steps > hp.max_steps:
        errors.append(FieldError("hyperparameters.warmup_steps",
                                 f"{hp.warmup_steps} is more than max_steps ({hp.max_steps})"))
    ck = spec.checkpointing
    if ck.every_steps is not None and hp.max_steps is not None and ck.every_steps > hp.max_steps:
        notes.append(f"checkpointing.every_steps {ck.every_steps} > max_steps {hp.max_steps}: only the final export")
    if errors:
        raise SpecError(errors)
    auto = hp.micro_batch_size == AUTO and raw_batch["train_micro_batch_size_per_gpu"] is None \
        and raw_batch["gradient_accumulation_steps"] is None
    hp.micro_batch_size = m
    hp.global_batch_size = g
    return ResolvedJob(spec=spec, world_size=world, micro_batch_size=m, gradient_accumulation_steps=a,
                       deepspeed_config=render(spec, g, m, a, merger), notes=notes, micro_batch_auto=auto)
