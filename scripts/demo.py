"""The end-to-end demo: start the stack, submit the demo job over HTTP, follow it, show the result.

`make demo` runs this after installing. It builds a tiny model from a config (byte-level tokenizer,
no downloads) and local text, starts the API, control plane and one worker, POSTs
examples/demo-job.json, follows the SSE stream with a progress line, and exits 0 only when the job
succeeded and its exported model loads and generates.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from contract.codes import EventKind, JobStatus
from contract.protocol import NodeState, WarmTrainer
from ftcli.download import download
from ftcli.http import Api
from scripts.client import follow, progress_line, submit
from scripts.corpus import write_corpus
from scripts.stack import ROOT, Stack, StackSettings, database_exists_or_create, ensure_dev_key, migrate

DEMO_JOB = ROOT / "examples" / "demo-job.json"

# Where the wait from POST /jobs to the first progress event goes: each phase ends at a mark that the worker
# (`picked_up`, `spawned`) or rank 0 of the trainer (trainer/startup.py) put in the `started` event, or at an event's
# own time. A phase whose marks an older worker or trainer did not send is left out; `total` is measured anyway.
PHASES: tuple[tuple[str, str, str, str], ...] = (
    ("dispatch", "posted", "picked_up", "POST /jobs sent -> the node's worker took the attempt (commit, NOTIFY, "
     "placement, Celery send and receive)"),
    ("worker", "picked_up", "spawned", "the worker's preparation: fence, checkpoint and inputs from the store, "
     "spec written"),
    ("launcher", "spawned", "process", "the guard and the launcher up to the rank 0 process's creation"),
    ("imports", "process", "imported", "rank 0 imports torch, transformers, DeepSpeed and the recipe"),
    ("distributed", "imported", "distributed", "deepspeed.init_distributed: the process group's rendezvous"),
    ("data", "distributed", "data", "tokenizer, reading and packing the data, the batch settled"),
    ("model", "data", "model", "the model built or loaded"),
    ("engine", "model", "engine", "kernels, the DeepSpeed config and deepspeed.initialize"),
    ("resume", "engine", "started", "the newest checkpoint resumed, the started event"),
    ("first_step", "started", "first_progress", "the first optimizer step, to rank 0's first progress event"),
    ("delivery", "first_progress", "seen", "the event through the worker, Redis, the ingester and the API's SSE"),
)


def startup_breakdown(times: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase of PHASES from the marks in `times` (epoch s), and `total` (posted -> seen)."""
    out = {name: round(times[end] - times[start], 3) for name, start, end, _ in PHASES
           if start in times and end in times}
    if "posted" in times and "seen" in times:
        out["total"] = round(times["seen"] - times["posted"], 3)
    return out


def breakdown_lines(phases: dict[str, float]) -> list[str]:
    lines = [f"    {name:<12} {phases[name]:6.2f} s  {what}" for name, _, _, what in PHASES if name in phases]
    return lines + [f"    {'total':<12} {phases.get('total', float('nan')):6.2f} s  POST /jobs -> first progress "
                    "event seen by this client"]


def prepare_assets(model_root: Path, data_root: Path) -> None:
    """The demo's model and data, made locally: the paths examples/demo-job.json and examples/dpo-job.json name."""
    from scripts.pairs import write_pairs
    from trainer.tiny import build_tiny_model

    train, _ = write_corpus(data_root / "demo")
    write_pairs(data_root / "demo" / "pairs.jsonl", 200, seed=1, shape="openai")
    model_dir = model_root / "tiny-llama"
    if not (model_dir / "config.json").is_file():
        build_tiny_model(model_dir, train.read_text())


def check_export(path: str) -> str:
    """Load the exported model the way a user would and let it write a few tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok("Return the", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


def wait_for_a_warm_node(stack: Stack, key: str | None, timeout: float = 120) -> None:
    """Until a node is up whose warm trainer is not importing (GET /nodes): the demo times its job's first step from
    POST, and a stack started a moment ago has its worker's spare still importing torch. A node that runs without a
    warm trainer (`none`) is waited for only until it is up."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    end, said = time.monotonic() + timeout, False
    while time.monotonic() < end:
        try:
            nodes = httpx.get(f"{stack.api_url}/nodes", headers=headers, timeout=5).json()["data"]
        except (httpx.HTTPError, KeyError, ValueError):
            nodes = []
        if any(n["state"] == NodeState.UP and n.get("warm_trainer") != WarmTrainer.IMPORTING for n in nodes):
            return
        if not said:
            print("waiting for the worker's node to be up with its warm trainer imported", flush=True)
            said = True
        time.sleep(0.5)
    print(f"no node was up with its warm trainer imported within {timeout:.0f} s: submitting anyway", flush=True)


