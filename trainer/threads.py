"""The size of each rank's intra-op thread pool while it trains.

torch gives every process one pool thread per core. A rank that trains on an accelerator uses its pool only for
the host's share of a step: indexing one batch and counting its tokens between launches. Each of those ops is a
parallel region that ends when the slowest of its threads does, so any other busy process on the host (the
checkpoint's upload, the kernel writing a save back) holds up one thread, and with it the launches the accelerator
is waiting for: the steps that ran beside an upload were measurably slower with a pool on every core and not with
one thread (bench/RESULTS.md, the checkpoint stall). One thread does that work in microseconds and waits on no one.

The pool keeps torch's size where the host does the heavy work: training on the CPU, and an optimizer or
parameters offloaded to it (DeepSpeed's CPU Adam is OpenMP code and uses the pool's size). An OMP_NUM_THREADS
the operator set is kept as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

LOOP_THREADS = 1


def offloaded(zero_cfg: Mapping[str, Any]) -> bool:
    """Whether the DeepSpeed config puts the optimizer or the parameters on the host (CPU or NVMe: both step the
    optimizer on the CPU)."""
    return any(str((zero_cfg.get(key) or {}).get("device", "none")) != "none"
               for key in ("offload_optimizer", "offload_param"))


def loop_threads(device_name: str, zero_cfg: Mapping[str, Any]) -> int | None:
    """The pool size for the training loop, or None to leave torch's."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    if device_name == "cpu" or offloaded(zero_cfg):
        return None
    return LOOP_THREADS


@contextmanager
def pool_of(threads: int | None) -> Iterator[None]:
    """The intra-op pool at `threads` inside the block (unchanged for None), torch's size again after it: the
    export that follows the loop copies whole weights on the host, where the pool does help."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
