"""Dependencies as Annotated aliases: sessions, settings, Redis, the caller; and the scope a route declares."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache
from typing import Annotated, Any

import redis
from fastapi import Depends, Request
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from api.access import Principal, Scope
from api.settings import ApiSettings, get_settings
from db.engine import _factory

log = logging.getLogger(__name__)



def _session() -> Iterator[Session]:
    session = _factory()()
    try:
        yield session
    finally:
        try:
            session.rollback()  # anything a route did not commit explicitly is not kept
            session.close()
        except sa_exc.DBAPIError as exc:
            # Postgres went away mid-request: the route's own error (a 503) is the answer, not this one.
            log.warning("could not end a database session: %s", type(exc.orig).__name__)


@lru_cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


# The pure dependencies are `async def`: FastAPI runs a plain `def` one in its thread pool on every request.
async def _settings() -> ApiSettings:
    return get_settings()


async def _redis_dep(settings: Annotated[ApiSettings, Depends(_settings)]) -> redis.Redis:
    return _redis(settings.redis_url)


SessionDep = Annotated[Session, Depends(_session)]
SettingsDep = Annotated[ApiSettings, Depends(_settings)]
RedisDep = Annotated[redis.Redis, Depends(_redis_dep)]


async def _caller(request: Request) -> Principal:
    # Set by api.guards.KeyAuth before the route was reached; a route outside it has no caller. As a plain
    # `def` its thread-pool hop cost the hot reads two thirds of their throughput.
    return request.state.caller


def scoped(scope: Scope) -> dict[str, Any]:
    """The route's required scope, as `openapi_extra`: KeyAuth reads it before the body, /docs shows it."""
    return {"x-scope": scope.value}


CallerDep = Annotated[Principal, Depends(_caller)]
