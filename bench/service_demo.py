"""Service figures on this machine: time from POST /jobs to the first progress event, and CPU time.

Starts the stack like `make demo` (same settings, same example job), submits the demo job N times
one after another, and prints one JSON line per run plus a summary. Run: `python -m bench.service_demo`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from scripts.demo import DEMO_JOB, prepare_assets, run_demo
from scripts.stack import ROOT, Stack, database_exists_or_create, ensure_dev_key, migrate


def main() -> None:
    from api.settings import get_settings

    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    settings = get_settings()
    prepare_assets(Path(settings.model_root).resolve(), Path(settings.data_root).resolve())
    database_exists_or_create(settings.database_url)
    migrate(dict(os.environ))
    stack = Stack(dict(os.environ), ROOT / "var" / "logs" / "bench")
    stack.start_api()
    stack.start_controlplane()
    stack.start_worker()
    key = ensure_dev_key()  # the dev stack's admin key, as make demo uses it
    rows = []
    try:
        stack.wait_ready()
        for i in range(a.runs):
            f = run_demo(stack, json.loads(DEMO_JOB.read_text()), quiet=True, key=key)
            job = f["job"]
            row = {"run": i + 1, "status": job["status"], "first_progress_s": round(f["first_progress_s"], 2),
                   "wall_s": round(f["wall_s"], 1), "job_cpu_s": job["progress"].get("cpu_seconds"),
                   "job_wall_s": job["progress"].get("wall_seconds"), "steps": job["progress"].get("step"),
                   "tokens_per_second": round(job["progress"].get("tokens_per_second") or 0)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stack.stop()
    print(json.dumps({"summary": True, "runs": len(rows),
                      "first_progress_s_median": statistics.median(r["first_progress_s"] for r in rows),
                      "job_cpu_s_median": statistics.median(r["job_cpu_s"] for r in rows),
                      "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
