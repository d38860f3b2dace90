"""A warm trainer: a process that has imported torch, transformers, DeepSpeed and the recipe before any job came,
and then serves exactly one attempt of one job as that attempt's guard, forking its ranks.

`python -m worker.spare`, started by the worker (worker/warm.py) in a session of its own with the environment every
job of the node gets. It imports, then waits on stdin for one request (a JSON line): the guard's options, the job's
environment, working directory, rlimits, umask, the rank log folder, the launcher's rendezvous (world size, port,
devices) and the trainer's arguments. It answers one line on stdout, `taken` or `refused: why`, and on `taken`:

- forks one child per local rank; each child becomes what `deepspeed.launcher.launch` would have started
  (`python -u -m trainer --local_rank=K ARGS` with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR,
  MASTER_PORT, CROSS_RANK, CROSS_SIZE and the visible devices set as the launcher sets them, stdout and stderr
  to `<log folder>/<stamp>_rank<R>.log`, stdin /dev/null, at the job's priority) and runs the trainer's main;
- then watches them as the launcher does (a rank that fails ends the others; SIGTERM is passed on) and the
  outside world as worker/guard.py does (the worker's death, a newer attempt, a lost lease), in the same loop.

Why the result is as isolated as a fresh process: the spare serves one attempt and ends with it, so no state of one
job can reach another through it; what a child inherits is the spare's state after imports only, made under the very
environment the job gets (a request whose environment differs, apart from the launcher's per-rank variables, is
refused), and the spare refuses to fork if the imports started a thread or opened a GPU device (CUDA must be
initialised in the rank, never before a fork). Its session is the attempt's process group, as the guard's was, so
killing the group kills the spare and every rank. It exits when the worker closes its stdin (the worker ended)
without having been handed an attempt.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# The trainer's whole import closure, and what every job imports lazily later (the model classes and tokenizer
# behind the auto classes, DeepSpeed's engine and ZeRO optimizers): imported here once, before any job, instead of
# by every rank of every job.
WARM_MODULES = ("trainer.__main__", "trainer.recipe", "transformers.models.llama.modeling_llama",
                "transformers.tokenization_utils_fast", "deepspeed.runtime.engine",
                "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3")
# What deepspeed.launcher.launch sets for each rank, on top of the environment it was started with: these alone may
# differ between the spare's environment and a job's.
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                            "CROSS_RANK", "CROSS_SIZE", "CUDA_VISIBLE_DEVICES"})
PR_SET_PDEATHSIG = 1  # prctl(2)
# Started with this argument and a long value: room in its command line's memory to name its attempt later.
ROOM_ARGUMENT = "--room"
ROOM = 4096
# Started with this argument and a path: the file it creates once its imports are done (worker/warm.py reads it,
# so that the node can announce a ready warm trainer without reading the pipe the attempt's answer comes on).
READY_ARGUMENT = "--ready-file"
TAKEN = "taken"
REFUSED = "refused"
# As deepspeed.launcher.launch's terminate_process_tree: how long ranks told to stop get before SIGKILL.
TERMINATE_WAIT_SECONDS = 30.0


def rank_env(base: dict[str, str], *, rank: int, local_rank: int, world: int, local_size: int, master_addr: str,
             master_port: int, devices: list[str], node_rank: int = 0, nodes: int = 1) -> dict[str, str]:
    """A rank's environment as deepspeed.launcher.launch makes it from its own (tests/test_spare.py compares)."""
    return {**base, "CUDA_VISIBLE_DEVICES": ",".join(devices), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world), "CROSS_RANK": str(node_rank),
            "CROSS_SIZE": str(nodes), "LOCAL_SIZE": str(local_size), "RANK": str(rank), "LOCAL_RANK": str(local_rank)}


def without_rank_variables(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RANK_VARIABLES}


