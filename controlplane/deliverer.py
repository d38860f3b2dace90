"""Sends the webhook outbox (`webhook_deliveries`): a thread of the control plane with its own event loop.

Like the dispatcher (controlplane/dispatcher.py) it wakes on a notification (`ft_webhooks`, a trigger on insert) and
looks anyway every POLL_SECONDS. A pass claims due rows with FOR UPDATE SKIP LOCKED and commits the claim
(attempt counted, the row leased until the delivery's deadline has passed) before any request is sent, so no
transaction stays open while a receiver thinks, and a control plane that dies mid-send retries the row once
its lease ends. Each claimed row is sent by a task of its own with an asynchronous HTTP client and one deadline
for the whole request; its outcome is written in a short transaction of its own.

A slow or dead receiver slows nothing else: the API and the ingester never wait for a delivery (they only
insert rows), at most `webhook_per_receiver` deliveries are in flight to one receiver (scheme, host, port)
and `webhook_concurrency` in all, and a pass claims rows only for receivers with a free slot. One job's events
go out in order: a delivery waits while an earlier one of its job is pending (in flight or backing off). A
delivery that keeps failing backs off exponentially with jitter and is given up after `webhook_max_attempts`,
which frees the job's later events.

Every attempt resolves the host again and checks each address against the SSRF rules (core/webhooks.py) and
then connects to the address it checked, naming the host only in `Host` and TLS's server name: a name that
now resolves somewhere internal (DNS rebinding) is refused, not called.

The owner's secret is read sealed with the claimed row and opened (core/secretbox.py) only to sign that one
request. One that no key in FT_SECRETS_KEY opens fails its delivery at once, the reason in `last_error` and the
log: this process's keys cannot change, so retrying would only fail again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg

from controlplane.ingest import first_line
from controlplane.settings import ControlPlaneSettings
from core import secretbox, webhooks
from db.pool import dsn

log = logging.getLogger(__name__)

CHANNEL = "ft_webhooks"
POLL_SECONDS = 1.0
LEASE_MARGIN_SECONDS = 30.0  # beyond the delivery's own deadline, before a claimed row counts as abandoned
RETRY_MAX_SECONDS = 5.0
USER_AGENT = "ft-webhooks/1"
ERROR_CHARS = 500
UNREADABLE = "the owner's webhook secret cannot be decrypted"

# Due rows, never one whose job has an earlier pending delivery; then, per receiver, only as many as it has
# free slots ($2/$3: receivers with deliveries in flight and how many; $4: the per-receiver bound). The rows
# chosen are leased ($5 seconds) and their attempt counted in the same statement.
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
    FROM candidates AS c LEFT JOIN unnest(%(busy)s::text[], %(used)s::int[]) AS busy(receiver, used)
         ON busy.receiver = c.receiver
), chosen AS (
    SELECT id FROM ranked WHERE slot <= %(per_receiver)s ORDER BY next_attempt_at, id LIMIT %(limit)s
)
UPDATE webhook_deliveries AS w
SET attempts = w.attempts + 1, last_attempt_at = now(), next_attempt_at = now() + make_interval(secs => %(lease)s)
FROM chosen WHERE w.id = chosen.id
RETURNING w.id, w.url, w.receiver, w.event, w.payload::text, w.attempts, w.owner,
          (SELECT o.secret FROM webhook_owners AS o WHERE o.owner = w.owner)"""
DELIVERED = """
UPDATE webhook_deliveries SET status = 'delivered', delivered_at = now(), last_status_code = %(code)s,
    last_error = NULL, next_attempt_at = NULL
WHERE id = %(id)s AND status = 'pending'"""
FAILED = """
UPDATE webhook_deliveries SET last_status_code = %(code)s, last_error = %(error)s,
    status = CASE WHEN attempts >= %(max)s THEN 'failed' ELSE 'pending' END,
    next_attempt_at = CASE WHEN attempts >= %(max)s THEN NULL ELSE now() + make_interval(secs => %(wait)s) END
WHERE id = %(id)s AND status = 'pending'"""


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


