"""What DeepSpeed's pipeline engine costs on one device: P = 1 through the pipeline engine vs the plain engine.

One process, one device, the same random-initialised model, rows, micro batch and accumulation for every arm:

- `plain`: the trainer's plain loop (forward, backward per micro batch, step) on the plain DeepSpeed engine;
- `pipe`: the trainer's own pipeline stages (trainer/pipeline.py: the model's layers as pipeline layers, each
  decoder layer rebuilding its mask and rotary embedding from the position ids) under `train_batch()`;
- `pipe_whole` (optional): the pipeline engine over the whole model as its one layer, with the same loss as
  `pipe`: the engine's own cost, apart from what splitting the model into layers costs.

All use the model's own SDPA attention and DeepSpeed ZeRO-1, no activation checkpointing. Every arm is built once;
each runs `--warmup` steps (excluded from every figure), then `--repeats` rounds each time `--steps` steps of every
arm, the arms' order rotating from round to round, so that a drift of the machine falls on all of them. A round's
ratio is an arm's tokens/s over the plain engine's in the same round; the line printed last gives, per arm, the
median tokens/s and the median and spread (min-max) of its ratio. `--profile` then runs one more step of each arm
under torch.profiler: wall and GPU-busy time, kernels, host synchronisations, GPU time by kind of kernel, and the
operators whose GPU time differs most between the arms (tables written to `--tables`).

  python3 -m bench.pipeline_overhead --model llama1b --seq-len 2048 --micro 4 --accum 4 --steps 8 --repeats 5 \
      --arms plain,pipe_whole,pipe --profile --tables /tmp/pipeline-tables
  python3 -m bench.pipeline_overhead --tiny          # CPU, a few seconds: proves the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from bench.shapes import model_config
from trainer.recipe import _skip_shared_memory_collectives

TINY = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)


def _init_single_process() -> None:
    import deepspeed

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    # As the trainer does: on the CPU, no shared-memory all-reduce op (built on first use, minutes, unused).
    _skip_shared_memory_collectives()
    deepspeed.init_distributed()


def _config(a: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": a.accum,
        "train_batch_size": a.micro * a.accum, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": not torch.cuda.is_available()}},
        "zero_optimization": {"stage": 1},
    }
    if a.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _model(config: PretrainedConfig, a: argparse.Namespace, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def _batches(config: PretrainedConfig, a: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(a.accum):
        ids = torch.randint(0, config.vocab_size, (a.micro, a.seq_len), generator=g)
        pos = torch.arange(a.seq_len).expand(a.micro, -1).contiguous()
        out.append({"input_ids": ids, "labels": ids.clone(), "position_ids": pos})
    return out


class WholeModel(torch.nn.Module):
    """The whole model as one pipeline layer: (input ids, position ids) -> logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model(input_ids=inputs[0], position_ids=inputs[1], use_cache=False).logits


def plain(config: PretrainedConfig, a: argparse.Namespace, device: str) -> tuple[Any, Any]:
    import deepspeed

    from trainer.kernels import token_loss_sum

    model = _model(config, a, device)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(a))
    batches = _batches(config, a)
    scale = a.accum / (a.micro * (a.seq_len - 1) * a.accum)

    def step() -> None:
        for batch in batches:
            engine.backward(token_loss_sum(engine, dict(batch), device) * scale)
            engine.step()

    return step, engine


def pipelined(config: PretrainedConfig, a: argparse.Namespace, device: str, whole: bool) -> tuple[Any, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from trainer.pipeline import TokenLoss, build, micro_batch

    model = _model(config, a, device)
    pipe = (PipelineModule(layers=[WholeModel(model)], num_stages=1, loss_fn=TokenLoss(), partition_method="uniform")
            if whole else build(model, 1, "parameters"))
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=_config(a))
    scale = a.accum / (a.micro * (a.seq_len - 1) * a.accum)
    ones = torch.ones(a.micro)
    batches = [micro_batch(b, scale, ones) for b in _batches(config, a)]

    def step() -> None:
        engine.train_batch(iter(batches))
        engine.module.loss_fn.take()  # as the trainer's train_step does (one host read of the summed loss)

    return step, engine


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


