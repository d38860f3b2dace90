"""What DeepSpeed's pipeline engine costs on one device: P = 1 through the pipeline engine vs the plain engine.

One process, one device, the same random-initialised model, rows, micro batch and accumulation for both; the
pipeline side runs the trainer's own stages (trainer/pipeline.py: the model's layers as pipeline layers,
`train_batch()` over the accumulation steps as micro batches), the plain side the trainer's plain loop
(forward, backward per micro batch, step). Both use the model's own SDPA attention and DeepSpeed ZeRO-1, so
the difference is the engine's. Prints one JSON line: tokens/s of each and the ratio.

  python3 -m bench.pipeline_overhead --model llama1b --seq-len 2048 --micro 4 --accum 4 --steps 20
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


def _timed(step: Any, a: argparse.Namespace, sync: Any) -> float:
    for _ in range(a.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    return a.steps * a.micro * a.accum * a.seq_len / (time.perf_counter() - start)


def plain(config: PretrainedConfig, a: argparse.Namespace, device: str, sync: Any) -> float:
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

    tps = _timed(step, a, sync)
    engine.destroy()
    return tps


def pipelined(config: PretrainedConfig, a: argparse.Namespace, device: str, sync: Any) -> float:
    import deepspeed

    from trainer.pipeline import build, micro_batch

    pipe = build(_model(config, a, device), 1, "parameters")
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=_config(a))
    scale = a.accum / (a.micro * (a.seq_len - 1) * a.accum)
    ones = torch.ones(a.micro)
    batches = [micro_batch(b, scale, ones) for b in _batches(config, a)]

    def step() -> None:
        engine.train_batch(iter(batches))

    tps = _timed(step, a, sync)
    engine.destroy()
    return tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama1b", help="a shape of bench/shapes.py (llama1b, llama3b, ...)")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer toy model on the CPU")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    a = parser.parse_args()
    if a.tiny:
        a.seq_len, a.micro, a.accum, a.steps, a.warmup, a.precision = 128, 2, 2, 3, 1, "fp32"
    config = TINY if a.tiny else model_config(a.model)
    _init_single_process()
    cuda = torch.cuda.is_available() and not a.tiny
    device = "cuda:0" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Plain first, then the pipeline: each engine is destroyed and its memory freed before the next.
    result: dict[str, Any] = {"model": "tiny" if a.tiny else a.model, "device": device,
                              "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
                              "seq_len": a.seq_len, "micro": a.micro, "accum": a.accum, "steps": a.steps,
                              "precision": a.precision}
    result["plain_tokens_per_second"] = plain(config, a, device, sync)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    result["pipeline_tokens_per_second"] = pipelined(config, a, device, sync)
    result["pipeline_over_plain"] = result["pipeline_tokens_per_second"] / result["plain_tokens_per_second"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
