"""One error shape for every 4xx/5xx: {"error": {"code", "message", "field", "details"}}.

The codes are one enum, documented in the OpenAPI schema with the shape itself, so clients can branch
on `code` and the fuzzer can hold every error response to the schema.

Another face of the service (api/v1, OpenAI's API) answers in its own envelope: every error is made here, as an
ApiError, and `respond` renders it with the face registered for the request's path prefix (`add_face`), so a
route, a guard or a handler never needs to know which face it serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import asyncpg
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from contract.problems import FieldError, SpecError
from db import errors as db
from db.pool import BROKEN_CONNECTION
from store.objects import error_line

log = logging.getLogger(__name__)

# Seconds a client should wait before retrying while Postgres or Redis is unreachable.
RETRY_AFTER_SECONDS = 5


class ErrorCode(str, Enum):
    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    NO_OUTPUT = "no_output"  # the job exists but has no export in the artifact store (yet)
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    FILE_IN_USE = "file_in_use"
    QUOTA_EXCEEDED = "quota_exceeded"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNAVAILABLE = "unavailable"
    HTTP_ERROR = "http_error"
    INTERNAL_ERROR = "internal_error"


class FieldProblem(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    code: ErrorCode
    message: str
    field: str | None = Field(description="The request field at fault (the first one), or null")
    details: list[FieldProblem] | None = Field(default=None, description="Every bad field, on a 422")


class ErrorResponse(BaseModel):
    error: ErrorDetail


_DESCRIPTIONS = {
    400: "The body is not what the content type says (a multipart body cut short); `field` names the part",
    401: "No valid API key (`Authorization: Bearer <key>`): missing, unknown, revoked or expired",
    403: "The key lacks the scope this needs; the message names it",
    404: "No such job, file or key (another owner's is not found either); on a list, no such row as `after` names",
    409: "The job's state does not allow this, the Idempotency-Key was used with another body, or a job that has not "
         "ended uses the file (`file_in_use`)",
    413: "The body is larger than the limit (1 MiB; an uploaded file: the service's FT_MAX_FILE_BYTES)",
    415: "The body is not of the content type the route takes (an upload: multipart/form-data)",
    416: "The Range lies outside the file; Content-Range gives its size",
    422: "A field is invalid; `field` and `details` name each one and say what is accepted",
    429: "The owner's quota would be exceeded; the message names the limit, the current use and the request",
    503: "Postgres or Redis is unreachable; retry after `Retry-After` seconds",
}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}},
    416: {"Content-Range": {"description": "bytes */<size>", "schema": {"type": "string"}}},
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error responses a route can give, each with the error model."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s],
                **({"headers": _HEADERS[s]} if s in _HEADERS else {})} for s in statuses}


class ApiError(Exception):
    def __init__(self, status: int, code: ErrorCode, message: str, field: str | None = None,
                 details: list[dict[str, str]] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.details = status, code, message, field, details
        self.headers = headers


def invalid(errors: list[FieldError]) -> ApiError:
    """A 422 naming every bad field; the first one is `field`, all of them are in `details`."""
    details = [{"field": e.field, "message": e.message} for e in errors]
    if len(errors) == 1:
        message = f"{errors[0].field}: {errors[0].message}"
    else:
        message = f"{len(errors)} invalid fields: " + "; ".join(f"{e.field}: {e.message}" for e in errors)
    return ApiError(422, ErrorCode.INVALID_REQUEST, message, errors[0].field, details)


def body(code: ErrorCode, message: str, field: str | None = None, details: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code.value, "message": message, "field": field}
    if details is not None:
        err["details"] = details
    return dict(error=err)


Render = Callable[[ApiError], JSONResponse]
# Path prefix ("/v1") -> the renderer of that face's errors.
_FACES: dict[str, Render] = {}


def add_face(prefix: str, render: Render) -> None:
    """Errors answered under `prefix` (the path itself, or below it) are rendered by `render`."""
    _FACES[prefix.rstrip("/")] = render


def native(err: ApiError) -> JSONResponse:
    return JSONResponse(body(err.code, err.message, err.field, err.details), status_code=err.status,
                        headers=err.headers)


def respond(path: str, err: ApiError) -> JSONResponse:
    """The error, in the shape of the face that serves `path`."""
    for prefix, render in _FACES.items():
        if path == prefix or path.startswith(prefix + "/"):
            return render(err)
    return native(err)


def error_response(status: int, code: ErrorCode, message: str, field: str | None = None,
                   headers: dict[str, str] | None = None, *, path: str = "") -> JSONResponse:
    return respond(path, ApiError(status, code, message, field, headers=headers))


# Where pydantic puts a parameter; users know the parameter's name only.
_LOCATIONS = ("body", "query", "path", "header", "cookie")


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for i, p in enumerate(loc) if not (i == 0 and p in _LOCATIONS)]
    # pydantic puts the union member or validator name in the path; users know only field names.
    parts = [p for p in parts if not (p.startswith("function-") or p in ("int", "constrained-int", "literal['auto']",
                                                                         "str", "list[str]", "float",
                                                                         "constrained-float"))]
    return ".".join(parts) or "body"


def _message(e: dict[str, Any]) -> str:
    kind = e.get("type")
    if kind == "extra_forbidden":
        return "is not a known field"
    if kind == "json_invalid":
        # Its context holds one entry: the decoder's message.
        return f"is not valid JSON: {next(iter((e.get('ctx') or {}).values()), 'decode error')}"
    if kind == "int_parsing" and str(e.get("input")).endswith(", not an integer)"):
        # A boolean or string for an integer, as contract.spec.refuse_lax_integers marked it.
        return f"must be an integer, got {str(e.get('input')).rsplit(' (', 1)[0]}"
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    expected = (e.get("ctx") or {}).get("expected")
    if kind in ("literal_error", "enum") and expected:
        return f"{str(e.get('input'))[:60]!r} is not accepted; accepted: {expected}"
    return msg


def _pydantic_errors(exc: RequestValidationError) -> list[FieldError]:
    out: list[FieldError] = []
    seen: set[tuple[str, str]] = set()
    for e in exc.errors():
        field = "body" if e.get("type") == "json_invalid" else _loc(tuple(e.get("loc", ())))
        msg = _message(e)
        if (field, msg) not in seen:
            seen.add((field, msg))
            out.append(FieldError(field, msg))
    return out


def quota_exceeded(exc: db.QuotaExceeded) -> ApiError:
    """A 429 naming each limit the submit would pass, the owner's use and what the submit asked for."""
    owner, (max_jobs, max_gpus), (jobs, used_gpus), gpus = exc.owner, exc.limits, exc.used, exc.gpus
    details = []
    if max_jobs is not None and jobs + 1 > max_jobs:
        details.append({"field": "max_active_jobs", "message": f"max_active_jobs is {max_jobs}; {owner} has {jobs} "
                        "unfinished jobs (queued or running); this submit is 1 more"})
    if max_gpus is not None and used_gpus + gpus > max_gpus:
        details.append({"field": "max_gpus", "message": f"max_gpus is {max_gpus}; {owner}'s unfinished jobs hold "
                        f"{used_gpus}; this submit asks for {gpus} (resources.num_gpus)"})
    return ApiError(429, ErrorCode.QUOTA_EXCEEDED, f"quota exceeded for owner {owner!r}: "
                    + "; ".join(d["message"] for d in details) + ". Wait for jobs to end, cancel some, or ask an "
                    "admin to raise the quota", details[0]["field"] if details else None, details)


