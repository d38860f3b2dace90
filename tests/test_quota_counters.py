"""Quotas held by counters (`owner_usage`, migration 0014), against two real API processes and a real control plane
on a fresh database: 64 submits at once against a quota of N admit exactly N, whichever process each reaches; the
count follows a job through cancel, retry (a lost worker's requeue), failure, success, events delivered twice
and a control plane killed and restarted; 64 uploads at once against a quota of stored bytes admit exactly as many
as fit. After each, every owner's counters equal what a count of its jobs and files says.

No worker runs: the jobs wait on queues no node serves, and what a worker would report is written to the event
stream as its publisher writes it, so the real ingester and reaper decide every state.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg
import pytest
import redis

from contract.codes import UNFINISHED_STATUSES, JobStatus, sql_list
from contract.protocol import EVENTS_STREAM, lease_key
from scripts.stack import Stack
from tests.apiproc import (
    ApiProcess,
    admin_database,
    api_processes,
    auth,
    controlplane_of,
    fixed_key,
    make_roots,
    parked_job,
)
from tests.helpers import wait_for

ADMIN_KEY = fixed_key("quotacounters")
CLIENTS = 64


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    with admin_database(ADMIN_KEY, "ops") as url:
        yield url


@pytest.fixture(scope="module")
def dsn(database: str) -> str:
    return database.replace("+psycopg", "")


@pytest.fixture(scope="module")
def redis_url(own_redis: str) -> str:
    return own_redis


@pytest.fixture(scope="module")
def env(database: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("quota-counters")
    # A lost worker is noticed within a second and a job is failed on its second loss: the retry is quick.
    return {"FT_DATABASE_URL": database, "FT_REDIS_URL": redis_url, "FT_ENV": "production",
            "FT_STORE_URL": f"file://{base / 'store'}", "FT_LEASE_GRACE_SECONDS": "1", "FT_LEASE_TTL_SECONDS": "1",
            "FT_LOOP_INTERVAL_SECONDS": "0.2", "FT_MAX_ATTEMPTS": "2", **make_roots(base)}


@pytest.fixture(scope="module")
def apis(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ApiProcess]]:
    with api_processes(env, tmp_path_factory.mktemp("quota-counters-logs")) as procs:
        yield procs


@pytest.fixture(scope="module")
def controlplane(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with controlplane_of(env, tmp_path_factory.mktemp("quota-counters-cp")) as stack:
        yield stack


@pytest.fixture(scope="module")
def admin(apis: list[ApiProcess]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=apis[0].url, headers=auth(ADMIN_KEY), timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def new_owner(admin: httpx.Client) -> Callable[[str], tuple[str, str]]:
    """An owner of the test's own (a fresh name) and a key of it."""

    def make(prefix: str) -> tuple[str, str]:
        owner = f"{prefix}-{uuid.uuid4().hex[:6]}"
        r = admin.post("/keys", json={"owner": owner, "scopes": ["jobs:write"], "name": "test"})
        assert r.status_code == 201, r.text
        return owner, r.json()["key"]

    return make


def at_once(apis: list[ApiProcess], key: str, send: Callable[[httpx.Client, int], httpx.Response],
            n: int = CLIENTS) -> list[httpx.Response]:
    """`send` from n clients released together, alternately through both API processes."""
    gate = threading.Barrier(n)
    clients = [httpx.Client(base_url=apis[i % 2].url, headers=auth(key), timeout=60) for i in range(n)]

    def one(i: int) -> httpx.Response:
        gate.wait()
        return send(clients[i], i)

    try:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))
    finally:
        for c in clients:
            c.close()


def usage(admin: httpx.Client, owner: str) -> dict[str, int]:
    return admin.get(f"/owners/{owner}/quota").json()["usage"]


def counters_match_the_tables(dsn: str) -> None:
    """Every owner's counters are what counting its unfinished jobs and summing its files gives."""
    with psycopg.connect(dsn) as conn:
        counted = {r[0]: tuple(int(v) for v in r[1:]) for r in conn.execute(
            "SELECT owner, active_jobs, gpus, stored_bytes FROM owner_usage").fetchall()}
        held = {r[0]: tuple(int(v) for v in r[1:]) for r in conn.execute(
            f"""SELECT owner, sum(jobs), sum(gpus), sum(bytes) FROM (
                    SELECT owner, count(*) AS jobs, sum(gpus) AS gpus, 0 AS bytes FROM jobs
                    WHERE status IN {sql_list(UNFINISHED_STATUSES)} GROUP BY owner
                    UNION ALL SELECT owner, 0, 0, sum(bytes) FROM files GROUP BY owner) AS h
                GROUP BY owner""").fetchall()}
    assert {o: c for o, c in counted.items() if c != (0, 0, 0)} == held


