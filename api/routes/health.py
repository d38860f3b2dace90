"""Liveness and readiness."""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from api.deps import RedisDep
from api.errors import responses
from api.schemas import Health
from db import reads

# The body limit holds for every request, probes included.
router = APIRouter(tags=["health"], responses=responses(413))


OK = b'{"status":"ok","checks":{}}'


@router.get("/healthz", response_model=Health)
async def healthz() -> Response:
    # On the event loop and pre-rendered: a liveness probe must answer even when the thread pool is busy.
    return Response(OK, media_type="application/json")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(client: RedisDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await reads.ready()
        checks["postgres"] = "ok"
    except Exception as exc:  # readiness reports, it does not raise
        checks["postgres"] = f"error: {type(exc).__name__}"
    try:
        await anyio.to_thread.run_sync(client.ping)
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(Health(status="ok" if ok else "unavailable", checks=checks).model_dump(),
                        status_code=200 if ok else 503)
