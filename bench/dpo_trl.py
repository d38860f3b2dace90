"""The reference for bench/dpo.py: trl's `DPOTrainer` on the same model shape, pairs and tokenizer, with DeepSpeed
ZeRO-2 through its TrainingArguments `deepspeed=` dict, bf16. Run under the DeepSpeed launcher, one process:

  python3 -m deepspeed.launcher.runner --num_gpus 1 bench/dpo_trl.py --model-dir DIR --pairs PAIRS.jsonl \
      --micro 8 --accum 9 --max-length 1024 --beta 0.1 --steps 15 --skip 5 [--precompute] [--gradient-checkpointing]

The reference is trl's default, a second frozen copy of the model (trl builds it from the model's path; the model
here is built from its config with random weights and has no path, so the copy is handed over as `ref_model`,
which trl then prepares exactly as its own), or with `--precompute` its `precompute_ref_log_probs=True` (one pass
before training, no second copy). Gradient checkpointing is off unless asked (DPOConfig's default is on; this
repository's trainer recomputes nothing by default).

Prints one JSON line (`{"trl": {...}}`): real tokens/s over the steps after `--skip` (trl's own count of the
attention mask, both sides, prompt included, no padding), its steps/s, Σ d² of those steps' sequences for the
attended MFU, the precompute pass's seconds, and the peak GPU memory of the training loop.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--micro", type=int, default=8, help="pairs per micro batch")
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True")
    p.add_argument("--precompute-batch", type=int, default=None, help="precompute_ref_batch_size")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true", help="CPU smoke test only")
    p.add_argument("--work", default="/tmp/bench-dpo-trl")
    return p


def main() -> None:
    a = parser().parse_args()
    import trl
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    t_start = time.time()
    on_gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    config = AutoConfig.from_pretrained(a.model_dir)
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    ref_model = None if a.precompute else copy.deepcopy(model).eval().requires_grad_(False)
    rows = [json.loads(line) for line in Path(a.pairs).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                                 for r in rows])
    ds = None if a.no_deepspeed else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "bf16": {"enabled": "auto"},
        # On a CPU (the smoke test) DeepSpeed's fused Adam would be compiled first; torch's AdamW does the same update.
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                  **({} if on_gpu else {"torch_adam": True})}},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "gradient_clipping": "auto"}
    args = DPOConfig(
        output_dir=str(Path(a.work) / "out"), per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.accum,
        max_steps=a.steps, learning_rate=a.lr, weight_decay=0.0, warmup_steps=0, beta=a.beta, loss_type=["sigmoid"],
        max_length=a.max_length, precompute_ref_log_probs=a.precompute, precompute_ref_batch_size=a.precompute_batch,
        gradient_checkpointing=a.gradient_checkpointing, bf16=True, logging_steps=a.steps, save_strategy="no",
        report_to=[], deepspeed=ds, dataloader_num_workers=0, seed=0, use_cpu=not on_gpu)

    precompute_s: list[float] = []
    original = DPOTrainer._precompute_ref_logps

    def timed_precompute(self: Any, dataset: Any, name: str, batch_size: int) -> Any:
        _sync()
        t0 = time.time()
        out = original(self, dataset, name, batch_size)
        _sync()
        precompute_s.append(time.time() - t0)
        return out

    DPOTrainer._precompute_ref_logps = timed_precompute  # type: ignore[method-assign]

    class Counted(DPOTrainer):
        """Σ d² of the sequences each training micro batch computes (d: a side's real tokens), on the device."""

        attended = torch.zeros((), dtype=torch.float64)

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if model.training:
                d = inputs["attention_mask"].sum(dim=1).double()
                self.attended = self.attended.to(d.device) + (d * d).sum()
                self.padded = getattr(self, "padded", 0) + inputs["attention_mask"].numel()
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Timer(TrainerCallback):
        """From the end of step `skip` to the end of the last step, the device synchronised at both ends."""

        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0
            self.tokens0 = self.tokens1 = 0
            self.attended0 = self.attended1 = 0.0
            self.padded0 = self.padded1 = 0
            self.step_times: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            self.begin = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step_times.append(time.time())
            if state.global_step in (a.skip, a.steps):
                _sync()
                mark = (time.time(), trainer._total_train_tokens, float(trainer.attended),
                        getattr(trainer, "padded", 0))
                if state.global_step == a.skip:
                    self.t0, self.tokens0, self.attended0, self.padded0 = mark
                else:
                    self.t1, self.tokens1, self.attended1, self.padded1 = mark

    timer = Timer()
    t_init = time.time()
    trainer = Counted(model=model, ref_model=ref_model, args=args, processing_class=tokenizer, train_dataset=dataset,
                      callbacks=[timer])
    init_s = time.time() - t_init
    trainer.train()
    dt = timer.t1 - timer.t0
    tokens = timer.tokens1 - timer.tokens0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {
        "trl_version": trl.__version__, "n_params": n_params, "layers": config.num_hidden_layers,
        "hidden": config.hidden_size, "micro_pairs": a.micro, "accum": a.accum, "global_pairs": a.micro * a.accum,
        "steps": trainer.state.global_step, "skip": a.skip, "steady_steps": a.steps - a.skip,
        "steady_s": round(dt, 3), "steady_real_tokens": tokens,
        "real_tokens_per_s": round(tokens / dt, 1) if dt > 0 else None,
        "steps_per_s": round((a.steps - a.skip) / dt, 4) if dt > 0 else None,
        "attended_d2": timer.attended1 - timer.attended0,
        "padded_tokens": timer.padded1 - timer.padded0,
        "precompute_s": round(sum(precompute_s), 2) if precompute_s else None,
        "trainer_init_s": round(init_s, 2), "process_s": round(time.time() - t_start, 1),
        "first_step_s": round(timer.step_times[0] - timer.begin, 2) if timer.step_times else None,
        "first_step_end_ts": timer.step_times[0] if timer.step_times else None,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "reference": "precomputed" if a.precompute else "model copy",
        "gradient_checkpointing": a.gradient_checkpointing, "loss_logged": losses[-1] if losses else None,
        "deepspeed": ds is not None,
    }
    print(json.dumps({"trl": out}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
