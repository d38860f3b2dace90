"""The nemesis's plan: which fault, on what, when and for how long, a pure function of the seed.

Faults come one at a time (each is healed before the next starts) so that a violation points at one fault; the
run still puts every component through every kind of fault in turn, and the system meets each fault in whatever
state the earlier ones left it (jobs requeued, a backlog of events, a webhook retrying). With `overlap` above 0,
that share of faults is followed by a second one that begins while the first still holds, on another target (a
worker killed while the store is down, Redis restarting while the control plane is stopped): faults in combination
at one instant, as a real outage often is; `at_once` above 2 lets a third (and more) join while all before it hold.
What the plan cannot fix in
advance (which trainer rank of which running job) is drawn when the fault fires, from a generator seeded by the run's
seed and the fault's index, so a replay picks alike wherever the same jobs are running.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

# The fault kinds and the targets each applies to; `{worker}` stands for each worker node.
SIGNAL_TARGETS = ("api", "controlplane", "{worker}", "rank")
NETWORK_LINKS = ("{worker}->redis", "{worker}->store", "controlplane->postgres")


@dataclass(frozen=True)
class Fault:
    index: int
    at: float  # seconds after the workload started
    # sigkill | sigterm | sigstop | restart | store_down | store_slow | disk_full | net_cut | net_drop | net_delay
    kind: str
    target: str  # a process (api, controlplane, a worker, rank), a service (redis, postgres, store) or a link
    duration: float  # how long it lasts before it is healed (SIGSTOP to SIGCONT, down to up); 0: a kill

    def __str__(self) -> str:
        last = f" for {self.duration:.1f}s" if self.duration else ""
        return f"#{self.index:<3} t={self.at:7.1f}s  {self.kind:<10} {self.target}{last}"


def catalogue(workers: list[str], *, private_postgres: bool) -> list[tuple[str, str]]:
    """Every (kind, target) pair the nemesis may draw, in a fixed order (the order is part of the seed's meaning)."""
    def each(names: tuple[str, ...]) -> list[str]:
        return [w for n in names for w in ([n.format(worker=x) for x in workers] if "{worker}" in n else [n])]

    pairs = [("sigkill", t) for t in each(SIGNAL_TARGETS)] + [("sigstop", t) for t in each(SIGNAL_TARGETS)]
    pairs += [("restart", "redis")] + ([("restart", "postgres")] if private_postgres else [])
    pairs += [("store_down", "store"), ("store_slow", "store")]
    pairs += [("disk_full", w) for w in workers]
    pairs += [(kind, link) for kind in ("net_cut", "net_drop", "net_delay") for link in each(NETWORK_LINKS)]
    return pairs


# A process's end comes in two manners: SIGKILL (a crash) or SIGTERM and a start again (an operator's restart, a
# deploy: the API and the control plane finish what they do, a worker's trainers checkpoint and it hands its jobs
# back). Of the processes' kills, this share are restarts; which ones is drawn from a generator of each fault's own,
# so that the manner left every seed's times and targets as they were.
RESTART_SHARE = 0.5


def manner(seed: int, fault: Fault) -> Fault:
    """`fault`, or, for a kill of a process drawn to end by an operator's restart, the same fault as a `sigterm`."""
    if fault.kind != "sigkill" or fault.target == "rank":
        return fault
    if random.Random(f"{seed}/{fault.index}").random() < RESTART_SHARE:
        return replace(fault, kind="sigterm")
    return fault


def drawable(workers: list[str], *, private_postgres: bool) -> set[tuple[str, str]]:
    """Every (kind, target) pair a plan may hold: the catalogue's, and the restart of each process it may kill."""
    pairs = set(catalogue(workers, private_postgres=private_postgres))
    return pairs | {("sigterm", t) for kind, t in pairs if kind == "sigkill" and t != "rank"}


# Seconds each kind lasts, drawn uniformly: long enough to outlast a lease (10 s) at the top, so that both sides of
# the lease bound are exercised.
DURATIONS = {"sigkill": (0.0, 0.0), "sigterm": (0.0, 0.0), "sigstop": (2.0, 16.0), "restart": (1.0, 12.0),
             "store_down": (3.0, 25.0), "store_slow": (5.0, 25.0), "disk_full": (5.0, 20.0), "net_cut": (2.0, 16.0),
             "net_drop": (2.0, 16.0), "net_delay": (5.0, 20.0)}


def plan(seed: int, seconds: float, workers: list[str], *, private_postgres: bool = True,
         mean_gap: float = 12.0, warmup: float = 20.0, overlap: float = 0.0, at_once: int = 2) -> list[Fault]:
    """The faults of a run of `seconds` seconds, all healed by `seconds`; the same arguments, the same plan.
    `overlap`: the chance that a fault is joined, while it holds, by a second one on another target, and that
    chance again for each further one while fewer than `at_once` hold together. At 0 the generator is drawn
    exactly as without the option, and at `at_once` 2 as before it existed, so a seed's plan stays what it was."""
    rng = random.Random(seed)
    pairs = catalogue(workers, private_postgres=private_postgres)
    faults: list[Fault] = []
    t = warmup  # the stack settles and the first jobs start before anything breaks
    while True:
        kind, target = pairs[rng.randrange(len(pairs))]
        low, high = DURATIONS[kind]
        duration = round(rng.uniform(low, high), 1)
        if t + duration > seconds:
            return [manner(seed, f) for f in faults]
        first = Fault(len(faults), round(t, 1), kind, target, duration)
        faults.append(first)
        t += duration + max(1.0, rng.expovariate(1.0 / mean_gap))
        group = [first]
        while overlap and len(group) < at_once and rng.random() < overlap:
            joined = _joining(rng, pairs, group, seconds)
            if joined is None:
                break
            faults.append(joined)
            group.append(joined)
            # The next fault waits for the whole group to heal, so no more than `at_once` ever hold together.
            t = max(t, joined.at + joined.duration + 1.0)


def _share(kind_a: str, target_a: str, kind_b: str, target_b: str) -> bool:
    """Whether two faults act on one thing, so the heal of one would end the other: one target, or the store's
    faults (which set every link to the store) beside a fault of one such link."""
    def store_links(kind: str, target: str) -> bool:
        return kind.startswith("store_") or target.endswith("->store")
    return target_a == target_b or (store_links(kind_a, target_a) and store_links(kind_b, target_b))


def _joining(rng: random.Random, pairs: list[tuple[str, str]], group: list[Fault], seconds: float) -> Fault | None:
    """A fault on a target none of `group` acts on that begins while every fault of it holds (a kill holds for a
    second, while the killed process starts again), or None where the one drawn would outlast the run or no instant
    is left that the whole group holds."""
    others = [(k, t) for k, t in pairs if not any(_share(f.kind, f.target, k, t) for f in group)]
    if not others:
        return None
    kind, target = others[rng.randrange(len(others))]
    low, high = DURATIONS[kind]
    duration = round(rng.uniform(low, high), 1)
    first = group[0]
    if len(group) == 1:  # drawn as before `at_once` existed, so a seed's pairs stay what they were
        at = first.at + (rng.uniform(0.1, 0.9) * first.duration if first.duration else rng.uniform(0.1, 1.0))
    else:
        start, end = max(f.at for f in group), min(f.at + (f.duration or 1.0) for f in group)
        if end - start < 0.5:
            return None
        at = start + rng.uniform(0.1, 0.9) * (end - start)
    at = round(at, 1)
    if at + duration > seconds:
        return None
    return Fault(group[-1].index + 1, at, kind, target, duration)


def counts(faults: list[Fault]) -> dict[str, int]:
    """Faults per kind, every kind of the catalogue present (0 where none was drawn)."""
    out = {kind: 0 for kind in DURATIONS}
    for f in faults:
        out[f.kind] += 1
    return out
