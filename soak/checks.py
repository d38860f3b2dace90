"""The invariants, each a named check over recorded history and state: what it examined (its count) and what it
found. Every function here is pure over its arguments (or reads only the store it is handed), so a test can plant a
violation in a recorded history and show that the check catches it (tests/test_soak.py)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from contract.codes import TERMINAL_STATUSES, EventKind, FailureCode

# The checks, in the order the report prints them, with what each one's count counts.
NAMES = {
    "one_attempt_at_a_time": "process samples of running jobs",
    "followers_match_store": "events received by followers",
    "no_event_lost": "trainer events printed by the ranks",
    "terminal_in_bound": "jobs",
    "no_worker_error": "ended jobs",
    "no_orphan_process": "process samples",
    "checkpoints_read_back": "checkpoint files",
    "resumes_from_a_commit": "resumed starts",
    "uploads_identical": "acknowledged uploads",
    "webhooks_once": "deliveries",
    "no_unexplained_5xx": "HTTP answers",
    "memory_bounded": "memory samples",
}
# Stored events the trainer did not print: the service's own (state changes) and every rank's non-JSON lines.
NOT_PRINTED_BY_THE_TRAINER = {EventKind.STATE.value, EventKind.LOG.value}


@dataclass(frozen=True)
class Violation:
    check: str
    message: str
    at: float | None = None  # seconds since the run's start, where known
    job: str | None = None

    def __str__(self) -> str:
        where = f" t={self.at:.1f}s" if self.at is not None else ""
        return f"[{self.check}]{where}{' ' + self.job if self.job else ''}: {self.message}"


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)

    def add(self, name: str, count: int, found: Iterable[Violation] = ()) -> None:
        assert name in NAMES, name
        self.counts[name] += count
        self.violations += list(found)

    def of(self, name: str) -> list[Violation]:
        return [v for v in self.violations if v.check == name]


Windows = list[tuple[float, float]]


def within(t: float, windows: Windows, slack: float = 0.0) -> bool:
    return any(start - slack <= t <= end + slack for start, end in windows)


# ------------------------------------------------------------------------------------------------ training

@dataclass(frozen=True)
class ProcSample:
    """One look at the host's processes: for each job, the attempts whose trainer ranks are alive."""

    t: float
    attempts: dict[str, set[int]]


def one_attempt_at_a_time(samples: Iterable[ProcSample]) -> tuple[int, list[Violation]]:
    count, found, reported = 0, [], set()
    for s in samples:
        for job, attempts in s.attempts.items():
            count += 1
            if len(attempts) > 1 and job not in reported:
                reported.add(job)
                found.append(Violation("one_attempt_at_a_time", f"attempts {sorted(attempts)} train at once",
                                       s.t, job))
    return count, found


@dataclass(frozen=True)
class Received:
    seq: int
    type: str
    attempt: int


@dataclass
class FollowerStream:
    """What one follower read of one job over all its connections, and the Last-Event-ID of each connection."""

    follower: str
    job: str
    events: list[Received] = field(default_factory=list)
    resumed_from: list[int] = field(default_factory=list)
    t_last: float = 0.0


def followers_match_store(streams: Iterable[FollowerStream],
                          stored: dict[str, list[dict[str, Any]]]) -> tuple[int, list[Violation]]:
    """Each follower's events, across its reconnections, are the stored log's from the first on: in order, none
    missing, none twice, each the event Postgres holds under its id."""
    count, found = 0, []
    for s in streams:
        count += len(s.events)
        seqs = [e.seq for e in s.events]
        expected = list(range(1, len(seqs) + 1))
        if seqs != expected:
            dups = [q for q, n in Counter(seqs).items() if n > 1]
            first_bad = next(i for i, (a, b) in enumerate(zip(seqs, expected, strict=False)) if a != b) \
                if any(a != b for a, b in zip(seqs, expected, strict=False)) else len(expected)
            found.append(Violation("followers_match_store",
                                   f"{s.follower} read ids {seqs[max(0, first_bad - 3):first_bad + 3]} around "
                                   f"position {first_bad + 1} (duplicated: {dups[:5]}; resumed from "
                                   f"{s.resumed_from[-5:]})", s.t_last, s.job))
            continue
        log = stored.get(s.job, [])
        for e in s.events:
            row = log[e.seq - 1] if e.seq <= len(log) else None
            if row is None or (row["seq"], row["type"], row["attempt"]) != (e.seq, e.type, e.attempt):
                found.append(Violation("followers_match_store",
                                       f"{s.follower} read event {e.seq} ({e.type}, attempt {e.attempt}); Postgres "
                                       f"holds {None if row is None else (row['seq'], row['type'], row['attempt'])}",
                                       s.t_last, s.job))
                break
    return count, found