def run_demo(stack: Stack, job: dict[str, Any], quiet: bool = False, key: str | None = None) -> dict[str, Any]:
    """Submit and follow one job with the API key `key`; returns its final state and the figures measured."""
    t0 = time.monotonic()
    times: dict[str, float] = {"posted": time.time()}
    created = submit(stack.api_url, job, token=key)
    job_id = created["id"]
    figures: dict[str, Any] = {"job_id": job_id, "first_progress_s": None, "losses": [], "times": times}
    if not quiet:
        print(f"submitted {job_id}: micro batch {created['resolved']['micro_batch_size']} × accumulation "
              f"{created['resolved']['gradient_accumulation_steps']} × {created['resolved']['world_size']} processes",
              flush=True)

    def on_event(ev: dict[str, Any]) -> None:
        if ev["type"] == EventKind.STARTED and "started" not in times:
            times.update(ev.get("startup") or {})
            times["started"] = ev.get("ts") or time.time()
        if ev["type"] == EventKind.PROGRESS:
            if figures["first_progress_s"] is None:
                figures["first_progress_s"] = time.monotonic() - t0
                times["seen"] = time.time()
                times["first_progress"] = ev.get("ts") or times["seen"]
            figures["losses"].append(ev.get("loss"))
            if not quiet:
                print("\r" + progress_line(job_id, ev).ljust(100), end="", flush=True)
        elif ev["type"] == EventKind.STATE and not quiet:
            print(f"\n[{ev['status']}]" + (f" {ev['error']['code']}: {ev['error']['message']}"
                                            if ev.get("error") else ""), flush=True)
        elif ev["type"] == EventKind.EVAL and not quiet:
            print(f"\n[eval] step {ev.get('step')} loss {ev.get('loss'):.4f} perplexity {ev.get('perplexity'):.1f}",
                  flush=True)

    follow(stack.api_url, job_id, on_event, token=key)
    figures["wall_s"] = time.monotonic() - t0
    figures["startup"] = startup_breakdown(times)
    figures["job"] = httpx.get(f"{stack.api_url}/jobs/{job_id}", timeout=10,
                               headers={"Authorization": f"Bearer {key}"} if key else {}).json()
    return figures


def prepared() -> tuple[dict[str, str], str | None]:
    """What the demo's stack needs before it starts: the tiny model and data, the database made and migrated, and
    the key to call it with (the dev stack's own in development, FT_KEY's otherwise; None if neither). Returns the
    stack's environment and the key."""
    from api.settings import get_settings

    settings = get_settings()
    model_root, data_root = Path(settings.model_root).resolve(), Path(settings.data_root).resolve()
    print(f"preparing the demo model under {model_root} and data under {data_root}", flush=True)
    prepare_assets(model_root, data_root)
    database_exists_or_create(settings.database_url)
    env = dict(os.environ)
    migrate(env)
    # The API requires a key in development too; the demo makes (or reuses) the dev stack's own.
    given = StackSettings.of(env).key
    return env, ensure_dev_key() if settings.development else given.get_secret_value() if given else None


@contextmanager
def running(env: dict[str, str]) -> Iterator[Stack]:
    """API, control plane and one worker, as `make up` starts them, ready; stopped on leaving."""
    stack = Stack(env, ROOT / "var" / "logs")
    stack.start_api()
    stack.start_controlplane()
    stack.start_worker()
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


def main() -> int:
    env, key = prepared()
    with running(env) as stack:
        wait_for_a_warm_node(stack, key)
        figures = run_demo(stack, json.loads(DEMO_JOB.read_text()), key=key)
        job = figures["job"]
        downloaded = None
        if job["status"] == JobStatus.SUCCEEDED:
            # The model as a client gets it: from the artifact store through the API, each file's SHA-256 checked.
            downloaded = ROOT / "var" / "downloads" / job["id"]
            download(Api(stack.api_url, key), job["id"], downloaded, parallel=4, console=None)
    job = figures["job"]
    p = job["progress"]
    losses = [x for x in figures["losses"] if x is not None]
    print(f"\njob {job['id']} {job['status']} (attempt {job['attempt']}) in {figures['wall_s']:.1f} s")
    if job["status"] != JobStatus.SUCCEEDED:
        print(json.dumps(job["error"], indent=2))
        print(f"logs: curl -H \"Authorization: Bearer $(cat var/dev-key)\" {stack.api_url}/jobs/{job['id']}/logs  "
              f"(stack logs in {stack.log_dir})")
        return 1
    print(f"  steps {p.get('step')}/{p.get('total_steps')}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{p.get('tokens_per_second') or 0:,.0f} tokens/s")
    print(f"  first progress event {figures['first_progress_s']:.1f} s after POST /jobs; "
          f"job CPU time {p.get('cpu_seconds', 0):.0f} s; where the wait went:")
    print("\n".join(breakdown_lines(figures["startup"])))
    print(f"  checkpoints: {[c['step'] for c in job['checkpoints']]}")
    files = job["output"]["files"]
    print(f"  exported model: {job['output']['store']} in the artifact store ({', '.join(f['path'] for f in files)}), "
          f"{job['output']['bytes']:,} bytes")
    print(f"  downloaded through the API (ft download {job['id']}) to {downloaded}")
    print(f"  it generates: {check_export(str(downloaded))!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
