"""Preference fine-tuning (DPO) on one GPU: this service's trainer against trl's `DPOTrainer`, same pairs, same card.

  python3 -m bench.dpo --arms ours,trl,trl_precomputed --out results.jsonl   # the Llama-3.2-1B shape
  python3 -m bench.dpo --tiny      # CPU smoke test, ours and trl on a tiny shape (2.5 min on a busy 2-core machine)

The model is the Llama-3.2-1B shape built from its config with random weights (bench/shapes.py) and the byte
tokenizer of bench/synthetic.py (one character, one token), so nothing is downloaded. The pairs are synthetic and
deterministic (`write_pairs`): prompts of 100-400 tokens and answers of 50-300 each (uniform), lowercase words, in
trl's prompt/chosen/rejected shape, one file read by both trainers. With `--seq-len` 1024 no side is cut by either.

Arms, each a process of its own under the DeepSpeed launcher, one after the other:
- `ours`: the real trainer (`python -m trainer`, method dpo, full fine-tuning, ZeRO-2, bf16, reference precomputed,
  packing on: both sides of each pair in rows of 2 x seq_len), launched through `--trainer-spec`, which is
  `python -m trainer --spec` with a timer around trainer/dpo.py's `Reference.precompute` (the reference pass).
- `trl`: trl's DPOTrainer (bench/dpo_trl.py), ZeRO-2 through TrainingArguments' `deepspeed=` dict, bf16, the same
  beta and max length, its default reference (a second frozen copy of the model), no gradient checkpointing.
- `trl_precomputed`: the same with `precompute_ref_log_probs=True`: a like-for-like reference.
- `trl_gc`: trl's defaults whole: a model-copy reference and DPOConfig's default gradient checkpointing.

A global batch of pairs: ours counts packed rows (`global_batch_size`), each holding whole pairs; trl counts pairs.
trl's batch is set to the pairs ours' rows hold on average (computed here with trainer/pairs.py's own packing).

Prints one JSON line per figure (`figure`, `arm`, `value`, `unit`, `definition`, `card`), and the ratios ours/trl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30

DEFINITIONS = {
    "dpo_tokens_per_s": "real (non-padding) tokens of both sides of every pair, prompt included, trained per second, "
                        "from the end of warm-up step N to the end of the last step (start-up, the reference pass and "
                        "the first N steps excluded)",
    "steps_per_s": "optimizer steps per second over the same window",
    "mfu_pct": "full row: (6N + 12*L*H*seq_len) per real token x tokens/s / peak bf16 (trainer/flops.py `mfu`; "
               "seq_len = the longest side allowed)",
    "mfu_6n_pct": "6N per real token x tokens/s / peak bf16: the dense matrix products of the trained model alone "
                  "(a reference forward is not counted; trainer/flops.py `mfu_6n`)",
    "mfu_attended_pct": "(6N per real token + 12*L*H*d^2 per sequence, d its real tokens) / s / peak bf16 "
                        "(trainer/flops.py `mfu_attended`)",
    "peak_gpu_GiB": "torch.cuda.max_memory_allocated of the training process, from the start of the training loop "
                    "(after the reference pass) to its end",
    "reference_pass_s": "the precomputed reference: wall seconds of the pass over every pair (device synchronised)",
}


def card() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def peak_flops(card_name: str) -> float | None:
    from trainer.recipe import PEAK_BF16_FLOPS

    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in card_name), None)


# --- the data ---------------------------------------------------------------------------------------------

def _text(rng: Any, n: int, lead_space: bool) -> str:
    """n characters of lowercase words (1-8 letters) separated by single spaces; n tokens under the byte tokenizer."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    size = 0
    while size < n + 1:
        word = "".join(letters[i] for i in rng.integers(0, 26, size=int(rng.integers(1, 9))))
        out.append(word)
        size += len(word) + 1
    text = (" " if lead_space else "") + " ".join(out)
    return text[:n]


