"""Reference: Hugging Face Trainer + DeepSpeed ZeRO-2, bf16, on the same shape and packed token stream.

  python3 -m deepspeed.launcher.runner --num_gpus 1 bench/hf_trainer_ref.py --model llama1b --micro 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.shapes import model_config  # noqa: E402


class RandomTokens(Dataset):
    def __init__(self, vocab: int, seq: int) -> None:
        self.vocab, self.seq = vocab, seq

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq,))
        return {"input_ids": ids, "labels": ids}


class Timer(TrainerCallback):
    def __init__(self, skip: int, steps: int) -> None:
        self.skip, self.steps, self.t0, self.dt = skip, steps, 0.0, 0.0

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.skip:
            torch.cuda.synchronize()
            self.t0 = time.time()
        if state.global_step == self.steps:
            torch.cuda.synchronize()
            self.dt = time.time() - self.t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--model", default="llama1b")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5)
    a = p.parse_args()
    cfg = model_config(a.model)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    n_params = sum(x.numel() for x in model.parameters())
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
          "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
          "gradient_clipping": "auto"}
    args = TrainingArguments(output_dir="/tmp/hf-ref", per_device_train_batch_size=a.micro, max_steps=a.steps,
                             bf16=True, learning_rate=1e-4, weight_decay=0.01, logging_steps=10**6, save_strategy="no",
                             report_to=[], deepspeed=ds, dataloader_num_workers=2)
    timer = Timer(a.skip, a.steps)
    torch.cuda.reset_peak_memory_stats()
    Trainer(model=model, args=args, train_dataset=RandomTokens(cfg.vocab_size, a.seq), callbacks=[timer]).train()
    tps = (a.steps - a.skip) * a.micro * a.seq / timer.dt
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    print(json.dumps({"recipe": "hf_trainer_zero2", "model": a.model, "micro": a.micro, "seq": a.seq,
                      "real_tokens_per_s": round(tps),
                      # Its rows are random tokens attended causally across the whole row, so the full-row term is
                      # what it attends; mfu_6n_pct counts the dense products alone (trainer/flops.py).
                      "mfu_real_pct": round(100 * tps * (6 * n_params + 12 * L * H * a.seq) / 989e12, 2),
                      "mfu_6n_pct": round(100 * tps * 6 * n_params / 989e12, 2),
                      "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)


if __name__ == "__main__":
    main()
