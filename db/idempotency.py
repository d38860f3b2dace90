"""Idempotent submits: the first successful answer to `POST /jobs` with an `Idempotency-Key` is stored, and
every retry with the same key and body gets it again (same status, same bytes); the same key with another
body is a 409. Keys are per owner (two teams may use the same one) and kept FT_IDEMPOTENCY_HOURS (at least
24 h).

Concurrency: the key's row is claimed with an insert inside the submit's transaction. A concurrent retry's
insert waits on the unique index until that transaction ends: if it committed, the retry reads the stored
answer; if it rolled back (a refused submit stores nothing), the retry claims the key and submits itself.
So twenty identical requests at once make one job.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import asyncpg

from db import jsonw
from db import pool as pg
from db.errors import IdempotencyConflict

log = logging.getLogger(__name__)

HEADER = "Idempotency-Key"
PURGE_SECONDS = 600.0

# Claims the key: a new row, or an expired one taken over. Returns nothing when a live row holds it.
CLAIM = """
INSERT INTO idempotency_keys (owner, key, request_hash, created_at) VALUES ($1, $2, $3, now())
ON CONFLICT (owner, key) DO UPDATE
    SET request_hash = EXCLUDED.request_hash, job_id = NULL, status_code = NULL, response = NULL, created_at = now()
    WHERE idempotency_keys.created_at < now() - make_interval(secs => $4)
RETURNING 1"""
STORED = "SELECT request_hash, status_code, response FROM idempotency_keys WHERE owner = $1 AND key = $2"
REMEMBER = "UPDATE idempotency_keys SET job_id = $3, status_code = $4, response = $5 WHERE owner = $1 AND key = $2"
PURGE = "DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(secs => $1)"


def request_hash(request: dict[str, Any]) -> bytes:
    """The body as parsed, with sorted keys: a retry that re-serialises the same JSON differently is the same."""
    return hashlib.sha256(jsonw.dumps(request, sort_keys=True).encode()).digest()


class Replay(Exception):
    """The key was used before with this body: answer what was answered then."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


async def claim(conn: asyncpg.Connection, *, owner: str, key: str, hashed: bytes, keep_hours: float) -> None:
    """Within the submit's transaction: claim the key, or raise Replay (same body) or IdempotencyConflict (another
    body). A key is kept `keep_hours`."""
    if await conn.fetchval(CLAIM, owner, key, hashed, keep_hours * 3600.0):
        return
    row = await conn.fetchrow(STORED, owner, key)
    if row is None:  # taken over and purged in between: rare; the client's retry will claim it
        raise IdempotencyConflict(f"the {HEADER} {key!r} is in use; retry", HEADER)
    if bytes(row["request_hash"]) != hashed:
        raise IdempotencyConflict(f"the {HEADER} {key!r} was used with a different body; a retry must send the "
                                  "same body, a new request a new key", HEADER)
    raise Replay(row["status_code"], row["response"].encode())


async def remember(conn: asyncpg.Connection, *, owner: str, key: str, job_id: str, status: int, body: str) -> None:
    await conn.execute(REMEMBER, owner, key, job_id, status, body)


async def purge_forever(keep_hours: float) -> None:
    """Every few minutes, drop keys past their time. Every API process does it; the deletes are idempotent."""
    while True:
        await asyncio.sleep(PURGE_SECONDS)
        try:
            await (await pg.pool()).execute(PURGE, keep_hours * 3600.0)
        except Exception as exc:  # the next pass tries again
            log.warning("could not purge expired idempotency keys: %s", type(exc).__name__)
