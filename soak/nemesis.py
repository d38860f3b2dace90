"""The fault actions: each takes one Fault of the plan (soak/schedule.py), applies it, waits out its duration and
heals it, recording both ends in the history. Runs in a thread of its own, in the plan's order and at its times."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from soak.cluster import NET_DELAY, STORE_SLOW_DELAY, Cluster
from soak.history import History
from soak.schedule import Fault

RANK = re.compile(r"jobs/(job_[0-9a-f]+)/attempts/(\d+)/.*--local_rank=(\d+)")
# A 503 is allowed while one of these is down (soak/checks.py no_unexplained_5xx): what the API itself depends on.
API_DEPENDENCIES = {("restart", "postgres"), ("restart", "redis"), ("store_down", "store"), ("store_slow", "store")}
# Faults between which the webhook deliverer may resend an acknowledged delivery: it lost the record of the answer.
DELIVERER_FAULTS = {("sigkill", "controlplane"), ("sigstop", "controlplane"), ("restart", "postgres"),
                    ("net_cut", "controlplane->postgres"), ("net_drop", "controlplane->postgres"),
                    ("net_delay", "controlplane->postgres")}


# How long an operator's restart waits for a process to end after SIGTERM before it kills it: a worker's trainers
# checkpoint on SIGTERM within the product's term grace (30 s), then the worker hands their jobs back.
RESTART_GRACE_SECONDS = 60.0


def rank_processes(marker: str) -> list[tuple[int, str, int, int]]:
    """(pid, job, attempt, local rank) of every live trainer rank whose command line names `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and " -m trainer " in cmd and (m := RANK.search(cmd)):
            found.append((int(entry.name), m.group(1), int(m.group(2)), int(m.group(3))))
    return sorted(found)


@dataclass
class Applied:
    fault: Fault
    start: float
    end: float
    what: str


@dataclass
class Nemesis:
    cluster: Cluster
    history: History
    faults: list[Fault]
    seed: int
    applied: list[Applied] = field(default_factory=list)
    halt: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Each fault in a thread of its own. One that the plan starts while an earlier one holds starts beside it;
        any other waits until every earlier fault has healed, as late as applying them made it."""
        holding: list[threading.Thread] = []
        previous: Fault | None = None
        for fault in self.faults:
            joins = previous is not None and fault.at < previous.at + max(previous.duration, 1.0)
            if not joins:
                for thread in holding:
                    thread.join()
                holding = []
            if self._sleep_until(fault.at):
                break
            thread = threading.Thread(target=self._one, args=(fault,), name=f"fault {fault.index}", daemon=True)
            thread.start()
            holding.append(thread)
            previous = fault
        for thread in holding:
            thread.join()

    def _one(self, fault: Fault) -> None:
        start = self.history.now()
        try:
            what = self.apply(fault)
        except Exception as exc:  # a fault that could not be applied is recorded, never a crash of the run
            what = f"could not apply: {type(exc).__name__}: {exc}"
            self.history.add("nemesis", f"{fault}: {what}")
        self.applied.append(Applied(fault, start, self.history.now(), what))

    def _sleep_until(self, at: float) -> bool:
        delay = at - self.history.now()
        return delay > 0 and self.halt.wait(delay)

    def _hold(self, fault: Fault) -> None:
        self.halt.wait(fault.duration)

    def say(self, fault: Fault, text: str) -> None:
        self.history.add("nemesis", f"{fault.kind} {fault.target}: {text}")

    def apply(self, f: Fault) -> str:
        c = self.cluster
        if f.kind in ("sigkill", "sigstop") and f.target == "rank":
            return self._rank(f)
        if f.kind == "sigkill":
            self.say(f, f"SIGKILL pid {c.pid(f.target)}")
            c.kill_and_restart(f.target)
            self.say(f, f"restarted as pid {c.pid(f.target)}")
            return "killed and restarted"
        if f.kind == "sigterm":
            self.say(f, f"SIGTERM pid {c.pid(f.target)}")
            ended = c.stop_and_restart(f.target, RESTART_GRACE_SECONDS)
            how = "ended by itself" if ended else f"still running after {RESTART_GRACE_SECONDS:.0f}s: SIGKILL"
            self.say(f, f"{how}; restarted as pid {c.pid(f.target)}")
            return f"restarted ({how})"
        if f.kind == "sigstop":
            pid = c.signal(f.target, signal.SIGSTOP)
            c.stopped.add(f.target)
            self.say(f, f"SIGSTOP pid {pid}")
            self._hold(f)
            c.signal(f.target, signal.SIGCONT)
            c.stopped.discard(f.target)
            self.say(f, f"SIGCONT pid {pid}")
            return f"stopped {f.duration}s"
        if f.kind == "restart" and f.target == "redis":
            self.say(f, "redis-server killed (it keeps nothing)")
            c.redis.kill()
            self._hold(f)
            c.redis.start()
            self.say(f, "redis-server up again, empty")
            return "restarted empty"
        if f.kind == "restart" and f.target == "postgres":
            assert c.postgres is not None
            self.say(f, "pg_ctl stop -m fast")
            c.postgres.stop()
            self._hold(f)
            c.postgres.start()
            self.say(f, "pg_ctl start: up")
            return "restarted"
        if f.kind in ("store_down", "store_slow"):
            mode = "cut" if f.kind == "store_down" else "delay"
            c.set_store(mode, STORE_SLOW_DELAY)
            self.say(f, f"every store link {mode}")
            self._hold(f)
            c.set_store("pass")
            self.say(f, "every store link healed")
            return mode
        if f.kind == "disk_full":
            filler = c.fill_disk(f.target)
            if filler is None:
                self.say(f, "no disk of its own (no tmpfs): skipped")
                return "skipped"
            self.say(f, f"{f.target}'s disk filled")
            self._hold(f)
            filler.unlink()
            self.say(f, f"{f.target}'s disk freed")
            return "filled"
        if f.kind.startswith("net_"):
            mode = f.kind.removeprefix("net_")
            c.hub.set(f.target, mode, NET_DELAY)
            self.say(f, f"link {mode}")
            self._hold(f)
            c.hub.set(f.target, "pass")
            self.say(f, "link healed")
            return mode
        raise ValueError(f"no action for {f}")

    def _rank(self, f: Fault) -> str:
        ranks = rank_processes(str(self.cluster.base))
        if not ranks:
            self.say(f, "no trainer rank running: nothing to do")
            return "no rank running"
        # Which rank depends on what runs now; the choice is still the seed's, given the same processes.
        pid, job, attempt, local = random.Random(self.seed * 1_000_003 + f.index).choice(ranks)
        if f.kind == "sigkill":
            os.kill(pid, signal.SIGKILL)
            self.history.add("nemesis", f"sigkill rank {local} (pid {pid}) of attempt {attempt}", job)
            return f"killed rank {local} of {job}"
        os.kill(pid, signal.SIGSTOP)
        self.history.add("nemesis", f"sigstop rank {local} (pid {pid}) of attempt {attempt}", job)
        self._hold(f)
        try:
            os.kill(pid, signal.SIGCONT)
            self.history.add("nemesis", f"sigcont rank {local} (pid {pid})", job)
        except ProcessLookupError:
            self.history.add("nemesis", f"rank {local} (pid {pid}) gone before SIGCONT", job)
        return f"stopped rank {local} of {job} {f.duration}s"

    def windows(self, pairs: set[tuple[str, str]]) -> list[tuple[float, float]]:
        return [(a.start, a.end) for a in self.applied if (a.fault.kind, a.fault.target) in pairs]

    def redis_windows(self) -> list[tuple[float, float]]:
        return self.windows({("restart", "redis")})

