"""The zero_optimization section of a raw DeepSpeed config: the stage, the two offload blocks (their device and
NVMe folder become the job's fields), and ZeRO's tuning values."""

from __future__ import annotations

from typing import Any

from contract.deepspeed import fields
from contract.deepspeed.merge_base import MergeState, is_auto, show
from contract.deepspeed.policy import DS, OFFLOAD_KINDS, UNRUN_OFFLOAD, UNRUN_ZERO, ZERO_KINDS

# DeepSpeed's deprecated booleans and the offload blocks they were replaced by.
DEPRECATED_OFFLOAD = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))


def merge_zero_optimization(m: MergeState, v: Any) -> None:
    m.out.zero_given = True
    if isinstance(v, dict):
        v = dict(v)
        for old, new in DEPRECATED_OFFLOAD:
            if old in v and new not in v and isinstance(v[old], bool):
                v[new] = {"device": "cpu"} if v.pop(old) else None
                m.notes.append(f"zero_optimization.{old} is {DS}'s deprecated name of {new}, rendered as {new}.")
    m.model_block("zero_optimization", "zero_optimization", v,
                  lambda f, where, zv: _zero_field(m, f, where, zv))


def _zero_field(m: MergeState, f: fields.Field, where: str, zv: Any) -> None:
    name = f.name
    if name == "stage":
        m.out.stage_given = True
        if is_auto(zv):
            return
        # bool is an int in Python (True == 1): refuse it explicitly.
        if isinstance(zv, bool) or zv not in (0, 1, 2, 3):
            m.err("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {show(zv)}")
        else:
            m.adopt(m.spec.deepspeed, "zero_stage", int(zv), "zero_optimization.stage", "deepspeed.zero_stage")
    elif name in ("offload_optimizer", "offload_param"):
        _merge_offload(m, name, where, zv)
    elif name in ("cpu_offload", "cpu_offload_param"):
        pass  # handled as their replacement: see model_block
    elif name in UNRUN_ZERO:
        if zv is not None:
            m.err(where, f"is {DS}'s {UNRUN_ZERO[name]}, which this service does not run", "unrun")
    elif m.knob(where, zv, ZERO_KINDS.get(name), f):
        m.out.zero_extra[name] = zv


def _merge_offload(m: MergeState, key: str, where: str, v: Any) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        m.err(where, f'must be an object such as {{"device": "cpu"}}, got {show(v)}')
        return
    device = v.get("device", "none")
    if not isinstance(device, str) or device not in ("none", "cpu", "nvme"):
        m.err(f"{where}.device", f'must be "none", "cpu" or "nvme", got {show(device)}')
        return
    extra: dict[str, Any] = {}

    def handle(f: fields.Field, field: str, x: Any) -> None:
        if f.name in ("device", "nvme_path"):
            return  # the job's own fields, adopted below
        if f.name in UNRUN_OFFLOAD:
            if x is not f.default and m.knob(field, x, None, f):
                m.err(field, f"is {DS}'s {UNRUN_OFFLOAD[f.name]}, which this service does not run", "unrun")
        elif m.knob(field, x, OFFLOAD_KINDS.get(f.name), f):
            extra[f.name] = x

    m.model_block(f"zero_optimization.{key}", where, v, handle)
    ds = m.spec.deepspeed
    if v.get("nvme_path") is not None:
        m.adopt(ds, "nvme_path", v["nvme_path"], f"{where}.nvme_path", "deepspeed.nvme_path")
    m.adopt(ds, key, device, f"{where}.device", f"deepspeed.{key}")
    m.out.offload_extra[key] = extra
