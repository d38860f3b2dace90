"""Nothing is lost when Postgres or Redis go away or the control plane is killed: real servers, really stopped.

One private stack (its own Postgres cluster and its own Redis, which keeps nothing on disk; API, control
plane and one Celery worker running the real launcher) serves every test here, so stopping a server
disturbs nobody else. Each test compares what Postgres stored with the rank-0 trainer log on disk: every
line exactly once, in order, with gap-free ids.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from contract.protocol import EVENTS_STREAM, INGEST_GROUP
from db.ingest import _clean, apply_event
from db.models import Job
from scripts.stack import ROOT, Stack, database_exists_or_create, migrate
from soak.proxy import ProxyHub
from tests.helpers import events_of, free_port, wait_for, wait_no_processes, wait_status
from tests.outage_support import (
    PrivatePostgres,
    PrivateRedis,
    compare_with_rank0,
    states,
    stored_events,
    trainer_event_count,
)
from worker.publisher import Publisher

ENDED = {"succeeded", "failed", "cancelled"}
POSTGRES_OUTAGE_SECONDS = 6.0
STEPS_A = 300


def figure(name: str, **values: Any) -> None:
    """The numbers a reader of the test output wants (run with -s to see them)."""
    print(f"\nFIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()), flush=True)


@pytest.fixture(scope="module")
def pg() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="module")
def private_redis(roots: dict[str, Path]) -> Iterator[PrivateRedis]:
    server = PrivateRedis(roots["logs"])
    server.start()
    yield server
    server.kill()


# Who the header-less requests of these tests are (FT_ALLOW_ANONYMOUS): the actor on their jobs' events.
ANONYMOUS = {"key_id": None, "owner": "default"}


@pytest.fixture(scope="module")
def outage_stack(pg: PrivatePostgres, private_redis: PrivateRedis, roots: dict[str, Path]) -> Iterator[Stack]:
    env = {
        "FT_DATABASE_URL": pg.url, "FT_REDIS_URL": private_redis.url, "FT_PORT": str(free_port()),
        "FT_ARTIFACTS_ROOT": str(roots["artifacts"]), "FT_MODEL_ROOT": str(roots["models"]),
        "FT_DATA_ROOT": str(roots["data"]), "FT_NVME_ROOT": str(roots["artifacts"] / "nvme"),
        # A lease of 6 s, renewed every second: a Redis restart of a second or two is survived by a live
        # worker, and a dead one is still noticed within seconds.
        "FT_HEARTBEAT_SECONDS": "1", "FT_LEASE_TTL_SECONDS": "6", "FT_LEASE_GRACE_SECONDS": "2",
        "FT_LOOP_INTERVAL_SECONDS": "0.2", "FT_ENV": "development",
        # Header-less requests act as `default`'s admin: these tests are about outages, and a key check that
        # needs the Postgres they take down would only add 503s they already expect from the routes.
        "FT_ALLOW_ANONYMOUS": "true",
    }
    database_exists_or_create(pg.url)
    migrate({**os.environ, **env})
    stack = Stack(env, roots["logs"] / "outages")
    stack.start_api()
    stack.start_controlplane()
    stack.start_worker("worker1")
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def oapi(outage_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=outage_stack.api_url, timeout=30) as client:
        yield client


def submit(api: httpx.Client, spec: dict[str, Any]) -> dict[str, Any]:
    r = api.post("/jobs", json=spec)
    assert r.status_code == 201, r.text
    return dict(r.json())


def job_dir(roots: dict[str, Path], job_id: str) -> Path:
    return roots["artifacts"].resolve() / "jobs" / job_id


def wait_progress(directory: Path, attempt: int, timeout: float = 240) -> None:
    """Read from the rank-0 log on disk, not the API: the test is about to take the API's database away."""
    logs = directory / "attempts" / str(attempt) / "logs"

    def progressing() -> bool:
        return any('"event": "progress"' in f.read_text(errors="replace") for f in logs.glob("*_rank0.log"))

    wait_for(progressing, timeout, f"the first progress line of attempt {attempt} in {logs}")


def assert_alive(stack: Stack, *names: str) -> None:
    for name in names:
        proc = stack.procs[name]
        assert proc.poll() is None, f"{name} exited with {proc.returncode}; see {stack.log_dir / (name + '.log')}"


