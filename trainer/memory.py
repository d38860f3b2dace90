"""The optimizer's memory around training: checked against the host before an offloaded run starts, and
handed back once the last step is done so the export has room."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from contract.codes import FailureCode
from contract.spec import DeepSpeedOptions
from trainer.errors import TrainerError

GiB = 2**30

# Host bytes per trainable parameter that ZeRO's CPU optimizer offload keeps: fp32 master weights, fp32
# gradient partition and two Adam moments (16), plus the 16-bit copy CPU Adam writes back to the GPU (2).
# 18 is what a 7.2 B ZeRO-2 full fine-tune held on an H200 node; ZeRO-3 held 20 per offloaded parameter
# (8.0 B, ratio 0.6) and 21.8 at its peak (13.3 B, ratio 0.44) (bench/RESULTS.md, memory section), so stage 3
# counts 2 more. These are floors: the check refuses what cannot fit rather than promising what will.
OFFLOAD_OPTIMIZER_BYTES = 16
OFFLOAD_HALF_COPY_BYTES = 2
OFFLOAD_STAGE3_EXTRA_BYTES = 2
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size


def offloaded_share(ratio: float, numel_per_rank: int, sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE) -> float:
    """The share of a rank's optimizer that ZeRO-3 puts on the CPU for `ratio`: it splits whole sub-groups,
    the first int((1 - ratio) * n) on the GPU, so the CPU gets at least `ratio` (8.0 B at 0.6 in groups of
    5e8: 11 of 17)."""
    if ratio >= 1.0:
        return 1.0
    groups = max(1, -(-numel_per_rank // max(1, sub_group_size)))
    return (groups - int((1.0 - ratio) * groups)) / groups


class HostMemoryError(TrainerError):
    code = FailureCode.OUT_OF_MEMORY


def offload_host_bytes(ds: DeepSpeedOptions, n_params: int, n_trainable: int, local_ranks: int,
                       world: int, optimizer_share: float = 1.0) -> int:
    """What this node's ranks will hold in host memory for offloaded state (ZeRO partitions it over all
    ranks, so a node holds its ranks' share; `optimizer_share` is what ZeRO-3's `ratio` leaves on the CPU:
    see offloaded_share)."""
    half = ds.precision in ("bf16", "fp16")
    total = 0.0
    if ds.offload_optimizer == "cpu":
        total += optimizer_share * n_trainable * (
            OFFLOAD_OPTIMIZER_BYTES + (OFFLOAD_HALF_COPY_BYTES if half else 0)
            + (OFFLOAD_STAGE3_EXTRA_BYTES if ds.zero_stage == 3 else 0))
    if ds.offload_param == "cpu":
        total += n_params * (2 if half else 4)
    return int(total * local_ranks / max(1, world))


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo: free memory plus what the kernel can reclaim without swapping."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_rank_count(world: int) -> int:
    # The DeepSpeed launcher sets LOCAL_SIZE; torchrun sets LOCAL_WORLD_SIZE.
    return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or world)


def check_offload_fits(ds: DeepSpeedOptions, n_params: int, n_trainable: int, local_ranks: int, world: int,
                       available: int | None, optimizer_share: float = 1.0) -> None:
    """Refuse, before DeepSpeed allocates it, offloaded state the host cannot hold: the kernel's OOM killer
    would otherwise end the job with SIGKILL minutes later and no message."""
    need = offload_host_bytes(ds, n_params, n_trainable, local_ranks, world, optimizer_share)
    if need == 0 or available is None or need <= available:
        return
    offloaded = [f"deepspeed.{k}" for k in ("offload_optimizer", "offload_param") if getattr(ds, k) == "cpu"]
    raise HostMemoryError(
        f"host memory: {' and '.join(offloaded)}=\"cpu\" needs about {need / GiB:.1f} GiB on this node "
        f"({n_trainable / 1e9:.2f} B trainable parameters, {local_ranks} of {world} ranks here) but "
        f"{available / GiB:.1f} GiB is available; use more nodes, LoRA, offload to \"nvme\", keep part "
        "of the optimizer on the GPU (ZeRO stage 3, offload_optimizer.ratio below 1), or no offload")


def release_optimizer_state(engine: Any) -> int:
    """Drop the optimizer's master weights, moments and gradient buffers once training is over; returns the
    bytes let go. The module's own (trained) weights are never touched: with fp32 and no ZeRO the optimizer
    updates them in place, so they are skipped."""
    wrapper = getattr(engine, "optimizer", None)
    if wrapper is None:
        return 0
    inner = getattr(wrapper, "optimizer", wrapper)
    if hasattr(wrapper, "bit16_groups") or hasattr(wrapper, "bf16_groups"):
        # ZeRO 1/2 and the bf16 optimizer keep views of the master weights on every parameter (`_hp_mapping`);
        # their destroy() drops those views and the gradient hooks. Stage 3's would also remove the hooks the
        # export's parameter gathering needs, so it is not called there.
        wrapper.destroy()
    # Stage 3 hands its fp32 partitions to the inner optimizer only during a step; between steps they live
    # on the wrapper. Where fp32 training shares them with the 16-bit partitions, they are the weights.
    masters = [p for group in inner.param_groups for p in group["params"]]
    masters += list(getattr(wrapper, "fp32_partitioned_groups_flat", []))
    keep = {id(p) for p in engine.module.parameters()}
    keep |= {id(t) for t in getattr(wrapper, "fp16_partitioned_groups_flat", [])}
    released = 0
    # ZeRO-3 with offload_optimizer.ratio below 1 steps its GPU-resident sub-groups with a second optimizer.
    optimizers = [o for o in (inner, getattr(wrapper, "backup_optimizer", None)) if o is not None]
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    released += value.numel() * value.element_size()
        opt.state.clear()
    seen: set[int] = set()
    for p in masters:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is not None:
            released += p.grad.numel() * p.grad.element_size()
            p.grad = None
        if id(p) not in keep:
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released
