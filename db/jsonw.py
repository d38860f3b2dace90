"""The one JSON writer of the data layer: what goes into a jsonb column, and what a request hash is taken of."""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any, *, sort_keys: bool = False) -> str:
    """orjson where it can; the standard library for integers beyond 64 bits (JSON and jsonb allow them)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None).decode()
    except TypeError:
        return json.dumps(value, sort_keys=sort_keys, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
