"""One attempt of a job on this node: prepare its folder, spawn the launcher, pump its output, heartbeat, obey
cancel and the time limit, kill its whole process group at the end, decide how it ended and report it.

Plain code, no Celery, so tests and operators can drive it directly. Everything the attempt says goes to Redis
tagged (job, attempt); the control plane decides what it means. The multi-node protocol is worker/gang.py, the
processes themselves worker/process.py.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from obstore.exceptions import BaseError as ObjectStoreError

from contract.codes import EventKind, FailureCode, JobStatus, TrainerExit
from contract.protocol import StateField, attempt_key, cancel_key, claim_key
from contract.spec import AttemptOrder, RunPaths, RunSpec, StoreRef
from store import checkpoints as stored
from store.objects import Store, error_line
from trainer import fence, swap
from worker import checkpoints, export_store, inputs, scratch, warm
from worker.gang import GangPart
from worker.lease import Lease, worker_id
from worker.logpump import LineReader, RankLogTail, RankWatch, parse_trainer_event
from worker.ops import extensions_dir, release_stale_build_locks
from worker.outcome import Outcome, Status, classify_failure, read_completion, server_paths
from worker.process import (
    GangLaunch,
    free_port,
    kill_group,
    launcher_argv,
    project_env,
    spawn,
    wait_group_gone,
)
from worker.publisher import Publisher
from worker.settings import WorkerSettings
from worker.spare import TAKEN

log = logging.getLogger(__name__)
FENCED = "FENCED"  # left in the attempt's folder by the guard that ended it (worker/guard.py)
# After a rank of a multi-node attempt reported its error, how long this node's processes get to exit by
# themselves: the world is broken, and a rank whose peer died can hang in its process group's teardown.
RANK_ERROR_GRACE_SECONDS = 5.0
# Why a deploy's SIGTERM hands an attempt back (its `released` state says so).
SHUT_DOWN = "the worker shut down (SIGTERM) after the trainer saved a checkpoint"
GANG_INTERRUPTED = "another node's worker shut down: this node's ranks saved the checkpoint with the gang's"


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


@dataclass
class Launched:
    """The launcher this part spawned, and what watching it decided."""

    proc: subprocess.Popen[bytes]
    reader: LineReader
    ranks: RankLogTail
    usage_before: resource.struct_rusage
    started: float  # monotonic
    # Why the worker ended it: 'stale', 'cancel', 'gang_stopped', 'released' or the time limit; None: by itself.
    reason: str | None = None
    term_at: float | None = None  # when it was sent SIGTERM (monotonic)
    errored_at: float | None = None  # when a rank of this multi-node part reported its error

    @property
    def pgid(self) -> int:
        return self.proc.pid  # spawned in a new session: its process group is its own


class Attempt:
    """The running state of one attempt; `execute()` returns how it ended and `report()` says it."""

    def __init__(self, *, job_id: str, attempt: int, job_dir: Path, run: dict[str, Any],
                 settings: WorkerSettings, client: redis.Redis,
                 stopping: Callable[[], bool] = lambda: False, disk_full: Callable[[], bool] = lambda: False) -> None:
        self.job_id, self.attempt, self.job_dir = job_id, attempt, job_dir
        self.attempt_dir = job_dir / "attempts" / str(attempt)
        # As sent; execute() validates it once and works on typed values from then on.
        self.order = run
        self.spec: RunSpec | None = None  # the run spec once validated and moved onto this node
        # Which part of a multi-node attempt this is (its node rank), and how many parts there are: read before
        # execute() validates the spec, since the part's lease needs them and a malformed spec must fail visibly.
        placement = run.get("placement") or {}
        self.part, parts = int(placement.get("node_rank", 0)), int(placement.get("num_nodes", 1))
        self.node = str(placement.get("node", ""))
        # What a multi-node attempt's log lines carry besides their rank: which node they came from.
        self.where = {"node": self.node} if parts > 1 else {}
        # Every node of a multi-node attempt writes into the same shared folder: each part its own files.
        self.suffix = f".node{self.part}" if self.part else ""
        self.settings = settings
        self.r = client
        self.pub = Publisher(client, job_id, attempt, server_paths(settings))
        self.lease = Lease(client, job_id, attempt, self.part)
        self.gang = GangPart(client=client, job_id=job_id, attempt=attempt, part=self.part, parts=parts,
                             node=self.node, lease=self.lease, settings=settings)
        self.tail: deque[str] = deque(maxlen=settings.log_tail_lines)
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.trainer_error: dict[str, Any] | None = None
        self.running_reported = False
        self.usage: dict[str, float] = {}
        self.rank_watch = RankWatch()
        self.stopping = stopping
        self.disk_full = disk_full
        self.deadline = float("inf")  # monotonic: the job's time limit, once its ranks were launched
        # From the launch on, the attempt's own processes may be writing: a full disk may then be the job's doing.
        self.launched = False
        # When this node took the attempt and started its processes (epoch s): the worker's part of the start-up
        # that the trainer's `started` event shows beside its own (trainer/startup.py).
        self.startup: dict[str, float] = {"picked_up": time.time()}

    # -- Redis I/O that must survive a Redis hiccup without losing the job --------------------------
    def note(self, line: str, **where: str) -> None:
        """A log line of the worker's own (no rank) for the job's stream."""
        self.pending.append((EventKind.LOG, {"rank": None, "line": line, **where}))

    def flush(self) -> None:
        if not self.pending:
            return
        try:
            self.pub.emit_many(self.pending)
            self.pending = []
        except redis.RedisError as exc:
            log.warning("could not publish %d events yet: %s", len(self.pending), exc)

    def control(self) -> str | None:
        """'stale', 'cancel' or 'gang_stopped' when the control plane (or another part) wants this attempt gone."""
        try:
            current, cancelled, stopped = self.r.pipeline(transaction=False).get(attempt_key(self.job_id)).exists(
                cancel_key(self.job_id)).get(self.gang.stop_key).execute()
        except redis.RedisError:
            return None
        if current is not None and int(current) != self.attempt:
            return "stale"
        if cancelled:
            return "cancel"
        if self.gang.stopped_by_another(stopped):
            return "gang_stopped"
        return None

    # -- output ---------------------------------------------------------------------------------
    def collect(self, reader: LineReader, ranks: RankLogTail, final: bool = False) -> None:
        for line in reader.take():
            self.rank_watch.see(line)
            self.tail.append(line)
            self.note(line, **self.where)
        for rank, line in (ranks.close() if final else ranks.poll()):
            event = parse_trainer_event(line)
            if event is None:
                self.tail.append(f"[rank {rank}] {line}")
                self.pending.append((EventKind.LOG, {"rank": rank, "line": line, **self.where}))
                continue
            kind = str(event.pop("event"))
            if kind == EventKind.ERROR and self.trainer_error is None:
                self.trainer_error = event
            if kind == EventKind.STARTED:
                event["startup"] = {**self.startup, **(event.get("startup") or {})}
            if kind == EventKind.STARTED and not self.running_reported:
                self.running_reported = True
                self.pending.append((EventKind.STATE, {"status": JobStatus.RUNNING}))
            self.pending.append((kind, event))

    # -- the attempt ----------------------------------------------------------------------------
    @property
    def fenced_file(self) -> Path:
        return self.attempt_dir / f"{FENCED}{self.suffix}"

    def prepare(self, spec: RunSpec) -> tuple[Path, Path, Path]:
        log_dir = self.attempt_dir / f"logs{self.suffix}"
        log_dir.mkdir(parents=True, exist_ok=True)
        output_dir = Path(spec.paths.output_dir)
        if self.part == 0:
            # A marker left by an earlier attempt must not make this one look finished.
            (output_dir / "COMPLETE").unlink(missing_ok=True)
        spec_file = self.attempt_dir / f"spec{self.suffix}.json"
        spec_file.write_text(spec.model_dump_json(indent=2))
        return spec_file, log_dir, output_dir

    def guard_args(self) -> list[str]:
        return ["--redis", self.settings.redis_url, "--job", self.job_id, "--attempt", str(self.attempt),
                "--owner", self.lease.owner, "--lease-expires-at", repr(self.lease.expires_at),
                "--fenced-file", str(self.fenced_file), "--part", str(self.part)]

    def execute(self) -> Outcome:
        # From here on no older attempt can commit a checkpoint or an export (trainer/fence.py).
        newest = fence.raise_to(self.job_dir, self.attempt)
        if newest > self.attempt:
            log.info("job %s attempt %s: attempt %s already started here; nothing to do", self.job_id,
                     self.attempt, newest)
            return Outcome(Status.STALE)
        # Where the trainer commits its checkpoints (trainer/uploader.py); credentials reach it through AWS_*.
        store = self.settings.store()
        # The contract, checked as the trainer will check it: a malformed message fails here, visibly.
        order = AttemptOrder.model_validate({**self.order, "attempt": self.attempt})
        spec = RunSpec(job=order.job, attempt=order.attempt, placement=order.placement, paths=node_paths(
            self.job_dir, StoreRef(config=store.config, job_id=self.job_id)))
        if self.restore_checkpoint(spec, store) is not None:
            return Outcome(Status.STALE)
        with ExitStack() as holds:
            localized = self.fetch_inputs(spec, holds)
            if isinstance(localized, Outcome):
                return localized
            spec = self.spec = localized
            spec_file, log_dir, output_dir = self.prepare(spec)
            ext_dir = extensions_dir(self.settings)
            gang = None
            if spec.placement is not None and spec.placement.num_nodes > 1:
                gang = self.gang.rendezvous(spec.placement, self.attempt_dir / f"hostfile{self.suffix}",
                                            stopped=lambda: self.control() is not None)
                if gang is None:
                    return self.decide(self.control(), None, output_dir, 0)
            time_limit = spec.job.spec.resources.time_limit_seconds
            self.launched = True
            run = self.launch(spec, spec_file, log_dir, ext_dir, gang)
            deadline = self.deadline = time.monotonic() + time_limit
            try:
                self.watch(run, deadline)
            finally:
                gone = self.end(run)
                if self.settings.warm_trainer:
                    # Now, not when the last one was taken: its imports would have slowed this attempt's start.
                    spares(self.settings).start(trainer_env(ext_dir))
            return self.conclude(run, gone, ext_dir, output_dir, time_limit)

    def renewing(self, name: str, work: Callable[[], None]) -> BaseException | None:
        """`work` in a thread while this one keeps the lease: a download may take longer than the lease's TTL.
        Returns what it raised."""
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # reported below, in this thread
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"{name}-{self.job_id}", daemon=True).start()
        while not done.wait(self.settings.heartbeat_seconds):
            self.lease.renew(self.settings.lease_ttl_seconds)
        return failure[0] if failure else None

    def restore_checkpoint(self, spec: RunSpec, store: Store) -> int | None:
        """Raise the job's fence in the store, then bring the newest committed checkpoint of the store onto this
        node (worker/checkpoints.py), the lease renewed meanwhile. Returns the newer attempt that already
        started, if any. An unreachable store leaves this node's disk as it is, which is all a single host
        needs; the job's log says so."""
        newer: list[int] = []

        def say(line: str, fields: dict[str, Any]) -> None:
            self.pending.append((EventKind.LOG, {"rank": None, "line": line, "checkpoint": fields, **self.where}))

        def work() -> None:
            fence_now = stored.raise_fence(store, self.job_id, self.attempt).attempt
            if fence_now > self.attempt:
                newer.append(fence_now)
                return
            checkpoints.restore(store, self.job_id, Path(spec.paths.checkpoint_dir), self.part, say)

        exc = self.renewing("checkpoints", work)
        if exc is not None:
            if not isinstance(exc, (OSError, ObjectStoreError)):
                raise exc
            self.note(f"the store ({store.where}) could not be read for the job's checkpoints "
                      f"({error_line(exc)}); it resumes from what this node's disk holds", **self.where)
        self.flush()
        return newer[0] if newer else None

    def fetch_inputs(self, spec: RunSpec, holds: ExitStack) -> RunSpec | Outcome:
        """The job's stored files into this node's cache and the run spec pointed at them (worker/inputs.py), with
        the lease renewed while they download; a failed outcome where one cannot be fetched."""
        if not spec.job.inputs and spec.job.base_model is None:
            return spec
        localized: list[RunSpec] = []
        exc = self.renewing("inputs", lambda: localized.append(inputs.localize(
            self.settings, spec, holds, self.attempt_dir / f"base-model{self.suffix}")))
        if exc is None:
            return localized[0]
        if not isinstance(exc, inputs.InputUnavailable):
            raise exc
        self.note(str(exc), **self.where)
        return Outcome(Status.FAILED, error={"code": exc.code, "message": str(exc)})

    def launch(self, spec: RunSpec, spec_file: Path, log_dir: Path, ext_dir: Path,
               gang: GangLaunch | None) -> Launched:
        s = self.settings
        env = trainer_env(ext_dir)
        if spec.placement is not None and spec.placement.kind != "cpu":
            # The launcher would otherwise read it as the devices to use; --include names them instead.
            env.pop("CUDA_VISIBLE_DEVICES", None)
        if gang is None and s.warm_trainer:
            warm_run = self.launch_warm(spec, spec_file, log_dir, env)
            if warm_run is not None:
                return warm_run
        argv = launcher_argv(s.python or sys.executable, spec.job.world_size, spec_file, log_dir,
                             spec.placement, gang)
        self.note("$ " + " ".join(argv))
        # The growth of the worker's children's CPU time: this job's alone on a node running one job at a time;
        # with several jobs at once it also counts the others' children that ended meanwhile (an upper bound).
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        self.startup["spawned"] = time.time()
        proc = spawn(argv, env=env, cwd=self.job_dir, guard=self.guard_args(), priority=s.trainer_priority)
        reader = LineReader(proc.stdout)  # type: ignore[arg-type]
        reader.start()
        ranks = RankLogTail(log_dir)
        self.rank_watch.start()
        return Launched(proc, reader, ranks, before, started)

    def launch_warm(self, spec: RunSpec, spec_file: Path, log_dir: Path, env: dict[str, str]) -> Launched | None:
        """The ranks forked by the node's warm trainer, which becomes the attempt's guard (worker/spare.py); None
        when there is none to take or it refused, and the launcher starts them."""
        s = self.settings
        spare = spares(s).take(env)
        if spare is None:
            return None
        share = spec.placement
        if share is not None and share.kind != "cpu":
            devices = list(share.devices)
        else:
            # As the launcher's --num_gpus N: devices 0..N-1, whatever slots the control plane counted.
            devices = [str(i) for i in range(len(share.devices) if share is not None else spec.job.world_size)]
        request = warm.Request(guard=self.guard_args(), worker_pid=os.getpid(), env=env, cwd=str(self.job_dir),
                               umask=warm.current_umask(), rlimits=warm.process_limits(), log_dir=str(log_dir),
                               priority=s.trainer_priority, world=len(devices), master_port=free_port(),
                               devices=devices, trainer_args=["--spec", str(spec_file)])
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        self.startup["spawned"] = time.time()
        # A spare still importing answers when it is done: the lease is kept meanwhile, as for a download.
        answered: list[tuple[str, list[str]]] = []
        failed = self.renewing("warm", lambda: answered.append(warm.hand_over(spare, request)))
        if failed is not None:
            warm.end(spare)
            raise failed
        answer, said = answered[0]
        for line in said:
            self.note(line)
        if answer != TAKEN:
            self.note(f"the warm trainer could not take the attempt ({answer}); the DeepSpeed launcher starts it")
            return None
        self.note(f"$ (warm trainer {spare.pid}) forks {len(devices)} rank(s) of python -u -m trainer "
                  f"--local_rank=K --spec {spec_file}")
        reader = LineReader(spare.stdout)  # type: ignore[arg-type]
        reader.start()
        ranks = RankLogTail(log_dir)
        self.rank_watch.start()
        return Launched(spare, reader, ranks, before, started)

    def watch(self, run: Launched, deadline: float) -> None:
        """Pump, heartbeat and obey until the launcher exits."""
        s = self.settings
        next_beat = 0.0
        while run.proc.poll() is None:
            self.collect(run.reader, run.ranks)
            self.flush()
            if self.gang.multi and run.reason is None and self.trainer_error is not None:
                self.gang.claim_failure()
                run.errored_at = run.errored_at or time.monotonic()
                if time.monotonic() - run.errored_at > RANK_ERROR_GRACE_SECONDS:
                    kill_group(run.pgid, signal.SIGKILL)
            now = time.monotonic()
            if now >= next_beat:
                self.lease.renew(s.lease_ttl_seconds)
                next_beat = now + s.heartbeat_seconds
            if run.reason is None:
                self.obey(run, now, deadline)
            if run.term_at is not None and now - run.term_at > s.term_grace_seconds:
                kill_group(run.pgid, signal.SIGKILL)
            time.sleep(s.poll_seconds)
        if self.gang.multi and run.reason is None and run.proc.returncode != 0 and not self.gang.claim_failure():
            # Decided while the lease is fresh: the cleanup after it may take longer than its TTL.
            self.gang.part_over()

    def obey(self, run: Launched, now: float, deadline: float) -> None:
        """End the attempt's processes when the control plane, the time limit or a shutdown says so."""
        run.reason = self.control()
        if run.reason == "gang_stopped":
            self.gang.part_over()  # before its lease could lapse: the part that failed reports
        if run.reason is not None:
            kill_group(run.pgid, signal.SIGKILL)
        elif now >= deadline:
            run.reason, run.term_at = FailureCode.TIME_LIMIT, now
            self.gang.say_term(run.reason)
            kill_group(run.pgid, signal.SIGTERM)  # the trainer saves a checkpoint on SIGTERM
        elif self.stopping():
            # The worker is shutting down (a deploy): checkpoint, then hand the job back.
            run.reason, run.term_at = Status.RELEASED, now
            self.gang.say_term(run.reason)
            kill_group(run.pgid, signal.SIGTERM)
            self.note("the worker is shutting down: the trainer saves a checkpoint and the job is requeued to "
                      "resume from it")

    def end(self, run: Launched) -> bool:
        """Whatever happened, nothing of this attempt may outlive it. True when its process group is gone."""
        if run.term_at is not None:
            self.let_ranks_finish(run.pgid, run.term_at + self.settings.term_grace_seconds, run.reader, run.ranks)
        self.rank_watch.stop()  # before this kill, which would otherwise read as a rank's own death
        kill_group(run.pgid, signal.SIGKILL)
        run.proc.wait()
        gone = self.wait_gone(run.pgid, 10)
        after, before = resource.getrusage(resource.RUSAGE_CHILDREN), run.usage_before
        self.usage = {"cpu_seconds": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
                      "wall_seconds": round(time.monotonic() - run.started, 2)}
        return gone

    def conclude(self, run: Launched, gone: bool, ext_dir: Path, output_dir: Path, time_limit: int) -> Outcome:
        """The attempt's processes are gone (or outlived SIGKILL): read the rest, clean up, decide."""
        run.reader.join(timeout=2)
        self.collect(run.reader, run.ranks, final=True)
        reason = run.reason
        if self.fenced_file.is_file():
            reason = "stale"
            log.warning("job %s attempt %s was fenced by its guard: %s", self.job_id, self.attempt,
                        self.fenced_file.read_text())
        if not gone:
            self.note("warning: processes of this attempt outlived SIGKILL")
        elif (reason is not None or run.proc.returncode != 0) and RUNNING.alone():
            # Only while no other attempt of this node runs: another one may be building an op under its lock.
            for lock in release_stale_build_locks(ext_dir):
                self.note(f"removed the stale op build lock {lock}")
        folder = swap.attempt_folder(self.spec) if self.spec is not None else None
        # The trainer clears it after a completed export; a failed, cancelled or killed attempt cannot.
        if gone and folder is not None and swap.remove(folder):
            self.note(f"removed the attempt's NVMe swap folder {folder}")
        # Killed here after its rank's own error: the error is the cause, not the kill.
        exit_code = 1 if run.errored_at is not None and run.proc.returncode != 0 else run.proc.returncode
        return self.decide(reason, exit_code, output_dir, time_limit)

    def wait_gone(self, pgid: int, timeout: float) -> bool:
        """wait_group_gone, renewing the lease meanwhile: killed ranks orphaned by their killed parents stay in the
        group until they are reaped, and the part must not look lost while it waits for them."""
        end = time.monotonic() + timeout
        while True:
            self.lease.renew(self.settings.lease_ttl_seconds)
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
                self.lease.renew(self.settings.lease_ttl_seconds)
                next_beat = time.monotonic() + self.settings.heartbeat_seconds

    def decide(self, reason: str | None, exit_code: int | None, output_dir: Path, time_limit: int) -> Outcome:
        if reason == "gang_stopped":
            self.gang.part_over()
        if reason in ("stale", "gang_stopped"):
            return Outcome(Status.STALE)  # the part that stopped the gang reports why
        if self.part > 0 and reason is None and exit_code == 0:
            # This node's ranks finished; node 0 (rank 0 exports and writes the completion marker) reports
            # the job's end. Its lease may lapse now without looking like a lost node.
            self.gang.part_over()
            return Outcome(Status.STALE)
        if reason == "cancel":
            return Outcome(Status.CANCELLED)
        if reason == FailureCode.TIME_LIMIT:
            return Outcome(Status.FAILED, error={
                "code": FailureCode.TIME_LIMIT, "message": f"the job ran past its time limit of {time_limit} s",
                "log_tail": "\n".join(self.tail)})
        completion = read_completion(output_dir)
        if completion is not None:
            return self.export(completion, output_dir, time_limit)
        if reason == Status.RELEASED:
            return Outcome(Status.RELEASED)
        if self.gang.multi and reason is None and exit_code == TrainerExit.INTERRUPTED:
            # Another part sent its ranks SIGTERM, and this part's stopped with them at the checkpoint they voted.
            why = self.gang.term_why()
            if why == Status.RELEASED:
                # That node's worker shuts down (a deploy): this part hands the attempt back too, rather than fail
                # it or wait on that part's hand-back, which a loaded node may give only after this part's look
                # for its lapsed lease (another_part_reports) has ended.
                return Outcome(Status.RELEASED, reason=GANG_INTERRUPTED)
            if why is not None:
                self.gang.part_over()  # that part's time limit: its report is the job's end
                return Outcome(Status.STALE)
        # A trainer's ENOSPC (a checkpoint's write) is classified disk_full and fails the job, never handed back
        # as a full disk before the launch is: the job's own writes may be what filled it (supervise says more).
        error = classify_failure(exit_code, self.trainer_error, list(self.tail),
                                 first_dead_rank=self.rank_watch.first_dead)
        if error["code"] == FailureCode.TRAINER_ERROR and self.trainer_error is None and self.disk_full():
            # The ranks' own logs are on this disk: a trainer that died of a full disk could write nothing of why.
            error = {**error, "code": FailureCode.DISK_FULL,
                     "message": f"the trainer exited with code {exit_code} without completing while the disk of "
                                f"node {self.node or worker_id()} was full: its ranks' logs could not be written"}
        return Outcome(Status.FAILED, error=error)

    def export(self, completion: dict[str, Any], output_dir: Path, time_limit: int) -> Outcome:
        """Node 0 found the completion marker: the job succeeds only once its export is in the artifact store."""
        s = self.settings
        store = s.store()

        def say(line: str) -> None:
            self.note(line)
            self.flush()

        # The ranks and their guard are gone: this thread keeps the lease, since one call to an unreachable
        # store can block longer than its TTL.
        try:
            with self.lease.kept(s.lease_ttl_seconds, s.heartbeat_seconds):
                output = export_store.publish(store, job_id=self.job_id, attempt=self.attempt,
                                              output_dir=output_dir, completion=completion,
                                              give_up_after=s.store_retry_seconds, interrupted=self.control,
                                              say=say, deadline=self.deadline)
        except export_store.Interrupted as exc:
            # No manifest was written: nothing of this upload is served, and the next export replaces it.
            if exc.reason == FailureCode.TIME_LIMIT:
                return Outcome(Status.FAILED, error={
                    "code": FailureCode.TIME_LIMIT, "message": f"the job ran past its time limit of {time_limit} s "
                    f"while it waited for the artifact store {store.where} to take its export",
                    "log_tail": "\n".join(self.tail)})
            if exc.reason == "cancel":
                return Outcome(Status.CANCELLED)
            if exc.reason == "gang_stopped":
                self.gang.part_over()
            return Outcome(Status.STALE)  # a newer attempt holds the job: it exports and reports
        except export_store.Unreachable as exc:
            return Outcome(Status.FAILED, error={"code": FailureCode.STORE_UNAVAILABLE, "message": str(exc),
                                                 "log_tail": "\n".join(self.tail)})
        self.note(f"export stored: {len(output['files'])} files, {output['bytes']} bytes under {output['store']} "
                  f"in {store.where}")
        return Outcome(Status.SUCCEEDED, output=output)

    # -- the report -----------------------------------------------------------------------------
    def report(self, outcome: Outcome) -> None:
        if outcome.status is Status.FAILED and self.gang.multi and self.another_part_reports():
            return
        if outcome.status is Status.STALE:
            self.publish_rest()
            return
        if outcome.status is Status.RELEASED:
            self.hand_back(outcome.reason or SHUT_DOWN)
            return
        if self.gang.multi and outcome.status is not Status.SUCCEEDED and outcome.status is not Status.FAILED:
            self.gang.stop_others()
        self.send_state(outcome)

    def another_part_reports(self) -> bool:
        """This part of a multi-node attempt failed, but the job's report is not its own to make: another part
        failed first, or another node was lost (the control plane requeues the whole job)."""
        if not self.gang.claim_failure():
            self.gang.part_over()
            log.warning("job %s attempt %s: part %d failed after another node's part did; that part reports the "
                        "job's error", self.job_id, self.attempt, self.part)
            self.note("another node's part of this job failed first: its error is the job's", **self.where)
            self.flush()
            return True
        if self.gang.peer_lost():
            log.warning("job %s attempt %s: part %d ended because another node was lost; the control plane "
                        "requeues the whole job", self.job_id, self.attempt, self.part)
            self.note("another node of this job was lost: its ranks ended too; the job is requeued as a whole",
                      **self.where)
            self.flush()
            return True
        return False

    def hand_back(self, reason: str) -> None:
        self.flush()
        # No terminal state: the job is not over. The control plane requeues it as the next attempt,
        # which resumes from the newest committed checkpoint. Every process of the attempt is gone by now,
        # so the lease goes too: nothing needs the usual grace before the next attempt may start.
        self.lease.hand_back({"reason": reason, "worker": self.lease.owner, "stream_id": self.pub.last_id})

    def no_room(self, exc: OSError, announce: Callable[[], None]) -> Outcome:
        """The node's disk was full before any process of the attempt started, so nothing of the job filled it: the
        job is handed back (requeued, not counted as a lost worker) to run where there is room, not failed. The
        node's announcement is renewed first, so the scheduler reads the full disk before it places the job again
        (controlplane/scheduler.py: a full node is placed on no more)."""
        announce()
        reason = (f"node {self.node or worker_id()}'s disk is full ({exc.strerror or 'no space left on device'}) "
                  f"before the attempt started: the job goes back to the queue")
        self.note(reason, **self.where)
        if self.gang.multi and not self.gang.claim_failure():
            # Another part failed first and stopped the gang: its report is the job's, and a hand-back beside it
            # would race it into a requeue.
            self.gang.part_over()
            self.flush()
            return Outcome(Status.STALE)
        # A multi-node part holds the gang's stop key now: the other parts stop at once and report nothing, and
        # this part's hand-back (its lease gone, `released` set) makes the control plane requeue the whole job.
        return Outcome(Status.RELEASED, reason=reason)

    def send_state(self, outcome: Outcome) -> None:
        data: dict[str, Any] = {"status": outcome.status.value, "usage": self.usage}
        if self.gang.multi:
            data["node"], data["node_rank"] = self.node, self.part
        if outcome.error:
            data[StateField.ERROR] = outcome.error
        if outcome.output:
            data["output"] = outcome.output
        self.pending.append((EventKind.STATE, data))
        # The terminal state must get through, whatever Redis is doing. The lease is renewed first on each
        # try, so that once Redis is back the control plane sees this worker alive (and does not requeue
        # the job) before it reads the state. The lease then stays a while: the terminal state must be
        # ingested before a missing lease could look like a dead worker.
        if not self.flush_until_sent(lambda: self.lease.renew(self.settings.lease_ttl_seconds * 6)):
            log.error("job %s attempt %s: could not report %s for %.0f s; the control plane will requeue it",
                      self.job_id, self.attempt, outcome.status.value, self.settings.report_retry_seconds)

    def publish_rest(self) -> None:
        """The attempt is no longer this worker's to report (its guard fenced it for a lease it could not see, a
        newer attempt holds the job, another node's part reports), but what its ranks printed and Redis has not
        taken yet is still sent: while the attempt is the job's current one (a job cancelled while the guard fenced
        it stays on it), that is the job's history, and once it is superseded the ingester drops it (db/ingest.py).
        The lease is not renewed meanwhile: the control plane must stay free to requeue the job."""
        if not self.flush_until_sent(lambda: None):
            log.error("job %s attempt %s: %d events of the ended attempt could not be published for %.0f s",
                      self.job_id, self.attempt, len(self.pending), self.settings.report_retry_seconds)

    def flush_until_sent(self, before_each: Callable[[], None]) -> bool:
        """Flush until Redis took every pending event, backing off while it cannot; False once
        `report_retry_seconds` passed first."""
        give_up = time.monotonic() + self.settings.report_retry_seconds
        delay = 0.5
        while True:
            before_each()
            self.flush()
            if not self.pending:
                return True
            if time.monotonic() > give_up:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def trainer_env(ext_dir: Path) -> dict[str, str]:
    """The environment every attempt's launcher (or warm trainer) on this node starts with."""
    env = project_env(PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=str(ext_dir))
    env.pop(warm.HANDED_DOWN, None)
    return env


