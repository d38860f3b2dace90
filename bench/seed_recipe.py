"""The seed document's recipe, made runnable on synthetic data: the baseline this service is measured against.

As in the document: GPT-2, every line tokenized with padding to 128 (empty lines too), micro batch 1,
gradient accumulation 4, the document's DeepSpeed config (fp16, ZeRO-2, optimizer offloaded to the CPU),
loss on every position as the script computes it. Only real (non-padding) tokens count as throughput.

  python3 -m deepspeed.launcher.runner --num_gpus 1 bench/seed_recipe.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.shapes import model_config  # noqa: E402
from bench.synthetic import line_lengths  # noqa: E402

SEED_CONFIG = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0001, "weight_decay": 0.01}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_scatter": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e8, "allgather_partitions": True},
    "gradient_clipping": 1.0, "steps_per_print": 100000, "wall_clock_breakdown": False,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5)
    a = p.parse_args()
    cfg = model_config("gpt2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    n_params = sum(x.numel() for x in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=SEED_CONFIG, model_parameters=model.parameters())
    lens = line_lengths(200_000)
    seq = 128
    gas = engine.gradient_accumulation_steps()
    i, real, t0 = 0, 0, None
    torch.cuda.reset_peak_memory_stats()
    for step in range(a.steps):
        if step == a.skip:
            torch.cuda.synchronize()
            t0, real = time.time(), 0
        for _ in range(gas):
            ids = torch.randint(0, cfg.vocab_size, (1, seq), device=engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            real += int(min(lens[i], seq))
            i += 1
    torch.cuda.synchronize()
    tps = real / (time.time() - t0)
    flops = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * seq
    print(json.dumps({"recipe": "seed", "model": "gpt2", "params_M": round(n_params / 1e6, 1), "seq": seq,
                      "micro": 1, "real_tokens_per_s": round(tps), "mfu_real_pct": round(100 * tps * flops / 989e12, 3),
                      "mfu_6n_pct": round(100 * tps * 6 * n_params / 989e12, 3),
                      "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)


if __name__ == "__main__":
    main()
