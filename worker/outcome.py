"""Decides how an attempt ended, from the trainer's markers, its events and the tail of its log."""

from __future__ import annotations

import enum
import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.codes import FailureCode, JobStatus
from core.serverpaths import ServerPaths, host_directories, python_directories, store_folder
from worker.ops import extensions_dir
from worker.settings import WorkerSettings

# Ordered: the first pattern found in the log tail names the error.
LOG_PATTERNS: list[tuple[FailureCode, re.Pattern[str]]] = [
    (FailureCode.OUT_OF_MEMORY, re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I)),
    (FailureCode.NCCL_TIMEOUT,
     re.compile(r"NCCL.*(timeout|timed out)|Watchdog caught collective operation timeout", re.I)),
    # Before the data and model patterns: a full disk makes loaders and savers fail with their own messages too.
    (FailureCode.DISK_FULL, re.compile(r"No space left on device|\[Errno 28\]|ENOSPC")),
    (FailureCode.DATA_ERROR, re.compile(r"DataError|data_error")),
    (FailureCode.MODEL_LOAD_ERROR,
     re.compile(r"OSError: .*(config\.json|not a valid model identifier)|ModelLoadError")),
]


def server_paths(settings: WorkerSettings) -> ServerPaths:
    """What a client may read of this node's folders in an attempt's events, its error and its log lines: paths
    relative to the model and data roots (as the job named them), to the other roots behind their label
    (`<artifacts>/jobs/job_…/checkpoints/…`, `<cache>/…`), to where Python and the service are installed
    (`<site-packages>/torch/…`, `trainer/data.py`), to the home and temporary folders. Applied to everything
    the worker publishes (worker/publisher.py), so the job's row, its events and its webhooks hold no path of the
    server's; a path outside all of these (a system library in a compiler's message) is left as it is."""
    return ServerPaths([(settings.model_root, ""), (settings.data_root, ""), (settings.nvme_root, ""),
                        (settings.artifacts_root, "<artifacts>"), (store_folder(settings.store_url), "<store>"),
                        (settings.cache_root, "<cache>"), (extensions_dir(settings), "<torch_extensions>"),
                        *python_directories(), *host_directories()])


# The DeepSpeed launcher logs the first failed rank's exit code (a signal as -N) and exits with it as a
# status byte (-9 -> 247).
RANK_EXIT = re.compile(r"exits with return code = (-?\d+)\b")


def signal_of(exit_code: int | None, tail: str) -> int | None:
    """The signal that ended the first failed rank, if a signal did."""
    codes = [int(m.group(1)) for m in RANK_EXIT.finditer(tail)]
    if codes and codes[0] < 0:
        return -codes[0]
    if exit_code is not None and exit_code < 0:
        return -exit_code
    if exit_code is not None and 129 <= exit_code <= 255 and not codes:
        return 256 - exit_code if exit_code > 192 else exit_code - 128
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Status(str, enum.Enum):
    SUCCEEDED = JobStatus.SUCCEEDED.value
    FAILED = JobStatus.FAILED.value
    CANCELLED = JobStatus.CANCELLED.value
    STALE = "stale"  # superseded by a newer attempt: report nothing
    # Handed back, not ended (the worker shut down after a checkpoint, or its node's disk was full before the
    # launch): the control plane requeues the job, not counting a lost worker.
    RELEASED = "released"


@dataclass
class Outcome:
    status: Status
    error: dict[str, str] | None = None
    output: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None  # why a RELEASED attempt was handed back: its `released` state says it


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


def classify_failure(exit_code: int | None, trainer_error: dict[str, Any] | None, log_tail: list[str],
                     first_dead_rank: int | None = None) -> dict[str, str]:
    """The error of a failed attempt. A rank ended by a signal the service did not send comes first: the
    other ranks then fail on their broken connections, and their errors are consequences, not the cause."""
    tail = "\n".join(log_tail)
    signum = signal_of(exit_code, tail)
    pattern = next((name for name, pat in LOG_PATTERNS if pat.search(tail)), None)
    if signum is not None and (signum == signal.SIGKILL or pattern is None):
        who = "a training process" if first_dead_rank is None else f"rank {first_dead_rank}"
        message = f"{who} was killed by {_signal_name(signum)}"
        if signum == signal.SIGKILL:
            # Nothing in the service sent it (that is reported as cancelled or timed out), so the usual
            # sender is the kernel: operators need the likely cause, not just the number.
            message += (" and left no error of its own; when no operator killed it, this is the kernel's "
                        "out-of-memory killer: the node ran out of host memory (optimizer or parameter "
                        "offload to the CPU, data loading)")
        return {"code": FailureCode.KILLED, "message": message, "log_tail": tail[-4000:],
                **({"rank": str(first_dead_rank)} if first_dead_rank is not None else {}),
                "signal": _signal_name(signum)}
    if trainer_error and trainer_error.get("code"):
        code = str(trainer_error["code"])
        message = str(trainer_error.get("message", ""))
    else:
        code = pattern or FailureCode.TRAINER_ERROR
        message = f"the trainer exited with code {exit_code} without completing"
    return {"code": code, "message": message, "log_tail": tail[-4000:]}