def trainer_events(stored: list[dict[str, Any]], attempt: int, rank: int) -> list[tuple[str, float]]:
    """(type, ts) of the trainer events rank `rank` printed in `attempt`, as the stored log holds them, in order."""
    return [(e["type"], e["data"]["ts"]) for e in stored
            if e["attempt"] == attempt and e["type"] not in NOT_PRINTED_BY_THE_TRAINER and "ts" in e["data"]
            and int(e["data"].get("rank") or 0) == rank]


def is_subsequence(part: list[Any], whole: list[Any]) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def no_event_lost(printed: dict[tuple[str, int, int], list[tuple[str, float]]],
                  stored: dict[str, list[dict[str, Any]]], final: dict[str, int],
                  exempt: set[tuple[str, int]]) -> tuple[int, list[Violation]]:
    """Against each rank's own log of each attempt (`printed`, by job, attempt and rank: type and timestamp of each
    trainer event): the final attempt's events all stored, once, in order; a superseded attempt's a prefix of what
    it printed (the rest was fenced off). An attempt in `exempt` (it ran while Redis restarted empty, which loses
    what the stream held: a documented limit) need only have stored a subsequence of what it printed, in order and
    once."""
    count, found = 0, []
    for (job, attempt, rank), lines in sorted(printed.items()):
        count += len(lines)
        got = trainer_events(stored.get(job, []), attempt, rank)
        where = f"attempt {attempt} rank {rank}"
        if len(got) != len(set(got)):
            found.append(Violation("no_event_lost", f"{where}: a trainer event was stored twice", job=job))
        elif (job, attempt) in exempt:
            if not is_subsequence(got, lines):
                found.append(Violation("no_event_lost", f"{where} (Redis restarted meanwhile): stored events that "
                                       "the rank did not print, or out of order", job=job))
        elif attempt == final.get(job):
            if got != lines:
                missing = [x for x in lines if x not in got]
                extra = [x for x in got if x not in lines]
                found.append(Violation("no_event_lost", f"final {where}: printed {len(lines)} trainer events, "
                                       f"{len(got)} stored; first missing {missing[:3]}, first extra {extra[:3]}",
                                       job=job))
        elif got != lines[:len(got)]:
            found.append(Violation("no_event_lost", f"superseded {where}: the stored events are not a prefix of what "
                                   f"the rank printed ({len(got)} stored, {len(lines)} printed)", job=job))
    return count, found


# A line of the store server's access log (moto's: one line per answered request, in the order it answered them)
# that wrote a checkpoint's manifest (its commit) or an attempt's fence (its takeover: store/checkpoints.py).
STORE_WRITE = re.compile(r'"PUT /\S*?jobs/(job_[A-Za-z0-9_-]+)/(?:checkpoints/step-(\d+)\.attempt-(\d+)\.json|'
                         r'fences/attempt-(\d+)\.json) HTTP/[\d.]+" 200 ')


def store_commits(access_log: str) -> dict[str, set[tuple[int, int]]]:
    """Per job, the (attempt, step) of each checkpoint manifest the store took before the next attempt's fence:
    the commits an attempt's restore may trust, as the store itself saw them, whatever the event log kept."""
    out: dict[str, set[tuple[int, int]]] = defaultdict(set)
    fenced: dict[str, int] = defaultdict(int)  # the newest attempt that took the job over in the store
    for m in STORE_WRITE.finditer(access_log):
        job = m.group(1)
        if m.group(4) is not None:
            fenced[job] = max(fenced[job], int(m.group(4)))
        elif int(m.group(3)) >= fenced[job]:
            out[job].add((int(m.group(3)), int(m.group(2))))
    return out


