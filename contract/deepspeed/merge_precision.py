"""The fp16, bf16 and activation_checkpointing sections of a raw DeepSpeed config, and the job's precision
where the config enables neither or both."""

from __future__ import annotations

from typing import Any

from contract.deepspeed import fields
from contract.deepspeed.merge_base import MergeState, explicit, is_auto, show
from contract.deepspeed.policy import ACTIVATION_CKPT_KINDS, DS, FP16_KINDS, UNRUN_PRECISION


def merge_precision(m: MergeState, key: str, v: Any) -> None:
    """The "fp16" or "bf16" block."""
    extra = m.out.fp16_extra if key == "fp16" else m.out.bf16_extra
    state: dict[str, Any] = {"enabled": False}

    def handle(f: fields.Field, where: str, x: Any) -> None:
        if f.name == "enabled":
            if x is True or x is False or is_auto(x):
                state["enabled"] = x
            else:
                m.err(where, f'must be true, false or "auto", got {show(x)}')
        elif f.name in UNRUN_PRECISION:
            if x is not f.default and m.knob(where, x, None, f):
                m.err(where, f"is {DS}'s {UNRUN_PRECISION[f.name]}, which this service does not run", "unrun")
        elif m.knob(where, x, FP16_KINDS.get(f.name), f):
            extra[f.name] = x

    m.model_block(key, key, v, handle)
    m.out.precision_blocks[key] = state["enabled"]


def merge_activation_checkpointing(m: MergeState, v: Any) -> None:
    if not isinstance(v, dict):
        m.err("activation_checkpointing", f"must be an object, got {show(v)}")
        return
    known = fields.dict_section_keys("activation_checkpointing")
    for k, x in v.items():
        if k not in known:
            m.unknown(f"activation_checkpointing.{k}", k, set(known), "activation_checkpointing")
        elif x is not None:
            m.knob(f"activation_checkpointing.{k}", x, ACTIVATION_CKPT_KINDS.get(k))
    m.adopt(m.spec.deepspeed, "activation_checkpointing", True, "activation_checkpointing",
            "deepspeed.activation_checkpointing")
    m.notes.append("activation_checkpointing turns on the model's own gradient checkpointing; its settings "
                   "are for models that call deepspeed.checkpointing, which the trainer's models do not, so "
                   "they are not rendered.")


def finish_precision(m: MergeState) -> None:
    blocks, ds = m.out.precision_blocks, m.spec.deepspeed
    on = [k for k, v in blocks.items() if v is True]
    auto = [k for k, v in blocks.items() if is_auto(v)]
    if len(on) == 2:
        m.err("bf16.enabled", f"and fp16.enabled are both true; {DS} refuses both at once", "conflict")
    elif on:
        m.adopt(ds, "precision", on[0], f"{on[0]}.enabled", "deepspeed.precision")
    elif auto:
        if not explicit(ds, "precision"):
            m.notes.append(f'{" and ".join(k + ".enabled" for k in auto)} "auto": the job\'s precision '
                           f"{ds.precision} applies (deepspeed.precision).")
    elif explicit(ds, "precision"):
        if ds.precision != "fp32":
            m.notes.append(f"the config enables neither fp16 nor bf16, so {DS} would train in fp32; "
                           f"deepspeed.precision {ds.precision} applies.")
    else:
        ds.precision = "fp32"
        m.notes.append(f"the config enables neither fp16 nor bf16: the job trains in fp32, as {DS} would.")
