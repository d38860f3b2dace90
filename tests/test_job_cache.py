"""GET /jobs/{id} is served from each API process's cache, and never older than Postgres: a change made behind
the API's back (straight in the database, as the ingester or the reaper make them) is seen by the very next
read in every process, also while the notifications are held up on their way, and while the processes'
LISTEN connections are cut."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import asyncpg
import httpx
import psycopg

from tests.test_followers import _listen_backends, listen_backend_pids


def _set_metadata(database_url: str, job_id: str, value: str) -> None:
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("UPDATE jobs SET metadata = jsonb_build_object('mark', %s::text) WHERE id = %s", (value, job_id))


def _seen_at_once_everywhere(api: httpx.Client, job_id: str, value: str) -> None:
    """The first GET after the change shows `value`, and so do 30 more (every API process answers some)."""
    marks = [api.get(f"/jobs/{job_id}").json()["metadata"].get("mark") for _ in range(31)]
    assert marks == [value] * 31, marks


def test_a_cached_job_changes_as_soon_as_its_row_does(api: httpx.Client, make_job: Any,
                                                      stack_env: dict[str, str]) -> None:
    db = stack_env["FT_DATABASE_URL"]
    job = api.post("/jobs", json=make_job(name="cached", resources={"queue": "nobody-serves-this"})).json()
    for i in range(10):
        for _ in range(20):  # warm every process's cache with the current row
            api.get(f"/jobs/{job['id']}")
        _set_metadata(db, job["id"], f"v{i}")
        # The very next read, far under the cache's 30 s age limit: a process serves a hit only once it has
        # been told of every change committed before the request came.
        _seen_at_once_everywhere(api, job["id"], f"v{i}")

    # The listener cut: what changes meanwhile is notified to no one; the processes read Postgres while
    # they do not listen and empty their caches when they listen again.
    for _ in range(20):
        api.get(f"/jobs/{job['id']}")
    assert _listen_backends(db, terminate=True) >= 1
    _set_metadata(db, job["id"], "while cut off")
    _seen_at_once_everywhere(api, job["id"], "while cut off")
    time.sleep(1.0)  # listening again by now: the caches fill again and must still follow the row
    for _ in range(20):
        api.get(f"/jobs/{job['id']}")
    _set_metadata(db, job["id"], "after")
    _seen_at_once_everywhere(api, job["id"], "after")
    assert api.post(f"/jobs/{job['id']}/cancel").status_code == 202
    assert api.get(f"/jobs/{job['id']}").json()["status"] == "cancelled"


def test_a_read_waits_for_notifications_held_up_on_the_way(api: httpx.Client, make_job: Any,
                                                          stack_env: dict[str, str]) -> None:
    """The API processes' listening backends are frozen (SIGSTOP: a stalled Postgres process, or notifications
    still on their way on a loaded host) while the row changes. A cached read must not answer with the old
    row: it waits for its round trip on the listening connection, which is answered after the notifications."""
    db = stack_env["FT_DATABASE_URL"]
    job = api.post("/jobs", json=make_job(name="held", resources={"queue": "nobody-serves-this"})).json()
    pids = listen_backend_pids(db)
    assert pids, "no listening backend"
    for round_ in range(3):
        for _ in range(20):
            api.get(f"/jobs/{job['id']}")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            _set_metadata(db, job["id"], f"held {round_}")
            with ThreadPoolExecutor(4) as pool:
                reads = [pool.submit(lambda: api.get(f"/jobs/{job['id']}").json()["metadata"].get("mark"))
                         for _ in range(4)]
                time.sleep(0.5)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                marks = [r.result(timeout=20) for r in reads]
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert marks == [f"held {round_}"] * 4, marks


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Return once `predicate()` holds, or after `timeout` (the caller's assertion then says what failed)."""
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        await asyncio.sleep(0.01)


def test_a_channel_subscribed_on_a_live_connection_is_trusted_only_once_it_is_listened_to(
        stack_env: dict[str, str], monkeypatch: Any) -> None:
    """The listener is already up for one channel when a cache subscribes another (the first request after
    start-up does that). Until that channel's LISTEN has run, a change on it is notified to no one, so
    `listening(channel)` must say False meanwhile, and the channel's on_connect must run once it is heard
    (a cache drops what it read before). Once heard, every change is delivered."""
    from api.settings import get_settings
    from db import pool as pg

    monkeypatch.setenv("FT_DATABASE_URL", stack_env["FT_DATABASE_URL"])
    get_settings.cache_clear()

    async def scenario() -> None:
        listener = pg.Listener()
        got: list[str] = []
        heard: list[str] = []
        listener.subscribe("ft_test_first", got.append)
        await _until(lambda: listener.connected)
        assert listener.connected and listener.active == {"ft_test_first"}
        listener.subscribe("ft_test_second", got.append, on_connect=lambda: heard.append("second"))
        # Connected, but the new channel's LISTEN has not run yet: not to be trusted.
        assert "ft_test_second" not in listener.active and heard == []
        await _until(lambda: "ft_test_second" in listener.active)
        assert heard == ["second"]
        conn = await asyncpg.connect(pg.dsn(stack_env["FT_DATABASE_URL"]))
        try:
            await conn.execute("SELECT pg_notify('ft_test_second', 'after')")
        finally:
            await conn.close()
        await _until(lambda: bool(got))
        assert got == ["after"]
        await listener.stop()

    try:
        asyncio.run(scenario())
    finally:
        get_settings.cache_clear()
