"""Resolve a job (batch sizes, `auto`, a raw DeepSpeed config) and render its DeepSpeed JSON.

Pure Python, no torch: the API runs it to validate and to show the user every value chosen, and the
trainer gets the same result. A raw DeepSpeed config is read field by field: known fields are checked
and merged into the job, `"auto"` is resolved, contradictions are refused with the fix, and anything
that writes files, opens connections or imports code is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from trainer.spec import JobSpec, ResolvedJob

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

    def adopt(self, section: Any, name: str, value: Any, raw_field: str, job_field: str) -> None:
        """Take a raw value unless the job set the same thing explicitly to something else."""
        current = getattr(section, name)
        if _explicit(section, name) and current != value:
            self.err(raw_field, f"is {value!r} but {job_field} is {current!r}; remove one or make them equal")
            return
        setattr(section, name, value)

    def run(self) -> None:
        for key, value in self.raw.items():
            if key in DANGEROUS_KEYS:
                self.err(key, f"is not accepted: it {DANGEROUS_KEYS[key]}")
            elif key in PASSTHROUGH_TOP:
                self.passthrough[key] = value
            elif key in MERGED_TOP:
                getattr(self, f"_merge_{key}")(value)
            else:
                accepted = sorted(PASSTHROUGH_TOP | MERGED_TOP)
                self.err(key, f"is not a known DeepSpeed field; accepted: {', '.join(accepted)}")

    def _batch_field(self, key: str, value: Any) -> None:
        if _is_auto(value):
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.err(key, f'must be a positive integer or "auto", got {value!r}')
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
        if not isinstance(v, (int, float)) or v < 0:
            self.err("gradient_clipping", f'must be a number >= 0 or "auto", got {v!r}')
            return
        self.adopt(self.spec.hyperparameters, "gradient_clipping", float(v), "gradient_clipping",
                   "hyperparameters.gradient_clipping")

    def _merge_optimizer(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("optimizer", "must be an object with type and params")
            return
        kind = str(v.get("type", "AdamW"))
        if kind.lower() not in OPTIMIZER_TYPES:
            self.err("optimizer.type", f"{kind!r} is not supported; accepted: Adam, AdamW")
        for k in v:
            if k not in ("type", "params"):
                self.err(f"optimizer.{k}", "is not a known field; accepted: type, params")
        params = v.get("params", {}) or {}
        if not isinstance(params, dict):
            self.err("optimizer.params", "must be an object")
            return
        hp = self.spec.hyperparameters
        for k, pv in params.items():
            if k not in OPTIMIZER_PARAMS:
                self.err(f"optimizer.params.{k}", f"is not accepted; accepted: {', '.join(sorted(OPTIMIZER_PARAMS))}")
            elif _is_auto(pv) or k in ("torch_adam", "adam_w_mode", "eps"):
                continue
            elif k == "lr":
                self._number(f"optimizer.params.{k}", pv, lambda x: self.adopt(
                    hp, "learning_rate", x, "optimizer.params.lr", "hyperparameters.learning_rate"))
            elif k == "weight_decay":
                self._number(f"optimizer.params.{k}", pv, lambda x: self.adopt(
                    hp, "weight_decay", x, "optimizer.params.weight_decay", "hyperparameters.weight_decay"))
            elif k == "betas":
                if not (isinstance(pv, (list, tuple)) and len(pv) == 2):
                    self.err("optimizer.params.betas", "must be a list of two numbers")
                else:
                    self.adopt(hp, "adam_betas", (float(pv[0]), float(pv[1])), "optimizer.params.betas",
                               "hyperparameters.adam_betas")

    def _number(self, field: str, v: Any, then: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.err(field, f'must be a number or "auto", got {v!r}')
        else:
            then(float(v))

    def _merge_scheduler(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("scheduler", "must be an object with type and params")
            return
        kind = str(v.get("type", ""))
        schedule = SCHEDULER_TYPES.get(kind.lower())
        if schedule is None:
            self.err("scheduler.type", f"{kind!r} is not supported; accepted: WarmupLR, WarmupDecayLR, WarmupCosineLR")
            return
        hp = self.spec.hyperparameters
        self.adopt(hp, "lr_schedule", schedule, "scheduler.type", "hyperparameters.lr_schedule")
        for k, pv in (v.get("params") or {}).items():
            if k not in SCHEDULER_PARAMS:
                self.err(f"scheduler.params.{k}", f"is not accepted; accepted: {', '.join(sorted(SCHEDULER_PARAMS))}")
            elif _is_auto(pv):
                continue
            elif k == "warmup_num_steps":
                if not isinstance(pv, int) or pv < 0:
                    self.err("scheduler.params.warmup_num_steps", "must be an integer >= 0")
                else:
                    self.adopt(hp, "warmup_steps", pv, "scheduler.params.warmup_num_steps",
                               "hyperparameters.warmup_steps")
            elif k == "warmup_max_lr":
                self._number("scheduler.params.warmup_max_lr", pv, lambda x: self.adopt(
                    hp, "learning_rate", x, "scheduler.params.warmup_max_lr", "hyperparameters.learning_rate"))
            elif k == "total_num_steps":
                self.notes.append("scheduler.params.total_num_steps ignored: the schedule spans the job's total steps")
        # The trainer owns the schedule (it must span the steps the data yields), so no block is rendered.

    def _merge_precision(self, key: str, v: Any) -> None:
        if not isinstance(v, dict):
            self.err(key, 'must be an object such as {"enabled": true}')
            return
        for k in v:
            if k not in FP16_KEYS:
                self.err(f"{key}.{k}", f"is not accepted; accepted: {', '.join(sorted(FP16_KEYS))}")
        enabled = v.get("enabled", False)
        ds = self.spec.deepspeed
        if enabled is True:
            self.adopt(ds, "precision", key, f"{key}.enabled", "deepspeed.precision")
        elif not (enabled is False or _is_auto(enabled)):
            self.err(f"{key}.enabled", f'must be true, false or "auto", got {enabled!r}')
        if key == "fp16":
            self.fp16_extra = {k: x for k, x in v.items() if k != "enabled" and k in FP16_KEYS and not _is_auto(x)}

    def _merge_fp16(self, v: Any) -> None:
        self._merge_precision("fp16", v)

    def _merge_bf16(self, v: Any) -> None:
        self._merge_precision("bf16", v)

    def _merge_activation_checkpointing(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("activation_checkpointing", "must be an object")
            return
        for k in v:
            if k not in ACTIVATION_CKPT_KEYS:
                self.err(f"activation_checkpointing.{k}",
                         f"is not accepted; accepted: {', '.join(sorted(ACTIVATION_CKPT_KEYS))}")
        self.adopt(self.spec.deepspeed, "activation_checkpointing", True, "activation_checkpointing",
                   "deepspeed.activation_checkpointing")

    def _merge_zero_optimization(self, v: Any) -> None:
        if not isinstance(v, dict):
            self.err("zero_optimization", "must be an object")
            return
        ds = self.spec.deepspeed
        for k, zv in v.items():
            if k == "stage":
                if zv not in (0, 1, 2, 3):
                    self.err("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {zv!r}")
                else:
                    self.adopt(ds, "zero_stage", zv, "zero_optimization.stage", "deepspeed.zero_stage")
            elif k in ("offload_optimizer", "offload_param"):
                self._merge_offload(k, zv)
            elif k in ZERO_TUNING:
                if _is_auto(zv):
                    self.notes.append(f"zero_optimization.{k}: auto resolved to DeepSpeed's default")
                else:
                    self.zero_extra[k] = zv
            else:
                accepted = sorted(ZERO_TUNING | ZERO_MERGED)
                self.err(f"zero_optimization.{k}", f"is not accepted; accepted: {', '.join(accepted)}")

    def _merge_offload(self, key: str, v: Any) -> None:
        if v is None:
            return
        if not isinstance(v, dict):
            self.err(f"zero_optimization.{key}", 'must be an object such as {"device": "cpu"}')
            return
        device = v.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            self.err(f"zero_optimization.{key}.device", f'must be "none", "cpu" or "nvme", got {device!r}')
            return
        for k in v:
            if k not in OFFLOAD_KEYS:
                self.err(f"zero_optimization.{key}.{k}",
                         f"is not accepted; accepted: {', '.join(sorted(OFFLOAD_KEYS))}")
        if "nvme_path" in v:
            self.adopt(self.spec.deepspeed, "nvme_path", v["nvme_path"], f"zero_optimization.{key}.nvme_path",
                       "deepspeed.nvme_path")
        self.adopt(self.spec.deepspeed, key, device, f"zero_optimization.{key}.device", f"deepspeed.{key}")
        self.offload_extra[key] = {k: x for k, x in v.items() if k in OFFLOAD_KEYS - {"device", "nvme_path"}}


def _divisors_desc(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


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
