"""The API's Postgres pool (db/pool.py) after a connection broke mid-operation: the error is a 503 to retry, never a
500, and the connections opened before it are replaced rather than handed out again.

asyncpg's "cannot switch to state ...; another operation is in progress" came from a connection whose link broke
while Postgres restarted under the soak (soak/, seed 134); it cannot be provoked on demand, so the error is raised
here as the driver raises it, and what the pool then does with its real connections is checked."""

from __future__ import annotations

import asyncio

import pytest

from db import pool as pg
from db.errors import Unavailable

BROKEN = pg.BROKEN_CONNECTION("cannot switch to state 12; another operation (2) is in progress")


def test_a_broken_connection_is_unavailable_and_every_older_connection_is_replaced(database: str) -> None:
    async def run() -> tuple[set[int], set[int], int]:
        pg.configure(database_url=database, pool_size=2)
        try:
            p = await pg.pool()
            async with p.acquire() as a, p.acquire() as b:
                before = {a.get_server_pid(), b.get_server_pid()}
            with pytest.raises(Unavailable):
                try:
                    raise BROKEN
                except pg.UNREACHABLE as exc:
                    raise pg.unavailable(exc) from exc
            await asyncio.sleep(0)  # the expiry is the loop's next turn
            async with p.acquire() as a, p.acquire() as b:
                after = {a.get_server_pid(), b.get_server_pid()}
            return before, after, await pg.fetchval("SELECT 1")
        finally:
            await pg.close()

    before, after, one = asyncio.run(run())
    assert one == 1 and len(before) == 2
    assert not before & after, "a connection opened before the break was handed out again"


def test_the_api_answers_a_broken_connection_503_with_retry_after() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from api.errors import install

    app = FastAPI()

    @app.get("/broken")
    async def broken() -> None:
        raise BROKEN

    install(app, app.routes)

    r = TestClient(app, raise_server_exceptions=False).get("/broken")
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0, (r.status_code, r.text)
