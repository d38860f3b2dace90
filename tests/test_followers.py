"""Many live followers of one job: every event to each, exactly once, in order; none holds a database
connection while it waits; a follower that stops reading holds up nobody else."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

import httpx
import psycopg

from tests.helpers import events_of, wait_for, wait_status

FOLLOWERS = 200


async def follow(host: str, port: int, job_id: str, last_event_id: int | None = None) -> list[int]:
    """A lean SSE client: the ids of the events it got until the server ended the stream."""
    reader, writer = await asyncio.open_connection(host, port)
    resume = f"Last-Event-ID: {last_event_id}\r\n" if last_event_id is not None else ""
    writer.write(f"GET /jobs/{job_id}/events HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n{resume}"
                 "Connection: close\r\n\r\n".encode())
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
    ids: list[int] = []
    async for raw in reader:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data: {"):
            ids.append(json.loads(line[6:])["id"])
    writer.close()
    return ids


def api_connections(database_url: str) -> int:
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        return int(conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                "AND application_name = 'ft-api'").fetchone()[0])


def test_many_followers_each_get_every_event_once_without_holding_connections(
        api: httpx.Client, make_job: Any, stack: Any, stack_env: dict[str, str]) -> None:
    url = urlparse(stack.api_url)
    job = api.post("/jobs", json=make_job(name="followed", hyperparameters={"max_steps": 24})).json()
    # A follower that reads nothing: its socket buffers fill and its stream stalls; nobody else's may.
    stuck = socket.create_connection((url.hostname, url.port))
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(f"GET /jobs/{job['id']}/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n".encode())

    async def everyone() -> tuple[list[list[int]], int]:
        tasks = [asyncio.create_task(follow(url.hostname, url.port, job["id"])) for _ in range(FOLLOWERS)]
        await asyncio.sleep(3)  # all connected, the job starting or running
        peak = await asyncio.to_thread(api_connections, stack_env["FT_DATABASE_URL"])
        return await asyncio.wait_for(asyncio.gather(*tasks), 400), peak

    started = time.monotonic()
    seen, connections = asyncio.run(everyone())
    elapsed = time.monotonic() - started
    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=30)
    assert final["status"] == "succeeded", final["error"]
    stored = [e["id"] for e in events_of(api, job["id"])]
    assert all(ids == stored for ids in seen), (
        f"{sum(ids != stored for ids in seen)} of {FOLLOWERS} followers did not get every event once, in order")
    # Followers share the API's small pools; they do not take a connection each.
    assert connections <= 2 * 10, f"{connections} database connections for {FOLLOWERS} followers"
    assert elapsed < 300
    stuck.close()

    # A late follower resuming from the middle gets exactly the rest.
    middle = stored[len(stored) // 2]
    rest = asyncio.run(follow(url.hostname, url.port, job["id"], last_event_id=middle))
    assert rest == [i for i in stored if i > middle]
    wait_for(lambda: api.get("/healthz").status_code == 200, 5, "the API to stay healthy")


def _insert_event(database_url: str, job_id: str, note: str) -> int:
    """Appends an event as the ingester does (the row's counter locked, the next sequence number)."""
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=False) as conn:
        seq = conn.execute("UPDATE jobs SET event_seq = event_seq + 1 WHERE id = %s RETURNING event_seq",
                           (job_id,)).fetchone()[0]
        conn.execute("INSERT INTO job_events (job_id, seq, attempt, type, data, created_at) "
                     "VALUES (%s, %s, 1, 'log', %s, now())", (job_id, seq, json.dumps({"line": note})))
        conn.commit()
    return int(seq)


def listen_backend_pids(database_url: str, terminate: bool = False) -> list[int]:
    """The pids of the API processes' LISTEN connections' backends (terminated, if asked)."""
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        fn = ", pg_terminate_backend(pid)" if terminate else ""
        return [r[0] for r in conn.execute(f"SELECT pid{fn} FROM pg_stat_activity WHERE datname = current_database() "
                                           "AND application_name = 'ft-api-listen'").fetchall()]


def _listen_backends(database_url: str, terminate: bool = False) -> int:
    return len(listen_backend_pids(database_url, terminate))


