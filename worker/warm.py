"""The node's warm trainer (worker/spare.py): one spare process kept imported, handed to the next single-node attempt
and replaced when an attempt ends.

A spare is replaced when an attempt ends, not when it is taken: its imports take seconds of CPU at the worker's
priority, and taken at a job's start they would compete with that job's ranks (at the trainer's lower priority)
for exactly the first steps this is meant to hasten. A node running no job has it ready; a node whose spare is
still importing hands it the attempt anyway (it answers when its imports are done, sooner than a cold launcher);
a node with none (a second attempt at once, a crashed spare, an environment that changed) starts the launcher.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from contract.protocol import WarmTrainer
from worker.process import kill_group
from worker.spare import READY_ARGUMENT, REFUSED, ROOM, ROOM_ARGUMENT, TAKEN, Request, without_rank_variables

# The limits a rank inherits from the worker through the launcher; a spare sets them again per attempt, so an attempt
# gets the worker's limits of its own start, not those of the spare's.
RLIMITS = ("RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_MEMLOCK", "RLIMIT_NOFILE",
           "RLIMIT_NPROC", "RLIMIT_STACK")
# A spare still importing answers once its imports are done; one that has not by then is taken for stuck.
ANSWER_TIMEOUT_SECONDS = 120.0


def process_limits() -> dict[str, list[int]]:
    return {name: list(resource.getrlimit(getattr(resource, name))) for name in RLIMITS if hasattr(resource, name)}


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# `python -m worker` starts the node's spare before it builds DeepSpeed's ops and execs into Celery, so the spare
# imports while they start; this variable hands the spare (pid, its pipes' descriptors, its environment's digest,
# its ready file) to the Celery process, which is the same process, the spare's parent still.
HANDED_DOWN = "FT_WARM_SPARE"


def digest(env: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(without_rank_variables(env).items())).encode()).hexdigest()


class Adopted:
    """A spare this process started before it exec'd: the same child, known by its pid and pipes, with the part of
    Popen's interface the supervisor uses."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.stdout = os.fdopen(stdout_fd, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone all the same
                done, status = self.pid, 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if give_up is not None and time.monotonic() >= give_up:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class Spares:
    """The spare of one worker process; thread-safe (the worker runs one supervisor thread per slot)."""

    def __init__(self, python: str, cwd: Path) -> None:
        self.python, self.cwd = python, cwd
        self._lock = threading.Lock()
        self._spare: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] | None = None
        self._ready: Path | None = None  # the file the spare creates once imported (worker/spare.py)

    def start(self, env: dict[str, str]) -> None:
        """Have a spare with `env` (the environment the node's attempts get) ready, unless one is."""
        with self._lock:
            if self._spare is not None and self._spare.poll() is None and self._env == env:
                return
            self._drop()
            self.cwd.mkdir(parents=True, exist_ok=True)
            # A dot-name: the node's scratch sweep passes over it, as over anything that is not a job's folder.
            ready = self.cwd / f".warm-{uuid.uuid4().hex[:12]}"
            self._spare = subprocess.Popen([self.python, "-m", "worker.spare", "--worker-pid", str(os.getpid()),
                                            READY_ARGUMENT, str(ready), ROOM_ARGUMENT, "." * ROOM],
                                           cwd=self.cwd, env=env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            self._env, self._ready = env, ready

    def state(self) -> WarmTrainer:
        """What the node announces of its spare: ready once its imports are done, importing until then."""
        with self._lock:
            spare, ready = self._spare, self._ready
        if spare is None or spare.poll() is not None:
            return WarmTrainer.NONE
        return WarmTrainer.READY if ready is not None and ready.exists() else WarmTrainer.IMPORTING

    def hand_down(self) -> None:
        """Before this process execs (`python -m worker`): leave the spare to the program it becomes (`adopt`)."""
        with self._lock:
            spare, env = self._spare, self._env
            if spare is None or env is None or spare.stdin is None or spare.stdout is None:
                return
            for fd in (spare.stdin.fileno(), spare.stdout.fileno()):
                os.set_inheritable(fd, True)
            os.environ[HANDED_DOWN] = (f"{spare.pid}:{spare.stdin.fileno()}:{spare.stdout.fileno()}:{digest(env)}:"
                                       f"{self._ready or ''}")

    def adopt(self, env: dict[str, str]) -> None:
        """Take over the spare `hand_down` left, if it was started with `env`; else end it."""
        handed = os.environ.pop(HANDED_DOWN, None)
        if handed is None:
            return
        pid, stdin_fd, stdout_fd, started_with, ready = handed.split(":", 4)
        spare = Adopted(int(pid), int(stdin_fd), int(stdout_fd))
        with self._lock:
            if started_with == digest(env) and spare.poll() is None and self._spare is None:
                self._spare, self._env = spare, env  # type: ignore[assignment]
                self._ready = Path(ready) if ready else None
                return
        end(spare)  # type: ignore[arg-type]
        if ready:
            Path(ready).unlink(missing_ok=True)

    def take(self, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The spare, if one is alive and was started with the environment `env` (the launcher's per-rank variables
        aside); None otherwise. Either way the node has no spare until `start` is called again."""
        with self._lock:
            spare, started_with, ready = self._spare, self._env, self._ready
            self._spare = self._env = self._ready = None
        if spare is None:
            return None
        if spare.poll() is not None or started_with is None or \
                without_rank_variables(started_with) != without_rank_variables(env):
            end(spare)
            if ready is not None:
                ready.unlink(missing_ok=True)
            return None
        return spare

    def _drop(self) -> None:
        if self._spare is not None:
            end(self._spare)
        if self._ready is not None:
            self._ready.unlink(missing_ok=True)  # the spare's own unlink is skipped when it is killed
        self._spare = self._env = self._ready = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def end(spare: subprocess.Popen[bytes]) -> None:
    """A spare that serves no attempt: its stdin closed ends it; its group killed ends whatever it may have forked."""
    try:
        if spare.stdin is not None:
            spare.stdin.close()
    except OSError:
        pass
    kill_group(spare.pid, signal.SIGKILL)
    spare.wait()


def hand_over(spare: subprocess.Popen[bytes], request: Request) -> tuple[str, list[str]]:
    """Give `spare` its attempt. Returns TAKEN when it forks the ranks, else why not (it is ended then), and the lines
    it wrote before its answer (its imports' warnings) for the job's log."""
    assert spare.stdin is not None and spare.stdout is not None
    try:
        spare.stdin.write((json.dumps(asdict(request)) + "\n").encode())
        spare.stdin.flush()
    except OSError as exc:
        end(spare)
        return f"{REFUSED}: it could not be written to ({exc})", []
    give_up = time.monotonic() + ANSWER_TIMEOUT_SECONDS
    lines: list[str] = []
    line = b""
    while True:
        left = give_up - time.monotonic()
        if left <= 0 or not select.select([spare.stdout], [], [], left)[0]:
            end(spare)
            return f"{REFUSED}: no answer within {ANSWER_TIMEOUT_SECONDS:.0f} s", lines
        # One byte at a time: what follows the answer is the ranks' launcher lines, for the worker's own reader.
        byte = os.read(spare.stdout.fileno(), 1)
        if not byte:
            end(spare)
            return f"{REFUSED}: it ended (exit code {spare.wait()})", lines
        if byte != b"\n":
            line += byte
            continue
        text, line = line.decode("utf-8", "replace").rstrip("\r"), b""
        if text == TAKEN:
            return text, lines
        if text.startswith(REFUSED):
            end(spare)
            return text, lines
        lines.append(text)
