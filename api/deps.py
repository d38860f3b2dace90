"""Dependencies as Annotated aliases: sessions, settings, Redis."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache
from typing import Annotated

import redis
from fastapi import Depends
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from api.db import _factory
from api.settings import ApiSettings, get_settings

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


def _redis_dep(settings: Annotated[ApiSettings, Depends(get_settings)]) -> redis.Redis:
    return _redis(settings.redis_url)


SessionDep = Annotated[Session, Depends(_session)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
RedisDep = Annotated[redis.Redis, Depends(_redis_dep)]