def test_sixty_four_submits_at_once_against_a_quota_of_n_admit_exactly_n(
        apis: list[ApiProcess], admin: httpx.Client, new_owner: Callable[[str], tuple[str, str]], dsn: str) -> None:
    owner, key = new_owner("burst")
    admin.put(f"/owners/{owner}/quota", json={"max_active_jobs": 7}).raise_for_status()
    answers = at_once(apis, key, lambda c, i: c.post("/jobs", json=parked_job(f"b{i}")))
    assert sorted(r.status_code for r in answers) == [201] * 7 + [429] * (CLIENTS - 7)
    err = next(r for r in answers if r.status_code == 429).json()["error"]
    assert err["code"] == "quota_exceeded" and err["field"] == "max_active_jobs"
    assert "max_active_jobs is 7" in err["message"] and "7 unfinished jobs" in err["message"], err
    assert usage(admin, owner) == {"active_jobs": 7, "gpus": 7, "stored_bytes": 0}
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM jobs WHERE owner = %s", (owner,)).fetchone()[0] == 7
    # The GPU limit, on the same owner and the same counter row: 2 GPUs each, 5 allowed, 7 jobs already.
    admin.put(f"/owners/{owner}/quota", json={"max_active_jobs": 100, "max_gpus": 7 + 5}).raise_for_status()
    answers = at_once(apis, key, lambda c, i: c.post("/jobs", json=parked_job(f"g{i}", num_gpus=2)))
    assert sorted(r.status_code for r in answers) == [201] * 2 + [429] * (CLIENTS - 2)
    err = next(r for r in answers if r.status_code == 429).json()["error"]
    assert err["field"] == "max_gpus" and "hold 11" in err["message"] and "asks for 2" in err["message"], err
    assert usage(admin, owner) == {"active_jobs": 9, "gpus": 11, "stored_bytes": 0}
    counters_match_the_tables(dsn)


def report(r: redis.Redis, job_id: str, attempt: int, *states: dict[str, Any]) -> None:
    """State events of one attempt, as a worker's publisher writes them, in one transaction (one ingest batch)."""
    pipe = r.pipeline(transaction=True)
    for data in states:
        pipe.xadd(EVENTS_STREAM, {"job_id": job_id, "attempt": str(attempt), "type": "state", "ts": repr(time.time()),
                                  "data": json.dumps(data)})
    pipe.execute()