def log_of(stack: Stack, name: str) -> str:
    return (stack.log_dir / f"{name}.log").read_text(errors="replace")


def no_orphans(job_id: str) -> None:
    wait_no_processes(job_id, 15, f"no process of job {job_id} left")


def test_a_postgres_restart_mid_job_loses_no_event(oapi: httpx.Client, outage_stack: Stack, pg: PrivatePostgres,
                                                   roots: dict[str, Path], make_job: Callable[..., Any]) -> None:
    began = time.monotonic()
    # Long enough (0.05–0.07 s a step here) that training goes on before, during and after the outage.
    job = submit(oapi, make_job(name="pg-outage", hyperparameters={"max_steps": STEPS_A},
                                checkpointing={"every_steps": 50, "keep_last": 2}))
    directory = job_dir(roots, job["id"])
    wait_progress(directory, 1)
    before = trainer_event_count(directory, 1)
    pg.stop()
    down = time.monotonic()
    time.sleep(POSTGRES_OUTAGE_SECONDS)
    during = trainer_event_count(directory, 1) - before
    pg.start()
    outage = time.monotonic() - down
    assert during > 0, "the trainer should have written events while Postgres was down"

    final = wait_status(oapi, job["id"], ENDED, timeout=300)
    assert final["status"] == "succeeded", final["error"]
    assert final["progress"]["step"] == STEPS_A
    counts = compare_with_rank0(pg.dsn, job["id"], directory, 1)
    after = counts["trainer"] - before - during
    assert after > 0, "training should have gone on after the outage (a slower machine needs more steps)"
    assert states(pg.dsn, job["id"]) == [(1, "queued"), (1, "starting"), (1, "running"), (1, "succeeded")]
    evs = events_of(oapi, job["id"])
    assert [e["id"] for e in evs] == list(range(1, len(evs) + 1))
    assert [c["step"] for c in final["checkpoints"] if c["committed"]] == [STEPS_A - 50, STEPS_A]
    no_orphans(job["id"])
    assert_alive(outage_stack, "controlplane", "api", "worker1")
    cp_log = log_of(outage_stack, "controlplane")
    assert "Postgres unavailable" in cp_log and "recovered" in cp_log, cp_log[-3000:]
    figure("postgres_restart", outage_s=round(outage, 1), trainer_events_before_during_after=(before, during, after),
           rank0_lines_compared=counts["rank0"], trainer_events_compared=counts["trainer"],
           events_stored=counts["stored"], wall_s=round(time.monotonic() - began, 1))


def test_a2_a_job_that_ends_while_postgres_is_down_keeps_its_final_state(
        oapi: httpx.Client, outage_stack: Stack, pg: PrivatePostgres, private_redis: PrivateRedis,
        roots: dict[str, Path], make_job: Callable[..., Any]) -> None:
    began = time.monotonic()
    job = submit(oapi, make_job(name="pg-outage-end", hyperparameters={"max_steps": 24}))
    directory = job_dir(roots, job["id"])
    wait_progress(directory, 1)
    pg.stop()
    down = time.monotonic()
    # The whole rest of the job, its completion and the worker's terminal state happen with Postgres away:
    # the terminal state waits in the stream, pending, until Postgres is back.
    r = private_redis.client()

    def terminal_published() -> bool:
        return any(f[b"job_id"].decode() == job["id"] and f[b"type"] == b"state" and b"succeeded" in f[b"data"]
                   for _, f in r.xrange(EVENTS_STREAM))

    wait_for(terminal_published, 90, "the worker to publish the job's end while Postgres is down")
    time.sleep(max(0.0, POSTGRES_OUTAGE_SECONDS - (time.monotonic() - down)))
    pg.start()
    outage = time.monotonic() - down

    final = wait_status(oapi, job["id"], ENDED, timeout=120)
    assert final["status"] == "succeeded", final["error"]
    assert final["output"] and final["progress"]["step"] == 24
    counts = compare_with_rank0(pg.dsn, job["id"], directory, 1)
    assert states(pg.dsn, job["id"]) == [(1, "queued"), (1, "starting"), (1, "running"), (1, "succeeded")]
    no_orphans(job["id"])
    assert_alive(outage_stack, "controlplane", "api", "worker1")
    figure("postgres_down_at_the_end", outage_s=round(outage, 1), rank0_lines_compared=counts["rank0"],
           trainer_events_compared=counts["trainer"], wall_s=round(time.monotonic() - began, 1))


