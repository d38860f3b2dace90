"""A node's name belongs to one live worker: a second worker under a held name refuses to start.

Real worker processes (`python -m worker`, as the stack and `make worker` start them) against the session's
Redis; the live worker must stay untouched and keep running the node's jobs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from contract.protocol import node_key
from scripts.stack import ROOT, Stack
from tests.helpers import events_of, wait_for, wait_status

BOOT = 120  # how long a worker may take to start (or refuse) on a busy test machine
HELD = "is held by a live worker"  # what a refused worker says, with the name it could not take


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def announced_by(r: redis.Redis, node: str) -> str | None:
    """The worker (host:pid) whose announcement the node's key holds now."""
    raw = r.get(node_key(node))
    return None if raw is None else str(json.loads(raw)["worker"])


def worker_id(proc: subprocess.Popen[bytes]) -> str:
    # `python -m worker` execs Celery in place: the worker keeps the pid the stack started.
    return f"{socket.gethostname()}:{proc.pid}"


def log_of(stack: Stack, name: str) -> str:
    return (stack.log_dir / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def r(stack_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(stack_env["FT_REDIS_URL"])
    yield client
    client.close()


@pytest.fixture
def started(stack: Stack) -> Iterator[list[str]]:
    """Names of the workers a test started: each is woken (a frozen one cannot act on SIGTERM) and stopped."""
    names: list[str] = []
    yield names
    for name in names:
        proc = stack.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        if name in stack.procs:
            stack.stop(name)


def test_a_second_worker_under_a_live_workers_name_refuses_names_it_and_consumes_nothing(
        api: httpx.Client, stack: Stack, r: redis.Redis, started: list[str], make_job: Any) -> None:
    node, queue = unique("twin"), unique("twinq")
    started.append(f"{node}-live")
    live = stack.start_worker(f"{node}-live", queues=queue, node=node, slots=1)
    wait_for(lambda: announced_by(r, node) == worker_id(live), BOOT, "the first worker announcing the node")

    # The second one as `make worker` starts it on the same host, its stderr apart from its stdout.
    env = {**stack.env, "FT_NODE_NAME": node, "FT_QUEUES": queue, "FT_NODE_SLOTS": "1", "FT_NODE_ADDR": "127.0.0.1"}
    refused = subprocess.run([sys.executable, "-m", "worker"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=BOOT)
    assert refused.returncode != 0, refused.stderr[-2000:]
    assert f"node name {node!r} {HELD} ({worker_id(live)}:" in refused.stderr, refused.stderr[-2000:]
    assert "FT_NODE_NAME=" in refused.stderr, "the message says how to choose another name"
    assert "FT_LEASE_TTL_SECONDS" in refused.stderr, "the message says when a dead holder's name is free"
    output = refused.stdout + refused.stderr
    assert " ready." not in output and "received" not in output, "the refused worker never consumed"

    # The live worker is untouched: still announcing the node as its own, and it runs the node's job.
    assert live.poll() is None and announced_by(r, node) == worker_id(live)
    job = api.post("/jobs", json=make_job(name="twin", hyperparameters={"max_steps": 8},
                                          resources={"num_gpus": 1, "queue": queue},
                                          checkpointing={"every_steps": 8})).json()
    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=400)
    assert final["status"] == "succeeded", final["error"]
    ran_on = [e.get("worker") for e in events_of(api, job["id"], ["state"]) if e.get("status") == "starting"]
    assert ran_on == [worker_id(live)]
    assert live.poll() is None and announced_by(r, node) == worker_id(live)


def test_workers_started_at_once_under_one_name_leave_exactly_one_running(
        stack: Stack, stack_env: dict[str, str], r: redis.Redis, started: list[str]) -> None:
    node, queue = unique("race"), unique("raceq")
    names = [f"{node}-{i}" for i in range(3)]
    started.extend(names)
    procs = {name: stack.start_worker(name, queues=queue, node=node, slots=1) for name in names}

    wait_for(lambda: sum(p.poll() is not None for p in procs.values()) == 2, BOOT, "two of the three refusing")
    (winner,) = [name for name, p in procs.items() if p.poll() is None]
    for name, proc in procs.items():
        if name != winner:
            assert proc.returncode != 0
            assert f"node name {node!r} {HELD}" in log_of(stack, name)
            assert " ready." not in log_of(stack, name)
    wait_for(lambda: announced_by(r, node) == worker_id(procs[winner]), BOOT, "the winner announcing the node")
    # It keeps the node: still running and announcing after several heartbeats.
    time.sleep(4 * float(stack_env["FT_HEARTBEAT_SECONDS"]))
    assert procs[winner].poll() is None and announced_by(r, node) == worker_id(procs[winner])


def test_a_killed_workers_name_is_refused_within_its_ttl_and_free_after_it(
        stack: Stack, r: redis.Redis, started: list[str]) -> None:
    # A longer TTL than the test stack's 3 s, so that a worker booting right after the kill claims within it.
    ttl = 30.0
    env = {"FT_LEASE_TTL_SECONDS": str(ttl)}
    node, queue = unique("phoenix"), unique("phoenixq")
    names = [f"{node}-{i}" for i in range(3)]
    started.extend(names)
    first = stack.start_worker(names[0], queues=queue, node=node, slots=1, env=env)
    wait_for(lambda: announced_by(r, node) == worker_id(first), BOOT, "the first worker announcing the node")
    stack.stop(names[0], sig=signal.SIGKILL)
    killed_at = time.monotonic()

    early = stack.start_worker(names[1], queues=queue, node=node, slots=1, env=env)
    wait_for(lambda: early.poll() is not None, BOOT, "the worker started within the TTL refusing")
    assert time.monotonic() - killed_at < ttl, "the machine was too slow to start a worker within the TTL"
    assert early.returncode != 0
    message = log_of(stack, names[1])
    assert f"node name {node!r} {HELD} ({worker_id(first)}:" in message
    assert f"lapses {ttl:g} s (FT_LEASE_TTL_SECONDS) after its last heartbeat" in message

    time.sleep(max(0.0, killed_at + ttl - time.monotonic()))
    later = stack.start_worker(names[2], queues=queue, node=node, slots=1, env=env)
    wait_for(lambda: announced_by(r, node) == worker_id(later), BOOT, "the worker started after the TTL announcing")
    assert later.poll() is None


def test_a_worker_that_lost_its_name_while_frozen_leaves_the_node_to_the_new_holder(
        stack: Stack, r: redis.Redis, started: list[str]) -> None:
    node, queue = unique("thaw"), unique("thawq")
    names = [f"{node}-frozen", f"{node}-new"]
    started.extend(names)
    frozen = stack.start_worker(names[0], queues=queue, node=node, slots=1)
    wait_for(lambda: announced_by(r, node) == worker_id(frozen), BOOT, "the first worker announcing the node")
    os.kill(frozen.pid, signal.SIGSTOP)
    wait_for(lambda: announced_by(r, node) is None, 30, "the frozen worker's announcement lapsing")

    new = stack.start_worker(names[1], queues=queue, node=node, slots=1)
    wait_for(lambda: announced_by(r, node) == worker_id(new), BOOT, "the new worker announcing the node")
    os.kill(frozen.pid, signal.SIGCONT)
    # Woken, it finds the name taken: it stops consuming the node's queue (exits) and never announces over it.
    wait_for(lambda: frozen.poll() is not None, 60, "the woken worker leaving")
    assert "was taken by another worker" in log_of(stack, names[0])
    assert new.poll() is None and announced_by(r, node) == worker_id(new)
