"""Supervises one attempt of a job: spawn the launcher, pump its output, heartbeat, cancel, end it.

Plain code, no Celery, so tests and operators can drive it directly. Everything the attempt says
goes to Redis tagged (job, attempt); the control plane decides what it means.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from contract.codes import EventKind, FailureCode, JobStatus
from contract.protocol import (
    attempt_key,
    cancel_key,
    claim_key,
    gang_stop_key,
    lease_key,
    part_done_key,
    released_key,
    rendezvous_key,
)
from contract.spec import NodeShare, RunSpec
from trainer import fence, swap
from worker.logpump import LineReader, RankLogTail, RankWatch, parse_trainer_event
from worker.outcome import Outcome, Status, classify_failure, read_completion
from worker.priority import Priority, command
from worker.publisher import Publisher
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parent.parent
FENCED = "FENCED"  # left in the attempt's folder by the guard that ended it (worker/guard.py)
# After a rank of a multi-node attempt reported its error, how long this node's processes get to exit by
# themselves: the world is broken, and a rank whose peer died can hang in its process group's teardown.
RANK_ERROR_GRACE_SECONDS = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_argv(python: str, num_procs: int, spec_file: Path, log_dir: Path,
                  share: NodeShare | None = None, gang: Gang | None = None) -> list[str]:
    """The DeepSpeed launcher running the trainer module on every rank of this node's share."""
    if gang is not None:
        # DeepSpeed's own multi-node launch without SSH: every node runs the runner with the same hostfile,
        # its own --node_rank, and node 0's address and port; the runner starts only this node's ranks
        # (deepspeed.launcher.launch with the whole world's layout), so ranks number across the nodes.
        argv = [python, "-m", "deepspeed.launcher.runner", "--hostfile", str(gang.hostfile), "--no_ssh",
                "--node_rank", str(gang.node_rank), "--master_addr", gang.master_addr,
                "--master_port", str(gang.master_port)]
        if gang.include:
            argv += ["--include", gang.include]
        return argv + ["--enable_each_rank_log", str(log_dir), "--module", "trainer", "--spec", str(spec_file)]
    if share is not None and share.kind != "cpu":
        # The devices the control plane placed the job on, by this node's GPU ids: the launcher sets each
        # rank's CUDA_VISIBLE_DEVICES from them (it refuses --num_gpus together with --include).
        devices = ["--include", f"localhost:{','.join(share.devices)}"]
    else:
        # CPU slots are bookkeeping: as many processes as slots placed (the OS schedules them).
        devices = ["--num_gpus", str(len(share.devices) if share is not None else num_procs)]
    return [python, "-m", "deepspeed.launcher.runner", *devices,
            "--master_port", str(free_port()), "--enable_each_rank_log", str(log_dir),
            "--module", "trainer", "--spec", str(spec_file)]


class Gang:
    """This node's view of a multi-node attempt: the hostfile every node writes alike, and node 0's address."""

    def __init__(self, hostfile: Path, node_rank: int, master_addr: str, master_port: int, include: str) -> None:
        self.hostfile, self.node_rank, self.include = hostfile, node_rank, include
        self.master_addr, self.master_port = master_addr, master_port


def hostfile_text(parts: list[tuple[str, int]]) -> str:
    """`name slots=N` per node, in node-rank order. Names are labels only: with --no_ssh nothing resolves them."""
    return "".join(f"{name} slots={slots}\n" for name, slots in parts)