def test_the_count_follows_cancel_retry_failure_success_duplicates_and_a_control_plane_restart(
        apis: list[ApiProcess], admin: httpx.Client, new_owner: Callable[[str], tuple[str, str]],
        controlplane: Stack, redis_url: str, dsn: str) -> None:
    owner, key = new_owner("life")
    admin.put(f"/owners/{owner}/quota", json={"max_active_jobs": 4}).raise_for_status()
    r = redis.Redis.from_url(redis_url)
    c = httpx.Client(base_url=apis[1].url, headers=auth(key), timeout=30)

    def submit(name: str) -> str:
        answer = c.post("/jobs", json=parked_job(name))
        assert answer.status_code == 201, answer.text
        return str(answer.json()["id"])

    def status(job_id: str) -> tuple[str, int]:
        job = c.get(f"/jobs/{job_id}").json()
        return job["status"], job["attempt"]

    def active() -> int:
        return usage(admin, owner)["active_jobs"]

    cancelled, retried, succeeded, stopped = (submit(n) for n in ("cancelled", "retried", "succeeded", "stopped"))
    assert c.post("/jobs", json=parked_job("fifth")).status_code == 429
    # Cancelled while queued: its slot is free at once, and a second cancel frees nothing more.
    assert c.post(f"/jobs/{cancelled}/cancel").status_code == 202
    assert c.post(f"/jobs/{cancelled}/cancel").status_code == 409
    assert active() == 3
    submit("fifth")
    assert active() == 4 and c.post("/jobs", json=parked_job("sixth")).status_code == 429

    # Three jobs start; two hold a lease, as a live worker's would. The third's worker is lost: the reaper
    # requeues it as attempt 2 (still unfinished: still counted once) and fails it on the second loss.
    for job_id in (succeeded, stopped):
        r.set(lease_key(job_id, 1), "w", ex=120)
    for job_id in (retried, succeeded, stopped):
        report(r, job_id, 1, {"status": JobStatus.STARTING, "worker": "w"}, {"status": JobStatus.RUNNING})
    wait_for(lambda: status(retried) == (JobStatus.QUEUED, 2), 30, "the lost attempt requeued")
    assert active() == 4
    report(r, retried, 2, {"status": JobStatus.STARTING, "worker": "w"}, {"status": JobStatus.RUNNING})
    wait_for(lambda: status(retried)[0] == JobStatus.FAILED, 30, "the second loss to fail the job")
    assert active() == 3

    # Success, then the same terminal events again and a late failure: kept, but they change nothing.
    report(r, succeeded, 1, {"status": JobStatus.SUCCEEDED, "output": {"path": "/x"}})
    wait_for(lambda: status(succeeded)[0] == JobStatus.SUCCEEDED, 30, "the success ingested")
    report(r, succeeded, 1, {"status": JobStatus.SUCCEEDED, "output": {"path": "/x"}},
           {"status": JobStatus.FAILED, "error": {"code": "trainer_error", "message": "late"}})
    wait_for(lambda: r.xlen(EVENTS_STREAM) == 0, 30, "the duplicates ingested")
    assert active() == 2

    # A cancel of a running job holds its slot until the worker says it stopped; that report arrives while the
    # control plane is down (killed, nothing acknowledged on the way out) and is ingested by the next one.
    assert c.post(f"/jobs/{stopped}/cancel").status_code == 202
    assert status(stopped)[0] == JobStatus.CANCELLING and active() == 2
    controlplane.stop("controlplane", sig=signal.SIGKILL)
    report(r, stopped, 1, {"status": JobStatus.CANCELLED, "reason": "cancelled by the user"})
    report(r, stopped, 1, {"status": JobStatus.CANCELLED, "reason": "cancelled by the user"})
    controlplane.start_controlplane()
    wait_for(lambda: status(stopped)[0] == JobStatus.CANCELLED, 60, "the restarted control plane's ingest")
    assert active() == 1
    counters_match_the_tables(dsn)
    # What the counter says is what the submit enforces: three more fit, the fourth does not.
    for i in range(3):
        submit(f"refill{i}")
    assert c.post("/jobs", json=parked_job("over")).status_code == 429
    assert active() == 4
    c.close()
    counters_match_the_tables(dsn)
    # The operator's repair rebuilds the same counters from the tables.
    before = usage(admin, owner)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ft_recount_owner_usage()")
    assert usage(admin, owner) == before
    counters_match_the_tables(dsn)


def upload(c: httpx.Client, size: int, i: int) -> httpx.Response:
    return c.post("/files", files={"file": (f"f{i}.txt", b"x" * size)}, data={"purpose": "fine-tune"})


def test_sixty_four_uploads_at_once_fill_the_quota_of_stored_bytes_exactly(
        apis: list[ApiProcess], admin: httpx.Client, new_owner: Callable[[str], tuple[str, str]], dsn: str) -> None:
    owner, key = new_owner("bytes")
    size = 1000
    admin.put(f"/owners/{owner}/quota", json={"max_stored_bytes": 5 * size + size // 2}).raise_for_status()
    answers = at_once(apis, key, lambda c, i: upload(c, size, i))
    assert sorted(r.status_code for r in answers) == [201] * 5 + [429] * (CLIENTS - 5), \
        [r.text for r in answers if r.status_code not in (201, 429)]
    err = next(r for r in answers if r.status_code == 429).json()["error"]
    assert err["code"] == "quota_exceeded" and err["field"] == "max_stored_bytes"
    assert usage(admin, owner)["stored_bytes"] == 5 * size
    counters_match_the_tables(dsn)
    # A delete gives its bytes back, once.
    with httpx.Client(base_url=apis[0].url, headers=auth(key), timeout=30) as c:
        first = next(r.json()["id"] for r in answers if r.status_code == 201)
        assert c.delete(f"/files/{first}").status_code == 200
        assert c.delete(f"/files/{first}").status_code == 404
        assert usage(admin, owner)["stored_bytes"] == 4 * size
        assert upload(c, size, 99).status_code == 201
        assert upload(c, size, 100).status_code == 429
    counters_match_the_tables(dsn)
