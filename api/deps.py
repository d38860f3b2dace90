"""Dependencies as Annotated aliases: sessions, settings, Redis, the caller's key, a job or 404."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from functools import lru_cache
from typing import Annotated

import redis
from fastapi import Depends, Header
from sqlalchemy.orm import Session

from api.db import _factory
from api.errors import ApiError
from api.settings import ApiSettings, get_settings


def _session() -> Iterator[Session]:
    session = _factory()()
    try:
        yield session
    finally:
        session.rollback()  # anything a route did not commit explicitly is not kept
        session.close()


@lru_cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


def _redis_dep(settings: Annotated[ApiSettings, Depends(get_settings)]) -> redis.Redis:
    return _redis(settings.redis_url)


def _caller(settings: Annotated[ApiSettings, Depends(get_settings)],
            authorization: Annotated[str | None, Header()] = None) -> str:
    if not settings.api_token:
        return "anonymous"
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token, settings.api_token):
        raise ApiError(401, "unauthorized", "send the API token as 'Authorization: Bearer <token>'", "authorization")
    return "token"


SessionDep = Annotated[Session, Depends(_session)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
RedisDep = Annotated[redis.Redis, Depends(_redis_dep)]
CurrentKey = Annotated[str, Depends(_caller)]
