"""Runs this service's trainer (`python -m trainer` under the DeepSpeed launcher) on a benchmark shape.

Builds the job the way the API does (JobSpec -> resolve -> RunSpec), runs the real launcher, reads the
trainer's JSON events and prints one JSON line: real tokens/s in steady state (from step `--skip` on: the first
steps, which compile and warm up, excluded) and over every step (from the `started` event to the last step:
model load and the micro-batch probe excluded, warm-up included), and the trainer's three MFU figures over the
steady state, each counted on real tokens against 989 TFLOP/s (trainer/flops.py defines them):
`mfu_real_pct` 6N + 12·L·H·seq per token (the reference scripts' formula: attention over the whole row),
`mfu_6n_pct` 6N alone, `mfu_attended_pct` 6N plus attention over the documents the trainer attends; peak memory.

  python3 -m bench.run_trainer --model llama1b --zero 2 --steps 30 --work /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.shapes import model_config
from bench.synthetic import write_documents, write_model_dir, write_stdlib_text
from contract.codes import EventKind
from contract.deepspeed import ResolveLimits, resolve
from contract.spec import JobSpec, RunSpec

PEAK = 989e12
ROOT = Path(__file__).resolve().parent.parent


def build_run(a: argparse.Namespace, work: Path) -> Path:
    model_dir = write_model_dir(work / "models" / a.model, model_config(a.model))
    if a.corpus == "stdlib":
        data = work / "data" / "stdlib-docs.txt"
        if not data.exists():
            write_stdlib_text(data)
    else:
        data = work / "data" / f"docs-{a.tokens}.txt"
        if not data.exists():
            write_documents(data, a.tokens)
    job: dict[str, Any] = {
        "name": f"bench-{a.model}", "model": {"name_or_path": str(model_dir), "init": "random",
                                               "attn_implementation": a.attn, "kernels": a.kernels},
        "data": {"train": str(data), "format": "text", "validation_fraction": a.val_fraction},
        "hyperparameters": {"max_steps": a.steps, "seq_len": a.seq, "global_batch_size": a.global_batch,
                            "micro_batch_size": a.micro if a.micro == "auto" else int(a.micro),
                            "learning_rate": a.lr, "warmup_steps": a.warmup, "weight_decay": 0.01,
                            "optimizer": a.optimizer, "eval_every_steps": a.eval_every},
        "deepspeed": {"zero_stage": a.zero, "precision": a.precision, "offload_optimizer": a.offload,
                      "activation_checkpointing": a.ckpt, "compile": a.compile},
        "resources": {"num_gpus": a.gpus, "on_oom": a.on_oom},
    }
    if a.offload != "none" and (a.no_pin or a.offload_ratio < 1.0):
        block: dict[str, Any] = {"device": a.offload}
        zero: dict[str, Any] = {"offload_optimizer": block}
        if a.no_pin:
            # Pinned host memory cannot be paged out; for an optimizer that fills most of host memory, plain pages fit.
            block["pin_memory"] = False
        if a.offload_ratio < 1.0:
            # ZeRO-3 splits the optimizer by sub-group; smaller groups than the default 1e9 make the split finer.
            block["ratio"] = a.offload_ratio
            zero["sub_group_size"] = 500_000_000
        job["deepspeed"]["config"] = {"zero_optimization": zero}
    if a.lora:
        job["lora"] = {"rank": 16, "alpha": 32, "target_modules": "all-linear"}
    resolved = resolve(JobSpec.model_validate(job), limits=ResolveLimits())
    tag = (f"{a.model}-z{a.zero}-{a.precision}-{a.offload}-{'lora' if a.lora else 'full'}-{a.kernels}-"
           f"{a.optimizer}-{a.label}")
    job_dir = work / "jobs" / tag
    run = RunSpec(job=resolved, paths={"job_dir": str(job_dir), "checkpoint_dir": str(job_dir / "ckpt"),
                                       "output_dir": str(job_dir / "out")})
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = job_dir / "spec.json"
    spec.write_text(run.model_dump_json(indent=2))
    return spec


def figures(events: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    progress = [e for e in events if e.get("event") == EventKind.PROGRESS]
    # The last `started`: the setting that trained (the OOM ladder starts once per setting it tries).
    started = next((e for e in reversed(events) if e.get("event") == EventKind.STARTED), {})
    steady = [e for e in progress if e["step"] >= skip]
    out: dict[str, Any] = {"steps": progress[-1]["step"] if progress else 0,
                           "micro_batch_size": started.get("micro_batch_size"),
                           "gradient_accumulation_steps": started.get("gradient_accumulation_steps"),
                           "packing_efficiency": started.get("packing_efficiency"),
                           "params_M": round((started.get("n_params") or 0) / 1e6, 1),
                           "adjustments": started.get("adjustments")}
    if progress:
        out["first_loss"] = round(progress[0]["loss"], 4)
    if len(steady) >= 2:
        first, last = steady[0], steady[-1]
        tps = (last["tokens_seen"] - first["tokens_seen"]) / (last["ts"] - first["ts"])
        out["real_tokens_per_s"] = round(tps)
        out["steady_from_step"] = first["step"]
        if started.get("ts") and progress and not started.get("resumed_from_step"):
            # Every step, the first (compile, warm-up) included; what ran before the loop (load, probe) is not.
            out["real_tokens_per_s_all_steps"] = round(last["tokens_seen"] / (last["ts"] - started["ts"]))
        for field, key in (("mfu", "mfu_real_pct"), ("mfu_6n", "mfu_6n_pct"), ("mfu_attended", "mfu_attended_pct")):
            # Each event's figure over its window's tokens/s is FLOPs per token over the peak: the steady mean of
            # that, times the steady tokens/s. Null off a known GPU, or from a trainer without the field.
            per = [e[field] / e["tokens_per_second"] for e in steady[1:] if e.get(field) and e["tokens_per_second"]]
            out[key] = round(100 * tps * sum(per) / len(per), 2) if per else None
        out["peak_gpu_GiB"] = round((last.get("peak_memory_bytes") or 0) / 2**30, 2)
        out["final_loss"] = round(last["loss"], 4)
    resolved = next((e for e in events if e.get("event") == EventKind.RESOLVED), None)
    if resolved:
        out["auto_reason"] = resolved.get("reason")
    adapted = [e for e in events if e.get("event") == EventKind.ADAPTED]
    if adapted:
        out["adapted"] = [{"phase": e["phase"], "step": e["step"], "change": e["change"],
                           "error": e["error"][:160]} for e in adapted]
        out["memory_setting"] = started.get("memory_setting")
    evals = [e for e in events if e.get("event") == EventKind.EVAL]
    if evals:
        out["eval_loss"] = {e["step"]: round(e["loss"], 4) for e in evals}
    err = next((e for e in events if e.get("event") == EventKind.ERROR), None)
    if err:
        out["error"] = f"{err.get('code')}: {str(err.get('message'))[:300]}"
    return out


def compile_log(text: str) -> dict[str, int]:
    """torch.compile's own words in the run's log: recompilations, and the warning that a function hit the
    recompile limit and runs eagerly from then on (what must never happen in a benchmark row)."""
    return {"recompiles": text.count("Recompiling function"),
            "recompile_limit_warnings": len(re.findall(r"recompile_limit|cache_size_limit", text)),
            "graph_break_warnings": text.count("Graph break")}


def exported(spec: Path) -> dict[str, Any]:
    """The committed export's weight size: evidence in the figure line that the run got past its export."""
    out = Path(RunSpec.model_validate_json(spec.read_text()).paths.output_dir)
    if not (out / "COMPLETE").exists():
        return {"export_GB": None}
    return {"export_GB": round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9, 2)}