def test_followers_are_woken_by_notifications_and_poll_while_the_listener_is_cut_off(
        api: httpx.Client, make_job: Any, stack: Any, stack_env: dict[str, str]) -> None:
    """An event reaches a follower within a second through `ft_events` (the feed's own look comes only
    every 2 s with notifications flowing, so eight arrivals under a second each do not happen by polling:
    odds 1 in 256); with the LISTEN connection killed, events still arrive (100 ms polling, then the
    re-opened listener)."""
    db = stack_env["FT_DATABASE_URL"]
    url = urlparse(stack.api_url)
    job = api.post("/jobs", json=make_job(name="notified", resources={"queue": "nobody-serves-this"})).json()

    async def scenario() -> list[float]:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(f"GET /jobs/{job['id']}/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n"
                     "Connection: close\r\n\r\n".encode())
        await writer.drain()
        assert b" 200 " in await reader.readline()

        async def until(seq: int) -> None:
            async for raw in reader:
                if raw.startswith(b"id: ") and int(raw[4:]) >= seq:
                    return

        await asyncio.wait_for(until(1), 10)  # the stored `queued` event: the follower is live
        delays = []
        for phase in ("listening", "cut off", "re-listening"):
            if phase == "cut off":
                assert await asyncio.to_thread(_listen_backends, db, True) >= 1
            if phase == "re-listening":
                deadline = time.monotonic() + 15
                while await asyncio.to_thread(_listen_backends, db) == 0:
                    assert time.monotonic() < deadline, "the API never listened again"
                    await asyncio.sleep(0.1)
            for i in range(8 if phase != "cut off" else 3):
                await asyncio.sleep(0.3)
                sent = time.monotonic()
                seq = await asyncio.to_thread(_insert_event, db, job["id"], f"{phase} {i}")
                await asyncio.wait_for(until(seq), 10)
                delays.append(time.monotonic() - sent)
        writer.close()
        return delays

    delays = asyncio.run(scenario())
    assert max(delays) < 1.0, [round(d, 3) for d in delays]
    assert api.post(f"/jobs/{job['id']}/cancel").status_code == 202


def test_an_idle_stream_gets_a_keep_alive_then_the_next_event(api: httpx.Client, make_job: Any, stack: Any,
                                                              stack_env: dict[str, str]) -> None:
    """A follower of a job with nothing new gets an SSE comment every ~15 s (so proxies keep the stream), woken
    by its feed's tick rather than a timer of its own, and still gets the next event at once."""
    url = urlparse(stack.api_url)
    job = api.post("/jobs", json=make_job(name="quiet", resources={"queue": "parked-keepalive"})).json()

    async def read_until(reader: asyncio.StreamReader, marker: bytes, seconds: float) -> float:
        buf, start = b"", time.monotonic()
        while marker not in buf:
            buf += await asyncio.wait_for(reader.read(4096), start + seconds - time.monotonic())
        return time.monotonic() - start

    async def quiet_stream() -> tuple[float, float]:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(f"GET /jobs/{job['id']}/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n"
                     .encode())
        await read_until(reader, b"id: 1\n", 10)  # the first event (queued), then nothing
        kept = await read_until(reader, b": keep-alive\n\n", 40)
        seq = await asyncio.to_thread(_insert_event, stack_env["FT_DATABASE_URL"], job["id"], "after the quiet")
        woke = await read_until(reader, f"id: {seq}\n".encode(), 10)
        writer.close()
        return kept, woke

    kept, woke = asyncio.run(quiet_stream())
    assert 14 <= kept <= 40, kept  # KEEPALIVE_SECONDS (15) after the last write, plus at most a tick or two
    assert woke < 5, woke
    api.post(f"/jobs/{job['id']}/cancel")


def test_a_fan_out_lets_other_work_run_between_batches() -> None:
    """An event's fan-out wakes followers WAKE_BATCH per event-loop turn: work that became ready meanwhile (a
    request to another route) runs after one batch, not after every follower; a follower that left while it
    waited is skipped; every other follower is woken."""
    from api import feeds

    async def scenario() -> tuple[int, list[int]]:
        feed = feeds.Feed("job_fanout")
        woken: list[int] = []

        async def follower(i: int) -> None:
            await feed.changed()
            woken.append(i)

        tasks = [asyncio.create_task(follower(i)) for i in range(5 * feeds.WAKE_BATCH)]
        await asyncio.sleep(0)  # every follower is waiting
        tasks[3].cancel()  # its client left
        await asyncio.sleep(0)
        seen_by_request: list[int] = []

        async def request() -> None:
            await asyncio.sleep(0)  # ready while the fan-out runs, as a request read off a socket would be
            seen_by_request.append(len(woken))

        announce = asyncio.create_task(feed._announce())
        other = asyncio.create_task(request())
        await asyncio.gather(announce, other, *tasks, return_exceptions=True)
        return seen_by_request[0], woken

    before_request, woken = asyncio.run(scenario())
    assert before_request <= feeds.WAKE_BATCH, before_request  # woken all at once, it would see 319
    assert sorted(woken) == [i for i in range(5 * feeds.WAKE_BATCH) if i != 3]