class Running:
    """How many attempts this worker process supervises right now (one per slot-thread of its pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def __enter__(self) -> Running:
        with self._lock:
            self.count += 1
        return self

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self.count -= 1

    def alone(self) -> bool:
        with self._lock:
            return self.count <= 1


RUNNING = Running()


def spawn(argv: list[str], *, env: dict[str, str], cwd: Path, guard: list[str],
          priority: Priority = "normal") -> subprocess.Popen[bytes]:
    """Start argv under the guard in a new session: its process group is the job's, to kill at once. argv runs
    at `priority` (worker/priority.py); the guard, which watches the lease, at the worker's own."""
    argv = command(argv, priority)
    # The worker's pid is named, not taken from getppid() once the guard runs: a worker that died while the
    # guard was still importing would leave it with init for a parent and nothing to compare against.
    guarded = [sys.executable, "-m", "worker.guard", "--worker-pid", str(os.getpid()), *guard, "--", *argv]
    return subprocess.Popen(guarded, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def extensions_dir(settings: WorkerSettings) -> Path:
    """Where the launched ranks build and cache DeepSpeed's ops: TORCH_EXTENSIONS_DIR where the operator set
    it, else one folder per Python installation, since ops built against one installation's sources are
    rebuilt (slowly, under a lock) by another. `worker.prebuild` builds into the same folder."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return Path(settings.extensions_dir).expanduser() / tag


def _open_paths() -> set[str] | None:
    """The paths of the files some process on this host has open (read from /proc), None where it cannot
    tell. Another user's processes cannot be read; they do not build into this user's folder."""
    paths: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    return paths


def release_stale_build_locks(folder: Path) -> list[Path]:
    """A rank killed while building an op leaves torch's build lock behind, and every later job on this
    node would wait on it forever. A live build keeps its lock file open (torch's FileBaton holds the fd
    until it removes the file), so only a lock no process holds open is stale: another process's build,
    or a rank loading an op, keeps its lock. Where /proc cannot tell, nothing is removed."""
    locks: dict[Path, int] = {}
    for lock in folder.glob("*/lock"):
        try:
            locks[lock] = lock.stat().st_ino
        except FileNotFoundError:
            continue
    held = _open_paths() if locks else None
    if held is None:
        return []
    stale: list[Path] = []
    for lock, inode in locks.items():
        try:
            # Not held, and still the file read before /proc was: one removed meanwhile may be a new build's.
            if str(lock.resolve()) not in held and lock.stat().st_ino == inode:
                lock.unlink()
                stale.append(lock)
        except FileNotFoundError:
            continue
    return stale


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def wait_group_gone(pgid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


class Attempt:
    """The running state of one attempt; `run()` returns how it ended."""

    def __init__(self, *, job_id: str, attempt: int, job_dir: Path, run: dict[str, Any],
                 settings: WorkerSettings, client: redis.Redis,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.job_id, self.attempt, self.job_dir = job_id, attempt, job_dir
        self.attempt_dir = job_dir / "attempts" / str(attempt)
        self.run_spec = {**run, "attempt": attempt}
        placement = run.get("placement") or {}
        # Which part of a multi-node attempt this is (its node rank), and how many parts there are.
        self.part, self.parts = int(placement.get("node_rank", 0)), int(placement.get("num_nodes", 1))
        self.node = str(placement.get("node", ""))
        # What a multi-node attempt's log lines carry besides their rank: which node they came from.
        self.where = {"node": self.node} if self.parts > 1 else {}
        self.settings = settings
        self.r = client
        self.pub = Publisher(client, job_id, attempt)
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.tail: deque[str] = deque(maxlen=settings.log_tail_lines)
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.trainer_error: dict[str, Any] | None = None
        self.running_reported = False
        self.usage: dict[str, float] = {}
        self.rank_watch = RankWatch()
        self.stopping = stopping
        self.lease_expires_at = 0.0  # epoch seconds: when the last lease this worker set runs out
        # What this part writes in the gang's stop key when its failure stops the others; None until it tried.
        self.stop_mark = f"{self.node or 'node'}#{self.part}"
        self.failure_claimed: bool | None = None

    # -- Redis I/O that must survive a Redis hiccup without losing the job --------------------------
    def flush(self) -> None:
        if not self.pending:
            return
        try:
            self.pub.emit_many(self.pending)
            self.pending = []
        except redis.RedisError as exc:
            log.warning("could not publish %d events yet: %s", len(self.pending), exc)

    def control(self) -> str | None:
        """'stale' or 'cancel' when the control plane wants this attempt gone."""
        try:
            current, cancelled, stopped = self.r.pipeline(transaction=False).get(attempt_key(self.job_id)).exists(
                cancel_key(self.job_id)).get(gang_stop_key(self.job_id, self.attempt)).execute()
        except redis.RedisError:
            return None
        if current is not None and int(current) != self.attempt:
            return "stale"
        if cancelled:
            return "cancel"
        if stopped is not None and self.parts > 1 and stopped.decode() != self.stop_mark:
            return "gang_stopped"  # another node's part failed: this one's ranks cannot go on alone
        return None

    def claim_failure(self) -> bool:
        """Whether this part owns the multi-node attempt's failure. The first part to fail sets the gang's stop
        key (every other part then stops its ranks) and reports the job's error; a part whose ranks failed
        after it, on the connections the first one's dead ranks broke, only followed it and reports nothing.
        Claimed as early as the part knows it failed: when a rank reports an error, before its ranks exit."""
        if self.failure_claimed is None:
            try:
                self.failure_claimed = bool(self.r.set(gang_stop_key(self.job_id, self.attempt), self.stop_mark,
                                                       nx=True, ex=7 * 24 * 3600))
            except redis.RedisError as exc:
                # Unknown: report the failure (should two parts report, the job takes the first).
                log.warning("could not claim the gang's failure: %s", exc)
                return True
        return self.failure_claimed

    def part_over(self) -> None:
        """This part ended and leaves the job's report to another part: its lease may lapse without the part
        counting as a lost node (to the control plane, or to the part that reports the gang's failure)."""
        try:
            self.r.set(part_done_key(self.job_id, self.attempt, self.part), "1", ex=7 * 24 * 3600)
        except redis.RedisError as exc:
            log.warning("could not mark part %d over (its lease stays until the report window): %s", self.part, exc)

    def heartbeat(self, ttl: float) -> None:
        sent = time.time()
        try:
            self.r.set(lease_key(self.job_id, self.attempt, self.part), self.worker_id, px=int(ttl * 1000))
            self.lease_expires_at = sent + ttl
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    # -- output ---------------------------------------------------------------------------------
    def collect(self, reader: LineReader, ranks: RankLogTail, final: bool = False) -> None:
        for line in reader.take():
            self.rank_watch.see(line)
            self.tail.append(line)
            self.pending.append((EventKind.LOG, {"rank": None, "line": line, **self.where}))
        for rank, line in (ranks.close() if final else ranks.poll()):
            event = parse_trainer_event(line)
            if event is None:
                self.tail.append(f"[rank {rank}] {line}")
                self.pending.append((EventKind.LOG, {"rank": rank, "line": line, **self.where}))
                continue
            kind = str(event.pop("event"))
            if kind == EventKind.ERROR and self.trainer_error is None:
                self.trainer_error = event
            if kind == EventKind.STARTED and not self.running_reported:
                self.running_reported = True
                self.pending.append((EventKind.STATE, {"status": JobStatus.RUNNING}))
            self.pending.append((kind, event))

    # -- the attempt ----------------------------------------------------------------------------
    def prepare(self) -> tuple[Path, Path, Path]:
        # Every node of a multi-node attempt writes into the same shared folder: each part its own files.
        suffix = f".node{self.part}" if self.part else ""
        log_dir = self.attempt_dir / f"logs{suffix}"
        log_dir.mkdir(parents=True, exist_ok=True)
        output_dir = Path(self.run_spec["paths"]["output_dir"])
        if self.part == 0:
            # A marker left by an earlier attempt must not make this one look finished.
            (output_dir / "COMPLETE").unlink(missing_ok=True)
        spec_file = self.attempt_dir / f"spec{suffix}.json"
        spec_file.write_text(json.dumps(self.run_spec, indent=2))
        return spec_file, log_dir, output_dir

    def rendezvous(self, share: NodeShare) -> Gang | None:
        """Node 0 picks its port and publishes it; the other nodes wait for it (watching cancel and the
        attempt key meanwhile). None: the attempt was stopped while waiting."""
        key = rendezvous_key(self.job_id, self.attempt)
        if self.part == 0:
            where = f"{share.master_addr}:{share.master_port or free_port()}"
            self.r.set(key, where, ex=7 * 24 * 3600)
        else:
            where = ""
            while not where:
                self.heartbeat(self.settings.lease_ttl_seconds)
                if self.control() is not None:
                    return None
                raw = self.r.get(key)
                where = raw.decode() if raw else ""
                if not where:
                    time.sleep(self.settings.poll_seconds)
        addr, port = where.rsplit(":", 1)
        parts = share.gang
        hostfile = self.attempt_dir / f"hostfile{f'.node{self.part}' if self.part else ''}"
        hostfile.write_text(hostfile_text([(p.node, len(p.devices)) for p in parts]))
        include = "" if share.kind == "cpu" else "@".join(f"{p.node}:{','.join(p.devices)}" for p in parts)
        return Gang(hostfile, self.part, addr, int(port), include)

    def guard_args(self) -> list[str]:
        return ["--redis", self.settings.redis_url, "--job", self.job_id, "--attempt", str(self.attempt),
                "--owner", self.worker_id, "--lease-expires-at", repr(self.lease_expires_at),
                "--fenced-file", str(self.attempt_dir / f"{FENCED}{f'.node{self.part}' if self.part else ''}"),
                "--part", str(self.part)]

    def execute(self) -> Outcome:
        s = self.settings
        # From here on no older attempt can commit a checkpoint or an export (trainer/fence.py).
        newest = fence.raise_to(self.job_dir, self.attempt)
        if newest > self.attempt:
            log.info("job %s attempt %s: attempt %s already started here; nothing to do", self.job_id,
                     self.attempt, newest)
            return Outcome(Status.STALE)
        # The contract, checked as the trainer will check it: a malformed message fails here, visibly.
        contract = RunSpec.model_validate(self.run_spec)
        spec_file, log_dir, output_dir = self.prepare()
        ext_dir = extensions_dir(s)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_EXTENSIONS_DIR": str(ext_dir),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
        if contract.placement is not None and contract.placement.kind != "cpu":
            # The launcher would otherwise read it as the devices to use; --include names them instead.
            env.pop("CUDA_VISIBLE_DEVICES", None)
        gang = None
        if contract.placement is not None and contract.placement.num_nodes > 1:
            gang = self.rendezvous(contract.placement)
            if gang is None:
                return self.decide(self.control(), None, output_dir, 0)
        argv = launcher_argv(s.python or sys.executable, contract.job.world_size, spec_file, log_dir,
                             contract.placement, gang)
        self.pending.append((EventKind.LOG, {"rank": None, "line": "$ " + " ".join(argv)}))
        # The growth of the worker's children's CPU time: this job's alone on a node running one job at a time;
        # with several jobs at once it also counts the others' children that ended meanwhile (an upper bound).
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        proc = spawn(argv, env=env, cwd=self.job_dir, guard=self.guard_args(), priority=s.trainer_priority)
        pgid = proc.pid
        reader = LineReader(proc.stdout)  # type: ignore[arg-type]
        reader.start()
        ranks = RankLogTail(log_dir)
        self.rank_watch.start()
        time_limit = self.run_spec["job"]["spec"]["resources"]["time_limit_seconds"]
        deadline = time.monotonic() + time_limit
        next_beat = 0.0
        reason: str | None = None
        term_at: float | None = None
        errored_at: float | None = None  # when a rank of this multi-node part reported its error
        try:
            while proc.poll() is None:
                self.collect(reader, ranks)
                self.flush()
                if self.parts > 1 and reason is None and self.trainer_error is not None:
                    self.claim_failure()
                    errored_at = errored_at or time.monotonic()
                    if time.monotonic() - errored_at > RANK_ERROR_GRACE_SECONDS:
                        kill_group(pgid, signal.SIGKILL)
                now = time.monotonic()
                if now >= next_beat:
                    self.heartbeat(s.lease_ttl_seconds)
                    next_beat = now + s.heartbeat_seconds
                if reason is None:
                    reason = self.control()
                    if reason == "gang_stopped":
                        self.part_over()  # before its lease could lapse: the part that failed reports
                    if reason is not None:
                        kill_group(pgid, signal.SIGKILL)
                    elif now >= deadline:
                        reason, term_at = FailureCode.TIME_LIMIT, now
                        kill_group(pgid, signal.SIGTERM)  # the trainer saves a checkpoint on SIGTERM
                    elif self.stopping():
                        # The worker is shutting down (a deploy): checkpoint, then hand the job back.
                        reason, term_at = "released", now
                        kill_group(pgid, signal.SIGTERM)
                        self.pending.append((EventKind.LOG, {"rank": None, "line": (
                            "the worker is shutting down: the trainer saves a checkpoint and the job is "
                            "requeued to resume from it")}))
                if term_at is not None and now - term_at > s.term_grace_seconds:
                    kill_group(pgid, signal.SIGKILL)
                time.sleep(s.poll_seconds)
            if self.parts > 1 and reason is None and proc.returncode != 0 and not self.claim_failure():
                # Decided while the lease is fresh: the cleanup below may take longer than its TTL.
                self.part_over()
        finally:
            if term_at is not None:
                self.let_ranks_finish(pgid, term_at + s.term_grace_seconds, reader, ranks)
            # Whatever happened above, nothing of this attempt may outlive it.
            self.rank_watch.stop()  # before this kill, which would otherwise read as a rank's own death
            kill_group(pgid, signal.SIGKILL)
            proc.wait()
            gone = self.wait_gone(pgid, 10)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            self.usage = {"cpu_seconds": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
                          "wall_seconds": round(time.monotonic() - started, 2)}
        reader.join(timeout=2)
        self.collect(reader, ranks, final=True)
        fenced = self.attempt_dir / f"{FENCED}{f'.node{self.part}' if self.part else ''}"
        if fenced.is_file():
            reason = "stale"
            log.warning("job %s attempt %s was fenced by its guard: %s", self.job_id, self.attempt,
                        fenced.read_text())
        if not gone:
            self.pending.append((EventKind.LOG,
                                 {"rank": None, "line": "warning: processes of this attempt outlived SIGKILL"}))
        elif (reason is not None or proc.returncode != 0) and RUNNING.alone():
            # Only while no other attempt of this node runs: another one may be building an op under its lock.
            for lock in release_stale_build_locks(ext_dir):
                self.pending.append((EventKind.LOG, {"rank": None, "line": f"removed the stale op build lock {lock}"}))
        folder = swap.attempt_folder(self.run_spec)
        # The trainer clears it after a completed export; a failed, cancelled or killed attempt cannot.
        if gone and folder is not None and swap.remove(folder):
            self.pending.append((EventKind.LOG,
                                 {"rank": None, "line": f"removed the attempt's NVMe swap folder {folder}"}))
        # Killed here after its rank's own error: the error is the cause, not the kill.
        exit_code = 1 if errored_at is not None and proc.returncode != 0 else proc.returncode
        return self.decide(reason, exit_code, output_dir, time_limit)

    def wait_gone(self, pgid: int, timeout: float) -> bool:
        """wait_group_gone, renewing the lease meanwhile: killed ranks orphaned by their killed parents stay in the
        group until they are reaped, and the part must not look lost while it waits for them."""
        end = time.monotonic() + timeout
        while True:
            self.heartbeat(self.settings.lease_ttl_seconds)
            if wait_group_gone(pgid, max(0.0, min(self.settings.heartbeat_seconds, end - time.monotonic()))):
                return True
            if time.monotonic() >= end:
                return False

    def let_ranks_finish(self, pgid: int, until: float, reader: LineReader, ranks: RankLogTail) -> None:
        """After a SIGTERM (a deploy, the time limit), wait until `until` (monotonic) for the attempt's processes
        to end by themselves: the single-node runner dies of SIGTERM at once, and the guard with it, while the
        ranks still finish their step and save the checkpoint; killing the group then would lose it. The lease
        is renewed meanwhile (the guard that watched it is gone), and the ranks' output still read."""
        next_beat = 0.0
        while time.monotonic() < until:
            if wait_group_gone(pgid, self.settings.poll_seconds):
                return
            self.collect(reader, ranks)
            self.flush()
            if time.monotonic() >= next_beat:
                self.heartbeat(self.settings.lease_ttl_seconds)
                next_beat = time.monotonic() + self.settings.heartbeat_seconds

    def decide(self, reason: str | None, exit_code: int | None, output_dir: Path, time_limit: int) -> Outcome:
        if reason == "gang_stopped":
            self.part_over()
        if reason in ("stale", "gang_stopped"):
            return Outcome(Status.STALE)  # the part that stopped the gang reports why
        if self.part > 0 and reason is None and exit_code == 0:
            # This node's ranks finished; node 0 (rank 0 exports and writes the completion marker) reports
            # the job's end. Its lease may lapse now without looking like a lost node.
            self.part_over()
            return Outcome(Status.STALE)
        if reason == "cancel":
            return Outcome(Status.CANCELLED)
        if reason == FailureCode.TIME_LIMIT:
            return Outcome(Status.FAILED, error={
                "code": FailureCode.TIME_LIMIT, "message": f"the job ran past its time limit of {time_limit} s",
                "log_tail": "\n".join(self.tail)})
        completion = read_completion(output_dir)
        if completion is not None:
            return Outcome(Status.SUCCEEDED, output=completion)
        if reason == "released":
            return Outcome(Status.RELEASED)
        return Outcome(Status.FAILED, error=classify_failure(exit_code, self.trainer_error, list(self.tail),
                                                             first_dead_rank=self.rank_watch.first_dead))

    def peer_lost(self) -> bool:
        """Whether another node of this multi-node attempt is gone (its lease lapsed, its part not done). Its
        ranks' death makes this node's ranks fail too; that is a lost node, which the control plane requeues
        as one new attempt, not a failure of the job. A dead peer's lease lapses within one TTL: wait that."""
        peers = [p for p in range(self.parts) if p != self.part]
        end = time.monotonic() + self.settings.lease_ttl_seconds + 1.0
        while True:
            self.heartbeat(self.settings.lease_ttl_seconds)  # this part is alive while it looks at the others
            try:
                pipe = self.r.pipeline(transaction=False)
                for p in peers:
                    pipe.exists(lease_key(self.job_id, self.attempt, p), part_done_key(self.job_id, self.attempt, p))
                if not all(pipe.execute()):
                    return True
            except redis.RedisError:
                pass
            if time.monotonic() > end:
                return False
            time.sleep(0.5)

    def report(self, outcome: Outcome) -> None:
        if outcome.status is Status.FAILED and self.parts > 1 and not self.claim_failure():
            self.part_over()
            log.warning("job %s attempt %s: part %d failed after another node's part did; that part reports the "
                        "job's error", self.job_id, self.attempt, self.part)
            self.pending.append((EventKind.LOG, {"rank": None, "line": "another node's part of this job failed first: "
                                         "its error is the job's", **self.where}))
            self.flush()
            return
        if outcome.status is Status.FAILED and self.parts > 1 and self.peer_lost():
            log.warning("job %s attempt %s: part %d ended because another node was lost; the control plane "
                        "requeues the whole job", self.job_id, self.attempt, self.part)
            self.pending.append((EventKind.LOG, {"rank": None, "line": "another node of this job was lost: its ranks "
                                         "ended too; the job is requeued as a whole", **self.where}))
            self.flush()
            outcome = Outcome(Status.STALE)
        if outcome.status is Status.STALE:
            return
        if outcome.status is Status.RELEASED:
            self.flush()
            # No terminal state: the job is not over. The control plane requeues it as the next attempt,
            # which resumes from the checkpoint just saved. Every process of the attempt is gone by now,
            # so the lease goes too: nothing needs the usual grace before the next attempt may start.
            note = {"reason": "the worker shut down (SIGTERM) after the trainer saved a checkpoint",
                    "worker": self.worker_id, "stream_id": self.pub.last_id}
            try:
                self.r.pipeline(transaction=False).set(
                    released_key(self.job_id, self.attempt, self.part), json.dumps(note), ex=7 * 24 * 3600).delete(
                    lease_key(self.job_id, self.attempt, self.part)).execute()
            except redis.RedisError as exc:
                log.warning("could not hand the job back (its lease expires by itself): %s", exc)
            return
        if self.parts > 1 and outcome.status is not Status.SUCCEEDED and outcome.status is not Status.FAILED:
            # One state for the gang: every other node's part stops its ranks now (a failure claimed the key
            # already, in claim_failure).
            try:
                self.r.set(gang_stop_key(self.job_id, self.attempt), self.stop_mark, ex=7 * 24 * 3600)
            except redis.RedisError as exc:
                log.warning("could not stop the other parts (their guards end them when the attempt moves on): %s",
                            exc)
        data: dict[str, Any] = {"status": outcome.status.value, "usage": self.usage}
        if self.parts > 1:
            data["node"], data["node_rank"] = self.node, self.part
        if outcome.error:
            data["error"] = outcome.error
        if outcome.output:
            data["output"] = outcome.output
        self.pending.append((EventKind.STATE, data))
        # The terminal state must get through, whatever Redis is doing. The lease is renewed first on each
        # try, so that once Redis is back the control plane sees this worker alive (and does not requeue
        # the job) before it reads the state. The lease then stays a while: the terminal state must be
        # ingested before a missing lease could look like a dead worker.
        give_up = time.monotonic() + self.settings.report_retry_seconds
        delay = 0.5
        while True:
            self.heartbeat(self.settings.lease_ttl_seconds * 6)
            self.flush()
            if not self.pending:
                return
            if time.monotonic() > give_up:
                log.error("job %s attempt %s: could not report %s for %.0f s; the control plane will requeue it",
                          self.job_id, self.attempt, outcome.status.value, self.settings.report_retry_seconds)
                return
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def supervise(*, job_id: str, attempt: int, job_dir: str, run: dict[str, Any], settings: WorkerSettings,
              client: redis.Redis | None = None, stopping: Callable[[], bool] = lambda: False) -> Status:
    """Run one attempt to its end; `stopping` says when the worker itself is shutting down."""
    r = client or redis.Redis.from_url(settings.redis_url)
    current = r.get(attempt_key(job_id))
    if current is not None and int(current) != attempt:
        log.info("job %s attempt %s is stale (current %s): nothing to do", job_id, attempt, current)
        return Status.STALE
    part = int((run.get("placement") or {}).get("node_rank", 0))
    if not r.set(claim_key(job_id, attempt, part), f"{socket.gethostname()}:{os.getpid()}", nx=True,
                 ex=30 * 24 * 3600):
        log.info("job %s attempt %s was already taken: nothing to do", job_id, attempt)
        return Status.STALE
    att = Attempt(job_id=job_id, attempt=attempt, job_dir=Path(job_dir), run=run, settings=settings, client=r,
                  stopping=stopping)
    att.heartbeat(settings.lease_ttl_seconds)
    if r.exists(cancel_key(job_id)):
        outcome = Outcome(Status.CANCELLED)
    else:
        att.pending.append((EventKind.STATE, {"status": JobStatus.STARTING, "worker": att.worker_id}))
        att.flush()
        try:
            with RUNNING:
                outcome = att.execute()
        except Exception as exc:  # a supervisor bug must still end the job visibly
            log.exception("supervising job %s failed", job_id)
            outcome = Outcome(Status.FAILED, error={"code": FailureCode.WORKER_ERROR, "message": repr(exc)})
    att.report(outcome)
    return outcome.status
