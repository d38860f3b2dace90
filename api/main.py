"""The FastAPI application: routers included in one place, one error shape everywhere."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import ValidationError

from api import errors, pg
from api.guards import MAX_BODY_BYTES, OPEN_PATHS, BearerAuth, BodyLimit
from api.routes import health, jobs
from api.settings import ApiSettings, get_settings


def load_settings() -> ApiSettings:
    """The settings, or exit with what is wrong: a misconfigured API must not start and answer 500s."""
    try:
        return get_settings()
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()))
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"FT_{where.upper()}: {msg}" if where else msg)
        raise SystemExit("the API cannot start: " + "; ".join(problems)) from None


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    yield
    await pg.close()


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or load_settings()
    app = FastAPI(title="Fine-tuning job service", version="0.1.0", lifespan=lifespan,
                  description="Submit DeepSpeed fine-tune jobs, follow their events and logs, get the model back. "
                              f"Request bodies are limited to {MAX_BODY_BYTES} bytes (1 MiB).")
    errors.install(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    # The last one added runs first: the token is checked before the body is read at all.
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(BearerAuth, token=settings.api_token)
    app.openapi = partial(openapi_with_bearer, app)  # type: ignore[method-assign]
    return app


def openapi_with_bearer(app: FastAPI) -> dict[str, Any]:
    """The schema with the bearer scheme on every guarded route. BearerAuth checks the token before any
    route runs, so the scheme is written here rather than as a dependency each request would resolve."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["HTTPBearer"] = {
            "type": "http", "scheme": "bearer", "description": "FT_API_TOKEN, as 'Authorization: Bearer <token>'"}
        for path, operations in schema["paths"].items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"HTTPBearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


app = create_app()
