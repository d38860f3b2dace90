"""The FastAPI application: routers included in one place, one error shape everywhere."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api import errors, heap, v1
from api.access import Scope
from api.guards import MAX_BODY_BYTES, OPEN_PATHS, BodyLimit, KeyAuth
from api.metrics import Metrics
from api.polls import JobPoll
from api.routes import audit, checkpoints, files, health, jobs, keys, nodes, outputs, owners, ui, webhooks
from api.settings import ApiSettings, api_settings_or_exit, get_settings
from db import idempotency
from db import keys as keys_store
from db import pool as pg

log = logging.getLogger(__name__)


NO_ADMIN_KEY = ("the API cannot start: FT_ENV is {env!r} and the database has no working admin key, so nobody "
                "could create keys or set quotas. Create one with `python -m api.admin.keys create --owner NAME "
                "--scopes admin` (in compose: `docker compose run --rm api python -m api.admin.keys create ...`), "
                "then start the API again")


async def require_admin_key(settings: ApiSettings) -> None:
    """Outside development, refuse to start without a working admin key. Where Postgres cannot be asked yet,
    start anyway: with no key readable, every request is refused (401 or 503), which is safe."""
    try:
        found = await keys_store.scope_holder_exists(Scope.ADMIN.value)
    except Exception as exc:
        log.warning("could not check for an admin key at start (%s); starting, every request needs a key",
                    type(exc).__name__)
        return
    if not found:
        log.error(NO_ADMIN_KEY.format(env=settings.env))
        raise RuntimeError(NO_ADMIN_KEY.format(env=settings.env))


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    settings = get_settings()
    if not settings.development:
        await require_admin_key(settings)
    purge = asyncio.get_running_loop().create_task(idempotency.purge_forever(settings.idempotency_hours),
                                                   name="idempotency purge")
    heap.PauseMeter().install()
    heap.settle()  # last: what start-up built is frozen, out of every later collection's walk
    yield
    purge.cancel()
    with suppress(asyncio.CancelledError):
        await purge
    await pg.close()


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or api_settings_or_exit()
    pg.configure(database_url=settings.database_url, pool_size=settings.api_db_pool_size)
    app = FastAPI(title="Fine-tuning job service", version="0.1.0", lifespan=lifespan,
                  description="Submit DeepSpeed fine-tune jobs, follow their events and logs, get the model back. "
                              f"Request bodies are limited to {MAX_BODY_BYTES} bytes (1 MiB), "
                              "except an upload's (`POST /files`: FT_MAX_FILE_BYTES).")
    routers = (health.router, jobs.router, outputs.router, checkpoints.router, files.router, keys.router,
               owners.router, audit.router, nodes.router, webhooks.router, *v1.routers)
    # The routers' own routes (full paths, each with its declared scope), not the app's list, which holds
    # FastAPI's wrappers of included routers.
    routes = [r for router in routers for r in router.routes]
    errors.install(app, routes=[*routes, *ui.router.routes])
    errors.add_face(v1.PREFIX, v1.errors.render)  # OpenAI's face answers in OpenAI's error envelope
    for router in routers:
        app.include_router(router)
    app.include_router(ui.router)  # the dashboard's page: keyless (OPEN_PATHS), each request it makes sends a key
    # The last one added runs first: the key and its scope are checked before the body is read at all.
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, routes=routes)
    app.add_middleware(JobPoll, routes=routes)  # the dashboards' poll, once the key is checked (api/polls.py)
    app.add_middleware(KeyAuth, routes=routes, allow_anonymous=settings.allow_anonymous,
                       lenient_prefixes=(v1.PREFIX,))
    # Outermost: every answer is counted and timed, refusals included; it serves /metrics itself, keyless.
    app.add_middleware(Metrics)
    app.openapi = partial(openapi_with_bearer, app)  # type: ignore[method-assign]
    return app


def openapi_with_bearer(app: FastAPI) -> dict[str, Any]:
    """The schema with the bearer scheme on every guarded route. KeyAuth checks the key before any route
    runs, so the scheme is written here rather than as a dependency each request would resolve; each
    route's `x-scope` says which scope its key needs."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["HTTPBearer"] = {
            "type": "http", "scheme": "bearer",
            "description": ("An API key (POST /keys, or `python -m api.admin.keys create`), as "
                            "'Authorization: Bearer <key>'")}
        for path, operations in schema["paths"].items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"HTTPBearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


app = create_app()
