"""The API process's heap is settled at start: what start-up built is frozen, so a full collection under load
walks only what requests made (a full walk of the start-up heap was the p99 of the hot reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

PROBE = """
import gc, json, sys
import api.main
from api import heap
loose_before = len(gc.get_objects())
heap.PauseMeter().install()
heap.settle()
gc.collect()
meters = sum(isinstance(c, heap.PauseMeter) for c in gc.callbacks)
print(json.dumps({"frozen": gc.get_freeze_count(), "loose_before": loose_before, "loose_after": len(gc.get_objects()),
                  "drivers": sorted(d for d in ("asyncpg", "psycopg", "sqlalchemy") if d in sys.modules),
                  "meters": meters,
                  "gen2_pauses": heap.GC_PAUSE.labels("2")._sum.get() > 0}))
"""


def test_start_up_heap_is_frozen_out_of_every_later_collection(tmp_path: Path) -> None:
    # A process of its own: freezing belongs to the API process, not to the test runner's heap.
    env = {**os.environ, "FT_ENV": "development", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # The API's one driver is loaded before the freeze, and no other is left to be loaded under a request (and walked
    # by every collection ever after).
    assert found["drivers"] == ["asyncpg"], found
    assert found["frozen"] > 50_000, found
    # What a full collection still walks is a small fraction of what start-up left to it.
    assert found["loose_after"] < found["loose_before"] / 20, found
    assert found["meters"] == 1 and found["gen2_pauses"], found
