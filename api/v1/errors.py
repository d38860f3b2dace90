"""OpenAI's error envelope, for everything answered under /v1: `{"error": {"message", "type", "param", "code"}}`.

Routes under /v1 raise the native ApiError (api/errors.py) as every route does; api/errors.respond renders it with
`render` here, whoever raised it: a route, a validation error, the key check, the body limit, the router's own 404.
The statuses are those the official SDKs map to their error classes (openai-python `_make_status_error`):
400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 409 ConflictError,
429 RateLimitError, 5xx InternalServerError; any other (405, 413, 416) APIStatusError.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from api.errors import ApiError, ErrorCode

PREFIX = "/v1"


class ErrorType(str, Enum):
    """OpenAI's `type` of an error."""

    INVALID_REQUEST = "invalid_request_error"
    INSUFFICIENT_QUOTA = "insufficient_quota"
    SERVER_ERROR = "server_error"


# OpenAI's `code` where OpenAI has one for the cause; every other error keeps the native code (docs/openai.md).
OPENAI_CODES = {ErrorCode.UNAUTHORIZED: "invalid_api_key", ErrorCode.QUOTA_EXCEEDED: "insufficient_quota"}
# Where OpenAI answers a status the native face does not: a field refused, and a body of another content type,
# are a 400 (BadRequestError); the native 422 would be the SDK's UnprocessableEntityError, which OpenAI never sends.
STATUSES = {422: 400, 415: 400}
# Neither a conflict nor a quota passes by waiting a second: the SDK retries both by default, so it is told not to.
NO_RETRY = frozenset({409, 429})
# Fields that are no request parameter: the key is a header, the scope the key's.
NOT_PARAMS = frozenset({ErrorCode.UNAUTHORIZED, ErrorCode.FORBIDDEN})


class OpenAIError(BaseModel):
    message: str
    type: ErrorType
    param: str | None = Field(description="The request parameter at fault (`purpose`, `hyperparameters.n_epochs`), "
                                          "or null")
    code: str | None = Field(description="OpenAI's code where it has one (`invalid_api_key`, `insufficient_quota`), "
                                         "else the service's own (`not_found`, `file_in_use`, `invalid_request`, …)")


class OpenAIErrorResponse(BaseModel):
    error: OpenAIError


def error_type(status: int, code: ErrorCode) -> ErrorType:
    if code is ErrorCode.QUOTA_EXCEEDED:
        return ErrorType.INSUFFICIENT_QUOTA
    return ErrorType.SERVER_ERROR if status >= 500 else ErrorType.INVALID_REQUEST


def envelope(err: ApiError) -> tuple[int, dict[str, Any]]:
    """The status and body OpenAI would answer for the native error."""
    status = STATUSES.get(err.status, err.status)
    code = OPENAI_CODES.get(err.code, err.code.value)
    param = None if err.code in NOT_PARAMS else err.field
    return status, {"error": {"message": err.message, "type": error_type(status, err.code).value, "param": param,
                              "code": code}}


def render(err: ApiError) -> JSONResponse:
    status, body = envelope(err)
    headers = dict(err.headers or {})
    if status in NO_RETRY:
        headers["x-should-retry"] = "false"
    return JSONResponse(body, status_code=status, headers=headers or None)


_DESCRIPTIONS = {
    400: "A parameter is invalid or missing (`param` names it), or the body is not what its content type says",
    401: "No valid API key (`Authorization: Bearer <key>`): missing, unknown, revoked or expired (`invalid_api_key`)",
    403: "The key lacks the scope this needs; the message names it",
    404: "No such object (another owner's is not found either), or no such route; on a list, no such object as "
         "`after` names (`param`: after)",
    409: "The object's state does not allow this (`file_in_use`: a job that has not ended uses the file; a job that "
         "has ended cannot be cancelled), or the Idempotency-Key was used with another body",
    413: "The body is larger than the limit (1 MiB; an uploaded file: the service's FT_MAX_FILE_BYTES)",
    416: "The Range lies outside the file; Content-Range gives its size",
    429: "The owner's quota would be exceeded (`insufficient_quota`); the message names the limit and the use",
    503: "Postgres or Redis is unreachable; retry after `Retry-After` seconds",
}
_NO_RETRY_HEADER = {"x-should-retry": {"description": "false: retrying the same request cannot succeed",
                                       "schema": {"type": "string", "enum": ["false"]}}}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    409: _NO_RETRY_HEADER,
    416: {"Content-Range": {"description": "bytes */<size>", "schema": {"type": "string"}}},
    429: _NO_RETRY_HEADER,
    503: {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}},
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error responses a /v1 route can give, each with OpenAI's envelope."""
    return {s: {"model": OpenAIErrorResponse, "description": _DESCRIPTIONS[s],
                **({"headers": _HEADERS[s]} if s in _HEADERS else {})} for s in statuses}
