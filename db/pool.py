"""The API's asynchronous Postgres pool (asyncpg), for the routes that dashboards call all day.

The API process's one driver: its reads and writes run here, on the event loop, with the JSON built by
Postgres itself: a read costs one round trip and no Python object per column. The control plane never
uses this pool. The URL is the store's (core.settings.StoreSettings); the API sets its own and the pool's
size with `configure` before the first use.

Beside the pool, one connection per process LISTENs for the database's notifications (`subscribe`):
followers are woken when their job gains events instead of polling for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from core.settings import StoreSettings
from db.errors import Unavailable
from db.urls import dsn

# What a connection whose link broke mid-operation (Postgres restarting under it) raises on its next use: asyncpg's
# protocol is still in the lost operation's state ("cannot switch to state ...; another operation is in progress").
BROKEN_CONNECTION = asyncpg.exceptions._base.InternalClientError
# What an unreachable or restarting Postgres raises here; each is answered 503, never 500.
UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.TooManyConnectionsError, BROKEN_CONNECTION)

log = logging.getLogger(__name__)

_pool: asyncpg.Pool | None = None
_lock: asyncio.Lock | None = None
_config: dict[str, Any] = {}
_expiring: set[asyncio.Task[None]] = set()  # referenced until done: the loop keeps only weak references to tasks


def configure(*, database_url: str, pool_size: int = 10) -> None:
    """The database and the pool's size for this process; without it, the store settings' URL and 10."""
    _config.update(database_url=database_url, pool_size=pool_size)


def database_url() -> str:
    if "database_url" not in _config:
        _config["database_url"] = StoreSettings().database_url
    return _config["database_url"]


async def pool() -> asyncpg.Pool:
    """The process's pool, created on first use (and again after a failed creation)."""
    global _pool, _lock
    if _pool is not None:
        return _pool
    _lock = _lock or asyncio.Lock()
    async with _lock:
        if _pool is None:
            _pool = await asyncpg.create_pool(
                dsn(database_url()), min_size=1, max_size=_config.get("pool_size", 10), timeout=5,
                command_timeout=30, server_settings={"timezone": "UTC", "application_name": "ft-api"},
                reset=_keep_session)
    return _pool


async def _keep_session(_: asyncpg.Connection) -> None:
    """Replaces the reset query asyncpg sends on every release (a round trip per request): these
    connections never change session state (no LISTEN, advisory locks, SET or open cursors)."""


async def close() -> None:
    global _pool
    await _listener.stop()
    if _pool is not None:
        await _pool.close()
        _pool = None


def unavailable(exc: BaseException | None = None) -> Unavailable:
    if isinstance(exc, BROKEN_CONNECTION) and _pool is not None:
        # Every connection opened before the restart may be in such a state: from the loop's next turn the pool closes
        # each as it is next acquired or released and opens a new one. Called while that exception is handled.
        _expiring.add(asyncio.get_running_loop().create_task(_pool.expire_connections()))
        for task in [t for t in _expiring if t.done()]:
            _expiring.discard(task)
    return Unavailable()


async def fetchval(sql: str, *args: Any) -> Any:
    try:
        return await (await pool()).fetchval(sql, *args)
    except UNREACHABLE as exc:
        raise unavailable(exc) from exc


async def fetchrow(sql: str, *args: Any) -> asyncpg.Record | None:
    try:
        return await (await pool()).fetchrow(sql, *args)
    except UNREACHABLE as exc:
        raise unavailable(exc) from exc


async def fetch(sql: str, *args: Any) -> list[asyncpg.Record]:
    try:
        return await (await pool()).fetch(sql, *args)
    except UNREACHABLE as exc:
        raise unavailable(exc) from exc


async def execute(sql: str, *args: Any) -> str:
    try:
        return await (await pool()).execute(sql, *args)
    except UNREACHABLE as exc:
        raise unavailable(exc) from exc


PING = "SELECT 1"


# How often the listening connection proves it is alive: a connection cut without a FIN (a dropped route)
# would otherwise wait for notifications that never come.
LISTEN_PING_SECONDS = 5.0


