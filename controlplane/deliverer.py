"""Sends the webhook outbox (`webhook_deliveries`): a thread of the control plane with its own event loop.

Like the dispatcher (controlplane/dispatcher.py) it wakes on a notification (`ft_webhooks`, a trigger on insert;
the control plane's one LISTEN loop, db/notify.py, hands it over) and looks anyway every POLL_SECONDS. A pass
claims due rows with FOR UPDATE SKIP LOCKED and commits the claim (attempt counted, the row leased until the
delivery's deadline has passed; db/deliveries.py) before any request is sent, so no transaction stays open while
a receiver thinks, and a control plane that dies mid-send retries the row once its lease ends. Each claimed row is
sent by a task of its own with an asynchronous HTTP client and one deadline for the whole request; its outcome is
written in a short transaction of its own.

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

import httpx

from controlplane.ingest import first_line
from controlplane.loop import POLL_SECONDS, RETRY_MAX_SECONDS
from controlplane.settings import ControlPlaneSettings
from core import secretbox, webhooks
from db import deliveries
from db.deliveries import Claimed
from db.notify import WEBHOOKS, Notifications

log = logging.getLogger(__name__)

LEASE_MARGIN_SECONDS = 30.0  # beyond the delivery's own deadline, before a claimed row counts as abandoned
USER_AGENT = "ft-webhooks/1"
ERROR_CHARS = 500
UNREADABLE = "the owner's webhook secret cannot be decrypted"


def backoff(attempts: int, settings: ControlPlaneSettings) -> float:
    """Seconds before the next try after `attempts` failed ones: doubling from the first pause, capped, and
    jittered (half fixed, half random) so receivers that failed together are not hit together again."""
    ceiling = min(settings.webhook_backoff_max_seconds, settings.webhook_backoff_seconds * 2 ** (attempts - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


class Deliverer:
    def __init__(self, settings: ControlPlaneSettings, notifications: Notifications | None = None) -> None:
        """`notifications`: the control plane's LISTEN loop, which wakes it on `ft_webhooks`; without one it only
        looks every POLL_SECONDS."""
        self.settings = settings
        self.notifications = notifications
        self.allow = webhooks.parse_allow_nets(settings.webhook_allow_nets)
        self.keys = secretbox.keyring(settings)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.in_flight: Counter[str] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()
        # Set when a notification came, or a slot came free: look again now. Made in the thread's own loop.
        self._woken: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if notifications is not None:
            notifications.subscribe(WEBHOOKS, self._notified)

    def _notified(self) -> None:
        """Called in the LISTEN loop's thread: wake this thread's loop."""
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:
                pass  # the loop has closed: stopping

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
        self._woken, self._loop = asyncio.Event(), asyncio.get_running_loop()
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
        self._loop = None

    async def _serve(self, client: httpx.AsyncClient) -> None:
        woken = self._woken
        assert woken is not None
        async with await deliveries.connect(self.settings.database_url) as conn:
            while not self._stopping.is_set():
                woken.clear()
                for row in await self._claim(conn):
                    task = asyncio.create_task(self._deliver(client, row, woken))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                # Look again when notified, when a slot came free, or after POLL_SECONDS (retries come due).
                try:
                    await asyncio.wait_for(woken.wait(), timeout=POLL_SECONDS)
                except TimeoutError:
                    pass

    async def _claim(self, conn: deliveries.Connection) -> list[Claimed]:
        free = self.settings.webhook_concurrency - sum(self.in_flight.values())
        if free <= 0:
            return []
        lease = self.settings.webhook_timeout_seconds + webhooks.RESOLVE_TIMEOUT_SECONDS + LEASE_MARGIN_SECONDS
        claimed = await deliveries.claim(conn, in_flight=dict(self.in_flight),
                                         per_receiver=self.settings.webhook_per_receiver, limit=free, lease=lease)
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
        async with await deliveries.connect(self.settings.database_url) as conn:
            if error is None:
                await deliveries.delivered(conn, row.id, code)
                return
            give_up = row.attempts if final else self.settings.webhook_max_attempts
            await deliveries.failed(conn, row.id, code=code, error=error[:ERROR_CHARS], give_up_at=give_up,
                                    wait=backoff(row.attempts, self.settings))
        if row.attempts >= self.settings.webhook_max_attempts:
            log.warning("webhook delivery %s (%s) given up after %d attempts: %s", row.id, row.event, row.attempts,
                        error)
