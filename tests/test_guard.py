"""The guard ends an attempt's processes by itself: lease gone, attempt superseded, Redis unreachable, worker dead.

Real processes and a real Redis; the "worker" is this test (or a shell it starts), the "ranks" are sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from contract.protocol import attempt_key, lease_key
from tests.helpers import free_port, group_members, wait_for

OWNER = "test-worker:1"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return bool(group_members(pgid))  # zombies of the group count as gone: they run nothing


def start_guard(redis_url: str, job: str, fenced: Path, lease_seconds: float) -> subprocess.Popen[bytes]:
    # A "rank" that ignores SIGTERM and has a child of its own, as a launcher with ranks would.
    ranks = "trap '' TERM; sleep 300 & sleep 300; wait"
    return subprocess.Popen(
        [sys.executable, "-m", "worker.guard", "--redis", redis_url, "--job", job, "--attempt", "1",
         "--owner", OWNER, "--lease-expires-at", repr(time.time() + lease_seconds), "--fenced-file", str(fenced),
         "--", "sh", "-c", ranks], start_new_session=True)


def test_a_lease_that_is_not_renewed_ends_the_group_when_it_expires(redis_url: str, client: redis.Redis,
                                                                     tmp_path: Path) -> None:
    job = f"job_guard_{uuid.uuid4().hex[:8]}"
    client.set(attempt_key(job), 1)
    client.set(lease_key(job, 1), OWNER, px=2000)
    proc = start_guard(redis_url, job, tmp_path / "FENCED", lease_seconds=2)
    started = time.monotonic()
    # Renewed: it keeps running past several lease lengths.
    while time.monotonic() - started < 4:
        client.set(lease_key(job, 1), OWNER, px=2000)
        assert proc.poll() is None and group_alive(proc.pid)
        time.sleep(0.4)
    last_renewal = time.monotonic()
    wait_for(lambda: not group_alive(proc.pid), 5, "the guard to end the group after the lease expired", 0.05)
    gone_after = time.monotonic() - last_renewal
    assert 1.5 <= gone_after <= 3.0, f"ended {gone_after:.2f} s after the last renewal of a 2 s lease"
    assert proc.wait(5) != 0
    assert "lease expired" in json.loads((tmp_path / "FENCED").read_text())["reason"]


def test_a_newer_attempt_ends_the_group_at_once(redis_url: str, client: redis.Redis, tmp_path: Path) -> None:
    job = f"job_guard_{uuid.uuid4().hex[:8]}"
    client.set(attempt_key(job), 1)
    client.set(lease_key(job, 1), OWNER, px=60_000)
    proc = start_guard(redis_url, job, tmp_path / "FENCED", lease_seconds=60)
    time.sleep(1.5)
    assert group_alive(proc.pid)
    client.set(attempt_key(job), 2)
    moved = time.monotonic()
    wait_for(lambda: not group_alive(proc.pid), 3, "the guard to end a superseded attempt", 0.05)
    assert time.monotonic() - moved < 1.5
    assert "superseded by attempt 2" in json.loads((tmp_path / "FENCED").read_text())["reason"]


def test_an_unreachable_redis_ends_the_group_when_the_last_known_lease_expires(tmp_path: Path) -> None:
    # Nothing listens there: the node is cut off from the control plane from the start.
    proc = start_guard(f"redis://127.0.0.1:{free_port()}/0", "job_partitioned", tmp_path / "FENCED",
                       lease_seconds=2.5)
    started = time.monotonic()
    time.sleep(1.5)
    assert group_alive(proc.pid), "the lease the worker set is still valid: the job may run"
    wait_for(lambda: not group_alive(proc.pid), 5, "the guard to end a partitioned attempt", 0.05)
    assert time.monotonic() - started <= 4.0
    assert "Redis unreachable" in json.loads((tmp_path / "FENCED").read_text())["reason"]


def test_the_group_dies_with_its_worker_even_by_sigkill(redis_url: str, client: redis.Redis,
                                                        tmp_path: Path) -> None:
    job = f"job_guard_{uuid.uuid4().hex[:8]}"
    client.set(lease_key(job, 1), OWNER, px=60_000)
    # A stand-in worker: a shell that starts the guard in a new session, as the supervisor does, then waits.
    pgid_file = tmp_path / "pgid"
    worker = subprocess.Popen(
        [sys.executable, "-c",
         "import os, subprocess, sys, time, pathlib;"
         f"p = subprocess.Popen([sys.executable, '-m', 'worker.guard', '--worker-pid', str(os.getpid()),"
         f" '--redis', {redis_url!r}, '--job', {job!r},"
         f" '--attempt', '1', '--owner', {OWNER!r}, '--lease-expires-at', str(time.time() + 60), '--',"
         " 'sleep', '300'], start_new_session=True);"
         f"pathlib.Path({str(pgid_file)!r}).write_text(str(p.pid)); time.sleep(300)"])
    pgid = int(wait_for(lambda: pgid_file.is_file() and pgid_file.read_text(), 10, "the guard to start"))
    wait_for(lambda: group_alive(pgid), 5, "the guarded command to run")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    wait_for(lambda: not group_alive(pgid), 3, "the group to die with its worker", 0.05)