def write_pairs(path: Path, n: int, prompt: tuple[int, int], answer: tuple[int, int], seed: int = 0) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        p = _text(rng, int(rng.integers(prompt[0], prompt[1] + 1)), False)
        c = _text(rng, int(rng.integers(answer[0], answer[1] + 1)), True)
        r = _text(rng, int(rng.integers(answer[0], answer[1] + 1)), True)
        lines.append(json.dumps({"prompt": p, "chosen": c, "rejected": r}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def packed_stats(model_dir: Path, pairs: Path, seq_len: int) -> dict[str, Any]:
    """How trainer/pairs.py encodes and packs the pairs: pairs per row, real tokens, padding."""
    from transformers import AutoTokenizer

    from contract.datasets import PreferencePair
    from trainer.pairs import encode_pairs, pack_pairs

    tok = AutoTokenizer.from_pretrained(model_dir)
    raw = [json.loads(line) for line in pairs.read_text().splitlines() if line.strip()]
    encoded, stats = encode_pairs(tok, [PreferencePair(**r) for r in raw], seq_len)
    blocks = pack_pairs(encoded, seq_len, tok.pad_token_id, True)
    lengths = [len(e.prompt) + len(e.chosen) for e in encoded] + [len(e.prompt) + len(e.rejected) for e in encoded]
    return {"pairs": blocks.pairs, "rows": len(blocks), "pairs_per_row": blocks.pairs / len(blocks),
            "real_tokens": int(blocks.real_tokens.sum()), "packing_efficiency": round(blocks.packing_efficiency, 4),
            "truncated": stats.truncated, "dropped": stats.as_dict()["pairs_dropped"],
            "mean_side_tokens": sum(lengths) / len(lengths), "longest_side": max(lengths)}


# --- the arms ---------------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher(args: list[str]) -> list[str]:
    # A port of its own: a rendezvous on the default 29500 can meet another job's store on a shared machine.
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
            *args]


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    try:  # on a CPU machine, the ops `make install` built (tests/trainer_support.py does the same)
        import torch

        if not torch.cuda.is_available() and "TORCH_EXTENSIONS_DIR" not in out:
            from worker.ops import extensions_dir
            from worker.settings import WorkerSettings

            out["TORCH_EXTENSIONS_DIR"] = str(extensions_dir(WorkerSettings()))
    except Exception:  # noqa: BLE001  # only a speed-up for the CPU smoke test
        pass
    return out


def run(argv: list[str], log: Path, limit: int) -> tuple[int, str, float]:
    """Run an arm in a session of its own, so that at its time limit the launcher and its ranks all stop."""
    import signal
    import tempfile

    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, env=env(), stdout=out, stderr=err, text=True, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        out.seek(0)
        err.seek(0)
        text = out.read() + "\n--- stderr ---\n" + err.read()
    log.write_text(text)
    return rc, text, time.time() - t0


def ours_spec(a: argparse.Namespace, model_dir: Path, pairs: Path, work: Path) -> Path:
    from contract.deepspeed import ResolveLimits, resolve
    from contract.spec import JobSpec, RunSpec

    job = {
        "name": "bench-dpo", "model": {"name_or_path": str(model_dir), "init": "random"},
        "data": {"train": str(pairs), "format": "preference", "packing": True},
        "hyperparameters": {"max_steps": a.steps, "seq_len": a.seq_len, "global_batch_size": a.rows,
                            "micro_batch_size": a.micro_rows, "learning_rate": a.lr, "warmup_steps": 0,
                            "weight_decay": 0.0, "optimizer": a.optimizer},
        "method": {"type": "dpo", "dpo": {"beta": a.beta, "reference": "precomputed"}},
        "deepspeed": {"zero_stage": 2, "precision": "bf16", "activation_checkpointing": a.activation_checkpointing},
        "checkpointing": {"every_steps": None},
        "resources": {"num_gpus": 1},
    }
    resolved = resolve(JobSpec.model_validate(job), limits=ResolveLimits())
    job_dir = work / "jobs" / f"dpo-{a.shape}"
    run_spec = RunSpec(job=resolved, paths={"job_dir": str(job_dir), "checkpoint_dir": str(job_dir / "ckpt"),
                                            "output_dir": str(job_dir / "out")})
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = job_dir / "spec.json"
    spec.write_text(run_spec.model_dump_json(indent=2))
    return spec


def events_of(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        start = line.find('{"event"')
        if start >= 0:
            try:
                out.append(json.loads(line[start:]))
            except ValueError:
                pass
    return out


def run_ours(a: argparse.Namespace, model_dir: Path, pairs: Path, work: Path, logs: Path) -> dict[str, Any]:
    from bench.run_trainer import figures

    spec = ours_spec(a, model_dir, pairs, work)
    t0 = time.time()
    rc, text, wall = run(launcher(["--module", "bench.dpo", "--trainer-spec", str(spec)]), logs / "ours.log",
                         a.limit)
    events = events_of(text)
    (logs / "ours-events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    row: dict[str, Any] = {"arm": "ours", "exit": rc, "wall_s": round(wall, 1), **figures(events, a.skip)}
    progress = [e for e in events if e.get("event") == "progress"]
    steady = [e for e in progress if e["step"] >= a.skip]
    if len(steady) >= 2:
        row["steps_per_s"] = round((steady[-1]["step"] - steady[0]["step"]) / (steady[-1]["ts"] - steady[0]["ts"]), 4)
    if progress:
        row["start_to_first_step_s"] = round(progress[0]["ts"] - t0, 1)
    refs = [e for e in events if e.get("event") == "bench_reference"]
    row["reference_pass_s"] = round(sum(e["seconds"] for e in refs), 2) if refs else None
    row["reference_pass"] = refs
    started = next((e for e in events if e.get("event") == "started"), {})
    row["pairs_stats"] = started.get("pairs")
    row["reference"] = started.get("reference")
    out_dir = work / "jobs" / f"dpo-{a.shape}" / "out"
    row["export_GB"] = (round(sum(f.stat().st_size for f in out_dir.glob("*.safetensors")) / 1e9, 2)
                        if (out_dir / "COMPLETE").exists() else None)
    if rc != 0:
        row["tail"] = text[-2500:]
    elif a.reload and row["export_GB"] is not None:
        try:
            row.update(reload_export(out_dir, pairs))
        except Exception as exc:  # noqa: BLE001  # the row is still printed, with the reason
            row["reload_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def reload_export(out_dir: Path, pairs: Path, n: int = 8) -> dict[str, Any]:
    """The committed export loaded as a user would (transformers, bf16): its parameters, and each of `n` pairs'
    summed answer log-probabilities, which must be finite."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16, device_map=device).eval()
    tok = AutoTokenizer.from_pretrained(out_dir)
    loaded = time.time() - t0
    params = sum(p.numel() for p in model.parameters())
    margins = []
    with torch.no_grad():
        for line in pairs.read_text().splitlines()[:n]:
            r = json.loads(line)
            prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            logps = []
            for answer in (r["chosen"], r["rejected"]):
                ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                x = torch.tensor([prompt + ids], device=device)
                logp = model(x).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
                logps.append(float(logp.gather(1, torch.tensor(ids, device=device)[:, None]).sum()))
            margins.append(logps[0] - logps[1])
    return {"reload_params_M": round(params / 1e6, 1), "reload_s": round(loaded, 1),
            "reload_pairs_scored": len(margins), "reload_logps_finite": all(math.isfinite(m) for m in margins)}


TRL_ARMS = {"trl": [], "trl_precomputed": ["--precompute"], "trl_gc": ["--gradient-checkpointing"]}


def run_trl(arm: str, a: argparse.Namespace, model_dir: Path, pairs: Path, work: Path, logs: Path,
            accum: int) -> dict[str, Any]:
    argv = [str(ROOT / "bench" / "dpo_trl.py"), "--model-dir", str(model_dir), "--pairs", str(pairs),
            "--micro", str(a.trl_micro), "--accum", str(accum), "--max-length", str(a.seq_len), "--beta", str(a.beta),
            "--lr", str(a.lr), "--steps", str(a.trl_steps), "--skip", str(a.skip), "--work", str(work / arm),
            "--precompute-batch", str(a.trl_micro * 2), *TRL_ARMS[arm]]
    t0 = time.time()
    rc, text, wall = run(launcher(argv), logs / f"{arm}.log", a.limit)
    row: dict[str, Any] = {"arm": arm, "exit": rc, "wall_s": round(wall, 1)}
    for line in text.splitlines():
        start = line.find('{"trl"')
        if start >= 0:
            row.update(json.loads(line[start:])["trl"])
    if row.get("first_step_end_ts"):
        row["start_to_first_step_s"] = round(row["first_step_end_ts"] - t0, 1)
    if rc != 0 or "real_tokens_per_s" not in row:
        row["tail"] = text[-2500:]
    return row


def trl_mfu(row: dict[str, Any], seq_len: int, peak: float | None) -> dict[str, Any]:
    """The trainer's three counts (trainer/flops.py) for trl's steady window."""
    from trainer.flops import FlopCounts

    if not peak or not row.get("steady_s"):
        return {"mfu_pct": None, "mfu_6n_pct": None, "mfu_attended_pct": None}
    c = FlopCounts(6.0 * row["n_params"], 12.0 * row["layers"] * row["hidden"], seq_len)
    tokens, seconds = row["steady_real_tokens"], row["steady_s"]
    return {"mfu_pct": round(100 * c.full_row_per_token * tokens / seconds / peak, 2),
            "mfu_6n_pct": round(100 * c.dense_per_token * tokens / seconds / peak, 2),
            "mfu_attended_pct": round(100 * (c.dense_per_token * tokens + c.attention_per_pair * row["attended_d2"])
                                      / seconds / peak, 2)}


# --- figures ----------------------------------------------------------------------------------------------

def figure_lines(rows: list[dict[str, Any]], common: dict[str, Any]) -> list[dict[str, Any]]:
    keys = {"dpo_tokens_per_s": ("real_tokens_per_s", "tokens/s"), "steps_per_s": ("steps_per_s", "steps/s"),
            "mfu_pct": ("mfu_pct", "%"), "mfu_6n_pct": ("mfu_6n_pct", "%"),
            "mfu_attended_pct": ("mfu_attended_pct", "%"), "peak_gpu_GiB": ("peak_gpu_GiB", "GiB"),
            "reference_pass_s": ("reference_pass_s", "s")}
    lines = []
    for row in rows:
        if row["arm"] == "ours":  # bench/run_trainer.py's name for the trainer's full-row figure
            row.setdefault("mfu_pct", row.get("mfu_real_pct"))
        for figure, (key, unit) in keys.items():
            if row.get(key) is not None:
                lines.append({"figure": figure, "arm": row["arm"], "value": row[key], "unit": unit,
                              "definition": DEFINITIONS[figure], **common})
    ours = next((r for r in rows if r["arm"] == "ours"), None)
    for row in rows:
        if ours is None or row is ours:
            continue
        for figure, key in (("tokens_per_s_ratio", "real_tokens_per_s"), ("peak_memory_ratio", "peak_gpu_GiB")):
            if ours.get(key) and row.get(key):
                lines.append({"figure": figure, "arm": f"ours/{row['arm']}", "value": round(ours[key] / row[key], 3),
                              "unit": "x", "definition": f"ours' {key} over {row['arm']}'s, same call, same card",
                              **common})
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--trainer-spec", default=None, help="(internal) run the trainer on this spec, reference timed")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny shape, 120 short pairs, ours and trl")
    p.add_argument("--shape", default="llama1b")
    p.add_argument("--arms", default="ours,trl,trl_precomputed")
    p.add_argument("--pairs", type=int, default=1200)
    p.add_argument("--prompt", default="100,400", help="prompt tokens, min,max")
    p.add_argument("--answer", default="50,300", help="tokens of each answer, min,max")
    p.add_argument("--seq-len", type=int, default=1024, help="ours' seq_len; trl's max_length")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--rows", type=int, default=32, help="ours' global batch: packed rows of 2 x seq_len")
    p.add_argument("--micro-rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=15, help="ours' steps")
    p.add_argument("--trl-micro", type=int, default=8, help="trl's pairs per micro batch")
    p.add_argument("--trl-steps", type=int, default=11)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps excluded (N), both")
    p.add_argument("--limit", type=int, default=400, help="seconds per arm")
    p.add_argument("--optimizer", default="adamw", help="ours' hyperparameters.optimizer: adamw | adamw_bf16")
    p.add_argument("--activation-checkpointing", action="store_true", help="ours: recompute each layer's activations")
    p.add_argument("--reload", action="store_true", help="ours: load the export with transformers and score pairs")
    p.add_argument("--work", default="/tmp/bench-dpo")
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    return p


def trainer_main(spec: str) -> int:
    """`python -m trainer --spec`, with the precomputed reference's pass timed into an event of its own."""
    import torch

    from trainer import dpo
    from trainer.__main__ import main
    from trainer.events import emit_rank0

    original = dpo.Reference.precompute

    def timed(self: Any, engine: Any, blocks: Any, which: str, *args: Any, **kw: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.time()
        original(self, engine, blocks, which, *args, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        emit_rank0("bench_reference", which=which, seconds=round(time.time() - t0, 3), pairs=blocks.pairs,
                   rows=len(blocks), real_tokens=int(blocks.real_tokens.sum()))

    dpo.Reference.precompute = timed  # type: ignore[method-assign]
    return main(["--spec", spec])


def main() -> None:
    a = parser().parse_args()
    if a.trainer_spec:
        sys.exit(trainer_main(a.trainer_spec))
    if a.tiny:
        a.shape, a.pairs, a.prompt, a.answer, a.seq_len = "tiny", 120, "20,60", "10,40", 128
        a.rows, a.micro_rows, a.steps, a.trl_micro, a.trl_steps, a.skip = 4, 2, 6, 4, 4, 2
        a.arms = a.arms if a.arms != parser().get_default("arms") else "ours,trl"
    from bench.shapes import model_config
    from bench.synthetic import write_model_dir

    work, card_name = Path(a.work), card()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = model_config(a.shape)
    if a.tiny:
        config.vocab_size = 320  # the byte tokenizer's 257 ids fit; the Llama vocabulary is slow on a CPU
    model_dir = write_model_dir(work / "models" / a.shape, config)
    lo_p, hi_p = (int(x) for x in a.prompt.split(","))
    lo_a, hi_a = (int(x) for x in a.answer.split(","))
    pairs = write_pairs(work / "data" / f"pairs-{a.pairs}-{a.prompt}-{a.answer}.jsonl", a.pairs, (lo_p, hi_p),
                        (lo_a, hi_a))
    data = packed_stats(model_dir, pairs, a.seq_len)
    accum = max(1, round(a.rows * data["pairs_per_row"] / a.trl_micro))
    common = {"card": card_name, "shape": a.shape, "seq_len": a.seq_len, "beta": a.beta,
              "warmup_steps_excluded": a.skip}
    print(json.dumps({"data": data, "ours_global_rows": a.rows, "ours_pairs_per_step_mean":
                      round(a.rows * data["pairs_per_row"], 1), "trl_global_pairs": a.trl_micro * accum,
                      **common}), flush=True)
    peak = peak_flops(card_name)
    rows = []
    for arm in a.arms.split(","):
        if arm == "ours":
            row = run_ours(a, model_dir, pairs, work, logs)
            row.update({"global_rows": a.rows, "micro_rows": a.micro_rows, "max_steps": a.steps,
                        "global_pairs_mean": round(a.rows * data["pairs_per_row"], 1)})
        else:
            row = run_trl(arm, a, model_dir, pairs, work, logs, accum)
            row.update(trl_mfu(row, a.seq_len, peak))
            row["reference_pass_s"] = row.get("precompute_s")
            if row.get("peak_gpu_bytes"):
                row["peak_gpu_GiB"] = round(row["peak_gpu_bytes"] / GiB, 2)
        row.update(common)
        rows.append(row)
        print(json.dumps({"row": row}), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps({"row": row}) + "\n")
    lines = figure_lines(rows, common)
    for line in lines:
        print(json.dumps(line), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