_spares: warm.Spares | None = None
_spares_lock = threading.Lock()


def spares(settings: WorkerSettings) -> warm.Spares:
    """This worker process's warm trainer (worker/warm.py)."""
    global _spares
    with _spares_lock:
        if _spares is None:
            _spares = warm.Spares(settings.python or sys.executable, settings.jobs_root)
        return _spares


def warm_up(settings: WorkerSettings) -> None:
    """Have the node's warm trainer importing before its first attempt comes: the one `python -m worker` started
    before it became this process, or a new one."""
    if settings.warm_trainer:
        env = trainer_env(extensions_dir(settings))
        spares(settings).adopt(env)
        spares(settings).start(env)
    else:
        spares(settings).adopt({})  # ends one handed down against the setting


def node_job_dir(settings: WorkerSettings, job_id: str) -> Path:
    """The job's folder under this node's own FT_ARTIFACTS_ROOT. A node's folder is scratch: what must outlive the
    node (checkpoints, the export) is in the artifact store, so no node needs another's disk."""
    return settings.jobs_root / job_id


def node_paths(job_dir: Path, store: StoreRef) -> RunPaths:
    return RunPaths(job_dir=str(job_dir), checkpoint_dir=str(job_dir / "checkpoints"),
                    output_dir=str(job_dir / "output"), store=store)


