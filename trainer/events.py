"""One JSON object per line on stdout: the trainer's only interface to whoever supervises it."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def rank() -> int:
    # The launcher sets RANK before the process starts, so this works before (and after) dist init.
    return int(os.environ.get("RANK", "0"))


def emit(kind: str, **fields: Any) -> None:
    line = json.dumps({"event": kind, "ts": time.time(), "rank": rank(), **fields}, default=str)
    # One write of the whole line, so lines from ranks sharing the pipe do not interleave mid-line.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def emit_rank0(kind: str, **fields: Any) -> None:
    if rank() == 0:
        emit(kind, **fields)
