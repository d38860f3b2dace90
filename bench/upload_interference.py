"""What a checkpoint's upload costs a training loop that runs beside it, by where the upload runs: a thread of the
training process (`thread`: `Store.put_file` called there) or a process of its own (`process`: `python -m
store.push`, what trainer/uploader.py runs), against no upload (`none`).

`python -m bench.upload_interference [--mb 1500] [--repeats 3]` trains a tiny Llama (built from a config:
hidden 64, 4 layers, batch 2 × 32 tokens, AdamW; torch on one thread) on core 0, a loop whose time goes mostly to
launching operators from Python, as a GPU training loop's host thread does, and uploads one file of `--mb`
MB of random bytes into a folder store under /dev/shm from core 1, so that the two never share a core: what is
left between them is the interpreter (the GIL) and the memory system. A GPU host has cores to spare for the upload;
this separates the cost the upload's placement decides from the cost of a busy core.

Figures per mode, medians over `--repeats` runs, each run against its own steps before the upload:

- `step_ms`: the median step before the upload starts (20 steps after 5 of warm-up);
- `during_ms`: the mean step while the upload runs;
- `slowdown_pct` = (`during_ms` / `step_ms` − 1) × 100: what the upload adds to each step it overlaps;
- `upload_s`: how long the upload took (process start-up included for `process`); the upload's own speed also
  changes with its placement, since a thread must win the GIL back from the loop for every chunk;
- `none` runs the same loop for a fixed 3 s with nothing beside it: the method's residual.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STORE_DIR = Path("/dev/shm/ft-upload-interference")


def training_step() -> Callable[[], float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, config.vocab_size, (2, 32))

    def step() -> float:
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def upload_in_thread(blob: Path, done: threading.Event) -> None:
    from contract.storage import StoreConfig
    from store.objects import Store

    def run() -> None:
        os.sched_setaffinity(threading.get_native_id(), {1})
        Store(StoreConfig(url=f"file://{STORE_DIR}")).put_file("blob", blob)
        done.set()

    threading.Thread(target=run, daemon=True).start()


def upload_in_process(blob: Path, done: threading.Event) -> None:
    from contract.storage import StoreConfig
    from store import push
    from store.objects import Store

    proc = push.start(Store(StoreConfig(url=f"file://{STORE_DIR}")), launcher=["taskset", "-c", "1"])
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"prefix": "", "source": str(blob.parent), "files": [blob.name]}) + "\n")
    proc.stdin.flush()

    def wait() -> None:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            if "done" in json.loads(line):
                break
        proc.stdin.close()
        proc.wait()
        done.set()

    threading.Thread(target=wait, daemon=True).start()


def one_run(mode: str, step: Callable[[], float], blob: Path) -> dict[str, Any]:
    shutil.rmtree(STORE_DIR, ignore_errors=True)
    for _ in range(5):
        step()
    before = [step() for _ in range(20)]
    done = threading.Event()
    started = time.perf_counter()
    if mode == "thread":
        upload_in_thread(blob, done)
    elif mode == "process":
        upload_in_process(blob, done)
    else:
        threading.Timer(3.0, done.set).start()
    during = []
    while not done.is_set():
        during.append(step())
    took = time.perf_counter() - started
    base, over = statistics.median(before), statistics.mean(during)
    return {"mode": mode, "step_ms": round(base * 1e3, 2), "during_ms": round(over * 1e3, 2),
            "slowdown_pct": round(100 * (over / base - 1), 1), "upload_s": round(took, 2), "steps_during": len(during)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1500, help="the uploaded file's size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="none,thread,process")
    a = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores: the loop on one, the upload on the other")
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})  # this thread (the loop); threads started later inherit it, the upload's re-pins
    work = Path(tempfile.mkdtemp(prefix="ft-upload-interference-"))
    try:
        blob = work / "blob"
        with blob.open("wb") as f:
            for _ in range(a.mb):
                f.write(os.urandom(1 << 20))
        step = training_step()
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(a.repeats):  # rounds of every mode in turn, so a slow minute hits all alike
            for mode in a.modes.split(","):
                row = one_run(mode, step, blob)
                runs.setdefault(mode, []).append(row)
                print(json.dumps({"figure": "upload interference run", "mb": a.mb, **row}), flush=True)
        summary: dict[str, Any] = {"figure": "upload interference", "mb": a.mb, "repeats": a.repeats}
        for mode, rows in runs.items():
            summary[mode] = {k: round(statistics.median(r[k] for r in rows), 2)
                             for k in ("step_ms", "during_ms", "slowdown_pct", "upload_s")}
        print(json.dumps(summary), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(STORE_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
