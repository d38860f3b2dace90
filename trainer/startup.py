"""When each phase of this process's start-up ended (epoch seconds), for the `started` event: a client that waits
for the first step can then see where the wait went (the process's creation, its imports, the process group, the
data, the model, the engine). Each mark is taken once: an OOM retry builds the model again but starts nothing."""

from __future__ import annotations

import os
import time

_marks: dict[str, float] = {}


def process_start() -> float | None:
    """When the kernel created this process (a fork's moment for a forked rank), from /proc; None elsewhere. Its age
    is read against /proc/uptime (hundredths of a second), not the boot time in /proc/stat (whole seconds)."""
    try:
        with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def mark(phase: str, at: float | None = None) -> None:
    _marks.setdefault(phase, time.time() if at is None else at)


def marks() -> dict[str, float]:
    return dict(_marks)
