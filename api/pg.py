"""The API's asynchronous Postgres pool (asyncpg), for the routes that dashboards call all day.

The hot reads run here, on the event loop, with the JSON built by Postgres itself: a read costs one
round trip and no Python object per column. Writes (submit, cancel) keep the SQLAlchemy session and
its transactions (api/services/jobs.py); the control plane never uses this pool.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from api.errors import RETRY_AFTER_SECONDS, ApiError, ErrorCode
from api.settings import get_settings

# What an unreachable or restarting Postgres raises here; each is answered 503, never 500.
UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.TooManyConnectionsError)

_pool: asyncpg.Pool | None = None
_lock: asyncio.Lock | None = None


def dsn(url: str) -> str:
    """The SQLAlchemy URL of the settings as a plain libpq URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def pool() -> asyncpg.Pool:
    """The process's pool, created on first use (and again after a failed creation)."""
    global _pool, _lock
    if _pool is not None:
        return _pool
    _lock = _lock or asyncio.Lock()
    async with _lock:
        if _pool is None:
            settings = get_settings()
            _pool = await asyncpg.create_pool(
                dsn(settings.database_url), min_size=1, max_size=settings.api_db_pool_size, timeout=5,
                command_timeout=30, server_settings={"timezone": "UTC", "application_name": "ft-api"},
                reset=_keep_session)
    return _pool


async def _keep_session(_: asyncpg.Connection) -> None:
    """Replaces the reset query asyncpg sends on every release (a round trip per request): these
    connections never change session state (no LISTEN, advisory locks, SET or open cursors)."""


async def close() -> None:
    global _pool
    if _pool is not None:
        await _pool.close()
        _pool = None


def unavailable() -> ApiError:
    return ApiError(503, ErrorCode.UNAVAILABLE, "the database is unreachable; retry shortly", None,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


async def fetchval(sql: str, *args: Any) -> Any:
    try:
        return await (await pool()).fetchval(sql, *args)
    except UNREACHABLE as exc:
        raise unavailable() from exc


async def fetch(sql: str, *args: Any) -> list[asyncpg.Record]:
    try:
        return await (await pool()).fetch(sql, *args)
    except UNREACHABLE as exc:
        raise unavailable() from exc