# Names of host-side waits for the device, and of the host reads that cause one.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def profile_step(name: str, step: Any, sync: Any, cuda: bool, tables: str | None) -> tuple[dict[str, Any], Any]:
    """One step under torch.profiler: wall and GPU-busy ms, kernels, host waits, GPU ms by kind of kernel."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_trainer import kind_of

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    device_ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith("ProfilerStep") and not getattr(e, "is_user_annotation", False)]
    spans = sorted((e.time_range.start, e.time_range.end) for e in device_ev)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:  # the union of kernel intervals: time the GPU was doing anything
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    by_kind: dict[str, float] = {}
    for e in averages:
        t = getattr(e, "self_device_time_total", 0.0) or 0.0
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + t / 1e3
    counts = {e.key: e.count for e in averages}
    if tables:
        os.makedirs(tables, exist_ok=True)
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(os.path.join(tables, f"{name}.txt"), "w") as f:
            f.write(averages.table(sort_by=sort, row_limit=60))
            f.write("\n\n")
            f.write(averages.table(sort_by="count", row_limit=40))
    out = {"wall_ms": round(wall * 1e3, 1), "gpu_busy_ms": round(busy / 1e3, 1),
           "gpu_idle_ms": round(wall * 1e3 - busy / 1e3, 1), "kernels": len(device_ev),
           "host_waits": {k: counts[k] for k in SYNCS if counts.get(k)},
           "cpu_ops": sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
           "gpu_ms_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}
    return out, averages


def op_differences(averages: dict[str, Any], base: str, cuda: bool, top: int = 12) -> list[dict[str, Any]]:
    """The operators whose self time (GPU on a GPU, else CPU) differs most from the `base` arm's, per step."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    table: dict[str, dict[str, tuple[float, int]]] = {}
    for arm, avg in averages.items():
        for e in avg:
            if e.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU):
                table.setdefault(e.key, {})[arm] = ((getattr(e, attr, 0.0) or 0.0) / 1e3, e.count)
    rows = []
    for key, per in table.items():
        b = per.get(base, (0.0, 0))
        worst = max((arm for arm in averages if arm != base), key=lambda arm: abs(per.get(arm, (0.0, 0))[0] - b[0]))
        rows.append((abs(per.get(worst, (0.0, 0))[0] - b[0]), key, per))
    rows.sort(reverse=True)
    return [{"op": key[:90], **{f"{arm}_ms": round(per.get(arm, (0.0, 0))[0], 2) for arm in averages},
             **{f"{arm}_n": per.get(arm, (0.0, 0))[1] for arm in averages}} for _, key, per in rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama1b", help="a shape of bench/shapes.py (llama1b, llama3b, ...)")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer toy model on the CPU")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per arm per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each times every arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm before the first round")
    parser.add_argument("--arms", default="plain,pipe", help="plain (always the base), pipe, pipe_whole")
    parser.add_argument("--profile", action="store_true", help="then profile one step of each arm")
    parser.add_argument("--tables", default=None, help="folder for the profiler's tables, one file per arm")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    a = parser.parse_args()
    if a.tiny:
        a.seq_len, a.micro, a.accum, a.steps, a.warmup, a.precision = 128, 2, 2, 2, 1, "fp32"
        a.repeats = min(a.repeats, 2)
    arms = ["plain"] + [x for x in a.arms.split(",") if x and x != "plain"]
    unknown = set(arms) - {"plain", "pipe", "pipe_whole"}
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}")
    config = TINY if a.tiny else model_config(a.model)
    _init_single_process()
    cuda = torch.cuda.is_available() and not a.tiny
    device = "cuda:0" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = a.micro * a.accum * a.seq_len
    # Every arm is built up front (same seed, same weights) and stays resident, so rounds can alternate.
    steps: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    for arm in arms:
        steps[arm], engines[arm] = (plain(config, a, device) if arm == "plain"
                                    else pipelined(config, a, device, whole=arm == "pipe_whole"))
        gc.collect()
    for arm in arms:
        for _ in range(a.warmup):
            steps[arm]()
    sync()
    tps: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(a.repeats):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            sync()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                steps[arm]()
            sync()
            tps[arm].append(a.steps * tokens / (time.perf_counter() - t0))
        print(json.dumps({"round": r, "order": order, **{f"{arm}_tokens_per_second": round(tps[arm][-1])
                                                          for arm in arms}}), flush=True)
    result: dict[str, Any] = {
        "recipe": "pipeline_overhead", "model": "tiny" if a.tiny else a.model, "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu", "seq_len": a.seq_len, "micro": a.micro,
        "accum": a.accum, "precision": a.precision, "warmup_steps_excluded": a.warmup, "steps_per_round": a.steps,
        "repeats": a.repeats,
        "activation_checkpoint_interval": {arm: getattr(engines[arm].module, "activation_checkpoint_interval", None)
                                           for arm in arms if arm != "plain"},
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None}
    for arm in arms:
        result[f"{arm}_tokens_per_second"] = {"median": round(_median(tps[arm])), "min": round(min(tps[arm])),
                                              "max": round(max(tps[arm])), "rounds": [round(x) for x in tps[arm]]}
    for arm in arms[1:]:
        ratios = [x / y for x, y in zip(tps[arm], tps["plain"], strict=True)]
        result[f"{arm}_over_plain"] = {"median": round(_median(ratios), 4), "min": round(min(ratios), 4),
                                       "max": round(max(ratios), 4), "rounds": [round(x, 4) for x in ratios]}
    if a.profile:
        profiles, averages = {}, {}
        for arm in arms:
            steps[arm]()  # one more untimed step, so the profiled one starts like the others
            profiles[arm], averages[arm] = profile_step(arm, steps[arm], sync, cuda, a.tables)
        result["profile_one_step"] = profiles
        for row in op_differences(averages, "plain", cuda):
            print(json.dumps({"op_difference": row}), flush=True)
    for engine in engines.values():
        engine.destroy()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