def heldout_loss(model: Any, blocks: Any, micro: int = 4) -> float:
    """Token-weighted next-token cross entropy over every row of `blocks`, as the trainer's evaluation counts it
    (labels not IGNORE; position ids passed, so packed documents stay apart), with the model's own modules."""
    import torch
    import torch.nn.functional as F

    from trainer.data import IGNORE

    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(blocks), micro):
            batch = blocks.batch(list(range(lo, min(lo + micro, len(blocks)))))
            labels = batch.pop("labels")[:, 1:].to(model.device)
            logits = model(**{k: v.to(model.device) for k, v in batch.items()}, use_cache=False).logits[:, :-1]
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=IGNORE, reduction="sum"))
            count += int((labels != IGNORE).sum())
    return total / max(count, 1)


def reload_export(spec: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Load the committed export the way a user would (transformers, safetensors) and check that the trained
    weights survived: its loss on the job's held-out documents (the validation rows the trainer evaluated:
    whole documents of the training distribution it never trained on) against the trainer's last evaluation
    loss, and a few generated tokens. A model that lost its training scores near its step-1 loss instead."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import IGNORE, load_blocks

    run = RunSpec.model_validate_json(spec.read_text())
    out, job = Path(run.paths.output_dir), run.job.spec
    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map=device)
    loaded_s = round(time.time() - t0, 1)
    row: dict[str, Any] = {"reload_params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                           "reload_s": loaded_s}
    _, val = load_blocks(job.data, run.paths, AutoTokenizer.from_pretrained(out), job.hyperparameters.seq_len,
                         job.hyperparameters.seed)
    evals = [e for e in events if e.get("event") == EventKind.EVAL]
    if val is None or not evals:
        row["reload_check"] = "no held-out data (run with --val-fraction): the weights' survival is not checked"
    else:
        loss = heldout_loss(model, val)
        row.update({"reload_heldout_loss": round(loss, 4), "trainer_eval_loss": round(evals[-1]["loss"], 4),
                    "reload_minus_trainer": round(loss - evals[-1]["loss"], 4),
                    "heldout_tokens": int((val.labels[:, 1:] != IGNORE).sum())})
    ids = torch.as_tensor(val.input_ids[:1, :16] if val is not None else [[1] * 16], device=device)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    row["reload_generated_tokens"] = int(gen.shape[1] - 16)
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama1b")
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--offload", default="none")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro", default="auto")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=8, help="steps excluded from the steady state (warm-up, compile)")
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--attn", default="auto")
    p.add_argument("--compile", default="auto")
    p.add_argument("--kernels", default="auto", help="auto: Liger where installed; torch: the model's own modules")
    p.add_argument("--log", default=None, help="write the launcher's whole output here")
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--no-pin", action="store_true", help="offloaded optimizer state in pageable host memory")
    p.add_argument("--offload-ratio", type=float, default=1.0, help="ZeRO-3: share of the optimizer on the CPU")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--work", default="/tmp/bench")
    p.add_argument("--label", default="trainer")
    p.add_argument("--optimizer", default="adamw", help="hyperparameters.optimizer: adamw | adamw_bf16")
    p.add_argument("--on-oom", default="fail", help="resources.on_oom: fail | adapt")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--corpus", default="letters", help="letters: synthetic.py's stream; stdlib: English docstrings")
    p.add_argument("--val-fraction", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--events", default=None, help="write the trainer's JSON events here")
    p.add_argument("--reload", action="store_true",
                   help="load the export afterwards: its held-out loss against the trainer's last eval loss "
                        "(needs --val-fraction)")
    return p


def main() -> None:
    a = parser().parse_args()
    spec = build_run(a, Path(a.work))
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(a.gpus), "--module", "trainer",
            "--spec", str(spec)]
    # TORCH_LOGS=recompiles: every recompilation is logged with its reason, so the row can count them.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TORCH_LOGS": os.environ.get("TORCH_LOGS", "recompiles")}
    t0 = time.time()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    events = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    row = {"recipe": a.label, "model": a.model, "zero": a.zero, "precision": a.precision, "offload": a.offload,
           "lora": a.lora, "seq": a.seq, "global_batch": a.global_batch, "activation_checkpointing": a.ckpt,
           "pin_memory": not a.no_pin, "offload_ratio": a.offload_ratio, "kernels": a.kernels,
           "exit": proc.returncode, "wall_s": round(time.time() - t0, 1), **figures(events, a.skip),
           **exported(spec), **compile_log(proc.stdout + proc.stderr)}
    row["optimizer"], row["on_oom"] = a.optimizer, a.on_oom
    if a.reload and row.get("export_GB"):
        try:
            row.update(reload_export(spec, events))
        except Exception as exc:  # the row must still be printed, with the reason
            row["reload_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if a.log:
        Path(a.log).write_text(proc.stdout + proc.stderr)
    if a.events:
        Path(a.events).write_text("".join(json.dumps(e) + "\n" for e in events))
    print(json.dumps(row), flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])


if __name__ == "__main__":
    main()