def gpu_opened() -> str | None:
    """A GPU device file this process holds open: the driver was initialised, and a fork would break CUDA."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("/dev/nvidia", "/dev/kfd", "/dev/dri")):
            return target
    return None


def unforkable() -> str | None:
    """Why this process must not fork ranks now, or None."""
    if threading.active_count() > 1:
        return f"the imports started threads: {[t.name for t in threading.enumerate()]}"
    opened = gpu_opened()
    if opened is not None:
        return f"the imports opened {opened}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the imports initialised CUDA"
    return None


@dataclass
class Request:
    """One attempt's start, as the worker sends it (worker/warm.py `request`)."""

    guard: list[str]  # worker/guard.py's options
    worker_pid: int
    env: dict[str, str]
    cwd: str
    umask: int
    rlimits: dict[str, list[int]]  # resource name -> [soft, hard], the worker's own
    log_dir: str
    priority: str
    world: int
    master_port: int
    devices: list[str]
    trainer_args: list[str]
    master_addr: str = "127.0.0.1"
    entry: str = "trainer.__main__"  # the module whose main(argv) a rank runs, as `python -m trainer` would


@dataclass
class Ranks:
    """The forked ranks, watched as deepspeed.launcher.launch watches its own: the guard's `Child`."""

    pids: dict[int, int]  # pid -> rank
    codes: dict[int, int] = field(default_factory=dict)  # rank -> exit code, Popen's convention
    failed: int | None = None  # the first non-zero exit code
    term_at: float | None = None

    def _reap(self) -> None:
        for pid, rank in list(self.pids.items()):
            if rank in self.codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.codes[rank] = os.waitstatus_to_exitcode(status)
                if self.codes[rank] != 0 and self.failed is None:
                    self.failed = self.codes[rank]
                    # Said at once: the others are stopped next, and a worker that looks at /proc later would find
                    # them all gone and could not tell which one failed (worker/logpump.py's RankWatch reads it).
                    print(f"process {pid} (local rank {rank}) failed first with exit code {self.failed}", flush=True)

    def _alive(self) -> list[int]:
        return [pid for pid, rank in self.pids.items() if rank not in self.codes]

    def send_signal(self, sig: int) -> None:
        for pid in self._alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM and self.term_at is None:
            self.term_at = time.monotonic()

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._reap()
            if self.failed is not None and self.term_at is None:
                # A rank failed: the others are stopped, as the launcher does, and its code is the attempt's.
                self.send_signal(signal.SIGTERM)
            if self.term_at is not None and time.monotonic() - self.term_at > TERMINATE_WAIT_SECONDS:
                self.send_signal(signal.SIGKILL)
            if not self._alive():
                if self.failed is not None:
                    return self.failed
                return 1 if self.term_at is not None else 0
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired("ranks", timeout or 0.0)
            time.sleep(0.02)


# This process's environment as it started, before the imports (some of which set variables of their own).
_started_with: dict[str, str] = {}


def _imports_changed(env: dict[str, str]) -> dict[str, str]:
    """`env` changed as the imports changed this process's environment: what a fresh rank's environment is after
    the same imports (DeepSpeed's sets PYTORCH_NVML_BASED_CUDA_CHECK unless given, torch's TORCHINDUCTOR_CACHE_DIR)."""
    now = dict(os.environ)
    changed = {k: v for k, v in now.items() if _started_with.get(k) != v and k not in env}
    return {k: v for k, v in {**env, **changed}.items() if not (k in _started_with and k not in now)}


def _child(request: Request, rank: int, log_file: Path) -> None:
    """In a forked child: become rank `rank` of the attempt, run the trainer, never return."""
    code = 1
    try:
        env = _imports_changed(rank_env(request.env, rank=rank, local_rank=rank, world=request.world,
                                        local_size=request.world, master_addr=request.master_addr,
                                        master_port=request.master_port, devices=request.devices))
        os.environ.clear()
        os.environ.update(env)
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # Nothing of the spare's pipes to the worker stays open in a rank.
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        _lower_priority(request.priority)
        entry = importlib.import_module(request.entry)
        set_command_line([sys.executable, "-u", "-m", request.entry.removesuffix(".__main__"),
                          f"--local_rank={rank}", *request.trainer_args])
        # As `python -u -m trainer` run in the job's folder would see itself.
        sys.argv = [entry.__file__, f"--local_rank={rank}", *request.trainer_args]
        sys.path[0] = request.cwd
        code = entry.main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001  # a rank's crash is its exit code and its log, as a fresh one's
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def set_command_line(argv: list[str]) -> None:
    """Show `argv` as this process's command line (/proc/PID/cmdline, ps): a rank reads as the launcher's rank would,
    with its spec's path, and the spare as its attempt's guard, so an operator, or a test looking for a job's
    processes, finds them by the job as before. It rewrites the memory the kernel reads that from (its start and end
    are in /proc/self/stat), within the room the spare was started with (`ROOM_ARGUMENT`)."""
    import ctypes

    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: proc(5) fields 48 and 49
    except (OSError, ValueError, IndexError):
        return
    room = end - start
    text = "\0".join(argv).encode()[:room - 1]
    ctypes.memmove(start, text + b"\0" * (room - len(text)), room)