def stored_bytes_exceeded(exc: db.StoredBytesExceeded) -> ApiError:
    size = f"{exc.size} bytes" if exc.size is not None else f"more than the {max(0, exc.limit - exc.used)} bytes left"
    message = f"max_stored_bytes is {exc.limit}; {exc.owner}'s files take {exc.used} bytes; this upload is {size}"
    return ApiError(429, ErrorCode.QUOTA_EXCEEDED, f"quota exceeded for owner {exc.owner!r}: {message}. Delete files "
                    "or ask an admin to raise the quota", "max_stored_bytes",
                    [{"field": "max_stored_bytes", "message": message}])


def from_db(exc: db.DbError) -> ApiError:
    """The HTTP answer to what the data layer refused."""
    if isinstance(exc, db.NotFound):
        return ApiError(404, ErrorCode.NOT_FOUND, exc.message, exc.field)
    if isinstance(exc, db.FileInUse):
        return ApiError(409, ErrorCode.FILE_IN_USE, exc.message, exc.field)
    if isinstance(exc, db.IdempotencyConflict):
        return ApiError(409, ErrorCode.IDEMPOTENCY_CONFLICT, exc.message, exc.field)
    if isinstance(exc, db.Conflict):
        return ApiError(409, ErrorCode.CONFLICT, exc.message, exc.field)
    if isinstance(exc, db.Invalid):
        return invalid([FieldError(exc.field or "body", exc.message)])
    if isinstance(exc, db.QuotaExceeded):
        return quota_exceeded(exc)
    if isinstance(exc, db.StoredBytesExceeded):
        return stored_bytes_exceeded(exc)
    return ApiError(503, ErrorCode.UNAVAILABLE, exc.message, None, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def unavailable(what: str, path: str = "") -> JSONResponse:
    return error_response(503, ErrorCode.UNAVAILABLE, f"{what} is unreachable; retry in {RETRY_AFTER_SECONDS} s",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)}, path=path)


