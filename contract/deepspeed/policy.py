"""What the service does with each field of a raw DeepSpeed config: refuse it (it writes files, opens
connections, or runs a feature the trainer does not run), merge it into the job, pass it through, or accept and
ignore it; and the service's own bound on each value it passes through (`Kind`).

tests/test_dsconfig.py holds every top-level key DeepSpeed reads to one of these policies.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

from contract.deepspeed import fields

AUTO = "auto"
DS = f"DeepSpeed {fields.version()}"

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

# DeepSpeed's checkpoint block (the trainer sets its load_universal: trainer/elastic.py); spelled like the
# `checkpoint` event kind, so named here.
CHECKPOINT = "checkpoint"

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
    CHECKPOINT: "checkpoint engine options (the service writes, validates and loads its own checkpoints)",
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
        number = finite_number(v)
        # DeepSpeed's own schema reads sizes as integers but accepts JSON's 5e8 for them.
        whole = number and (isinstance(v, int) or (self.type == "size" and float(v).is_integer()))
        if self.type == "number" and number and self.lo <= v <= self.hi:
            return None
        if self.type in ("int", "size") and whole and self.lo <= v <= self.hi:
            return None
        what = "a number" if self.type == "number" else "an integer"
        return f"must be {what} from {num(self.lo)} to {num(self.hi)}"


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
# Keyed by DeepSpeed's canonical names (contract/deepspeed/deepspeed_fields.json).
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


def num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def finite_number(v: Any) -> bool:
    """A JSON number a 64-bit float holds. JSON integers have no size limit, and math.isfinite or float() raise
    OverflowError on one beyond the float range: such an integer is compared, never converted."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, int):
        return -sys.float_info.max <= v <= sys.float_info.max
    return math.isfinite(v)