def _lower_priority(priority: str) -> None:
    """worker/priority.py's levels, set on this process as chrt(1) and nice(1) would before an exec."""
    from worker.priority import LOW_NICE

    if priority == "low":
        os.nice(LOW_NICE)
    elif priority == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            os.nice(19)


def _apply_process_settings(request: Request) -> None:
    os.chdir(request.cwd)
    os.umask(request.umask)
    for name, (soft, hard) in request.rlimits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _refuse(why: str) -> int:
    print(f"{REFUSED}: {why}", flush=True)
    return 3


def serve(line: str) -> int:
    from worker import guard

    request = Request(**json.loads(line))
    if without_rank_variables(request.env) != without_rank_variables(_started_with):
        differ = sorted(k for k in set(request.env) | set(_started_with) if k not in RANK_VARIABLES
                        and request.env.get(k) != _started_with.get(k))
        return _refuse(f"the job's environment differs from this spare's in {differ}")
    why = unforkable()
    if why is not None:
        return _refuse(why)
    _apply_process_settings(request)
    set_command_line([sys.executable, "-m", "worker.spare", *request.guard, "--", "warm trainer of",
                      *request.trainer_args])
    _die_with(request.worker_pid, 0)
    print(TAKEN, flush=True)
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())
    Path(request.log_dir).mkdir(parents=True, exist_ok=True)
    pids: dict[int, int] = {}
    for rank in range(request.world):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, Path(request.log_dir) / f"{stamp}_rank{rank}.log")
        pids[pid] = rank
        # The launcher's own line, which worker/logpump.py's RankWatch reads to know each rank's pid.
        print(f"process {pid} spawned with command: [warm trainer, --local_rank={rank}, "
              f"{', '.join(request.trainer_args)}]", flush=True)
    os.environ.clear()
    os.environ.update(_imports_changed(request.env))
    args = guard.parser().parse_args(request.guard)
    return guard.guard(args, Ranks(pids), request.worker_pid)


def _die_with(parent: int, sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent (the worker) dies; 0 undoes it. Linux only."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if sig and os.getppid() != parent:
        os._exit(0)  # the worker died before it could be watched


def main() -> int:
    # Until it takes an attempt a spare is the worker's alone, and dies with it even mid-import (its stdin's end is
    # read only after the imports). A spare serving an attempt watches the worker itself: it must then outlive it
    # long enough to kill the attempt's group, so the kernel's signal is undone before the ranks are forked.
    _die_with(int(sys.argv[sys.argv.index("--worker-pid") + 1]) if "--worker-pid" in sys.argv else os.getppid(),
              signal.SIGKILL)
    _started_with.update(os.environ)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional module this installation lacks: the rank imports what it needs itself
    ready = Path(sys.argv[sys.argv.index(READY_ARGUMENT) + 1]) if READY_ARGUMENT in sys.argv else None
    if ready is not None:
        try:
            ready.touch()
        except OSError:
            ready = None  # a full disk: the node announces no ready spare, which is all the file is for
    line = sys.stdin.readline()
    if ready is not None:
        ready.unlink(missing_ok=True)
    if not line.strip():
        return 0  # the worker ended (or gave this spare up) before handing it an attempt
    return serve(line)


if __name__ == "__main__":
    sys.exit(main())
