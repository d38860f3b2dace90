"""`python -m soak --minutes M --seed S`: bring the stack up on its own Postgres, Redis, store and folders, run the
workload while the seeded nemesis faults it for M minutes, let it settle, check every invariant, print the report
and `violations: N`, tear everything down; the exit status is 1 when N > 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from contract.codes import TERMINAL_STATUSES
from db import inspect
from scripts.stack import ROOT
from soak import checks
from soak.checks import CheckpointFile, JobEnd, Tally
from soak.cluster import Cluster, make_base, remove_base
from soak.history import History, render
from soak.monitor import Monitor, job_processes, processes
from soak.nemesis import API_DEPENDENCIES, DELIVERER_FAULTS, Nemesis
from soak.schedule import Fault, counts, plan
from soak.workload import Receiver, Workload
from store.checkpoints import read_all
from store.objects import Store
from tests.s3_support import store_config
from worker.logpump import RANK_FILE, parse_trainer_event

TERMINAL_BOUND_SECONDS = 300  # every job terminal this long after the nemesis stops
ORPHAN_GRACE_SECONDS = 30  # a job's processes may take this long to go after the job is seen terminal
DEPENDENCY_SLACK_SECONDS = 15  # 503s may go on this long after a dependency is back (pools reconnect)
# About four times what a calm run holds (under 130 MiB each): a leak shows within a long run, a busy moment does not.
MEMORY_BOUNDS = {"api": 512 * 2**20, "controlplane": 512 * 2**20}


def say(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", flush=True)


def printed_by_ranks(kept: Path, job: str) -> dict[tuple[str, int, int], list[tuple[str, float]]]:
    """(type, ts) of each trainer event in each rank's log of each attempt, on whichever node ran it, from the copies
    the monitor kept (soak/monitor.py: a node may have swept the job's folder since)."""
    out: dict[tuple[str, int, int], list[tuple[str, float]]] = {}
    for node in sorted(p for p in kept.iterdir() if p.is_dir()) if kept.is_dir() else []:
        for log in sorted((node / job / "attempts").glob("*/logs/*_rank*.log")):
            attempt, rank = int(log.parent.parent.name), int(RANK_FILE.search(log.name).group(1))  # type: ignore[union-attr]
            events = []
            for raw in log.read_bytes().split(b"\n"):
                event = parse_trainer_event(raw.decode("utf-8", "replace").rstrip("\r"))
                if event is not None and "ts" in event:
                    events.append((str(event["event"]), event["ts"]))
            out[(job, attempt, rank)] = out.get((job, attempt, rank), []) + events
    return out


def overlaps(windows: list[tuple[float, float]], start: float, end: float) -> bool:
    return any(a <= end and start <= b for a, b in windows)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.history = History()
        self.base = make_base()
        self.cluster = Cluster(self.base, self.history, args.workers)
        self.tally = Tally()
        self.faults: list[Fault] = []
        self.nemesis: Nemesis | None = None

    def run(self) -> int:
        a = self.args
        seconds = a.minutes * 60
        say(f"seed {a.seed}, {a.minutes} min, overlap {a.overlap} (at most {a.at_once} at once), {a.workers} workers, "
            f"{a.followers} followers; base {self.base}")
        self.cluster.up()
        self.faults = plan(a.seed, seconds, [n.name for n in self.cluster.nodes],
                           private_postgres=self.cluster.private_postgres, overlap=a.overlap, at_once=a.at_once)
        print(f"schedule (seed {a.seed}, {len(self.faults)} faults):", flush=True)
        for f in self.faults:
            print(f"  {f}", flush=True)
        assert self.cluster.stack is not None
        with self.cluster.api() as api:
            put = api.put("/owners/soak/webhook", json={"url": None})
            put.raise_for_status()
        receiver = Receiver(self.history, a.seed)
        with self.cluster.api() as api:
            api.put("/owners/soak/webhook", json={"url": receiver.url}).raise_for_status()
        workload = Workload(self.cluster.stack.api_url, self.cluster.key, self.history, a.seed,
                            followers=a.followers, active_jobs=a.active_jobs)
        monitor = Monitor(self.cluster, self.history, lambda: set(workload.record.jobs),
                          workload.record.terminal_since, kept=self.base / "rank-logs")
        self.nemesis = Nemesis(self.cluster, self.history, self.faults, a.seed)
        self.history.start, self.history.wall_start = time.monotonic(), time.time()
        threads = [threading.Thread(target=monitor.run, name="soak-monitor", daemon=True),
                   threading.Thread(target=self.nemesis.run, name="soak-nemesis", daemon=True)]
        for t in threads:
            t.start()
        try:
            asyncio.run(self._drive(workload, seconds, threads[1]))
        finally:
            self.nemesis.halt.set()
            threads[1].join(60)
            monitor.halt.set()
            threads[0].join(10)
            receiver.close()
        return self._check(workload, monitor, receiver)

    async def _drive(self, workload: Workload, seconds: float, nemesis: threading.Thread) -> None:
        done = asyncio.Event()
        runner = asyncio.create_task(workload.run(seconds, done))
        await asyncio.sleep(seconds)
        while nemesis.is_alive():
            await asyncio.sleep(0.5)
        self.nemesis_end = self.history.now()
        self.history.add("nemesis", "nemesis stopped: every fault healed")
        say(f"nemesis done at t={self.nemesis_end:.0f}s; waiting for every job to end "
            f"(bound {TERMINAL_BOUND_SECONDS}s)")
        deadline = self.nemesis_end + TERMINAL_BOUND_SECONDS
        while self.history.now() < deadline:
            await asyncio.sleep(1.0)
            if not workload.record.active() and not workload.producing:
                break
        # Followers read their jobs to the end; give them a little while after the last job ended.
        end = self.history.now() + 60
        while self.history.now() < end and any(
                s.t_last and workload.record.jobs[s.job].terminal_at is None for s in workload.record.streams):
            await asyncio.sleep(1.0)
        await asyncio.sleep(5)
        done.set()
        await runner
        self.settled = self.history.now()

    # ------------------------------------------------------------------------------------ checks
    def _check(self, workload: Workload, monitor: Monitor, receiver: Receiver) -> int:
        assert self.nemesis is not None
        record = workload.record
        tally = self.tally
        dsn = self.cluster.dsn
        self._wait_deliveries(dsn)
        rows = inspect.jobs(dsn)
        ids = [r["id"] for r in rows]
        stored = inspect.events(dsn, ids)
        jobs_by_id = {r["id"]: r for r in rows}

        tally.add("one_attempt_at_a_time", *checks.one_attempt_at_a_time(monitor.samples))

        tally.add("followers_match_store", *checks.followers_match_store(record.streams, stored))

        monitor.keep_rank_logs()  # what the ranks wrote since the last copy
        kept = monitor.kept or self.base / "rank-logs"
        printed: dict[tuple[str, int, int], list[tuple[str, float]]] = {}
        for job in ids:
            printed.update(printed_by_ranks(kept, job))
        redis = self.nemesis.redis_windows()
        # Jobs that lived while Redis restarted empty, which may lose what its stream held (a documented limit).
        through_redis_loss = {j for j, info in record.jobs.items()
                              if overlaps(redis, info.submitted, info.terminal_at or self.history.now())}
        exempt = {(j, att) for (j, att, _) in printed if j in through_redis_loss}
        final = {r["id"]: r["attempt"] for r in rows
                 if r["status"] in TERMINAL_STATUSES and (r["error"] or {}).get("code") != "worker_lost"}
        tally.add("no_event_lost", *checks.no_event_lost(printed, stored, final, exempt))
        tally.add("resumes_from_a_commit", *checks.resumes_from_a_commit(stored, {
            (j, e["attempt"]) for j in through_redis_loss for e in stored.get(j, [])},
            checks.store_commits(self.cluster.s3.log_path.read_text(errors="replace"))))

        ends = {}
        for j in record.jobs.values():
            row = jobs_by_id.get(j.id, {})
            # Postgres's own time of the end where it has one: the pollers see it up to a poll later, or not at all
            # while the API is down.
            finished = row.get("finished_at")
            at = self.history.of_wall(finished.timestamp()) if finished is not None else j.terminal_at
            ends[j.id] = JobEnd(row.get("status", j.status), at)
        tally.add("terminal_in_bound", *checks.terminal_in_bound(ends, self.nemesis_end + TERMINAL_BOUND_SECONDS))

        tally.add("no_worker_error", *checks.no_worker_error(rows))

        count, found = checks.no_orphan_process(monitor.late, record.terminal_since(), ORPHAN_GRACE_SECONDS)
        left = job_processes(processes(), set(ids))
        found += [checks.Violation("no_orphan_process", f"pid {pid} still lives at the end: {cmd[:160]}", job=job)
                  for pid, job, cmd in left if jobs_by_id[job]["status"] in TERMINAL_STATUSES]
        tally.add("no_orphan_process", count + monitor.looks, found)

        store = Store(store_config(self.cluster.s3.env(self._bucket())))  # type: ignore[union-attr]
        files = []
        for job in ids:
            manifests, _refused = read_all(store, job)
            files += [CheckpointFile(job, m.key, f.key, f.sha256) for m in manifests for f in m.files]
        tally.add("checkpoints_read_back", *checks.checkpoints_read_back(files, store.get_bytes))

        downloaded = self._download_all(record.uploads)
        tally.add("uploads_identical", *checks.uploads_identical(record.uploads, downloaded))

        unsure = self.nemesis.windows(DELIVERER_FAULTS)
        tally.add("webhooks_once", *checks.webhooks_once(inspect.deliveries(dsn), receiver.received,
                                                         jobs_by_id, unsure))

        tally.add("no_unexplained_5xx", *checks.no_unexplained_5xx(
            record.answers, self.nemesis.windows(API_DEPENDENCIES), DEPENDENCY_SLACK_SECONDS))

        tally.add("memory_bounded", *checks.memory_bounded(monitor.memory, MEMORY_BOUNDS))
        self._report(workload, monitor, receiver, rows, stored, len(files))
        return len(tally.violations)

    def _bucket(self) -> str:
        return self.cluster.env["FT_STORE_URL"].removeprefix("s3://").split("/", 1)[0]

    def _wait_deliveries(self, dsn: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not [d for d in inspect.deliveries(dsn) if d["status"] == "pending"]:
                return
            time.sleep(1)

    def _download_all(self, uploads: dict[str, str]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        with self.cluster.api(timeout=60) as api:
            for file_id in uploads:
                out[file_id] = None
                for _ in range(5):
                    with contextlib.suppress(httpx.HTTPError):
                        r = api.get(f"/files/{file_id}/content")
                        if r.status_code == 200:
                            out[file_id] = hashlib.sha256(r.content).hexdigest()
                            break
                    time.sleep(1)
        return out

    # ------------------------------------------------------------------------------------ report
    def _report(self, workload: Workload, monitor: Monitor, receiver: Receiver, rows: list[dict[str, Any]],
                stored: dict[str, list[dict[str, Any]]], checkpoint_files: int) -> None:
        assert self.nemesis is not None
        record = workload.record
        applied = Counter(a.fault.kind for a in self.nemesis.applied)
        status = Counter(r["status"] for r in rows)
        kinds = Counter(j.kind for j in record.jobs.values())
        codes = Counter((r["error"] or {}).get("code") for r in rows if r["status"] == "failed")
        answers = Counter(a.status for a in record.answers)
        mem = {name: max((s.rss for s in monitor.memory if s.process == name), default=0) / 2**20
               for name in MEMORY_BOUNDS}
        print("\nfaults applied per kind: " + ", ".join(f"{k} {applied.get(k, 0)}" for k in counts([])), flush=True)
        restarts = Counter(a.what for a in self.nemesis.applied if a.fault.kind == "sigterm")
        if restarts:
            print("restarts: " + ", ".join(f"{n} {what}" for what, n in sorted(restarts.items())), flush=True)
        print(f"jobs: {len(rows)} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); "
              f"{dict(status)}; failures {dict(codes)}; cancels accepted {record.cancels}; "
              f"attempts beyond the first {sum(r['attempt'] - 1 for r in rows)}")
        for code in sorted(c for c in codes if c):
            example = next(r for r in rows if r["status"] == "failed" and (r["error"] or {}).get("code") == code)
            print(f"  e.g. {code} ({example['id']}): {str(example['error'].get('message'))[:200]!r}")
        print(f"events stored: {sum(len(v) for v in stored.values())}; read by followers: "
              f"{sum(len(s.events) for s in record.streams)} over {len(record.streams)} streams, "
              f"{sum(len(s.resumed_from) for s in record.streams)} resumptions with Last-Event-ID")
        print(f"uploads acknowledged: {len(record.uploads)}; mid-run downloads {dict(record.downloads)}; "
              f"checkpoint files read back: {checkpoint_files}")
        print(f"webhook posts received: {len(receiver.received)} "
              f"({sum(1 for d in receiver.received if d.answered >= 300)} answered 500 on purpose)")
        print(f"HTTP answers: {dict(sorted(answers.items()))}; connection errors {record.connection_errors}; "
              f"client exceptions survived {dict(record.client_errors) or 'none'}")
        print("peak RSS MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in mem.items())
              + f"; stack processes that ended by themselves: {monitor.crashes or 'none'}")
        print("\nchecks:")
        for name, what in checks.NAMES.items():
            bad = len(self.tally.of(name))
            print(f"  {name:<24} {self.tally.counts[name]:>9} {what:<34} {'ok' if not bad else f'{bad} VIOLATED'}")
        for v in self.tally.violations[:20]:
            print(f"\nVIOLATION {v}\n  seed {self.args.seed}; history around it:", flush=True)
            print(render(self.history.around(v.at, v.job)), flush=True)
        if len(self.tally.violations) > 20:
            print(f"\n... and {len(self.tally.violations) - 20} more violations")
        print(f"\nseed {self.args.seed}; violations: {len(self.tally.violations)}", flush=True)

    def teardown(self) -> None:
        self.cluster.down()
        if self.tally.violations or self.args.keep:
            kept = ROOT / "var" / "soak" / f"seed-{self.args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.base / "logs", kept, dirs_exist_ok=True)
            say(f"the stack's logs are kept in {kept}")
        remove_base(self.base)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=float(os.environ.get("MINUTES") or 3))
    p.add_argument("--seed", type=int, default=int(os.environ.get("SEED") or 1))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--overlap", type=float, default=float(os.environ.get("OVERLAP") or 0),
                   help="the chance that a fault is joined, while it holds, by a second one on another target")
    p.add_argument("--at-once", type=int, default=int(os.environ.get("AT_ONCE") or 2),
                   help="with --overlap: the most faults that hold together (each further one joins at that chance)")
    p.add_argument("--followers", type=int, default=None, help="default: 100 for runs of 10 minutes or more, else 10")
    p.add_argument("--active-jobs", type=int, default=3, help="unfinished jobs the workload keeps")
    p.add_argument("--keep", action="store_true", help="keep the stack's logs under var/soak/ even when all pass")
    p.add_argument("--plan-only", action="store_true", help="print the seed's schedule and exit")
    args = p.parse_args(argv)
    if args.followers is None:
        args.followers = 100 if args.minutes >= 10 else 10
    if not 0 <= args.overlap <= 1:
        p.error("--overlap: a chance, from 0 to 1")
    if args.at_once < 2:
        p.error("--at-once: 2 or more (one fault at a time is --overlap 0)")
    if args.workers < 2:
        p.error("--workers: two or more (the nodes are what the soak faults one at a time)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.plan_only:
        for f in plan(args.seed, args.minutes * 60, [f"node{i + 1}" for i in range(args.workers)],
                      overlap=args.overlap, at_once=args.at_once):
            print(f)
        return 0
    # A CI runner's timeout sends SIGTERM: the teardown below must still run (no process, database or mount left).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    soak = Soak(args)
    try:
        violations = soak.run()
    except BaseException:
        print(f"seed {args.seed}: the soak itself failed; history tail:\n"
              f"{render(soak.history.records()[-40:])}", file=sys.stderr, flush=True)
        raise
    finally:
        soak.teardown()
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
