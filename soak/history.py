"""What the run did and saw, in order: every fault, every client operation and answer, every event a follower read.
A violation is printed with the records around it, so a failing seed comes with its story."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    t: float  # seconds since the run's start
    source: str  # nemesis, client, follower, webhook, monitor, check
    text: str
    job: str | None = None


class History:
    def __init__(self, limit: int = 500_000) -> None:
        self.start = time.monotonic()
        self.wall_start = time.time()
        self._records: deque[Record] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.start

    def of_wall(self, at: float) -> float:
        """A wall-clock time (a database's timestamp) as seconds since the run's start."""
        return at - self.wall_start

    def add(self, source: str, text: str, job: str | None = None, t: float | None = None) -> Record:
        record = Record(round(self.now() if t is None else t, 3), source, text, job)
        with self._lock:
            self._records.append(record)
        return record

    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def around(self, t: float | None, job: str | None, window: float = 20.0, limit: int = 60) -> list[Record]:
        """Every record of `job` (its whole life: when it was submitted, each state and attempt, each fault that
        named it) and the nemesis's records within `window` seconds of `t` (every record there, if no job is
        named); the last `limit` of them."""
        records = self.records()
        if t is None:
            t = records[-1].t if records else 0.0
        near = [r for r in records if (job is not None and r.job == job)
                or (abs(r.t - t) <= window and (r.source == "nemesis" or job is None))]
        return near[-limit:]


def render(records: list[Record]) -> str:
    return "\n".join(f"  {r.t:9.3f}  {r.source:<9} {r.job or '-':<26} {r.text}" for r in records)
