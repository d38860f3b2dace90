"""The webhook outbox's statements (`webhook_deliveries`), for the deliverer (controlplane/deliverer.py): claim the
due rows a pass may send, and record each outcome. They run on the deliverer's own asynchronous psycopg connection
(the control plane's one driver), each in a short transaction of its own, written with `$n` parameters as every
statement in db/ is and sent as written (psycopg's raw cursor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from db.urls import dsn

Connection = psycopg.AsyncConnection[Any]

# Due rows, never one whose job has an earlier pending delivery; then, per receiver, only as many as it has
# free slots ($1/$2: receivers with deliveries in flight and how many; $3: the per-receiver bound), at most $4. The
# rows chosen are leased ($5 seconds) and their attempt counted in the same statement.
CLAIM = """
WITH candidates AS (
    SELECT d.id, d.receiver, d.next_attempt_at FROM webhook_deliveries AS d
    WHERE d.status = 'pending' AND d.next_attempt_at <= now()
      AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS e
                      WHERE e.job_id = d.job_id AND e.status = 'pending' AND e.event_seq < d.event_seq)
    ORDER BY d.next_attempt_at, d.id LIMIT 500
    FOR UPDATE OF d SKIP LOCKED
), ranked AS (
    SELECT c.id, c.next_attempt_at, row_number() OVER (PARTITION BY c.receiver ORDER BY c.next_attempt_at, c.id)
           + coalesce(busy.used, 0) AS slot
    FROM candidates AS c LEFT JOIN unnest($1::text[], $2::int[]) AS busy(receiver, used)
         ON busy.receiver = c.receiver
), chosen AS (
    SELECT id FROM ranked WHERE slot <= $3 ORDER BY next_attempt_at, id LIMIT $4
)
UPDATE webhook_deliveries AS w
SET attempts = w.attempts + 1, last_attempt_at = now(), next_attempt_at = now() + make_interval(secs => $5::float8)
FROM chosen WHERE w.id = chosen.id
RETURNING w.id, w.url, w.receiver, w.event, w.payload::text, w.attempts, w.owner,
          (SELECT o.secret FROM webhook_owners AS o WHERE o.owner = w.owner)"""
DELIVERED = """
UPDATE webhook_deliveries SET status = 'delivered', delivered_at = now(), last_status_code = $2,
    last_error = NULL, next_attempt_at = NULL
WHERE id = $1 AND status = 'pending'"""
FAILED = """
UPDATE webhook_deliveries SET last_status_code = $2, last_error = $3,
    status = CASE WHEN attempts >= $4 THEN 'failed' ELSE 'pending' END,
    next_attempt_at = CASE WHEN attempts >= $4 THEN NULL ELSE now() + make_interval(secs => $5::float8) END
WHERE id = $1 AND status = 'pending'"""


@dataclass(frozen=True)
class Claimed:
    id: str
    url: str
    receiver: str
    event: str
    body: bytes
    attempts: int
    owner: str
    secret: str | None  # sealed, as stored


async def connect(database_url: str) -> Connection:
    """A connection of its own for the deliverer (autocommit: each statement or `transaction()` commits)."""
    return await psycopg.AsyncConnection.connect(dsn(database_url), autocommit=True, connect_timeout=5,
                                                 cursor_factory=psycopg.AsyncRawCursor)


async def claim(conn: Connection, *, in_flight: dict[str, int], per_receiver: int, limit: int,
                lease: float) -> list[Claimed]:
    """Claim (lease for `lease` seconds, attempt counted, committed) up to `limit` due rows: never one whose job
    has an earlier pending delivery, and per receiver only as many as `per_receiver` less its `in_flight`."""
    busy = [r for r, n in in_flight.items() if n > 0]
    async with conn.transaction():
        cur = await conn.execute(CLAIM, (busy, [in_flight[r] for r in busy], per_receiver, limit, lease))
        rows = await cur.fetchall()
    return [Claimed(id=r[0], url=r[1], receiver=r[2], event=r[3], body=r[4].encode(), attempts=r[5], owner=r[6],
                    secret=r[7]) for r in rows]


async def delivered(conn: Connection, delivery_id: str, code: int | None) -> None:
    await conn.execute(DELIVERED, (delivery_id, code))


async def failed(conn: Connection, delivery_id: str, *, code: int | None, error: str,
                 give_up_at: int, wait: float) -> None:
    """Record a failed attempt: retried after `wait` seconds, or given up once `give_up_at` attempts were made."""
    await conn.execute(FAILED, (delivery_id, code, error, give_up_at, wait))
