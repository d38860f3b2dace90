"""Decides how an attempt ended, from the trainer's markers, its events and the tail of its log."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ordered: the first pattern found in the log tail names the error.
LOG_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("out_of_memory", re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I)),
    ("nccl_timeout", re.compile(r"NCCL.*(timeout|timed out)|Watchdog caught collective operation timeout", re.I)),
    ("data_error", re.compile(r"DataError|data_error")),
    ("model_load_error", re.compile(r"OSError: .*(config\.json|not a valid model identifier)|ModelLoadError")),
]


# The DeepSpeed launcher logs each rank's exit code and exits with it as a status byte (-9 -> 247).
RANK_KILLED = re.compile(r"exits with return code = -9\b")
KILLED_EXIT_CODES = (-9, 9, 137, 247)


class Status(str, enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STALE = "stale"  # superseded by a newer attempt: report nothing


@dataclass
class Outcome:
    status: Status
    error: dict[str, str] | None = None
    output: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def read_completion(output_dir: Path) -> dict[str, Any] | None:
    """The trainer's completion marker, only if the exported model it describes is really there."""
    marker = output_dir / "COMPLETE"
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return None
    has_config = (output_dir / "config.json").is_file() or (output_dir / "adapter_config.json").is_file()
    has_weights = any(output_dir.glob("*.safetensors"))
    if not (has_config and has_weights):
        return None
    files = sorted(p.name for p in output_dir.iterdir() if p.is_file())
    return {"path": str(output_dir), "format": "huggingface", "files": files, **{
        k: v for k, v in info.items() if k in ("step", "final_loss")}}


def classify_failure(exit_code: int | None, trainer_error: dict[str, Any] | None,
                     log_tail: list[str]) -> dict[str, str]:
    tail = "\n".join(log_tail)
    if trainer_error and trainer_error.get("code"):
        code = str(trainer_error["code"])
        message = str(trainer_error.get("message", ""))
    else:
        code = next((name for name, pat in LOG_PATTERNS if pat.search(tail)), None)
        message = f"the trainer exited with code {exit_code} without completing"
        if code is None and (exit_code in KILLED_EXIT_CODES or RANK_KILLED.search(tail)):
            code = "killed"
            # Nothing in the service sent it (that is reported as cancelled or timed out), so the usual
            # sender is the kernel: operators need the likely cause, not just the number.
            message = ("a training process was killed with SIGKILL and left no error of its own; when no "
                       "operator killed it, this is the kernel's out-of-memory killer: the node ran out of "
                       "host memory (optimizer or parameter offload to the CPU, data loading)")
        code = code or "trainer_error"
    return {"code": code, "message": message, "log_tail": tail[-4000:]}