def backoff(attempts: int, settings: ControlPlaneSettings) -> float:
    """Seconds before the next try after `attempts` failed ones: doubling from the first pause, capped, and
    jittered (half fixed, half random) so receivers that failed together are not hit together again."""
    ceiling = min(settings.webhook_backoff_max_seconds, settings.webhook_backoff_seconds * 2 ** (attempts - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


class Deliverer:
    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.settings = settings
        self.allow = webhooks.parse_allow_nets(settings.webhook_allow_nets)
        self.keys = secretbox.keyring(settings)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.in_flight: Counter[str] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="deliverer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.webhook_timeout_seconds + 2 * POLL_SECONDS)

    def client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.settings.webhook_concurrency, max_keepalive_connections=0)
        verify: ssl.SSLContext | bool = True
        if self.settings.webhook_ca_file:
            verify = ssl.create_default_context()
            verify.load_verify_locations(self.settings.webhook_ca_file)
        # trust_env off: a proxy from the environment would connect somewhere the address check never saw.
        return httpx.AsyncClient(limits=limits, follow_redirects=False, trust_env=False, verify=verify,
                                 timeout=self.settings.webhook_timeout_seconds)

    async def _run(self) -> None:
        async with self.client() as client:
            pause = 0.5
            while not self._stopping.is_set():
                try:
                    await self._serve(client)
                except Exception as exc:  # Postgres away: wait and look again; rows in flight finish by themselves
                    log.warning("delivering webhooks failed (%s); retrying in %.1f s", first_line(exc), pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, RETRY_MAX_SECONDS)
                else:
                    pause = 0.5
            if self.tasks:
                await asyncio.wait(self.tasks, timeout=self.settings.webhook_timeout_seconds)

    async def _serve(self, client: httpx.AsyncClient) -> None:
        url = dsn(self.settings.database_url)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5) as listen, \
                await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5) as conn:
            await listen.execute(f"LISTEN {CHANNEL}")
            woken = asyncio.Event()
            # LISTEN first, then look: a row committed in between is either claimed now or notified.
            while not self._stopping.is_set():
                woken.clear()
                for row in await self._claim(conn):
                    task = asyncio.create_task(self._deliver(client, row, woken))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                # Look again when notified, when a slot came free, or after POLL_SECONDS (retries come due).
                waiter = asyncio.create_task(woken.wait())
                notified = asyncio.create_task(self._notified(listen))
                await asyncio.wait({waiter, notified}, timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                notified.cancel()
                await asyncio.gather(waiter, notified, return_exceptions=True)

    @staticmethod
    async def _notified(listen: psycopg.AsyncConnection[Any]) -> None:
        async for _ in listen.notifies(timeout=POLL_SECONDS, stop_after=1):
            return

    async def _claim(self, conn: psycopg.AsyncConnection[Any]) -> list[Claimed]:
        free = self.settings.webhook_concurrency - sum(self.in_flight.values())
        if free <= 0:
            return []
        busy = [r for r, n in self.in_flight.items() if n > 0]
        lease = self.settings.webhook_timeout_seconds + webhooks.RESOLVE_TIMEOUT_SECONDS + LEASE_MARGIN_SECONDS
        async with conn.transaction():
            cur = await conn.execute(CLAIM, {"busy": busy, "used": [self.in_flight[r] for r in busy],
                                             "per_receiver": self.settings.webhook_per_receiver, "limit": free,
                                             "lease": lease})
            rows = await cur.fetchall()
        claimed = [Claimed(id=r[0], url=r[1], receiver=r[2], event=r[3], body=r[4].encode(), attempts=r[5],
                           owner=r[6], secret=r[7]) for r in rows]
        for row in claimed:
            self.in_flight[row.receiver] += 1
        return claimed

    async def _deliver(self, client: httpx.AsyncClient, row: Claimed, woken: asyncio.Event) -> None:
        try:
            code, error = await self._send(client, row)
            await self._record(row, code, error, final=code is None and error is not None
                               and error.startswith(UNREADABLE))
        except Exception as exc:  # recording failed (Postgres away): the lease runs out and the row is retried
            log.warning("webhook delivery %s: %s", row.id, first_line(exc))
        finally:
            self.in_flight[row.receiver] -= 1
            if self.in_flight[row.receiver] <= 0:
                del self.in_flight[row.receiver]
            woken.set()

    async def _send(self, client: httpx.AsyncClient, row: Claimed) -> tuple[int | None, str | None]:
        """(HTTP status, error): a 2xx is delivered; anything else is retried."""
        if not row.secret:
            return None, "the owner has no webhook secret (PUT /owners/{owner}/webhook makes one)"
        try:
            secret = self.keys.open(row.secret, context=secretbox.webhook_context(row.owner))
        except secretbox.Unreadable as exc:
            log.error("webhook delivery %s: owner %r's secret cannot be decrypted with %s: %s", row.id, row.owner,
                      secretbox.SETTING, exc)
            return None, f"{UNREADABLE} with {secretbox.SETTING}: {exc}"
        try:
            where, addresses = await webhooks.vet(row.url, self.allow)
        except webhooks.Refused as exc:
            return None, f"refused: {exc}"
        timestamp = int(time.time())
        headers = {"Host": where.host_header, "Content-Type": "application/json", "User-Agent": USER_AGENT,
                   webhooks.SIGNATURE_HEADER: webhooks.signature(secret, timestamp, row.body),
                   webhooks.EVENT_HEADER: row.event, webhooks.DELIVERY_HEADER: row.id}
        extensions = {"sni_hostname": where.host} if where.scheme == "https" else {}
        try:
            async with asyncio.timeout(self.settings.webhook_timeout_seconds):
                # Each checked address in the resolver's order, the next one only where a connection was refused
                # (a name with IPv4 and IPv6 addresses, a receiver listening on one of them).
                for i, address in enumerate(addresses):
                    request = client.build_request("POST", where.url_for(address), content=row.body,
                                                   headers=headers, extensions=extensions)
                    try:
                        response = await client.send(request, stream=True)
                    except httpx.ConnectError:
                        if i + 1 == len(addresses):
                            raise
                        continue
                    await response.aclose()  # the status is the answer; the body is not read
                    break
        except TimeoutError:
            return None, f"no answer within {self.settings.webhook_timeout_seconds:g} s"
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS] or type(exc).__name__
        if 200 <= response.status_code < 300:
            return response.status_code, None
        return response.status_code, f"HTTP {response.status_code}"

    async def _record(self, row: Claimed, code: int | None, error: str | None, final: bool = False) -> None:
        async with await psycopg.AsyncConnection.connect(dsn(self.settings.database_url), autocommit=True,
                                                         connect_timeout=5) as conn:
            if error is None:
                await conn.execute(DELIVERED, {"id": row.id, "code": code})
                return
            wait = backoff(row.attempts, self.settings)
            give_up = row.attempts if final else self.settings.webhook_max_attempts
            await conn.execute(FAILED, {"id": row.id, "code": code, "error": error[:ERROR_CHARS],
                                        "max": give_up, "wait": wait})
        if row.attempts >= self.settings.webhook_max_attempts:
            log.warning("webhook delivery %s (%s) given up after %d attempts: %s", row.id, row.event, row.attempts,
                        error)

