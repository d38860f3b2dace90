"""Reads the launcher's output and every rank's log file, line by line, without blocking.

The launcher writes each rank's stdout and stderr to `<log_dir>/<stamp>_rank<N>.log`
(`--enable_each_rank_log`), which tags every line with its rank; trainer events are the lines of
rank files that parse as JSON objects with an "event" member.
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any

RANK_FILE = re.compile(r"_rank(\d+)\.log$")


class LineReader(threading.Thread):
    """Drains a pipe in a thread: a full pipe would otherwise stall the launcher."""

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.lines: deque[str] = deque()

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def take(self) -> list[str]:
        out = []
        while self.lines:
            out.append(self.lines.popleft())
        return out


class RankLogTail:
    """Follows the per-rank log files in a directory, yielding only complete lines."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.files: dict[Path, tuple[IO[bytes], int, bytearray]] = {}

    def poll(self) -> list[tuple[int, str]]:
        if self.log_dir.is_dir():
            for path in self.log_dir.iterdir():
                m = RANK_FILE.search(path.name)
                if m and path not in self.files:
                    self.files[path] = (path.open("rb"), int(m.group(1)), bytearray())
        out: list[tuple[int, str]] = []
        for fh, rank, buf in self.files.values():
            chunk = fh.read()
            if not chunk:
                continue
            buf.extend(chunk)
            *complete, rest = buf.split(b"\n")
            buf[:] = rest
            out.extend((rank, line.decode("utf-8", "replace").rstrip("\r")) for line in complete)
        return out

    def close(self) -> list[tuple[int, str]]:
        out = self.poll()
        for fh, rank, buf in self.files.values():
            if buf:
                out.append((rank, buf.decode("utf-8", "replace")))
            fh.close()
        self.files.clear()
        return out


def parse_trainer_event(line: str) -> dict[str, Any] | None:
    """A trainer event is one JSON object per line with an "event" member; anything else is a log line."""
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("event"), str) else None


SPAWNED = re.compile(r"process (\d+) spawned with command: .*--local_rank=(\d+)")
# The warm trainer's own line (worker/spare.py): it reaps its ranks itself and names the one that failed first.
FAILED_FIRST = re.compile(r"process \d+ \(local rank (\d+)\) failed first with exit code")


class RankWatch:
    """Which rank ended first, from the launcher's own lines and /proc.

    The launcher logs the exit code of the first rank that failed, but next to the command of another;
    when a rank is killed it then ends the others, after up to a second of its own polling. The rank whose
    process was seen gone first is the one that died on its own. A thread of its own looks every
    `interval` seconds: the supervisor's loop, sharing a busy worker's cores and GIL, can take longer than
    that second between two looks, and would then find every rank gone at once.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.pids: dict[int, int] = {}  # pid -> local rank
        self.first_dead: int | None = None
        self.interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def see(self, line: str) -> None:
        m = SPAWNED.search(line)
        if m:
            with self._lock:
                self.pids[int(m.group(1))] = int(m.group(2))
        elif failed := FAILED_FIRST.search(line):
            self.first_dead = int(failed.group(1))  # its reaper's word beats what /proc showed

    def poll(self) -> None:
        if self.first_dead is not None:
            return
        with self._lock:
            pids = list(self.pids.items())
        for pid, rank in pids:
            if not _alive(pid):
                self.first_dead = rank
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _watch(self) -> None:
        while self.first_dead is None and not self._stop.wait(self.interval):
            self.poll()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
