"""Who may do what, against real API processes: owners kept apart on every route, each scope's routes, revoked
and expired keys, quotas under concurrent submits, idempotent retries under concurrency, the audit log, and
the operator's key CLI.

Two API processes (as `make up` runs several) share a fresh database, in production mode (keys required),
with a key cache TTL of five minutes: a revoked key that stops working in the other process within a second
was dropped by the notification, not by the TTL. A control plane dispatches the submitted jobs to queues no
worker serves, so a test can count the task messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis

from scripts.stack import ROOT, Stack
from tests.apiproc import (
    ApiProcess,
    add_key,
    admin_database,
    api_processes,
    auth,
    controlplane_of,
    fixed_key,
    make_roots,
    parked,
    parked_job,
)
from tests.helpers import wait_for

ADMIN_KEY = fixed_key("accessadmin")
CACHE_TTL = 300  # far beyond any wait below: only the revocation notification can make a key fail in time


def job_body(queue: str, name: str = "access", num_gpus: int = 1) -> dict[str, object]:
    return parked_job(name, queue, num_gpus)


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    with admin_database(ADMIN_KEY, "ops") as url:
        yield url


@pytest.fixture(scope="module")
def redis_url(own_redis: str) -> str:
    return own_redis


@pytest.fixture(scope="module")
def env(database: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"FT_DATABASE_URL": database, "FT_REDIS_URL": redis_url, "FT_ENV": "production",
            "FT_KEY_CACHE_SECONDS": str(CACHE_TTL), **make_roots(tmp_path_factory.mktemp("access"))}


@pytest.fixture(scope="module")
def apis(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ApiProcess]]:
    with api_processes(env, tmp_path_factory.mktemp("access-logs")) as procs:
        yield procs


@pytest.fixture(scope="module")
def controlplane(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with controlplane_of({**env, "FT_LOOP_INTERVAL_SECONDS": "0.2"}, tmp_path_factory.mktemp("access-cp")) as stack:
        time.sleep(1)
        yield stack


@pytest.fixture(scope="module")
def admin(apis: list[ApiProcess]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=apis[0].url, headers=auth(ADMIN_KEY), timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def new_key(admin: httpx.Client) -> Callable[..., tuple[str, str]]:
    def make(owner: str, *scopes: str, **extra: Any) -> tuple[str, str]:
        r = admin.post("/keys", json={"owner": owner, "scopes": list(scopes), "name": "test", **extra})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["key"].startswith("ftk_") and body["prefix"] == body["key"][:12]
        return body["id"], body["key"]

    return make


def client(api: ApiProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=api.url, headers=auth(key), timeout=30)


def error_of(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


# -- owners: another owner's job does not exist, on every route --


def every_job_route(c: httpx.Client, job_id: str) -> dict[str, httpx.Response]:
    out = {
        "get": c.get(f"/jobs/{job_id}"),
        "events": c.get(f"/jobs/{job_id}/events"),
        "events after": c.get(f"/jobs/{job_id}/events", params={"after": 1, "type": "state"}),
        "events SSE": c.get(f"/jobs/{job_id}/events", headers={"Accept": "text/event-stream"}),
        "logs": c.get(f"/jobs/{job_id}/logs"),
        "logs follow": c.get(f"/jobs/{job_id}/logs", params={"follow": "true"}),
        "deepspeed config": c.get(f"/jobs/{job_id}/deepspeed-config"),
        "cancel": c.post(f"/jobs/{job_id}/cancel"),
    }
    return out


def test_two_owners_cannot_see_or_touch_each_others_jobs(apis: list[ApiProcess], admin: httpx.Client,
                                                         new_key: Callable[..., tuple[str, str]]) -> None:
    queue = parked()
    _, key_a = new_key("team-a", "jobs:write")
    _, key_b = new_key("team-b", "jobs:write")
    with client(apis[0], key_a) as a, client(apis[1], key_b) as b:
        job_a, job_b = (c.post("/jobs", json=job_body(queue, name)) for c, name in ((a, "a's"), (b, "b's")))
        assert job_a.status_code == job_b.status_code == 201, (job_a.text, job_b.text)
        job_a, job_b = job_a.json(), job_b.json()
        assert job_a["owner"] == "team-a" and job_b["owner"] == "team-b"
        unknown = every_job_route(a, "job_00000000000000000000")
        for caller, other in ((a, job_b["id"]), (b, job_a["id"])):
            for route, r in every_job_route(caller, other).items():
                err = error_of(r, 404, "not_found")  # never 403: that would say the job exists
                assert err["field"] == "id" and r.json()["error"]["message"] == \
                    unknown[route].json()["error"]["message"].replace("job_00000000000000000000", other), route
            # Lists: absent, and another owner's id is no cursor (not found, as an unknown id); filtering by another
            # owner needs admin.
            listed = [j["id"] for j in caller.get("/jobs", params={"limit": 200}).json()["data"]]
            assert other not in listed
            assert error_of(caller.get("/jobs", params={"after": other}), 404, "not_found")["field"] == "after"
            assert "admin" in error_of(caller.get("/jobs", params={"owner": "team-z"}), 403, "forbidden")["message"]
        assert [j["id"] for j in a.get("/jobs").json()["data"]] == [job_a["id"]]
        assert [j["id"] for j in a.get("/jobs", params={"owner": "team-a"}).json()["data"]] == [job_a["id"]]
        # Neither cancel went through; each owner still reads and cancels its own.
        for c, job in ((a, job_a), (b, job_b)):
            assert c.get(f"/jobs/{job['id']}").json()["status"] == "queued"
            assert c.get(f"/jobs/{job['id']}/events").status_code == 200
            assert c.get(f"/jobs/{job['id']}/logs").status_code == 200
            rendered = c.get(f"/jobs/{job['id']}/deepspeed-config")
            assert rendered.status_code == 200 and rendered.json() == job["resolved"]["deepspeed_config"]
            assert rendered.json()["train_micro_batch_size_per_gpu"] >= 1
        assert b.post(f"/jobs/{job_b['id']}/cancel").json()["status"] == "cancelled"
        sse = b.get(f"/jobs/{job_b['id']}/events", headers={"Accept": "text/event-stream"})
        assert sse.status_code == 200 and "event: state" in sse.text and "cancelled" in sse.text
    # An admin sees both owners, and one owner with ?owner=.
    everyone = {j["id"] for j in admin.get("/jobs", params={"limit": 200}).json()["data"]}
    assert {job_a["id"], job_b["id"]} <= everyone
    only_b = admin.get("/jobs", params={"owner": "team-b"}).json()["data"]
    assert [j["id"] for j in only_b] == [job_b["id"]]
    assert admin.get(f"/jobs/{job_a['id']}/events").status_code == 200
    assert admin.post(f"/jobs/{job_a['id']}/cancel").json()["status"] == "cancelled"


# -- scopes: each scope's routes allowed, the others refused with the scope named, before the body is read --

ROUTES: list[tuple[str, str, str]] = [  # method, path (JOB: a job of the caller's owner), scope it needs
    ("GET", "/jobs", "jobs:read"), ("GET", "/jobs/JOB", "jobs:read"), ("GET", "/jobs/JOB/events", "jobs:read"),
    ("GET", "/jobs/JOB/logs", "jobs:read"), ("GET", "/jobs/JOB/deepspeed-config", "jobs:read"),
    ("GET", "/jobs/JOB/output", "jobs:read"), ("GET", "/jobs/JOB/output/config.json", "jobs:read"),
    ("POST", "/jobs", "jobs:write"), ("POST", "/jobs/JOB/cancel", "jobs:write"),
    ("GET", "/keys", "admin"), ("POST", "/keys", "admin"), ("DELETE", "/keys/key_nope", "admin"),
    ("PUT", "/owners/team-s/quota", "admin"), ("GET", "/owners/team-s/quota", "admin"), ("GET", "/audit", "admin"),
]
GRANTS = {"jobs:read": {"jobs:read"}, "jobs:write": {"jobs:read", "jobs:write"},
          "admin": {"jobs:read", "jobs:write", "admin"}}


@pytest.mark.parametrize("scope", ["jobs:read", "jobs:write", "admin"])
def test_each_scope_allows_its_routes_and_refuses_the_others(apis: list[ApiProcess], admin: httpx.Client,
                                                             new_key: Callable[..., tuple[str, str]],
                                                             scope: str) -> None:
    queue = parked()
    _, key = new_key("team-s", scope)
    bodies = {"/jobs": job_body(queue), "/keys": {"owner": "team-s", "scopes": ["jobs:read"]},
              "/owners/team-s/quota": {"max_active_jobs": 50}}
    with client(apis[1], key) as c:
        for method, template, needed in ROUTES:
            job_id = admin.post("/jobs", json=job_body(queue)).json()["id"] if "JOB" in template else ""
            if job_id:  # a job of the caller's owner (admin's own is `ops`: move it)
                with psycopg.connect(admin_db(apis)) as conn:
                    conn.execute("UPDATE jobs SET owner = 'team-s' WHERE id = %s", (job_id,))
            path = template.replace("JOB", job_id)
            r = c.request(method, path, json=bodies.get(path))
            if needed in GRANTS[scope]:
                assert r.status_code not in (401, 403), (scope, method, path, r.text)
                assert r.status_code in (200, 201, 202, 404), (scope, method, path, r.text)  # 404: key_nope
            else:
                err = error_of(r, 403, "forbidden")
                assert repr(needed) in err["message"] and scope in err["message"], err
        if scope != "jobs:write" and scope != "admin":
            # The scope is refused before the body is read: neither a bad body (422) nor a huge one (413) is
            # looked at.
            error_of(c.post("/jobs", json={"colour": "blue"}), 403, "forbidden")
            big = c.post("/jobs", content=b" " * (20 * 1024 * 1024), headers={"content-type": "application/json"})
            error_of(big, 403, "forbidden")


def admin_db(apis: list[ApiProcess]) -> str:
    return apis[0].env["FT_DATABASE_URL"].replace("+psycopg", "")


# -- revoked and expired keys --


def test_a_revoked_key_is_refused_by_every_api_process_at_once(apis: list[ApiProcess], admin: httpx.Client,
                                                               new_key: Callable[..., tuple[str, str]]) -> None:
    key_id, key = new_key("team-r", "jobs:read")
    for api in apis:  # cached in both processes now
        for _ in range(3):
            assert httpx.get(api.url + "/jobs", headers=auth(key)).status_code == 200
    r = admin.delete(f"/keys/{key_id}")
    assert r.status_code == 200 and r.json()["revoked"] is True and "key" not in r.json()
    # The revoking process answers 401 from its next request on: it dropped the key itself.
    error_of(httpx.get(apis[0].url + "/jobs", headers=auth(key)), 401, "unauthorized")
    # The other one within a second, by the notification (its cache would keep the key for 5 minutes).
    started = time.monotonic()
    wait_for(lambda: httpx.get(apis[1].url + "/jobs", headers=auth(key)).status_code == 401, 3,
             "the other API process to refuse the revoked key")
    assert time.monotonic() - started < 3
    listed = {k["id"]: k for k in admin.get("/keys", params={"owner": "team-r"}).json()["data"]}
    assert listed[key_id]["revoked"] and listed[key_id]["revoked_at"] and "key" not in listed[key_id]
    assert admin.delete(f"/keys/{key_id}").status_code == 200  # twice changes nothing
    error_of(admin.delete("/keys/key_missing"), 404, "not_found")


def test_an_expired_key_is_refused(apis: list[ApiProcess], admin: httpx.Client,
                                   new_key: Callable[..., tuple[str, str]], database: str) -> None:
    soon = datetime.now(timezone.utc) + timedelta(seconds=3)
    _, key = new_key("team-e", "jobs:read", expires_at=soon.isoformat())
    for api in apis:
        assert httpx.get(api.url + "/jobs", headers=auth(key)).status_code == 200  # cached from here on
    time.sleep(max(0.0, (soon - datetime.now(timezone.utc)).total_seconds()) + 0.2)
    for api in apis:  # a cached key does not outlive its expiry
        error_of(httpx.get(api.url + "/jobs", headers=auth(key)), 401, "unauthorized")
    expired = fixed_key("expiredlongago")
    add_key(database, expired, "team-e", ("admin",), expires_at=datetime(2020, 1, 1, tzinfo=timezone.utc))
    error_of(httpx.get(apis[0].url + "/jobs", headers=auth(expired)), 401, "unauthorized")
    past = admin.post("/keys", json={"owner": "team-e", "scopes": ["jobs:read"], "expires_at": "2020-01-01T00:00:00Z"})
    assert error_of(past, 422, "invalid_request")["field"] == "expires_at"


def test_a_key_name_postgres_cannot_store_is_a_422_naming_it_and_makes_no_key(admin: httpx.Client) -> None:
    for name, why in (("a\u0000b", "NUL"), ("a\ud800b", "unicode")):
        r = admin.post("/keys", content=json.dumps({"owner": "team-nul", "scopes": ["jobs:read"], "name": name}),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert "name" in r.text and why in r.text, r.text
    assert admin.get("/keys", params={"owner": "team-nul"}).json()["data"] == []


def test_keys_record_when_they_were_last_used(apis: list[ApiProcess], admin: httpx.Client,
                                              new_key: Callable[..., tuple[str, str]]) -> None:
    key_id, key = new_key("team-u", "jobs:read")
    assert httpx.get(apis[0].url + "/jobs", headers=auth(key)).status_code == 200

    def used() -> str | None:
        keys = admin.get("/keys", params={"owner": "team-u"}).json()["data"]
        return next(k["last_used_at"] for k in keys if k["id"] == key_id)

    first = wait_for(used, 10, "last_used_at to be written")
    for _ in range(20):  # at most once a minute per key and process: these write nothing
        httpx.get(apis[0].url + "/jobs", headers=auth(key))
    time.sleep(0.5)
    assert used() == first


# -- quotas: concurrent submits stop exactly at the limit --


def burst(apis: list[ApiProcess], key: str, bodies: list[dict[str, Any]],
          headers: dict[str, str] | None = None) -> list[httpx.Response]:
    """Every body submitted at the same moment, alternately through both API processes."""
    gate = threading.Barrier(len(bodies))
    clients = [client(apis[i % 2], key) for i in range(len(bodies))]

    def one(i: int) -> httpx.Response:
        gate.wait()
        return clients[i].post("/jobs", json=bodies[i], headers=headers or {})

    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(one, range(len(bodies))))
    finally:
        for c in clients:
            c.close()


def test_concurrent_submits_stop_exactly_at_the_job_quota(apis: list[ApiProcess], admin: httpx.Client,
                                                          new_key: Callable[..., tuple[str, str]]) -> None:
    _, key = new_key("team-q", "jobs:write")
    assert admin.put("/owners/team-q/quota", json={"max_active_jobs": 5}).json()["max_active_jobs"] == 5
    queue = parked()
    answers = burst(apis, key, [job_body(queue, f"q{i}") for i in range(30)])
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [201] * 5 + [429] * 25, statuses
    err = error_of(next(r for r in answers if r.status_code == 429), 429, "quota_exceeded")
    assert err["field"] == "max_active_jobs"
    assert "max_active_jobs is 5" in err["message"] and "5 unfinished jobs" in err["message"] \
        and "1 more" in err["message"], err
    quota = admin.get("/owners/team-q/quota").json()
    assert quota["usage"] == {"active_jobs": 5, "gpus": 5, "stored_bytes": 0}
    # A refused submit left nothing behind; an ended job frees its slot.
    with client(apis[0], key) as c:
        assert len(c.get("/jobs", params={"limit": 200}).json()["data"]) == 5
        first = next(r.json()["id"] for r in answers if r.status_code == 201)
        assert c.post(f"/jobs/{first}/cancel").status_code == 202
        assert c.post("/jobs", json=job_body(queue)).status_code == 201
        error_of(c.post("/jobs", json=job_body(queue)), 429, "quota_exceeded")


def test_concurrent_submits_stop_exactly_at_the_gpu_quota(apis: list[ApiProcess], admin: httpx.Client,
                                                          new_key: Callable[..., tuple[str, str]]) -> None:
    _, key = new_key("team-g", "jobs:write")
    admin.put("/owners/team-g/quota", json={"max_active_jobs": 100, "max_gpus": 5})
    answers = burst(apis, key, [job_body(parked(), f"g{i}", num_gpus=2) for i in range(12)])
    assert sorted(r.status_code for r in answers) == [201] * 2 + [429] * 10
    err = error_of(next(r for r in answers if r.status_code == 429), 429, "quota_exceeded")
    assert err["field"] == "max_gpus" and "max_gpus is 5" in err["message"] and "hold 4" in err["message"] \
        and "asks for 2" in err["message"], err
    assert admin.get("/owners/team-g/quota").json()["usage"] == {"active_jobs": 2, "gpus": 4, "stored_bytes": 0}
    # Back to the service default (100 jobs, no GPU limit) with nulls.
    restored = admin.put("/owners/team-g/quota", json={}).json()
    assert restored["max_active_jobs"] == 100 and restored["max_gpus"] is None
    with client(apis[0], key) as c:
        assert c.post("/jobs", json=job_body(parked(), num_gpus=2)).status_code == 201


# -- idempotent submits --


def test_twenty_identical_retries_at_once_make_one_job_and_one_dispatch(
        apis: list[ApiProcess], admin: httpx.Client, new_key: Callable[..., tuple[str, str]], redis_url: str,
        controlplane: Stack, database: str) -> None:
    _, key = new_key("team-i", "jobs:write")
    queue = parked()
    body = job_body(queue, "retried")
    answers = burst(apis, key, [body] * 20, headers={"Idempotency-Key": "nightly-2026-12-03"})
    assert {r.status_code for r in answers} == {201}, [r.text for r in answers if r.status_code != 201]
    assert len({r.content for r in answers}) == 1  # the same bytes, every one
    job_id = answers[0].json()["id"]
    with psycopg.connect(database.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT count(*) FROM jobs WHERE owner = 'team-i'").fetchone()[0] == 1
        # No node serves the parked queue: the one job waits in Postgres, saying why, and nothing is sent.
        wait_for(lambda: conn.execute("SELECT queued_reason FROM jobs WHERE id = %s", (job_id,)).fetchone()[0], 20,
                 "the scheduler to look at the job")
    r = redis.Redis.from_url(redis_url)
    time.sleep(2)  # a message, if any, would be sent within the dispatcher's pass
    assert r.llen(queue) == 0 and not r.keys("node.*"), "a job no node can take is never sent"
    with client(apis[1], key) as c:
        # A later retry, even after the job moved on, gets the first answer again.
        assert c.post(f"/jobs/{job_id}/cancel").status_code == 202
        again = c.post("/jobs", json=body, headers={"Idempotency-Key": "nightly-2026-12-03"})
        assert again.status_code == 201 and again.content == answers[0].content
        # The same key with another body is a conflict, and creates nothing.
        other = c.post("/jobs", json=job_body(queue, "different"), headers={"Idempotency-Key": "nightly-2026-12-03"})
        assert "different body" in error_of(other, 409, "idempotency_conflict")["message"]
        error_of(c.post("/jobs", json=body, headers={"Idempotency-Key": "has space"}), 422, "invalid_request")
    # Keys are per owner: another team's same key is its own submit.
    _, key2 = new_key("team-i2", "jobs:write")
    with client(apis[0], key2) as c2:
        theirs = c2.post("/jobs", json=body, headers={"Idempotency-Key": "nightly-2026-12-03"})
        assert theirs.status_code == 201 and theirs.json()["id"] != job_id
    # Kept at least 24 h: a day-old-less-an-hour key still answers; one past its time is a new submit.
    with psycopg.connect(database.replace("+psycopg", ""), autocommit=True) as conn, client(apis[0], key) as c:
        conn.execute("UPDATE idempotency_keys SET created_at = now() - interval '23 hours' WHERE owner = 'team-i'")
        assert c.post("/jobs", json=body, headers={"Idempotency-Key": "nightly-2026-12-03"}).json()["id"] == job_id
        conn.execute("UPDATE idempotency_keys SET created_at = now() - interval '25 hours' WHERE owner = 'team-i'")
        fresh = c.post("/jobs", json=body, headers={"Idempotency-Key": "nightly-2026-12-03"})
        assert fresh.status_code == 201 and fresh.json()["id"] != job_id


def test_a_refused_submit_stores_no_answer_for_its_key(apis: list[ApiProcess], admin: httpx.Client,
                                                       new_key: Callable[..., tuple[str, str]]) -> None:
    _, key = new_key("team-iq", "jobs:write")
    admin.put("/owners/team-iq/quota", json={"max_active_jobs": 0})
    with client(apis[0], key) as c:
        headers = {"Idempotency-Key": "k1"}
        error_of(c.post("/jobs", json=job_body(parked()), headers=headers), 429, "quota_exceeded")
        admin.put("/owners/team-iq/quota", json={"max_active_jobs": 1})
        assert c.post("/jobs", json=job_body(parked()), headers=headers).status_code == 201  # the retry runs now


# -- the audit trail --


def test_submits_cancels_and_key_changes_record_who_did_them(apis: list[ApiProcess], admin: httpx.Client,
                                                             new_key: Callable[..., tuple[str, str]]) -> None:
    start = admin.get("/audit", params={"after": 0, "limit": 1000}).json()
    cursor = start["next_after"]
    while start["has_more"]:
        start = admin.get("/audit", params={"after": cursor, "limit": 1000}).json()
        cursor = start["next_after"]
    key_id, key = new_key("team-audit", "jobs:write")
    admin_id = next(k["id"] for k in admin.get("/keys", params={"owner": "ops"}).json()["data"]
                    if k["prefix"] == ADMIN_KEY[:12])
    with client(apis[1], key) as c:
        job = c.post("/jobs", json=job_body(parked())).json()
        c.post(f"/jobs/{job['id']}/cancel")
        events = c.get(f"/jobs/{job['id']}/events").json()["data"]
        error_of(c.get("/audit"), 403, "forbidden")
    actor = {"key_id": key_id, "owner": "team-audit"}
    assert [(e["status"], e["actor"]) for e in events] == [("queued", actor), ("cancelled", actor)]
    admin.put("/owners/team-audit/quota", json={"max_active_jobs": 3})
    admin.delete(f"/keys/{key_id}")
    entries = admin.get("/audit", params={"after": cursor}).json()["data"]
    seen = [(e["action"], e["subject"], e["actor"]["key_id"], e["actor"]["owner"]) for e in entries]
    assert seen == [("key.create", key_id, admin_id, "ops"), ("job.submit", job["id"], key_id, "team-audit"),
                    ("job.cancel", job["id"], key_id, "team-audit"), ("quota.set", "team-audit", admin_id, "ops"),
                    ("key.revoke", key_id, admin_id, "ops")], seen
    assert entries[0]["data"]["scopes"] == ["jobs:write"] and entries[3]["data"]["max_active_jobs"] == 3
    ids = [e["id"] for e in entries]
    assert ids == sorted(ids) and admin.get("/audit", params={"after": ids[-1]}).json()["data"] == []


# -- the operator's bootstrap --


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.admin.keys", *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_the_cli_makes_the_first_admin_key_and_revokes_keys(apis: list[ApiProcess], env: dict[str, str]) -> None:
    made = cli(env, "create", "--owner", "platform", "--scopes", "admin", "--name", "bootstrap")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()  # the key alone on stdout: KEY=$(python -m api.admin.keys create ...)
    assert key.startswith("ftk_") and len(key) == 47 and "\n" not in key
    assert "owner 'platform'" in made.stderr and "shown this once" in made.stderr
    with client(apis[1], key) as c:
        created = c.post("/keys", json={"owner": "team-c", "scopes": ["jobs:read"], "name": "ci"})
        assert created.status_code == 201
        mine = next(k for k in c.get("/keys", params={"owner": "platform"}).json()["data"] if k["name"] == "bootstrap")
        assert mine["created_by"] is None and mine["scopes"] == ["admin"] and mine["prefix"] == key[:12]
    listed = cli(env, "list", "--owner", "platform")
    assert listed.returncode == 0 and mine["id"] in listed.stdout and key not in listed.stdout
    assert cli(env, "revoke", mine["id"]).returncode == 0
    wait_for(lambda: httpx.get(apis[1].url + "/jobs", headers=auth(key)).status_code == 401, 3,
             "the key revoked by the CLI to be refused (the table's trigger notifies)")
    bad = cli(env, "create", "--owner", "platform", "--scopes", "root")
    assert bad.returncode != 0 and "jobs:read, jobs:write, admin" in bad.stderr
    assert cli(env, "revoke", "key_nope").returncode == 1


def test_the_dev_stack_makes_its_key_once(env: dict[str, str], tmp_path: Path) -> None:
    """`make up` and `make demo` run ensure_dev_key: a working key is reused, a revoked one replaced."""
    code = ("import sys; from pathlib import Path; from scripts.stack import ensure_dev_key; "
            "print(ensure_dev_key(Path(sys.argv[1])))")
    path = tmp_path / "dev-key"

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    first = run()
    assert path.read_text().strip() == first and path.stat().st_mode & 0o777 == 0o600
    assert run() == first
    with psycopg.connect(env["FT_DATABASE_URL"].replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("UPDATE api_keys SET revoked_at = now() WHERE prefix = %s", (first[:12],))
    assert run() != first


def test_development_requires_keys_unless_anonymous_is_allowed(env: dict[str, str], tmp_path: Path) -> None:
    dev = {**env, "FT_ENV": "development"}
    keyed = ApiProcess(dev, tmp_path / "dev.log").start()
    try:  # the dev stack (`make up`) requires keys like production
        error_of(httpx.get(keyed.url + "/jobs"), 401, "unauthorized")
    finally:
        keyed.stop()
    open_ = ApiProcess({**dev, "FT_ALLOW_ANONYMOUS": "true"}, tmp_path / "open.log").start()
    try:  # no header: an admin of `default`; a header is still checked
        with httpx.Client(base_url=open_.url, timeout=30) as c:
            job = c.post("/jobs", json=job_body(parked(), "anonymous"))
            assert job.status_code == 201 and job.json()["owner"] == "default", job.text
            assert c.get("/keys").status_code == 200
            first = c.get(f"/jobs/{job.json()['id']}/events").json()["data"][0]
            assert first["actor"] == {"key_id": None, "owner": "default"}
            error_of(c.get("/jobs", headers=auth(fixed_key("nosuchkey"))), 401, "unauthorized")
    finally:
        open_.stop()