def test_b_redis_restarted_empty_redrives_the_queued_job_and_the_running_one_continues(
        oapi: httpx.Client, outage_stack: Stack, pg: PrivatePostgres, private_redis: PrivateRedis,
        roots: dict[str, Path], make_job: Callable[..., Any]) -> None:
    began = time.monotonic()
    running = submit(oapi, make_job(name="redis-loss-running", hyperparameters={"max_steps": 40}))
    wait_progress(job_dir(roots, running["id"]), 1)
    r = private_redis.client()
    # A task message that waits in the broker: the control plane places a job only on a node with free slots,
    # and an idle worker's pending pop takes a message at once. So the message goes to a node whose worker
    # just died while its announcement is still live (one lease): it waits in that node's queue, in the
    # Redis about to lose everything.
    ghost = outage_stack.start_worker("ghost", queues="redis-loss", slots=1)
    wait_for(lambda: any(n["name"] == "ghost" and n["state"] == "up" for n in oapi.get("/nodes").json()["data"]),
             60, "node ghost to announce itself")
    ghost.kill()
    ghost.wait()
    outage_stack.procs.pop("ghost")
    waiting = submit(oapi, make_job(name="redis-loss-queued", resources={"num_gpus": 1, "queue": "redis-loss"}))
    wait_for(lambda: r.llen("node.ghost") == 1, 10, "the placed job's task message in the broker", interval=0.05)
    assert oapi.get(f"/jobs/{waiting['id']}").json()["status"] == "queued"

    # Events still in the stream when Redis dies are gone with it: the service does not promise those.
    # Hold the worker for the moment it takes the control plane to store everything already published,
    # so that every event this test compares is one the service does promise: those the worker had
    # not published yet when Redis went away (it keeps them and publishes them once Redis is back).
    worker = outage_stack.procs["worker1"]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: r.xlen(EVENTS_STREAM) == 0 and r.xpending(EVENTS_STREAM, INGEST_GROUP)["pending"] == 0,
                 10, "the control plane to have stored every published event", interval=0.05)
        private_redis.kill()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    killed = time.monotonic()
    time.sleep(1.5)  # the worker's publishes and heartbeats fail meanwhile; it must keep what it could not send
    private_redis.start()
    down = time.monotonic() - killed
    outage_stack.start_worker("rescuer", queues="redis-loss", slots=1)

    first = wait_status(oapi, running["id"], ENDED, timeout=300)
    second = wait_status(oapi, waiting["id"], ENDED, timeout=300)
    outage_stack.stop("rescuer")
    assert first["status"] == "succeeded" and first["attempt"] == 1, (first["status"], first["error"])
    assert second["status"] == "succeeded", second["error"]
    # Its task message was lost, so it was sent again, as a new attempt (2): the attempt key fences any worker
    # that might have claimed the old one just before the loss (its claim key was lost too). Its node then
    # counted as gone, so it was placed afresh (3), on the node that joined.
    assert second["attempt"] == 3
    assert states(pg.dsn, waiting["id"]) == [(1, "queued"), (2, "queued"), (3, "queued"), (3, "starting"),
                                              (3, "running"), (3, "succeeded")]
    assert states(pg.dsn, running["id"]) == [(1, "queued"), (1, "starting"), (1, "running"), (1, "succeeded")]
    counts_running = compare_with_rank0(pg.dsn, running["id"], job_dir(roots, running["id"]), 1)
    counts_waiting = compare_with_rank0(pg.dsn, waiting["id"], job_dir(roots, waiting["id"]), 3)
    for never in (1, 2):
        assert not (job_dir(roots, waiting["id"]) / "attempts" / str(never)).exists(), f"attempt {never} never ran"
    assert second["placement"][0]["node"] == "rescuer"
    for job_id in (running["id"], waiting["id"]):
        no_orphans(job_id)
    assert_alive(outage_stack, "controlplane", "api", "worker1")
    assert f"job {waiting['id']} goes out again as attempt 2 after Redis lost its data" in log_of(outage_stack,
                                                                                         "controlplane")
    figure("redis_restart_empty", redis_down_s=round(down, 1),
           running_rank0_lines=counts_running["rank0"], running_trainer_events=counts_running["trainer"],
           queued_rank0_lines=counts_waiting["rank0"], queued_trainer_events=counts_waiting["trainer"],
           wall_s=round(time.monotonic() - began, 1))


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def test_c_a_sigkilled_control_plane_continues_from_its_pending_entries(
        oapi: httpx.Client, outage_stack: Stack, pg: PrivatePostgres, roots: dict[str, Path],
        make_job: Callable[..., Any]) -> None:
    began = time.monotonic()
    job = submit(oapi, make_job(name="cp-kill", hyperparameters={"max_steps": 32}))
    directory = job_dir(roots, job["id"])
    wait_progress(directory, 1)
    outage_stack.stop("controlplane", sig=signal.SIGKILL)
    killed = time.monotonic()
    # The worst moment to die, made certain: a batch committed to Postgres and never acknowledged.
    crash = subprocess.run([sys.executable, "-m", "tests.outage_support", "commit-without-ack"], cwd=ROOT,
                           env={**outage_stack.env}, capture_output=True, text=True, timeout=120)
    assert crash.returncode == 0, crash.stdout + crash.stderr
    committed = json.loads(crash.stdout.strip().splitlines()[-1])["committed"]
    assert committed > 0
    time.sleep(2)  # the trainer goes on writing; the stream holds it until a control plane is back
    outage_stack.start_controlplane()
    gap = time.monotonic() - killed

    final = wait_status(oapi, job["id"], ENDED, timeout=300)
    assert final["status"] == "succeeded", final["error"]
    counts = compare_with_rank0(pg.dsn, job["id"], directory, 1)
    assert states(pg.dsn, job["id"]) == [(1, "queued"), (1, "starting"), (1, "running"), (1, "succeeded")]
    no_orphans(job["id"])
    assert_alive(outage_stack, "controlplane", "api", "worker1")
    figure("controlplane_sigkill", without_control_plane_s=round(gap, 1), committed_without_ack=committed,
           rank0_lines_compared=counts["rank0"], trainer_events_compared=counts["trainer"],
           wall_s=round(time.monotonic() - began, 1))