class Listener:
    """One LISTENing connection, re-opened after any loss, delivering each channel's payloads to callbacks.

    `connected` says whether notifications are flowing: a caller that must not miss a change polls
    quickly while it is False. After each (re)connection every `on_connect` callback runs, because what
    was committed while nobody listened was notified to no one.
    """

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[str], None]]] = {}
        self.on_connect: dict[str, list[Callable[[], None]]] = {}
        self.connected = False
        # The channels LISTENed on the current connection. A channel subscribed while connected is heard only
        # once its LISTEN has run: until then `listening(channel)` is False, so nobody trusts it meanwhile.
        self.active: set[str] = set()
        # The round trip the next `caught_up()` caller joins, not sent yet; one at a time on the connection.
        self._round: asyncio.Future[bool] | None = None
        self._lock: asyncio.Lock | None = None
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, channel: str, callback: Callable[[str], None],
                  on_connect: Callable[[], None] | None = None) -> None:
        """Call `callback(payload)` for each notification on `channel` (from the event loop's thread)."""
        new_channel = channel not in self.callbacks
        self.callbacks.setdefault(channel, []).append(callback)
        if on_connect is not None:
            self.on_connect.setdefault(channel, []).append(on_connect)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pg listener")
        elif new_channel and self._conn is not None and not self._conn.is_closed():
            # A connection being opened picks the channel up itself (_run listens until none is left).
            asyncio.get_running_loop().create_task(self._listen(self._conn, channel))

    def _deliver(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        for callback in self.callbacks.get(channel, ()):
            try:
                callback(payload)
            except Exception:
                log.exception("a %s notification handler failed", channel)

    async def _listen(self, conn: asyncpg.Connection, channel: str) -> None:
        await conn.add_listener(channel, self._deliver)
        if conn is self._conn and not conn.is_closed():
            self._heard(channel)

    def _heard(self, channel: str) -> None:
        # From now on every change on the channel is notified; what changed before was notified to no one.
        self.active.add(channel)
        for callback in list(self.on_connect.get(channel, ())):
            callback()

    async def caught_up(self) -> bool:
        """Wait until every notification committed before this call has been delivered; False if that cannot
        be known (not connected, or the connection failed meanwhile).

        Postgres sends a listening session its pending notifications before it answers the session's next
        query, and asyncpg runs their callbacks before the query's caller resumes: a round trip sent after
        this call began is enough. The callers that arrive while one is in flight share the next one, so a
        burst of reads costs one or two round trips, not one each."""
        if self._conn is None:
            return False
        round_trip = self._round
        if round_trip is None:
            round_trip = self._round = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._send_round(round_trip))
        return await asyncio.shield(round_trip)

    async def _send_round(self, round_trip: asyncio.Future[bool]) -> None:
        ok = False
        try:
            async with self._conn_lock():
                # Whoever calls from now on may have come after this round trip was sent: they wait for the next.
                if self._round is round_trip:
                    self._round = None
                conn = self._conn
                if conn is not None:
                    await conn.fetchval(PING, timeout=LISTEN_PING_SECONDS)
                    ok = conn is self._conn and not conn.is_closed()
        except Exception:
            ok = False
        finally:
            if self._round is round_trip:
                self._round = None
            round_trip.set_result(ok)

    def _conn_lock(self) -> asyncio.Lock:
        # One query at a time on the connection: the round trips and the liveness ping.
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _run(self) -> None:
        delay = 0.5
        while True:
            try:
                conn = await asyncpg.connect(dsn(database_url()), timeout=5,
                                             server_settings={"application_name": "ft-api-listen"})
            except Exception as exc:
                log.warning("cannot LISTEN (%s); followers poll meanwhile; retrying in %.1f s",
                            type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _c, lost=lost: lost.set())
            try:
                listened: set[str] = set()
                # Again until none is left: a channel may be subscribed while the others' LISTENs run.
                while pending := [c for c in self.callbacks if c not in listened]:
                    for channel in pending:
                        await conn.add_listener(channel, self._deliver)
                        listened.add(channel)
                self._conn, self.connected, delay = conn, True, 0.5
                for channel in listened:
                    self._heard(channel)
                while not lost.is_set():
                    try:
                        await asyncio.wait_for(lost.wait(), LISTEN_PING_SECONDS)
                    except asyncio.TimeoutError:
                        async with self._conn_lock():
                            await conn.fetchval(PING, timeout=LISTEN_PING_SECONDS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("the LISTEN connection failed (%s); reconnecting", type(exc).__name__)
            finally:
                self._conn, self.connected = None, False
                self.active.clear()
                conn.terminate()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None


_listener = Listener()


def subscribe(channel: str, callback: Callable[[str], None], on_connect: Callable[[], None] | None = None) -> None:
    """Run `callback(payload)` on every notification of `channel` in this process (see Listener)."""
    _listener.subscribe(channel, callback, on_connect)


async def caught_up() -> bool:
    """Every notification committed before this call has been delivered to this process (see Listener)."""
    return await _listener.caught_up()


def listening(channel: str | None = None) -> bool:
    """Whether notifications flow: on the connection at all, or (given a channel) on that channel."""
    return _listener.connected and (channel is None or channel in _listener.active)
