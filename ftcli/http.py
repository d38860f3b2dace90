"""The API as the CLI sees it: configured requests, the service's error shape turned into one exception, and an
SSE reader that resumes after a dropped connection with Last-Event-ID."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contract.protocol import ERROR_BODY
from ftcli.settings import CliSettings

# What `make up` writes in the repository it ran from; read only when FT_API_KEY is unset.
DEV_KEY = Path("var") / "dev-key"
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 5.0


class CliError(Exception):
    """What the service (or the network) said went wrong, ready to print: never a traceback."""

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None, status: int | None = None,
                 details: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.field, self.status, self.details = message, code, field, status, details

    def as_json(self) -> dict[str, Any]:
        return {ERROR_BODY: {"code": self.code, "message": self.message, "field": self.field, "status": self.status,
                          **({"details": self.details} if self.details else {})}}


def api_key() -> str | None:
    key = CliSettings().key
    if key:
        return key.strip()
    if DEV_KEY.is_file():
        return DEV_KEY.read_text().strip() or None
    return None


def error_of(r: httpx.Response) -> CliError:
    """The service's `{"error": {"code", "message", "field"}}`, or the status and body of anything else (a proxy's
    page, say)."""
    try:
        err = r.json()[ERROR_BODY]
        return CliError(str(err.get("message")), code=err.get("code"), field=err.get("field"), status=r.status_code,
                        details=err.get("details"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return CliError(f"HTTP {r.status_code}: {r.text[:500]}", status=r.status_code)


@dataclass
class Api:
    url: str
    key: str | None
    timeout: float = 30.0

    @classmethod
    def from_env(cls) -> Api:
        return cls(CliSettings().api_url.rstrip("/"), api_key())

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return {**h, **(extra or {})}

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 202), **kw: Any) -> httpx.Response:
        try:
            r = httpx.request(method, self.url + path, headers=self.headers(kw.pop("headers", None)),
                              timeout=self.timeout, **kw)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach the API at {self.url}: {exc or type(exc).__name__} (set FT_API_URL)",
                           code="unreachable") from None
        if r.status_code not in ok:
            raise error_of(r)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()

    def stream_text(self, path: str, params: dict[str, Any]) -> Iterator[str]:
        """A plain-text stream (logs?follow=true) as it arrives."""
        try:
            with httpx.stream("GET", self.url + path, params=params, headers=self.headers(),
                              timeout=httpx.Timeout(self.timeout, read=None)) as r:
                if r.status_code != 200:
                    r.read()
                    raise error_of(r)
                yield from r.iter_text()
        except httpx.HTTPError as exc:
            raise CliError(f"the stream from {self.url} broke: {exc or type(exc).__name__}", code="unreachable") \
                from None

    def events(self, job_id: str, *, after: int = 0, types: list[str] | None = None,
               on_reconnect: Callable[[int, str], None] | None = None,
               give_up_seconds: float = 300.0) -> Iterator[dict[str, Any]]:
        """Every event of the job from `after` on, live, until the server ends the stream (the job ended and
        everything was sent). A dropped connection is resumed with Last-Event-ID, so no event is seen twice
        or missed; an error answer (401, 404) is raised, and so is an API unreachable for `give_up_seconds`."""
        last = after
        pause = RECONNECT_FIRST_SECONDS
        failing_since: float | None = None
        while True:
            headers = {"Accept": "text/event-stream", "Last-Event-ID": str(last)}
            try:
                with httpx.stream("GET", f"{self.url}/jobs/{job_id}/events", params={"type": types or []},
                                  headers=self.headers(headers),
                                  timeout=httpx.Timeout(self.timeout, read=None)) as r:
                    if r.status_code != 200:
                        r.read()
                        raise error_of(r)
                    failing_since, pause = None, RECONNECT_FIRST_SECONDS
                    for event in parse_sse(r.iter_lines()):
                        last = event["id"]
                        yield event
                return  # a clean end: the server closes the stream only after the job's last event
            except httpx.HTTPError as exc:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > give_up_seconds:
                    raise CliError(f"lost the event stream of {job_id} for {give_up_seconds:.0f} s: {exc}",
                                   code="unreachable") from None
                if on_reconnect is not None:
                    on_reconnect(last, str(exc) or type(exc).__name__)
                time.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_SECONDS)


def parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Events of an SSE stream (the `data:` JSON of each, which carries its id); comments (keep-alives) skipped."""
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            yield json.loads("\n".join(data))
            data = []
