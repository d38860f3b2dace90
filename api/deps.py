"""Dependencies as Annotated aliases: settings, Redis, the caller, the caller's job; and the scope a route declares."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any

import redis
from fastapi import Depends, Path, Request

from api import reads
from api.access import Principal, Scope
from api.settings import ApiSettings, get_settings
from contract.storage import StoreConfig
from store.objects import Store


@lru_cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


# The pure dependencies are `async def`: FastAPI runs a plain `def` one in its thread pool on every request.
async def _settings() -> ApiSettings:
    return get_settings()


async def _redis_dep(settings: Annotated[ApiSettings, Depends(_settings)]) -> redis.Redis:
    return _redis(settings.redis_url)


@lru_cache
def _store(config: StoreConfig) -> Store:
    # The process's one client of the store, for every route (obstore keeps its connections).
    return Store(config)


def store_of(settings: ApiSettings) -> Store:
    return _store(settings.store_config())


async def _store_dep(settings: Annotated[ApiSettings, Depends(_settings)]) -> Store:
    return store_of(settings)


SettingsDep = Annotated[ApiSettings, Depends(_settings)]
RedisDep = Annotated[redis.Redis, Depends(_redis_dep)]
StoreDep = Annotated[Store, Depends(_store_dep)]


async def _caller(request: Request) -> Principal:
    # Set by api.guards.KeyAuth before the route was reached; a route outside it has no caller. As a plain
    # `def` its thread-pool hop cost the hot reads two thirds of their throughput.
    return request.state.caller


def scoped(scope: Scope) -> dict[str, Any]:
    """The route's required scope, as `openapi_extra`: KeyAuth reads it before the body, /docs shows it."""
    return {"x-scope": scope.value}


CallerDep = Annotated[Principal, Depends(_caller)]

ID_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"
JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job id, as `POST /jobs` returned it")]


def owner_of(caller: Principal) -> str | None:
    """Whose jobs the caller may see: its own owner's, or every owner's (None) for an admin."""
    return None if caller.admin else caller.owner


async def job_for_caller(job_id: JobId, caller: CallerDep) -> bytes:
    """The caller's job as JSON (through this process's cache), or the 404: another owner's job is not found
    either (never a 403, which would say it exists)."""
    return await reads.job_cached(job_id, owner_of(caller))


JobForCaller = Annotated[bytes, Depends(job_for_caller)]
