"""The dashboards' poll, `GET /jobs/{id}`, answered from the job cache before FastAPI's router sees it.

Dashboards poll this one route more than every other together, and with the job's JSON in this process's cache
(api/jobcache.py) little of a poll's cost was the answer: most was the framework around it (matching the path
against every route, solving the route's dependencies, the exception and exit-stack middleware). On two cores the
API is CPU-bound under a poll load, so a closed loop of clients waits in proportion to each request's CPU time:
this path does only what the route did (the caller KeyAuth found, `deps.job_for_caller`, the bytes as they are).

Only a job found is answered here. Anything else (no such job or another owner's, Postgres unreachable, a bug)
goes on to the app as if this path did not exist, so every error is the app's own answer, in the one error shape,
from the one set of handlers. The route stays declared in api/routes/jobs.py, for the OpenAPI document and for
the requests this path passes on; the metrics count a poll under its template as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fastapi.routing import APIRoute
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from api.deps import ID_PATTERN, job_for_caller

ROUTE = "/jobs/{job_id}"
JOB_PATH = re.compile("/jobs/(" + ID_PATTERN.strip("^$") + ")")
HEADERS = [(b"content-type", b"application/json")]


class JobPoll:
    """ASGI middleware, inside KeyAuth (which put the caller in the request's state and checked its scope)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.route = next(r for r in routes if isinstance(r, APIRoute) and r.path == ROUTE and "GET" in r.methods)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = JOB_PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "GET" else None
        try:
            caller = scope["state"]["caller"]  # the request's state, where KeyAuth put it
        except KeyError:
            caller = None
        if found is None or caller is None:
            await self.app(scope, receive, send)
            return
        try:
            body = await job_for_caller(found[1], caller)
        except Exception:
            await self.app(scope, receive, send)  # the app answers it, as it answers every error
            return
        scope["route"] = self.route  # what the metrics label a request by (api/metrics.py)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*HEADERS, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
