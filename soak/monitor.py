"""What the soak watches on the host while it runs: the live processes of every job (for the one-attempt and orphan
checks), the API's and control plane's memory, any stack process that ended by itself, and a copy of every rank's log
(a node sweeps an ended job's folder when its disk runs short, and the no-event-lost check reads the logs at the
end)."""

from __future__ import annotations

import contextlib
import re
import resource
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from soak.checks import JobProcess, MemorySample, ProcSample
from soak.cluster import Cluster
from soak.history import History

JOB_ID = re.compile(r"job_[0-9a-f]{20}")
ATTEMPT = re.compile(r"jobs/(job_[0-9a-f]{20})/attempts/(\d+)/")


def processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every live, non-zombie process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it ended while we looked
        if stat[0] != "Z" and cmd:
            found.append((int(entry.name), int(stat[1]), cmd))
    return found


def tree_rss(pid: int, procs: list[tuple[int, int, str]]) -> int:
    children: dict[int, list[int]] = {}
    for p, parent, _ in procs:
        children.setdefault(parent, []).append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * resource.getpagesize()
        todo += children.get(p, [])
    return total


def job_processes(procs: list[tuple[int, int, str]], known: set[str]) -> list[tuple[int, str, str]]:
    """(pid, job, command line) of the processes that belong to a job of this run: guards, launchers, ranks."""
    out = []
    for pid, _, cmd in procs:
        m = JOB_ID.search(cmd)
        if m and m.group(0) in known:
            out.append((pid, m.group(0), cmd))
    return out


@dataclass
class Monitor:
    cluster: Cluster
    history: History
    known_jobs: Callable[[], set[str]]
    terminal_since: Callable[[], dict[str, float]]
    interval: float = 0.25
    samples: list[ProcSample] = field(default_factory=list)
    late: list[JobProcess] = field(default_factory=list)  # processes of ended jobs (the orphan check's input)
    looks: int = 0
    memory: list[MemorySample] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    halt: threading.Event = field(default_factory=threading.Event)
    # Where each rank log is copied, as <node>/<job>/attempts/<n>/logs/<file>; None: not kept.
    kept: Path | None = None

    def run(self) -> None:
        n = 0
        while not self.halt.wait(self.interval):
            n += 1
            try:
                self.look(with_memory=n % 20 == 0)
                if n % 4 == 0:
                    self.crashes += self.cluster.revive_crashed()
                if n % 8 == 0:
                    self.keep_rank_logs()
            except Exception as exc:  # the monitor must outlive a transient failure of what it looks at
                self.history.add("monitor", f"look failed: {type(exc).__name__}: {exc}")

    def keep_rank_logs(self) -> None:
        """Copy each rank log that grew since the last copy; one swept meanwhile keeps its last copy."""
        if self.kept is None:
            return
        for node in self.cluster.nodes:
            jobs = node.disk / "artifacts" / "jobs"
            for log in jobs.glob("job_*/attempts/*/logs/*_rank*.log"):
                copy = self.kept / node.name / log.relative_to(jobs)
                try:
                    if copy.exists() and copy.stat().st_size == log.stat().st_size:
                        continue
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, copy)
                except OSError:
                    continue  # swept or still being made: the last copy stands, or the next look makes one

    def look(self, with_memory: bool) -> None:
        procs = processes()
        t = self.history.now()
        known = self.known_jobs()
        ended = self.terminal_since()
        attempts: dict[str, set[int]] = {}
        for pid, job, cmd in job_processes(procs, known):
            self.looks += 1
            if " -m trainer " in cmd and (m := ATTEMPT.search(cmd)):
                attempts.setdefault(job, set()).add(int(m.group(2)))
            if job in ended:
                self.late.append(JobProcess(t, pid, job, cmd))
        if attempts:
            self.samples.append(ProcSample(t, attempts))
        if with_memory:
            for name in ("api", "controlplane"):
                pid = self.cluster.pid(name)
                if pid is not None:
                    self.memory.append(MemorySample(t, name, tree_rss(pid, procs)))
