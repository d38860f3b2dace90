"""What the pinned DeepSpeed accepts in a config, read from the table contract/deepspeed/fields_gen.py builds from it.

Pure Python and one small JSON file, so the API knows DeepSpeed's field names, aliases, deprecated names,
types and defaults without importing torch or DeepSpeed. `check_rendered` repeats, for the fields the service
renders, the checks DeepSpeed's `DeepSpeedConfig` makes, so a job is refused at submit time instead of failing
at step 0; tests/test_dsconfig.py and tests/test_dsconfig_corpus.py hold it to DeepSpeed's own parser.
"""

from __future__ import annotations

import difflib
import json
import math
import operator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("deepspeed_fields.json")
# pydantic reads a JSON float such as 5e8 into an integer field only strictly inside the int64 range.
FLOAT_AS_INT_LIMIT = 2**63


@cache
def table() -> dict[str, Any]:
    return json.loads(TABLE_PATH.read_text())


def version() -> str:
    return str(table()["deepspeed"])


@dataclass(frozen=True)
class Field:
    """One field of a DeepSpeed section: `name` is the one DeepSpeed writes (its alias where it has one)."""

    section: str
    name: str
    spec: dict[str, Any]

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def default(self) -> Any:
        return self.spec.get("default")

    @property
    def deprecated_for(self) -> str | None:
        """The canonical name of the field a deprecated one sets, "" where DeepSpeed only warns, else None."""
        dep = self.spec.get("deprecated")
        if dep is None:
            return None
        if not dep.get("sets_new", True):
            return ""
        new = dep.get("new", "")
        for name, spec in table()["models"][self.section].items():
            if new in spec["names"]:
                return str(name)
        return ""

    def problem(self, value: Any) -> str | None:
        return value_problem(self.spec, value)


def has_section(section: str) -> bool:
    return section in table()["models"]


def lookup(section: str, key: str) -> Field | None:
    """The field `key` names in a DeepSpeed model section, by its alias or its attribute name."""
    for name, spec in table()["models"].get(section, {}).items():
        if key in spec["names"]:
            return Field(section, name, spec)
    return None


def fields(section: str) -> list[Field]:
    return [Field(section, name, spec) for name, spec in table()["models"].get(section, {}).items()]


def top_level_keys() -> set[str]:
    t = table()
    return set(t["top_level"]) | set(t["top_level_aliases"])


def top_level_default(key: str) -> Any:
    return table()["top_level"].get(key)


def dict_section_keys(section: str) -> dict[str, Any]:
    """Keys DeepSpeed reads (with their defaults) from a section it reads as a plain dict."""
    return dict(table()["dict_sections"].get(section, {}))


def removed(section: str, key: str) -> str | None:
    """DeepSpeed's own message for a key it has removed and now refuses."""
    return table()["removed"].get(section, {}).get(key)


def closest(key: str, known: set[str] | list[str]) -> str | None:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return match[0] if match else None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def value_problem(spec: dict[str, Any], v: Any) -> str | None:
    """Why DeepSpeed's model would refuse `v` for this field, or None. Stricter than pydantic's lax mode in one
    way only: JSON's own types are required (no "true" for true, no "16" for 16). Only DeepSpeed's own bounds
    are checked here; the service's are in contract/deepspeed/policy.py, where they are reported as the service's."""
    kind = spec["type"]
    if v is None:
        return None if spec.get("nullable") else "must not be null"
    if kind == "bool":
        return None if isinstance(v, bool) else "must be true or false"
    if kind == "str":
        return None if isinstance(v, str) else "must be a string"
    if kind == "list":
        return None if isinstance(v, list) else "must be a list"
    if kind in ("object", "model"):
        return None if isinstance(v, dict) else "must be an object"
    if kind == "choice":
        choices = spec["choices"]
        if not isinstance(v, bool) and v in choices:
            return None
        return "must be one of " + ", ".join(json.dumps(c) for c in choices)
    if kind in ("int", "number"):
        problem = _int_problem(v) if kind == "int" else _number_problem(v)
        if problem:
            return problem
        for bound, word in (("ge", "at least"), ("gt", "more than"), ("le", "at most"), ("lt", "less than")):
            if bound in spec and not _within(bound, v, spec[bound]):
                return f"must be {word} {_num(spec[bound])}"
        return None
    return None  # "any": DeepSpeed's model takes any value there


