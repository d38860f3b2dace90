"""The API process's heap, settled at start so that garbage collection stays off the requests' tail.

A full collection walks every container object the process holds. After start that is ~100,000 objects
(FastAPI, pydantic's validators, asyncpg), and each full collection took 40-200 ms on
this project's 2-core machine: under load it ran every second or two in each API process and was the whole
p99 of `GET /jobs/{id}` (p99 72-100 ms with p50 3 ms; 6-27 ms once settled, bench/RESULTS.md). Those objects
live as long as the process, so they are moved to the permanent generation (`gc.freeze`) once start-up has
built them, and a full collection then walks only what requests made since.

The collections' pauses are measured (`ft_api_gc_pause_seconds`, by generation), so a dependency that starts
building long-lived objects under requests shows up in the metrics rather than as an unexplained tail.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from api.metrics import GC_PAUSE


def settle() -> None:
    """Build what start-up would otherwise leave to the first request, collect once, freeze the rest."""
    gc.collect()
    gc.freeze()


class PauseMeter:
    """A `gc.callbacks` entry: the time from each collection's start to its stop, by generation."""

    def __init__(self) -> None:
        self.started = 0.0
        self.children = [GC_PAUSE.labels(str(g)) for g in range(3)]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.children[info["generation"]].observe(time.perf_counter() - self.started)

    def install(self) -> None:
        if not any(isinstance(cb, PauseMeter) for cb in gc.callbacks):
            gc.callbacks.append(self)