def no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def supervise(*, job_id: str, attempt: int, run: dict[str, Any], settings: WorkerSettings,
              client: redis.Redis | None = None, stopping: Callable[[], bool] = lambda: False,
              announce: Callable[[], None] = lambda: None, disk_full: Callable[[], bool] = lambda: False) -> Status:
    """Run one attempt to its end; `run` is the AttemptOrder as sent, `stopping` says when the worker itself is
    shutting down, `announce` renews the node's announcement now and `disk_full` says whether its disk is full now
    (worker/celery_app.py)."""
    r = client or redis.Redis.from_url(settings.redis_url)
    current = r.get(attempt_key(job_id))
    if current is not None and int(current) != attempt:
        log.info("job %s attempt %s is stale (current %s): nothing to do", job_id, attempt, current)
        return Status.STALE
    part = int((run.get("placement") or {}).get("node_rank", 0))
    if not r.set(claim_key(job_id, attempt, part), worker_id(), nx=True, ex=30 * 24 * 3600):
        log.info("job %s attempt %s was already taken: nothing to do", job_id, attempt)
        return Status.STALE
    att = Attempt(job_id=job_id, attempt=attempt, job_dir=node_job_dir(settings, job_id), run=run, settings=settings,
                  client=r, stopping=stopping, disk_full=disk_full)
    att.lease.renew(settings.lease_ttl_seconds)
    with ExitStack() as held:
        if r.exists(cancel_key(job_id)):
            outcome = Outcome(Status.CANCELLED)
        else:
            att.pending.append((EventKind.STATE, {"status": JobStatus.STARTING, "worker": att.lease.owner}))
            att.flush()
            try:
                # Before the job's folder is made (the fence makes it), until the attempt's end is reported: the sweep
                # of idle folders (worker/scratch.py) passes over it meanwhile, and one under way ends first.
                held.enter_context(scratch.in_use(settings.jobs_root, job_id,
                                                  waiting=lambda: att.lease.renew(settings.lease_ttl_seconds)))
                with RUNNING:
                    outcome = att.execute()
            except Exception as exc:  # a supervisor bug must still end the job visibly
                if no_space(exc) and not att.launched:
                    # The node's disk, full before the launch (the lock file, the fence, the spec, the logs' folder):
                    # not the job's fault.
                    log.warning("job %s attempt %s: the node's disk is full before the launch: %s", job_id, attempt,
                                exc)
                    outcome = att.no_room(exc, announce)
                else:
                    log.exception("supervising job %s failed", job_id)
                    # A full disk once the attempt's processes ran is named as the trainer's own ENOSPC is (worker/
                    # outcome.py), and fails the job: its own writes (checkpoints, the export) may be what filled the
                    # disk, and handed back it would fill the next node's too, or this one's again once freed, a loop
                    # that no count of lost workers ends.
                    full = no_space(exc)
                    outcome = Outcome(Status.FAILED, error={
                        "code": FailureCode.DISK_FULL if full else FailureCode.WORKER_ERROR, "message": repr(exc)})
        att.report(outcome)
    return outcome.status