def store_unavailable(exc: BaseException, done: str = "read") -> ApiError:
    """The artifact store could not be read or written (unreachable, or refusing): a 503 to retry, as for the
    database. The store's own words stay in the log: they name its folder or its endpoint, which a client never
    sees."""
    log.warning("the artifact store could not be %s: %s", done, error_line(exc))
    return ApiError(503, ErrorCode.UNAVAILABLE, f"the artifact store could not be {done}; retry in "
                    f"{RETRY_AFTER_SECONDS} s", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def allowed_methods(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """Every method the request's path serves, for a 405's Allow. FastAPI makes one route per method and
    Starlette's own Allow names only the first route whose path matched, so DELETE /jobs would say POST alone."""
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def install(app: FastAPI, routes: Sequence[BaseRoute]) -> None:
    """The handlers; `routes` are the routers' own (full paths), which a 405's Allow is computed from."""
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(request.scope["path"], exc)

    @app.exception_handler(SpecError)
    async def _spec_error(request: Request, exc: SpecError) -> JSONResponse:
        return respond(request.scope["path"], invalid(exc.errors))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request.scope["path"], invalid(_pydantic_errors(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED, 401: ErrorCode.UNAUTHORIZED,
                403: ErrorCode.FORBIDDEN, 413: ErrorCode.PAYLOAD_TOO_LARGE}.get(exc.status_code, ErrorCode.HTTP_ERROR)
        headers, message = dict(exc.headers or {}), str(exc.detail)
        if exc.status_code == 405:
            # RFC 9110: a 405 lists the methods the path serves.
            headers["Allow"] = allowed_methods(routes, request.scope)
            message = f"{request.method} is not allowed on this path; allowed: {headers['Allow']}"
        elif exc.status_code == 404 and message == "Not Found":  # the router's own: no route has this path
            message = f"no route serves {request.method} {request.scope['path'][:200]}"
        return respond(request.scope["path"], ApiError(exc.status_code, code, message, headers=headers or None))

    @app.exception_handler(db.DbError)
    async def _db_error(request: Request, exc: db.DbError) -> JSONResponse:
        return respond(request.scope["path"], from_db(exc))

    # What reaches here unwrapped (a connection lost between two statements of a transaction): a 503 too.
    @app.exception_handler(asyncpg.PostgresConnectionError)
    @app.exception_handler(asyncpg.InterfaceError)
    @app.exception_handler(asyncpg.exceptions.OperatorInterventionError)
    @app.exception_handler(asyncpg.exceptions.TooManyConnectionsError)
    @app.exception_handler(BROKEN_CONNECTION)
    async def _database(request: Request, exc: Exception) -> JSONResponse:
        log.warning("Postgres unreachable during %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return unavailable("the database", request.scope["path"])

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis(request: Request, exc: redis.RedisError) -> JSONResponse:
        log.warning("Redis unreachable during %s %s: %s", request.method, request.url.path, exc)
        return unavailable("Redis", request.scope["path"])

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return respond(request.scope["path"], ApiError(500, ErrorCode.INTERNAL_ERROR,
                                                       "an internal error occurred; see the server log"))