def resumes_from_a_commit(stored: dict[str, list[dict[str, Any]]], exempt: set[tuple[str, int]],
                          in_store: dict[str, set[tuple[int, int]]] | None = None) -> tuple[int, list[Violation]]:
    """Every start that resumed (its `resumed_from_step`) did so from a checkpoint its job had committed before it,
    and its first step is the one after that checkpoint. Committed: a committed checkpoint event earlier in the
    job's log, or (`in_store`, from `store_commits`) a manifest an earlier attempt wrote to the store before the
    resuming one took over; the log alone cannot say, as the ingester drops what a superseded attempt's worker
    publishes late (a commit held up by a cut link). An attempt in `exempt` (its job lived while Redis restarted
    empty, which may lose the commit's event) is counted, not held to it."""
    count, found = 0, []
    for job, events in sorted(stored.items()):
        committed: set[int] = set()
        for i, e in enumerate(events):
            if e["type"] == EventKind.CHECKPOINT.value and e["data"].get("committed"):
                committed.add(int(e["data"]["step"]))
            step = e["data"].get("resumed_from_step") if e["type"] == EventKind.STARTED.value else None
            if not step:
                continue
            count += 1
            if (job, e["attempt"]) in exempt:
                continue
            earlier = {s for a, s in (in_store or {}).get(job, set()) if a < e["attempt"]}
            if step not in committed | earlier:
                found.append(Violation("resumes_from_a_commit", f"attempt {e['attempt']} resumed from step {step}, "
                                       f"which no checkpoint committed before it (committed: {sorted(committed)})",
                                       job=job))
                continue
            first = next((x["data"].get("step") for x in events[i + 1:]
                          if x["attempt"] == e["attempt"] and x["type"] == EventKind.PROGRESS.value), None)
            if first is not None and first != step + 1:
                found.append(Violation("resumes_from_a_commit", f"attempt {e['attempt']} resumed from step {step} "
                                       f"but its first step is {first}", job=job))
    return count, found


@dataclass(frozen=True)
class JobEnd:
    status: str
    terminal_at: float | None  # seconds since the run's start when the soak first saw it terminal


def terminal_in_bound(jobs: dict[str, JobEnd], deadline: float) -> tuple[int, list[Violation]]:
    found = [Violation("terminal_in_bound", f"still {end.status} at the deadline (t={deadline:.0f}s)", job=job)
             if end.status not in TERMINAL_STATUSES or end.terminal_at is None else
             Violation("terminal_in_bound", f"terminal only at t={end.terminal_at:.0f}s, past t={deadline:.0f}s",
                       end.terminal_at, job)
             for job, end in jobs.items()
             if end.status not in TERMINAL_STATUSES or end.terminal_at is None or end.terminal_at > deadline]
    return len(jobs), found


def no_worker_error(rows: Iterable[dict[str, Any]]) -> tuple[int, list[Violation]]:
    """No job failed as `worker_error`: that code is the supervisor's own exception (worker/attempt.py), a bug by its
    definition, where a fault should have had an outcome of its own (requeued, released, a classified failure)."""
    ended = [r for r in rows if r["status"] in TERMINAL_STATUSES]
    found = [Violation("no_worker_error", f"failed as {FailureCode.WORKER_ERROR.value}: "
                       f"{str((r['error'] or {}).get('message'))[:200]}", job=r["id"])
             for r in ended if (r["error"] or {}).get("code") == FailureCode.WORKER_ERROR]
    return len(ended), found


@dataclass(frozen=True)
class JobProcess:
    t: float
    pid: int
    job: str
    cmd: str


def no_orphan_process(seen: Iterable[JobProcess], terminal_since: dict[str, float],
                      grace: float) -> tuple[int, list[Violation]]:
    """No process of a job (guard, launcher, rank) lives `grace` seconds after the job became terminal."""
    count, found, reported = 0, [], set()
    for p in seen:
        count += 1
        since = terminal_since.get(p.job)
        if since is not None and p.t - since > grace and p.pid not in reported:
            reported.add(p.pid)
            found.append(Violation("no_orphan_process", f"pid {p.pid} lives {p.t - since:.0f}s after the job "
                                   f"ended: {p.cmd[:160]}", p.t, p.job))
    return count, found


# ------------------------------------------------------------------------------------------------ storage

@dataclass(frozen=True)
class CheckpointFile:
    job: str
    manifest: str
    key: str
    sha256: str


def checkpoints_read_back(files: Iterable[CheckpointFile],
                          read: Callable[[str], bytes]) -> tuple[int, list[Violation]]:
    """Every file a committed (trusted) manifest names reads back from the store with the manifest's SHA-256."""
    count, found = 0, []
    for f in files:
        count += 1
        try:
            digest = hashlib.sha256(read(f.key)).hexdigest()
        except FileNotFoundError:
            found.append(Violation("checkpoints_read_back", f"{f.manifest} names {f.key}, which is gone", job=f.job))
            continue
        if digest != f.sha256:
            found.append(Violation("checkpoints_read_back", f"{f.key} reads back as sha256 {digest[:12]}…, "
                                   f"{f.manifest} recorded {f.sha256[:12]}…", job=f.job))
    return count, found


