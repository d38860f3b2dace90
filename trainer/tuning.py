"""Speed and memory choices made on the device itself: block compilation and the `auto` micro batch
(which kernels run is `trainer.kernels`)."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

from contract.spec import ResolvedJob
from trainer import optim

# What a GPU may hold beyond the probe's own peak: allocator fragmentation, NCCL and DeepSpeed buffers.
HEADROOM_FRACTION = 0.90
RESERVE_BYTES = 3 * 2**30


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each transformer block in place (regional compilation): the block's elementwise work
    (norms, rotary, activations) fuses into few kernels, and all blocks share one compiled graph."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.compile(dynamic=False)
            count += 1
    return count


def fits_unsharded(model: torch.nn.Module) -> bool:
    """The probe runs the whole model on one GPU; with ZeRO-3 that is only possible for models that fit."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * weights < 0.5 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def optimizer_bytes(job: ResolvedJob, n_trainable: int) -> float:
    """GPU bytes DeepSpeed will add for the optimizer once training starts (the probe does not see them)."""
    ds = job.spec.deepspeed
    if ds.offload_optimizer != "none":
        return 0.0
    if job.spec.hyperparameters.optimizer == "adamw_bf16":
        per_param = optim.STATE_BYTES["adamw_bf16"]
    else:
        per_param = 8.0 if ds.precision == "fp32" else 12.0  # Adam moments (+ fp32 master weights)
    shards = job.world_size if ds.zero_stage >= 1 else 1
    return n_trainable * per_param / shards


def probe_micro_batch(model: torch.nn.Module, job: ResolvedJob, loss_fn: Any, device: str,
                      vocab_size: int) -> tuple[int, str]:
    """The largest micro batch (a divisor of the per-process batch) whose measured forward+backward peak,
    plus the optimizer's share, fits this GPU. Every rank probes; all take the smallest answer."""
    hp = job.spec.hyperparameters
    per_rank = hp.global_batch_size // job.world_size
    candidates = sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True)
    total = torch.cuda.get_device_properties(device).total_memory
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    budget = HEADROOM_FRACTION * total - RESERVE_BYTES - optimizer_bytes(job, n_trainable)
    model.to(device)
    chosen, seen = candidates[-1], "no candidate fitted"
    for m in candidates:
        ids = torch.randint(0, vocab_size, (m, hp.seq_len), device=device)
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            loss = loss_fn(model, {"input_ids": ids, "labels": ids.clone()}, device)
            loss.backward()
            peak = torch.cuda.max_memory_allocated(device)
        except torch.OutOfMemoryError:
            peak = None
        finally:
            model.zero_grad(set_to_none=True)
            del ids
            gc.collect()
            torch.cuda.empty_cache()
        if peak is not None and peak <= budget:
            chosen = m
            seen = (f"measured peak {peak / 2**30:.1f} GiB for micro {m} × seq {hp.seq_len}, within the budget "
                    f"{budget / 2**30:.1f} GiB (90% of {total / 2**30:.0f} GiB less {RESERVE_BYTES / 2**30:.0f} GiB "
                    f"reserve and {optimizer_bytes(job, n_trainable) / 2**30:.1f} GiB of optimizer state)")
            break
    if dist.is_initialized():
        t = torch.tensor([chosen], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        chosen = int(t.item())
    return chosen, f"micro batch auto (probe): {chosen}, {seen}"