def _int_problem(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "must be an integer"
    if isinstance(v, int):
        return None  # pydantic takes a JSON integer of any size
    # DeepSpeed's integer fields take JSON's 5e8; a fraction is refused, as pydantic refuses it.
    if not math.isfinite(v) or not v.is_integer():
        return "must be an integer"
    if not -FLOAT_AS_INT_LIMIT < v < FLOAT_AS_INT_LIMIT:
        return (f"must be an integer; written with a decimal point or an exponent it must be below "
                f"{FLOAT_AS_INT_LIMIT} in magnitude")
    return None


def _number_problem(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "must be a number"
    if isinstance(v, float):
        return None if math.isfinite(v) else "must be a number"
    try:
        float(v)  # pydantic refuses an integer no 64-bit float can hold
    except OverflowError:
        return "must be a number within the range of a 64-bit float"
    return None


def _within(bound: str, v: float, limit: float) -> bool:
    # Python compares an int with a float exactly, so an integer of any size is safe here.
    compare = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}[bound]
    return bool(compare(v, limit))


def _check_model(section: str, block: Any, where: str, problems: list[str]) -> None:
    """One block against DeepSpeed's model: known keys, one name per field, DeepSpeed's types."""
    if not isinstance(block, dict):
        problems.append(f"{where} must be an object")
        return
    seen: dict[str, str] = {}
    for key, value in block.items():
        if isinstance(value, str) and value == "auto":
            continue  # DeepSpeed's models drop "auto" and use their default
        f = lookup(section, key)
        if f is None:
            problems.append(f"{where}.{key} is not a field of DeepSpeed's {section} section")
            continue
        target = f.deprecated_for or f.name
        if target in seen:
            problems.append(f"{where}.{key} and {where}.{seen[target]} set the same DeepSpeed field")
        seen[target] = key
        problem = f.problem(value)
        if problem:
            problems.append(f"{where}.{key} {problem}")
        elif f.spec["type"] == "model" and isinstance(value, dict):
            _check_model(f.spec["model"], value, f"{where}.{key}", problems)


def check_rendered(cfg: dict[str, Any], world: int) -> list[str]:
    """Problems DeepSpeed's DeepSpeedConfig would raise for this rendered config at `world` processes.

    Covers every section the service renders: unknown keys, alias pairs, types and bounds from the table, and
    the cross-field rules DeepSpeed applies (batch arithmetic, precision, ZeRO stage rules).
    """
    problems: list[str] = []
    known = top_level_keys()
    for key in cfg:
        if key not in known:
            problems.append(f"{key} is not a key DeepSpeed {version()} reads")
        message = removed("", key)
        if message:
            problems.append(f"{key}: {message}")
    g, m, a = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps"))
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (g, m, a)):
        problems.append("train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps must "
                        "all be positive integers")
    elif g != m * a * world:
        problems.append(f"train_batch_size {g} != {m} × {a} × {world} processes")
    for section in ("zero_optimization", "fp16", "bf16", "comms_logger"):
        if section in cfg:
            _check_model(section, cfg[section], section, problems)
    if "timers" in cfg:
        timers = cfg["timers"]
        if not isinstance(timers, dict) or set(timers) - {"throughput"}:
            problems.append("timers may only hold throughput")
        else:
            _check_model("timers.throughput", timers.get("throughput", {}), "timers.throughput", problems)
    zero = cfg.get("zero_optimization", {}) if isinstance(cfg.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", lookup("zero_optimization", "stage").default)  # type: ignore[union-attr]
    fp16, bf16 = cfg.get("fp16", {}), cfg.get("bf16", {})
    if fp16.get("enabled") is True and bf16.get("enabled") is True:
        problems.append("fp16 and bf16 cannot both be enabled")
    if fp16.get("enabled") is True and fp16.get("loss_scale", 0) == 0:
        # DeepSpeedFP16Config: dynamic loss scaling divides by the window and floors at the minimum.
        if fp16.get("loss_scale_window", 1000) <= 0 or fp16.get("min_loss_scale", 1) <= 0:
            problems.append("fp16.loss_scale_window and fp16.min_loss_scale must be above 0 with dynamic loss "
                            "scaling")
    for block, key in ((fp16, "fp16_master_weights_and_grads"), (bf16, "bf16_master_weights_and_grads"),
                       (bf16, "bf16_optimizer_states")):
        if block.get(key) is True and stage not in (1, 2, 3):
            problems.append(f"{key} needs ZeRO stage 1, 2 or 3")
    if bf16.get("bf16_optimizer_states") is True and bf16.get("bf16_master_weights_and_grads") is not True:
        problems.append("bf16_optimizer_states needs bf16_master_weights_and_grads")
    if zero.get("compute_grad_norm") is False and stage not in (1, 2):
        problems.append("zero_optimization.compute_grad_norm false needs ZeRO stage 1 or 2")
    ratio = (zero.get("offload_optimizer") or {}).get("ratio", 1.0)
    if isinstance(ratio, (int, float)) and ratio < 1.0 and stage != 3:
        problems.append("zero_optimization.offload_optimizer.ratio below 1 needs ZeRO stage 3")
    op = cfg.get("gradient_allreduce_op", top_level_default("gradient_allreduce_op"))
    if not isinstance(op, str) or op.lower() not in ("mean", "sum"):
        problems.append('gradient_allreduce_op must be "mean" or "sum"')
    elif op.lower() == "sum" and stage == 3:
        problems.append('gradient_allreduce_op "sum" is not supported with ZeRO stage 3')
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, str) or v.lower() not in ("fp16", "bf16", "fp32")):
            problems.append(f'{key} must be "fp16", "bf16" or "fp32"')
    optimizer = cfg.get("optimizer")
    if optimizer is not None and not (isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str)
                                      and isinstance(optimizer.get("params", {}), dict)):
        problems.append("optimizer must be an object with a type and params")
    return problems
