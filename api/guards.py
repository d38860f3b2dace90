"""What every request passes before any route sees it: the API key and its scope, then the body size, then
strict JSON.

The first two are plain ASGI middleware so they act before FastAPI reads or validates anything: an
unauthenticated or unauthorised request is refused without its body being read, and a body is counted while it
streams in, so neither a missing nor a lying Content-Length gets more than the limit buffered.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import access
from api.errors import ErrorCode, error_response, from_db, respond
from db.errors import DbError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
# Documentation and probes stay reachable without a key.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/ui"})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class KeyAuth:
    """Refuses every request outside OPEN_PATHS without a valid API key, and one whose key lacks the route's
    scope, before anything else runs: the body is neither read nor measured for a caller who may not send it.

    The route's scope is the `x-scope` its decorator declares (`api.deps.scoped`); a route that declares
    none, and a path no route serves, needs `admin`: a new route is closed until it says otherwise. Under a prefix
    of `lenient_prefixes` (OpenAI's face, /v1), a path no route serves needs only a valid key and is answered 404,
    as OpenAI answers an unknown URL, rather than 403 to every key but an admin's. The
    principal goes into the request's state for the route (`api.deps.CallerDep`). Keys are checked through
    the process's cache (api/access.py): no database round trip for a key seen in the last seconds.
    """

    def __init__(self, app: ASGIApp, routes: list[BaseRoute], allow_anonymous: bool = False,
                 lenient_prefixes: tuple[str, ...] = ()) -> None:
        self.app = app
        self.routes = routes
        self.allow_anonymous = allow_anonymous
        self.lenient_prefixes = tuple(p.rstrip("/") for p in lenient_prefixes)

    def required_scope(self, scope: Scope) -> str | None:
        """The scope the request's route needs; None for a known path with another method (the router
        answers 405) and for an unknown path under a lenient prefix (the router answers 404)."""
        partial = False
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                extra = getattr(route, "openapi_extra", None) or {}
                return str(extra.get("x-scope", access.Scope.ADMIN.value))
            partial = partial or match is Match.PARTIAL
        path = scope["path"]
        if partial or any(path == p or path.startswith(p + "/") for p in self.lenient_prefixes):
            return None
        return access.Scope.ADMIN.value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        if header is None and self.allow_anonymous:
            caller: access.Principal | None = access.ANONYMOUS
        else:
            scheme, _, given = (header or b"").partition(b" ")
            given = given.strip()
            caller = None
            if scheme.lower() == b"bearer" and access.looks_like_a_key(given):
                try:
                    caller = await access.CACHE.lookup(given)
                except DbError as exc:  # Postgres unreachable: the key cannot be checked
                    err = from_db(exc)
                    await respond(scope["path"], err)(scope, receive, send)
                    return
                except Exception:  # outside the app's handlers: answered here, in the one error shape
                    log.exception("checking an API key failed")
                    await error_response(500, ErrorCode.INTERNAL_ERROR, "an internal error occurred; see the "
                                         "server log", path=scope["path"])(scope, receive, send)
                    return
            if caller is None:
                response = error_response(
                    401, ErrorCode.UNAUTHORIZED, "send a valid API key as 'Authorization: Bearer <key>' "
                    "(this one is missing, unknown, revoked or expired)", "authorization",
                    headers={"WWW-Authenticate": "Bearer"}, path=scope["path"])
                await response(scope, receive, send)
                return
        needed = self.required_scope(scope)
        if needed is not None and not caller.allows(needed):
            await error_response(403, ErrorCode.FORBIDDEN, f"this needs the scope {needed!r}; the key has "
                                 f"{', '.join(sorted(caller.scopes)) or 'none'}", "scope", path=scope["path"])(
                scope, receive, send)
            return
        Request(scope).state.caller = caller  # the request's state: scope["state"], made where missing
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body up front, at most `max_bytes` of it, and answers 413 beyond that.

    Buffering here (1 MiB at most) is what makes the limit hold whatever Content-Length says; the
    route then gets the body replayed from memory. A route of class StreamedBodyRoute (an upload) is passed
    through unread: it streams its body and counts it itself.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, routes: list[BaseRoute] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streamed = frozenset((method, route.path) for route in routes or () if isinstance(route, StreamedBodyRoute)
                                  for method in route.methods)

    def _too_large(self, path: str) -> Response:
        return error_response(413, ErrorCode.PAYLOAD_TOO_LARGE,
                              f"the body is larger than {self.max_bytes} bytes, the limit", "body", path=path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.streamed:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope["path"])(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope["path"])(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of the range of a 64-bit float")
    return value


def strict_json(raw: bytes) -> Any:
    """RFC 8259 JSON only: Python's json also takes NaN, Infinity and -Infinity, which no field means and
    Postgres JSONB cannot store; numbers that overflow to infinity are refused for the same reason."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"the body is not UTF-8 ({exc.reason} at byte {exc.start})", "", 0) from None
    except ValueError as exc:  # the hooks above, or an integer Python will not read
        message = str(exc)
        if "digits" in message:
            message = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        raise json.JSONDecodeError(message, "", 0) from None


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """Routes whose JSON bodies are parsed by `strict_json`; FastAPI turns its errors into a 422."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


class StreamedBodyRoute(APIRoute):
    """A route that reads its own body as a stream (`request.stream()`) and bounds it itself: BodyLimit passes
    its requests through unread. Its path must be literal (no parameters): BodyLimit compares it as a string."""
