"""Owns an attempt's process group and ends it as soon as the attempt can no longer be proven current.

The launcher and the trainer ranks live in their own session (so that ending a job can kill all of them
at once). This guard is the session's leader and the only process of it that watches the outside world:

- the worker that started it dies (even by SIGKILL): the group is killed at once;
- the control plane moved the job to a newer attempt (the attempt key in Redis): killed at once;
- the worker's lease can no longer be seen: killed when the last lease the guard saw expires.

The last rule is what makes "at most one attempt runs" hold without the worker's help: a worker that is
frozen (SIGSTOP, a stuck host) or cut off from Redis stops renewing its lease, and the guard, which keeps
running beside it, kills the ranks no later than the moment that lease expires in Redis. The control plane
requeues a job only after its lease has been missing for a grace period on top of that, so the next
attempt never starts while this one's ranks still run. Before killing the group the guard leaves a FENCED
file in the attempt's folder, so its worker (if it ever wakes up) knows it lost the job and reports nothing.

Usage: python -m worker.guard --redis URL --job ID --attempt N --owner WORKER --lease-expires-at T
       --fenced-file PATH -- ARGV...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

import redis

from contract.protocol import attempt_key, lease_key

POLL_SECONDS = 0.25
# A Redis call that hangs (a partition) must not keep the guard from its deadline for long.
REDIS_TIMEOUT_SECONDS = 0.5


class LeaseWatch:
    """Knows until when the attempt is provably current, from what Redis last said."""

    def __init__(self, client: redis.Redis, job_id: str, attempt: int, owner: str, valid_until: float,
                 part: int = 0) -> None:
        self.r, self.job_id, self.attempt, self.owner, self.part = client, job_id, attempt, owner, part
        self.valid_until = valid_until  # monotonic clock
        self.last_error: str | None = None

    def check(self) -> str | None:
        """None while the attempt is provably current; otherwise why the group must end."""
        sent = time.monotonic()
        try:
            current, ttl_ms, holder = (self.r.pipeline(transaction=False).get(attempt_key(self.job_id))
                                       .pttl(lease_key(self.job_id, self.attempt, self.part))
                                       .get(lease_key(self.job_id, self.attempt, self.part)).execute())
            self.last_error = None
        except redis.RedisError as exc:
            current = ttl_ms = holder = None
            self.last_error = f"{type(exc).__name__}: {exc}"
        if current is not None and int(current) != self.attempt:
            return f"attempt {self.attempt} was superseded by attempt {int(current)}"
        if holder is not None and holder.decode() == self.owner and ttl_ms is not None and ttl_ms > 0:
            # The lease expires no earlier than this: the TTL was read after `sent`.
            self.valid_until = max(self.valid_until, sent + ttl_ms / 1000)
        if time.monotonic() >= self.valid_until:
            why = f"Redis unreachable ({self.last_error})" if self.last_error else "its worker's lease expired"
            return f"attempt {self.attempt} can no longer be proven current: {why}"
        return None


def kill_group(signum: int = signal.SIGKILL) -> None:
    try:
        os.killpg(os.getpgid(0), signum)
    except ProcessLookupError:
        pass


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: python -m worker.guard [options] -- ARGV...")
    split = argv.index("--")
    return parser().parse_args(argv[:split]), argv[split + 1:]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.guard")
    parser.add_argument("--redis", help="Redis URL; without it only the worker's death is watched")
    parser.add_argument("--job")
    parser.add_argument("--attempt", type=int)
    parser.add_argument("--owner", help="the lease's value: the worker that holds it")
    parser.add_argument("--lease-expires-at", type=float, help="when the lease the worker just set expires (epoch s)")
    parser.add_argument("--fenced-file", type=Path)
    parser.add_argument("--worker-pid", type=int, default=None,
                        help="the supervising worker's pid (default: this process's parent when it starts)")
    parser.add_argument("--part", type=int, default=0, help="this node's part (node rank) of a multi-node job")
    return parser


class Child(Protocol):
    """What the guard watches: the launcher it started, or the ranks a warm trainer forked (worker/spare.py)."""

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def main(argv: list[str]) -> int:
    args, command = parse(argv)
    worker_pid = args.worker_pid if args.worker_pid is not None else os.getppid()
    return guard(args, subprocess.Popen(command), worker_pid)


def guard(args: argparse.Namespace, child: Child, worker_pid: int) -> int:
    """Watch `child` until it ends (its exit code) or the attempt can no longer be proven current (137)."""
    watch = None
    if args.redis:
        client = redis.Redis.from_url(args.redis, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                      socket_connect_timeout=REDIS_TIMEOUT_SECONDS)
        valid_until = time.monotonic() + max(0.0, args.lease_expires_at - time.time())
        watch = LeaseWatch(client, args.job, args.attempt, args.owner, valid_until, args.part)

    def forward(signum: int, _frame: object) -> None:
        # The worker asks for a graceful stop: pass it on, the launcher forwards it to the ranks.
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    while True:
        try:
            return child.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != worker_pid:
            kill_group()
            return 137
        reason = watch.check() if watch else None
        if reason is not None:
            fence(args.fenced_file, reason)
            kill_group()
            return 137


def fence(marker: Path | None, reason: str) -> None:
    """Say why before the group (this process included) is killed. Not on stdout: that pipe's reader is
    the worker, which may be the frozen one, and a full pipe would block the guard before its kill."""
    if marker is not None:
        try:
            marker.write_text(json.dumps({"reason": reason, "at": time.time()}))
        except OSError:
            pass  # the kill matters more than the note


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