def entry(job_id: str, kind: str, data: dict[str, Any], attempt: int = 1) -> dict[str, str]:
    """A stream entry as the worker's publisher writes it (json.dumps lets NaN through, as it does there)."""
    return {"job_id": job_id, "attempt": str(attempt), "type": kind, "ts": repr(time.time()),
            "data": json.dumps(data)}


def test_d_an_event_postgres_refuses_does_not_stall_ingestion(oapi: httpx.Client, outage_stack: Stack,
                                                              pg: PrivatePostgres, private_redis: PrivateRedis,
                                                              make_job: Callable[..., Any]) -> None:
    # A queue no worker serves: the job stays queued and only the events below are its story.
    job = submit(oapi, make_job(name="odd-events", resources={"queue": "nobody-serves-this"}))
    client = private_redis.client()

    # One transaction, so the ingester reads all four as one batch: the bad one must not sink the others.
    pipe = client.pipeline(transaction=True)
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "log", {"rank": 0, "line": "before"}))
    pipe.xadd(EVENTS_STREAM, entry("job_\x00bad", "log", {"rank": 0, "line": "x"}))
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "log", {"rank": 0, "line": "a NUL \x00 in a line"}))
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "progress", {"rank": 0, "step": 1, "loss": math.nan}))
    pipe.execute()
    wait_for(lambda: len(stored_events(pg.dsn, job["id"])) >= 4, 30, "the job's three events stored")
    got = [(e["type"], e["data"]) for e in stored_events(pg.dsn, job["id"])]
    assert got == [("state", {"status": "queued", "actor": ANONYMOUS}), ("log", {"rank": 0, "line": "before"}),
                   ("log", {"rank": 0, "line": "a NUL \ufffd in a line"}),
                   ("progress", {"rank": 0, "step": 1, "loss": "nan"})]
    with psycopg.connect(pg.dsn) as conn:
        progress = conn.execute("SELECT progress FROM jobs WHERE id = %s", (job["id"],)).fetchone()[0]
    assert progress["loss"] == "nan"
    wait_for(lambda: client.xlen(EVENTS_STREAM) == 0, 10, "the stream drained: nothing left stuck in it")
    assert oapi.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    assert "is dropped" in log_of(outage_stack, "controlplane"), "the event Postgres refuses is named in the log"
    assert_alive(outage_stack, "controlplane")


