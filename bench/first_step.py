"""Time to the first step: POST /jobs to the first progress event of the demo job, phase by phase, and the steady
training throughput beside it (a faster start must cost no tokens/s).

Starts a stack of its own, as `make demo` does (same settings, same example job) but on its own port, database,
Redis database and folders, so it runs beside another stack of this host; submits the demo job `--runs` times one
after another and prints one JSON line per run, then a summary line, each with its definitions.

    python -m bench.first_step --runs 3

Figures (seconds unless named otherwise):
- first_progress_s: POST /jobs sent -> the first progress event read from the job's SSE stream, by this client;
- phases: scripts/demo.py PHASES, each from the marks the worker and rank 0 put in the `started` event;
- steady_tokens_per_s: real (unpadded) tokens of the progress events after step 10 over their trainer's wall
  time (from the progress event of step 10 to the last), i.e. the steady loop without the start or the export;
- load: the 1-minute load average at the run's start and end (the host is shared);
- gap: seconds the stack sat idle before each submit (`--gap`), as a node between two users' jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from contract.codes import JobStatus
from scripts.demo import DEMO_JOB, PHASES, prepare_assets, run_demo
from scripts.stack import ROOT, Stack, database_exists_or_create, ensure_dev_key, migrate

STEADY_FROM_STEP = 10


def isolated_env(port: int, redis_db: int, tag: str) -> dict[str, str]:
    var = ROOT / "var" / tag
    return {**os.environ, "FT_PORT": str(port), "FT_REDIS_URL": f"redis://127.0.0.1:6379/{redis_db}",
            "FT_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{tag.replace('-', '_')}",
            "FT_ARTIFACTS_ROOT": str(var / "artifacts"), "FT_STORE_URL": f"file://{var / 'store'}",
            "FT_CACHE_ROOT": str(var / "cache"), "FT_NODE_NAME": tag}


def steady_tokens_per_s(base: str, job_id: str, key: str) -> float | None:
    """From the job's stored progress events: tokens after step STEADY_FROM_STEP over the trainer's time for them."""
    events: list[dict[str, Any]] = []
    after = 0
    while True:
        page = httpx.get(f"{base}/jobs/{job_id}/events", params={"after": after, "limit": 1000, "type": "progress"},
                         headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        events += page["data"]
        if not page["has_more"]:
            break
        after = page["next_after"]
    steady = [e for e in events if (e.get("step") or 0) >= STEADY_FROM_STEP]
    if len(steady) < 2:
        return None
    tokens = steady[-1]["tokens_seen"] - steady[0]["tokens_seen"]
    return round(tokens / (steady[-1]["ts"] - steady[0]["ts"]), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--port", type=int, default=8139)
    p.add_argument("--redis-db", type=int, default=7)
    p.add_argument("--tag", default="first-step", help="names the database, the node and the folder under var/")
    p.add_argument("--label", default="", help="copied into every line (e.g. before/after)")
    p.add_argument("--priority", choices=["normal", "low", "idle"], default="idle",
                   help="FT_TRAINER_PRIORITY of the ranks (the stack's default: idle; on a host shared with other "
                        "work, normal gives them a fair share instead of what the others leave)")
    p.add_argument("--gap", type=float, default=20.0,
                   help="seconds idle before each submit, as a node between jobs (a warm trainer imports meanwhile)")
    a = p.parse_args()
    env = {**isolated_env(a.port, a.redis_db, a.tag), "FT_TRAINER_PRIORITY": a.priority}
    os.environ.update(env)  # the settings read below (roots, database) are the stack's
    from api.settings import get_settings

    settings = get_settings()
    prepare_assets(Path(settings.model_root).resolve(), Path(settings.data_root).resolve())
    database_exists_or_create(settings.database_url)
    migrate(env)
    stack = Stack(env, ROOT / "var" / a.tag / "logs")
    stack.start_api()
    stack.start_controlplane()
    stack.start_worker(node=a.tag)
    rows: list[dict[str, Any]] = []
    try:
        stack.wait_ready(timeout=300)
        key = ensure_dev_key(ROOT / "var" / a.tag / "dev-key")
        for i in range(a.runs):
            time.sleep(a.gap)
            load_before = os.getloadavg()[0]
            f = run_demo(stack, json.loads(DEMO_JOB.read_text()), quiet=True, key=key)
            job = f["job"]
            row = {"label": a.label, "run": i + 1, "status": job["status"],
                   "first_progress_s": round(f["first_progress_s"], 2), "phases": f["startup"],
                   "steady_tokens_per_s": steady_tokens_per_s(stack.api_url, job["id"], key),
                   "job_wall_s": job["progress"].get("wall_seconds"), "job_cpu_s": job["progress"].get("cpu_seconds"),
                   "load": [round(load_before, 2), round(os.getloadavg()[0], 2)], "gap": a.gap, "priority": a.priority,
                   "at": time.strftime("%H:%M:%S")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stack.stop()
    ok = [r for r in rows if r["status"] == JobStatus.SUCCEEDED]
    print(json.dumps({
        "label": a.label, "summary": True, "runs": len(rows), "succeeded": len(ok),
        "first_progress_s_median": statistics.median(r["first_progress_s"] for r in ok) if ok else None,
        "steady_tokens_per_s_median": statistics.median(r["steady_tokens_per_s"] or 0 for r in ok) if ok else None,
        "phases_median": {name: statistics.median(r["phases"][name] for r in ok if name in r["phases"])
                          for name, *_ in PHASES if any(name in r["phases"] for r in ok)},
        "cores": os.cpu_count(),
        "definitions": {"first_progress_s": "POST /jobs sent -> first progress event read from SSE",
                        "steady_tokens_per_s": f"real tokens from the progress event of step {STEADY_FROM_STEP} "
                                               "to the last, over the trainer's time between them",
                        **{name: what for name, _, _, what in PHASES}}}), flush=True)


if __name__ == "__main__":
    main()
