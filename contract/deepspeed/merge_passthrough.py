"""Sections of a raw DeepSpeed config rendered as DeepSpeed reads them once every field checks out (comms_logger,
timers, aio), and the blocks that could write files or open connections, taken only switched off."""

from __future__ import annotations

from typing import Any

from contract.deepspeed import fields
from contract.deepspeed.merge_base import MergeState, show
from contract.deepspeed.policy import AIO_KINDS, DANGEROUS_KEYS


def dangerous(m: MergeState, key: str, value: Any) -> None:
    # Only an explicit "enabled": false is taken: a block that names an output path or a project but leaves
    # enabled unset was most likely meant to run.
    if not isinstance(value, dict) or value.get("enabled") is not False:
        m.err(key, f'is not accepted unless "enabled" is false: enabled, it {DANGEROUS_KEYS[key]}', "dangerous")
    elif fields.has_section(key):
        m.model_block(key, key, value, lambda f, where, v: m.knob(where, v, None, f))


def pass_model(m: MergeState, key: str, v: Any) -> None:
    before = len(m.errors)
    m.model_block(key, key, v, lambda f, where, x: m.knob(where, x, None, f))
    if len(m.errors) == before:
        m.out.passthrough[key] = v


def pass_timers(m: MergeState, v: Any) -> None:
    if not isinstance(v, dict):
        m.err("timers", f"must be an object, got {show(v)}")
        return
    for k in v:
        if k != "throughput":
            m.unknown(f"timers.{k}", k, {"throughput"}, "timers")
    if "throughput" in v:
        m.model_block("timers.throughput", "timers.throughput", v["throughput"],
                      lambda f, where, x: m.knob(where, x, None, f))
    if not any(e.field.startswith("deepspeed.config.timers") for e in m.errors):
        m.out.passthrough["timers"] = v


def pass_aio(m: MergeState, v: Any) -> None:
    if not isinstance(v, dict):
        m.err("aio", f"must be an object, got {show(v)}")
        return
    known = fields.dict_section_keys("aio")
    before = len(m.errors)
    for k, x in v.items():
        if k not in known:
            m.unknown(f"aio.{k}", k, set(known), "aio")
        else:
            m.knob(f"aio.{k}", x, AIO_KINDS.get(k))
    if len(m.errors) == before:
        m.out.passthrough["aio"] = v
