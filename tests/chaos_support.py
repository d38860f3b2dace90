"""What every chaos test checks after a fault: one attempt at a time, every trainer event stored exactly once."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import events_of, job_processes
from tests.outage_support import rank0_events

ATTEMPT_IN_CMDLINE = re.compile(r"/attempts/(\d+)/")


class AttemptSampler(threading.Thread):
    """Samples the job's live processes every 50 ms and records each moment two attempts ran at once."""

    def __init__(self, job_id: str) -> None:
        super().__init__(daemon=True)
        self.job_id = job_id
        self.overlaps: list[tuple[set[int], list[str]]] = []
        self.seen: set[int] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            lines = job_processes(self.job_id)
            running = {int(m.group(1)) for line in lines for m in [ATTEMPT_IN_CMDLINE.search(line)] if m}
            self.seen |= running
            if len(running) > 1:
                self.overlaps.append((running, lines))
            time.sleep(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def trainer_events_in_log(job_dir: Path, attempt: int) -> list[tuple[str, float]]:
    """(type, ts) of each trainer event rank 0 printed in the attempt, in order (none if it never launched)."""
    if not any((job_dir / "attempts" / str(attempt) / "logs").glob("*_rank0.log")):
        return []
    return [(kind, data["ts"]) for kind, data in rank0_events(job_dir, attempt) if kind != "log"]


def assert_history_exact(api: httpx.Client, job_id: str, job_dir: Path) -> list[dict[str, Any]]:
    """The stored events against the ranks' own logs: the final attempt's trainer events all stored, once,
    in order; a superseded attempt's stored events a prefix of what it printed (the rest was fenced off);
    ids gap-free. Returns the stored events."""
    job = api.get(f"/jobs/{job_id}").json()
    evs = events_of(api, job_id)
    assert [e["id"] for e in evs] == list(range(1, len(evs) + 1)), "event ids are gap-free and ordered"
    for attempt in range(1, job["attempt"] + 1):
        printed = trainer_events_in_log(job_dir, attempt)
        stored = [(e["type"], e["ts"]) for e in evs if e["attempt"] == attempt and "ts" in e
                  and e["type"] not in ("state", "log")]
        assert len(stored) == len(set(stored)), f"attempt {attempt}: an event was stored twice"
        if attempt == job["attempt"]:
            assert stored == printed, (f"attempt {attempt}: stored {len(stored)} trainer events, rank 0 printed "
                                       f"{len(printed)}")
        else:
            assert stored == printed[:len(stored)], f"attempt {attempt}: stored events are not what it printed"
    return evs


def committed_markers(job_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((job_dir / "checkpoints").glob("step-*/COMMITTED"))]


def rank_pids(job_id: str, attempt: int) -> dict[int, int]:
    """local rank -> pid of the attempt's trainer ranks."""
    out = {}
    for line in job_processes(f"{job_id}/attempts/{attempt}/spec.json"):
        m = re.search(r"--local_rank=(\d+)", line)
        if m and " -m trainer " in f" {line} ":
            out[int(m.group(1))] = int(line.split(":", 1)[0])
    return out
