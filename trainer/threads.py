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
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from contract.spec import DeepSpeedOptions

LOOP_THREADS = 1


def loop_threads(device_name: str, ds: DeepSpeedOptions) -> int | None:
    """The pool size for the training loop, or None to leave torch's. `ds` is the try's options: a raw config's
    offload blocks are merged into them at submit, and the OOM ladder's offload at its rung. NVMe offload steps
    the optimizer on the CPU too."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    if device_name == "cpu" or ds.offload_optimizer != "none" or ds.offload_param != "none":
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
