"""The out-of-memory ladder (`resources.on_oom: "adapt"`): what a job that ran out of GPU memory at its start
tries next, within the same attempt.

The rungs, in order, each keeping the ones before it:
1. a smaller micro batch (the largest divisor of the per-process batch at most half the current one) with
   the accumulation raised to match, so the global batch, the rows of every step and the gradient stay the same;
   repeated down to micro 1;
2. activation checkpointing (the blocks' activations are recomputed in the backward pass);
3. the optimizer offloaded to the CPU (ZeRO stage 1-3 with DeepSpeed's own AdamW only; the host check of
   trainer/memory.py still applies, so a node that cannot hold it fails with that error instead).

Rungs that cannot lower what ran out are skipped: activations live only between a micro batch's forward and its
backward, so an error in the setup (DeepSpeed allocating master weights) or in an optimizer step (the moments
are allocated at the first one) goes straight to the offload rung. Only the first ADAPT_STEPS optimizer steps of
an attempt are covered: later an out-of-memory error is not a question of the setting, and it fails the job as
before. Every rank meets the same error at the same point in practice (same shapes, same memory); a rank that
ran out while another waits in a collective is not recovered (the collective times out, as without the ladder).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from contract.deepspeed.batch import largest_divisor_at_most
from contract.spec import ResolvedJob

# Optimizer steps from an attempt's start (or its resume) during which an out-of-memory error adapts.
ADAPT_STEPS = 2
# The test seam: "PHASE:N" makes the first N tries of this process raise torch.OutOfMemoryError at PHASE
# ("setup", "forward" or "step"), the way a too-large setting fails on a GPU. Tests set it; a job never does.
FORCE_ENV = "FT_TEST_FORCE_OOM"
PHASES = ("setup", "forward", "step")


@dataclass(frozen=True)
class MemorySetting:
    """What the ladder changes; the rest of the job stays as resolved."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool
    offload_optimizer: str

    def shown(self) -> dict[str, Any]:
        return asdict(self)


class AdaptableOOM(Exception):
    """An out-of-memory error the ladder may answer: where it happened, torch's message, the setting it ran."""

    def __init__(self, phase: str, step: int, message: str, setting: MemorySetting) -> None:
        super().__init__(f"out of memory in the {phase} at step {step}: {message}")
        self.phase, self.step, self.message, self.setting = phase, step, message, setting


def initial(job: ResolvedJob, micro: int, accum: int) -> MemorySetting:
    ds = job.spec.deepspeed
    return MemorySetting(micro, accum, ds.activation_checkpointing, ds.offload_optimizer)


def can_offload(job: ResolvedJob) -> bool:
    ds = job.spec.deepspeed
    # DeepSpeed offloads only its own optimizer, and only from a ZeRO stage (contract.deepspeed.optimizer_problems).
    return ds.zero_stage >= 1 and job.spec.hyperparameters.optimizer == "adamw" and job.spec.lora is None


def next_setting(current: MemorySetting, phase: str, *, per_rank: int, offload_ok: bool) -> tuple[MemorySetting,
                                                                                                  str] | None:
    """The next rung for an error in `phase`, with a sentence saying why; None at the ladder's end."""
    if phase == "forward":
        if current.micro_batch_size > 1:
            micro = largest_divisor_at_most(per_rank, current.micro_batch_size // 2)
            return (replace(current, micro_batch_size=micro, gradient_accumulation_steps=per_rank // micro),
                    f"micro batch {current.micro_batch_size} -> {micro} with accumulation "
                    f"{current.gradient_accumulation_steps} -> {per_rank // micro}: the same global batch")
        if not current.activation_checkpointing:
            return (replace(current, activation_checkpointing=True),
                    "activation checkpointing on: activations are recomputed in the backward pass")
    if offload_ok and current.offload_optimizer == "none":
        skipped = "" if phase == "forward" else (
            f" (the error was in the {phase}, where a smaller micro batch or activation checkpointing frees nothing)")
        return (replace(current, offload_optimizer="cpu"),
                "optimizer offloaded to the CPU: master weights and moments leave the GPU" + skipped)
    return None


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # Some CUDA allocations (cuBLAS workspaces, NCCL buffers) report it as a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class ForcedOOM:
    """The test seam's state in this process: how many tries have raised so far."""

    def __init__(self) -> None:
        spec = os.environ.get(FORCE_ENV, "")
        phase, _, count = spec.partition(":")
        if spec and (phase not in PHASES or not count.isdigit()):
            raise ValueError(f"{FORCE_ENV}={spec!r}: expected PHASE:N with PHASE one of {', '.join(PHASES)}")
        self.phase, self.left = (phase, int(count)) if spec else ("", 0)

    def check(self, phase: str) -> None:
        if self.left > 0 and phase == self.phase:
            self.left -= 1
            raise torch.OutOfMemoryError(f"{FORCE_ENV}: forced out of memory in {phase} "
                                         f"({self.left} more forced tries)")

    def install(self, engine: Any) -> None:
        """Put the seam on this try's engine, once at setup: its forward, or its step at an accumulation boundary
        (where the optimizer runs), raises as the device would. The training loop itself carries no test switch;
        without FT_TEST_FORCE_OOM the engine is left as DeepSpeed built it."""
        if self.left == 0 or self.phase not in ("forward", "step"):
            return
        real = getattr(engine, self.phase)

        def failing(*args: Any, **kwargs: Any) -> Any:
            if self.phase == "forward" or engine.is_gradient_accumulation_boundary():
                self.check(self.phase)
            return real(*args, **kwargs)

        setattr(engine, self.phase, failing)
