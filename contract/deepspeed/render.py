"""The DeepSpeed JSON of a resolved job: everything DeepSpeed reads is written here, from the job and what a
raw config merged into it."""

from __future__ import annotations

from typing import Any

from contract.deepspeed import fields
from contract.deepspeed.merge import Merger
from contract.spec import JobSpec


def render(spec: JobSpec, g: int, m: int, a: int, merger: Merger | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for a resolved job: everything DeepSpeed reads comes from here.

    Without a raw config the service's own tuning choices fill ZeRO's block; with one, DeepSpeed's defaults
    do (nothing the config left unset is written), so the job runs as DeepSpeed would run that file.
    """
    hp, ds = spec.hyperparameters, spec.deepspeed
    raw = merger.out if merger else None
    adam = fields.table()["adam_defaults"]
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
            if raw:
                block.update(raw.offload_extra[key])
            if device == "nvme":
                # The job's one NVMe folder (a raw config's own nvme_path was adopted into it by the merge); the
                # trainer points it at the attempt's swap folder beneath (trainer/swap.py).
                block["nvme_path"] = ds.nvme_path
            zero[key] = block
    if raw:
        zero.update(raw.zero_extra)
        cfg.update(raw.passthrough)
    cfg["zero_optimization"] = zero
    return cfg