class LostReplies:
    """A TCP relay to Redis that, once `lose` is set, passes what the client sends and never what Redis answers,
    then drops the client: a link cut after Redis did the work, before the client heard."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.lose = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.lose.is_set():
                    time.sleep(0.3)  # whatever else of the request is on its way reaches Redis too
                    dst.close()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


def test_f_events_sent_again_after_a_lost_reply_are_stored_once(oapi: httpx.Client, outage_stack: Stack,
                                                                 pg: PrivatePostgres, private_redis: PrivateRedis,
                                                                 make_job: Callable[..., Any]) -> None:
    """The worker's publisher keeps what Redis did not acknowledge and sends it again; when Redis had added it and
    only the reply was lost, the entries are in the stream twice and each event must be stored once."""
    job = submit(oapi, make_job(name="lost-reply", resources={"queue": "nobody-serves-this"}))
    relay = LostReplies(private_redis.port)
    added_before = private_redis.client().xinfo_stream(EVENTS_STREAM)["entries-added"]
    try:
        # No retry of the client's own: the publisher's caller is what sends again here.
        pub = Publisher(redis.Redis(port=relay.port, socket_timeout=2, retry=Retry(NoBackoff(), 0)), job["id"], 1)
        pending = [("log", {"rank": 0, "line": f"line {i}"}) for i in range(3)]
        pub.emit_many(pending[:1])
        relay.lose.set()
        with pytest.raises(redis.RedisError):
            pub.emit_many(pending[1:])
        relay.lose.clear()
        pub.emit_many(pending[1:])  # as worker/attempt.py's flush does: what was not acknowledged, again
    finally:
        relay.close()
    # Redis took the batch whose reply was lost: the two lines are in the stream twice.
    assert private_redis.client().xinfo_stream(EVENTS_STREAM)["entries-added"] - added_before == 5
    lines = [("log", {"rank": 0, "line": f"line {i}"}) for i in range(3)]
    wait_for(lambda: [(e["type"], e["data"]) for e in stored_events(pg.dsn, job["id"])][1:] == lines, 30,
             "the three lines stored")
    time.sleep(1.0)  # had a copy been stored too, it would be by now
    got = [(e["type"], e["data"]) for e in stored_events(pg.dsn, job["id"])]
    assert got[1:] == lines, got
    assert oapi.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelled"


def test_g_an_attempt_fenced_while_cut_from_redis_still_publishes_what_its_ranks_printed(
        oapi: httpx.Client, outage_stack: Stack, pg: PrivatePostgres, private_redis: PrivateRedis,
        roots: dict[str, Path], make_job: Callable[..., Any]) -> None:
    """A node's link to Redis drops every packet: its guard fences the attempt once the lease can no longer be proven,
    and the job is cancelled meanwhile, so no newer attempt supersedes it. What the ranks printed while the worker
    could not publish is the job's history: once the link is back, every rank-0 line is stored, once and in order."""
    hub = ProxyHub()
    link = hub.add("cutnode->redis", private_redis.port)
    queue = "cut-node"
    outage_stack.start_worker("cutnode", queue, env={"FT_REDIS_URL": f"redis://127.0.0.1:{link.port}/0"})
    try:
        job = submit(oapi, make_job(name="fenced-while-cut", hyperparameters={"max_steps": 5000},
                                    resources={"queue": queue}))
        directory = job_dir(roots, job["id"])
        wait_progress(directory, 1)
        wait_status(oapi, job["id"], {"running"}, timeout=60)
        hub.set(link.name, "drop")
        printed_at_cut = trainer_event_count(directory, 1)
        assert oapi.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelling"
        # The guard kills the ranks when the last lease it saw expires; the control plane, finding the lease gone,
        # ends the cancelling job on attempt 1.
        wait_for(lambda: any((directory / "attempts" / "1").glob("FENCED*")), 60, "the guard's fence")
        assert wait_status(oapi, job["id"], ENDED, timeout=60)["status"] == "cancelled"
        printed = trainer_event_count(directory, 1)
        assert printed > printed_at_cut, "the ranks should have trained on while the link was down"
        hub.set(link.name, "pass")

        def all_stored() -> bool:
            try:
                compare_with_rank0(pg.dsn, job["id"], directory, 1)
            except AssertionError:
                return False
            return True

        wait_for(all_stored, 90, "every rank-0 line of the fenced attempt stored")
        counts = compare_with_rank0(pg.dsn, job["id"], directory, 1)
        assert states(pg.dsn, job["id"])[-1] == (1, "cancelled")
        no_orphans(job["id"])
        figure("fenced_while_cut", trainer_events_at_cut=printed_at_cut, trainer_events_printed=printed,
               rank0_lines_compared=counts["rank0"])
    finally:
        outage_stack.stop("cutnode")
        hub.close()


