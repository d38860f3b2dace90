"""An attempt's processes: the DeepSpeed launcher's command line, spawned under the guard in a session of its
own (its process group is the attempt's, to kill at once), and that group killed and waited for."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from contract.spec import NodeShare
from worker.priority import Priority, command

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_env(**extra: str) -> dict[str, str]:
    """This process's environment with the project first on PYTHONPATH, for a child that runs one of its modules
    (the trainer, a helper program) from another working directory."""
    path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class GangLaunch:
    """What the launcher needs to start this node's ranks of a multi-node attempt (worker/gang.py agrees on it):
    the hostfile every node writes alike, this node's rank, and node 0's address."""

    hostfile: Path
    node_rank: int
    master_addr: str
    master_port: int
    include: str


def launcher_argv(python: str, num_procs: int, spec_file: Path, log_dir: Path,
                  share: NodeShare | None = None, gang: GangLaunch | None = None) -> list[str]:
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
