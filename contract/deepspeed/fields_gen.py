"""Build the table of DeepSpeed's config fields (contract/deepspeed/deepspeed_fields.json) from the installed DeepSpeed.

Run at development time, after DeepSpeed is upgraded: `python -m contract.deepspeed.fields_gen`. The API reads only the
JSON (contract/deepspeed/fields.py), so it never imports torch or DeepSpeed; tests/test_dsconfig.py rebuilds the table
from the installed DeepSpeed and fails when the checked-in one differs.

Everything here is read from DeepSpeed itself: the top-level keys are the ones `DeepSpeedConfig` looks up
(recorded by handing it a dict that logs every lookup), the sections are DeepSpeed's own pydantic models
(names, aliases, deprecated names, types, bounds, defaults), the optimizer and scheduler defaults are the
signatures of the classes DeepSpeed builds, and the removed keys are DeepSpeed's own list with its messages.
"""

from __future__ import annotations

import enum
import inspect
import json
import logging
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("deepspeed_fields.json")


class _Recorder(dict):  # type: ignore[type-arg]
    """A config dict that logs each key DeepSpeed looks up, with the default it would use."""

    def __init__(self, *args: Any, log: list[tuple[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, Any]] = log if log is not None else []

    def get(self, key: Any, default: Any = None) -> Any:
        self.log.append((key, default))
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.log.append((key, None))
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.log.append((key, None))
        return super().__contains__(key)

    def keys(self) -> Any:
        # `key in d.keys()` must be logged too; DeepSpeed uses both spellings.
        outer = self

        class _Keys:
            def __contains__(self, key: Any) -> bool:
                return key in outer

            def __iter__(self) -> Any:
                return iter(dict.keys(outer))

        return _Keys()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # DeepSpeedConfig parses a copy.copy() of the dict: the copy must log into the same list.
        return (_Recorder, (dict(self),), {"log": self.log})


def _jsonable(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return _jsonable(v.value)
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if v == v and abs(v) != float("inf") else None
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, Path):
        return str(v)
    return None  # torch dtypes and other objects: no JSON default


def _describe(annotation: Any, models: dict[str, Any], path: str) -> dict[str, Any]:
    """A JSON description of a pydantic annotation: type, choices, nullability, nested model."""
    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        out = _describe(args[0], models, path) if len(args) == 1 else {"type": "any"}
        if nullable:
            out["nullable"] = True
        return out
    if origin is typing.Literal:
        return {"type": "choice", "choices": [_jsonable(a) for a in typing.get_args(annotation)]}
    if origin in (list, tuple, set) or annotation in (list, tuple, set):
        return {"type": "list"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            # use_enum_values: DeepSpeed takes each member's value (and ZeroStageEnum's ints).
            return {"type": "choice", "choices": sorted({_jsonable(m.value) for m in annotation}, key=str)}
        if issubclass(annotation, bool):
            return {"type": "bool"}
        if issubclass(annotation, int):
            return {"type": "int"}
        if issubclass(annotation, float):
            return {"type": "number"}
        if issubclass(annotation, (str, Path)):
            return {"type": "str"}
        if issubclass(annotation, BaseModel):
            _model(annotation, models, path)
            return {"type": "model", "model": path}
    return {"type": "any"}


def _model(cls: Any, models: dict[str, Any], path: str) -> None:
    """Every field of one DeepSpeed pydantic model, keyed by the name DeepSpeed writes (its alias)."""
    import annotated_types

    fields: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        canonical = info.alias or name
        entry: dict[str, Any] = {"names": sorted({canonical, name}), "field": name}
        entry.update(_describe(info.annotation, models, f"{path}.{canonical}"))
        for meta in info.metadata:
            for bound in ("ge", "gt", "le", "lt"):
                if isinstance(meta, getattr(annotated_types, bound.capitalize())):
                    entry[bound] = _jsonable(getattr(meta, bound))
        if info.default_factory is None and not info.is_required():
            entry["default"] = _jsonable(info.default)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            entry["deprecated"] = {"new": extra.get("new_param", ""), "sets_new": extra.get("set_new_param", True)}
        fields[canonical] = entry
    models[path] = dict(sorted(fields.items()))


def _reads(section: str | None) -> list[tuple[str, Any]]:
    """The keys DeepSpeedConfig looks up at the top level, or inside one section when `section` is given."""
    from deepspeed.runtime.config import DeepSpeedConfig

    log: list[tuple[str, Any]] = []
    if section is None:
        config = _Recorder({"train_batch_size": 1}, log=log)
    else:
        config = {"train_batch_size": 1, section: _Recorder({}, log=log)}
    try:
        DeepSpeedConfig(config)
    except Exception:  # noqa: BLE001 - an empty section may not parse; the keys it read are what counts
        pass
    seen: dict[str, Any] = {}
    for key, default in log:
        if isinstance(key, str) and key not in seen:
            seen[key] = _jsonable(default)
    return list(seen.items())


def _signature_defaults(fn: Any, skip: int) -> dict[str, Any]:
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return {p.name: _jsonable(p.default) for p in params if p.default is not inspect.Parameter.empty}


def build() -> dict[str, Any]:
    """The table, from the DeepSpeed installed in this environment."""
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.ops.adam.fused_adam import FusedAdam
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import lr_schedules, precision_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    models: dict[str, Any] = {}
    _model(DeepSpeedZeroConfig, models, "zero_optimization")
    _model(precision_config.DeepSpeedFP16Config, models, "fp16")
    _model(precision_config.DeepSpeedBF16Config, models, "bf16")
    _model(CommsLoggerConfig, models, "comms_logger")
    for key, info in DeepSpeedMonitorConfig.model_fields.items():
        _model(info.annotation, models, key)
    _model(DeepSpeedThroughputTimerConfig, models, "timers.throughput")

    top = dict(_reads(None))
    # Keys deepspeed.initialize and DeepSpeedConfig test with `"key" in config` before any parsing.
    sources = inspect.getsource(deepspeed.initialize) + inspect.getsource(ds_config.DeepSpeedConfig.__init__)
    for key in re.findall(r'"(\w+)" in config', sources):
        top.setdefault(key, None)
    removed = {**ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS}
    for key in removed:
        top.pop(key, None)
    # Dict-read sections: DeepSpeed looks up each key with its default and ignores the rest.
    dict_sections = {section: dict(_reads(section)) for section in sorted(top)
                     if section not in models and section != "timers"}
    dict_sections = {k: v for k, v in dict_sections.items() if v}
    # Attributes of a parsed config that are not keys: DeepSpeed never reads such a key, so it ignores it.
    parsed = ds_config.DeepSpeedConfig({"train_batch_size": 1})
    inert = sorted(k for k in vars(parsed) if not k.startswith("_") and k not in top)

    schedulers = {}
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        schedulers[name] = _signature_defaults(getattr(lr_schedules, name).__init__, 2)
    return {
        "deepspeed": deepspeed.__version__,
        "top_level": dict(sorted(top.items())),
        "top_level_aliases": {precision_config.BFLOAT16_OLD: precision_config.BFLOAT16},
        "inert_top_level": inert,
        "removed": {"": dict(sorted(removed.items())),
                    "zero_optimization": dict(sorted(ds_config._REMOVED_ZERO_CONFIG_KEYS.items()))},
        "models": dict(sorted(models.items())),
        "dict_sections": dict(sorted(dict_sections.items())),
        "optimizers": sorted(ds_config.DEEPSPEED_OPTIMIZERS),
        "adam_defaults": _signature_defaults(FusedAdam.__init__, 2),
        "adam_extra_params": sorted([ds_config.TORCH_ADAM_PARAM, ds_config.ADAM_W_MODE]),
        "schedulers": schedulers,
    }


def render_table(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=1, sort_keys=False) + "\n"


def main() -> None:
    TABLE_PATH.write_text(render_table(build()))
    print(f"wrote {TABLE_PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