def test_e_events_after_the_end_are_kept_but_change_nothing(oapi: httpx.Client, outage_stack: Stack,
                                                             pg: PrivatePostgres, private_redis: PrivateRedis,
                                                             make_job: Callable[..., Any]) -> None:
    # A worker that took the job just before its cancel reports on: what it says is the job's story.
    job = submit(oapi, make_job(name="late-events", resources={"queue": "nobody-serves-this"}))
    ended = oapi.post(f"/jobs/{job['id']}/cancel").json()
    assert ended["status"] == "cancelled"
    client = private_redis.client()
    pipe = client.pipeline(transaction=True)
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "state", {"status": "starting", "worker": "w"}))
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "log", {"rank": None, "line": "late line"}))
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "state", {"status": "succeeded", "output": {"path": "/x"}}))
    pipe.xadd(EVENTS_STREAM, entry(job["id"], "log", {"rank": None, "line": "not this attempt"}, attempt=2))
    pipe.execute()
    wait_for(lambda: len(stored_events(pg.dsn, job["id"])) >= 5, 30, "the late events stored")
    wait_for(lambda: client.xlen(EVENTS_STREAM) == 0, 10, "the stream drained")
    got = [(e["type"], e["data"]) for e in stored_events(pg.dsn, job["id"])]
    why = "the job had already ended as cancelled"
    assert got == [("state", {"status": "queued", "actor": ANONYMOUS}),
                   ("state", {"status": "cancelled", "reason": "cancelled before it started", "actor": ANONYMOUS}),
                   ("state", {"status": "starting", "worker": "w", "ignored": why}),
                   ("log", {"rank": None, "line": "late line"}),
                   ("state", {"status": "succeeded", "output": {"path": "/x"}, "ignored": why})]
    after = oapi.get(f"/jobs/{job['id']}").json()
    assert after["status"] == "cancelled" and after["output"] is None
    assert after["finished_at"] == ended["finished_at"]


def test_an_ended_job_keeps_its_final_state_and_row() -> None:
    job = Job(id="job_x", status="succeeded", attempt=1, progress={"step": 5}, checkpoints=[], event_seq=3,
              output={"path": "/out"}, resolved={})
    apply_event(job, "state", {"status": "failed", "error": {"code": "worker_lost"}})
    apply_event(job, "state", {"status": "running"})
    assert job.status == "succeeded" and job.error is None and job.output == {"path": "/out"}


def test_values_postgres_refuses_are_made_storable() -> None:
    assert _clean({"a\x00": ["x\x00y", math.inf, -math.inf, math.nan, 1.5, "\ud800"]}) == {
        "a\ufffd": ["x\ufffdy", "inf", "-inf", "nan", 1.5, "?"]}


def test_redis_loss_is_told_by_the_marker(private_redis: PrivateRedis) -> None:
    from controlplane.reaper import DATASET_KEY, RedisLossWatch

    client = redis.Redis.from_url(private_redis.url.rsplit("/", 1)[0] + "/5")
    client.flushdb()
    watch = RedisLossWatch([client])
    assert watch.check() is True, "no marker at the first start: new, or lost while nobody watched"
    assert watch.check() is False
    client.delete(DATASET_KEY)
    assert watch.check() is True
    client.set(DATASET_KEY, "someone else's")
    assert watch.check() is True and watch.check() is False
    client.flushdb()
