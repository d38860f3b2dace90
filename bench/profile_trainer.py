"""Where a training step's time goes: the trainer's own recipe, in-process, under torch.profiler for a few
optimizer steps. Prints one JSON line (GPU time per step by kind of kernel, and the GPU's idle share of the
wall time) and writes the profiler's kernel table beside it.

  python3 -m deepspeed.launcher.runner --num_gpus 1 --module bench.profile_trainer --model llama1b --zero 3 \
      --steps 9 --active 3 --table /tmp/profile-z3.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from bench.run_trainer import build_run
from contract.spec import RunSpec

# Kernel names to the parts of a step they belong to; the first matching pattern wins.
KINDS = (
    ("attention", ("flash", "fmha", "attention")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
    ("optimizer", ("multi_tensor", "adam")),
    ("fused_elementwise", ("rms_norm", "swiglu", "rope", "triton")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90")),
    ("copy", ("memcpy", "memset", "copy", "cat", "fill")),
    ("collective", ("nccl",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pats in KINDS if any(p in low for p in pats)), "other_elementwise")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="llama1b")
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--active", type=int, default=3, help="profiled optimizer steps, the last ones before the end")
    p.add_argument("--table", default="/tmp/profile.txt")
    p.add_argument("--work", default="/tmp/bench-profile")
    a = p.parse_args()
    ns = argparse.Namespace(model=a.model, zero=a.zero, precision="bf16", offload="none", seq=2048, global_batch=32,
                            micro="auto", steps=a.steps, tokens=4_000_000, attn="auto", compile="auto",
                            kernels=a.kernels, ckpt=False, lora=False, no_pin=False, offload_ratio=1.0, gpus=1)
    run_spec = RunSpec.model_validate_json(build_run(ns, Path(a.work)).read_text())

    from deepspeed.runtime.engine import DeepSpeedEngine

    from trainer import recipe

    wait = a.steps - a.active - 1
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=wait, warmup=1, active=a.active, repeat=1))
    marks: dict[str, float] = {}
    original = DeepSpeedEngine.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = self.global_steps
        out = original(self, *args, **kwargs)
        if self.global_steps != before:
            if self.global_steps in (wait + 1, wait + 1 + a.active):
                torch.cuda.synchronize()
                marks["start" if self.global_steps == wait + 1 else "end"] = time.perf_counter()
            prof.step()
        return out

    DeepSpeedEngine.step = step  # type: ignore[method-assign]
    prof.start()
    try:
        recipe.run(run_spec)
    finally:
        prof.stop()
        recipe.cleanup()
    by_kind: dict[str, float] = defaultdict(float)
    busy = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", 0.0) or 0.0
        # ProfilerStep* spans whole steps on the GPU timeline too: a range, not a kernel.
        if t and ev.device_type == torch.autograd.DeviceType.CUDA and not ev.key.startswith("ProfilerStep"):
            by_kind[kind_of(ev.key)] += t
            busy += t
    wall_ms = (marks["end"] - marks["start"]) * 1e3 / a.active if {"start", "end"} <= marks.keys() else None
    per_step = {k: round(v / 1e3 / a.active, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    Path(a.table).write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=60))
    print(json.dumps({"recipe": "profile", "model": a.model, "zero": a.zero, "kernels": a.kernels,
                      "active_steps": a.active, "wall_ms_per_step": wall_ms and round(wall_ms, 1),
                      "gpu_busy_ms_per_step": round(busy / 1e3 / a.active, 1), "gpu_ms_per_step_by_kind": per_step}),
          flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
