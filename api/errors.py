"""One error shape for every 4xx/5xx: {"error": {"code", "message", "field", "details"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainer.dsconfig import FieldError, SpecError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 details: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.details = status, code, message, field, details


def invalid(errors: list[FieldError]) -> ApiError:
    """A 422 naming every bad field; the first one is `field`, all of them are in `details`."""
    details = [{"field": e.field, "message": e.message} for e in errors]
    if len(errors) == 1:
        message = f"{errors[0].field}: {errors[0].message}"
    else:
        message = f"{len(errors)} invalid fields: " + "; ".join(f"{e.field}: {e.message}" for e in errors)
    return ApiError(422, "invalid_request", message, errors[0].field, details)


def body(code: str, message: str, field: str | None = None, details: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message, "field": field}
    if details is not None:
        err["details"] = details
    return {"error": err}


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic puts the union member or validator name in the path; users know only field names.
    parts = [p for p in parts if not (p.startswith("function-") or p in ("int", "literal['auto']", "str"))]
    return ".".join(parts) or "body"


def _pydantic_errors(exc: RequestValidationError) -> list[FieldError]:
    out: list[FieldError] = []
    seen: set[tuple[str, str]] = set()
    for e in exc.errors():
        field = _loc(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "is not a known field"
        if (field, msg) not in seen:
            seen.add((field, msg))
            out.append(FieldError(field, msg))
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(body(exc.code, exc.message, exc.field, exc.details), status_code=exc.status)

    @app.exception_handler(SpecError)
    async def _spec_error(_: Request, exc: SpecError) -> JSONResponse:
        err = invalid(exc.errors)
        return JSONResponse(body(err.code, err.message, err.field, err.details), status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = invalid(_pydantic_errors(exc))
        return JSONResponse(body(err.code, err.message, err.field, err.details), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized"}.get(exc.status_code, "http_error")
        return JSONResponse(body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(body("internal_error", "an internal error occurred; see the server log"),
                            status_code=500)