def uploads_identical(acknowledged: dict[str, str],
                      downloaded: dict[str, str | None]) -> tuple[int, list[Violation]]:
    """Every upload the API acknowledged (file id -> sha256 of what was sent) downloads with the same bytes."""
    found = []
    for file_id, digest in acknowledged.items():
        got = downloaded.get(file_id)
        if got != digest:
            found.append(Violation("uploads_identical", f"{file_id}: sent sha256 {digest[:12]}…, downloaded "
                                   f"{'nothing' if got is None else got[:12] + '…'}"))
    return len(acknowledged), found


# ------------------------------------------------------------------------------------------------ clients

@dataclass(frozen=True)
class Delivery:
    """One POST the webhook receiver answered."""

    t: float
    delivery: str
    event: str
    job: str
    event_id: int | None
    answered: int


def webhooks_once(rows: list[dict[str, Any]], received: list[Delivery], jobs: dict[str, dict[str, Any]],
                  unsure: Windows) -> tuple[int, list[Violation]]:
    """Every delivery the outbox holds was answered 2xx by the receiver at least once and is no longer pending;
    no delivery id was acknowledged twice (outside `unsure`: a control plane killed or cut off from Postgres between
    a receiver's answer and its record resends, as at-least-once delivery must); no event announced under two ids;
    every terminal job that names a receiver announced its end."""
    found = []
    acked: dict[str, list[float]] = defaultdict(list)
    for d in received:
        if 200 <= d.answered < 300:
            acked[d.delivery].append(d.t)
    for row in rows:
        if not acked.get(row["id"]):
            found.append(Violation("webhooks_once", f"delivery {row['id']} ({row['event']}, event {row['event_seq']}) "
                                   f"is {row['status']} after {row['attempts']} attempts and was never received "
                                   f"with a 2xx (last: {row['last_status_code']} {row['last_error'] or ''})",
                                   job=row["job_id"]))
    for delivery, times in acked.items():
        for a, b in zip(times, times[1:], strict=False):
            if not any(start <= b and a <= end for start, end in unsure):
                found.append(Violation("webhooks_once", f"delivery {delivery} acknowledged twice (t={a:.1f}s and "
                                       f"t={b:.1f}s) with no fault of the deliverer between", b))
    announced: dict[tuple[str, str, int], set[str]] = defaultdict(set)
    for row in rows:
        announced[(row["job_id"], row["event"], row["event_seq"])].add(row["id"])
    for (job, event, seq), ids in announced.items():
        if len(ids) > 1:
            found.append(Violation("webhooks_once", f"{event} of event {seq} announced under {len(ids)} delivery ids",
                                   job=job))
    events_of = defaultdict(set)
    for row in rows:
        events_of[row["job_id"]].add(row["event"])
    for job, j in jobs.items():
        if j.get("webhook_url") and j["status"] in TERMINAL_STATUSES and f"job.{j['status']}" not in events_of[job]:
            found.append(Violation("webhooks_once", f"{j['status']} but no job.{j['status']} delivery", job=job))
    return len(rows), found


@dataclass(frozen=True)
class Answer:
    t: float
    method: str
    path: str
    status: int
    retry_after: str | None


def no_unexplained_5xx(answers: Iterable[Answer], dependency_down: Windows,
                       slack: float) -> tuple[int, list[Violation]]:
    """No 5xx but a 503 with Retry-After, and that only while a dependency was down (or within `slack` seconds of
    it coming back: pools reconnect, caches refill)."""
    count, found = 0, []
    for a in answers:
        count += 1
        if a.status < 500:
            continue
        if a.status != 503 or not a.retry_after:
            found.append(Violation("no_unexplained_5xx", f"{a.method} {a.path} answered {a.status}"
                                   f"{'' if a.retry_after else ' without Retry-After'}", a.t))
        elif not within(a.t, dependency_down, slack):
            found.append(Violation("no_unexplained_5xx", f"{a.method} {a.path} answered 503 while every dependency "
                                   "was up", a.t))
    return count, found


@dataclass(frozen=True)
class MemorySample:
    t: float
    process: str
    rss: int


def memory_bounded(samples: Iterable[MemorySample], bounds: dict[str, int]) -> tuple[int, list[Violation]]:
    count, found, reported = 0, [], set()
    for s in samples:
        count += 1
        bound = bounds.get(s.process)
        if bound is not None and s.rss > bound and s.process not in reported:
            reported.add(s.process)
            found.append(Violation("memory_bounded", f"{s.process} RSS {s.rss / 2**20:.0f} MiB over its bound of "
                                   f"{bound / 2**20:.0f} MiB", s.t))
    return count, found
