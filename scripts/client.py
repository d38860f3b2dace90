"""A small client for the service: submit a job and follow its events live over SSE."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx


def submit(base: str, job: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(f"{base}/jobs", json=job, headers=headers, timeout=30)
    if r.status_code != 201:
        raise RuntimeError(f"POST /jobs answered {r.status_code}: {r.text}")
    return r.json()


def sse_events(base: str, job_id: str, *, last_event_id: int | None = None, timeout: float = 600,
               token: str | None = None) -> Iterator[dict[str, Any]]:
    """Yields each event of the job's SSE stream until the server ends it (the job ended)."""
    headers = {"Accept": "text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    with httpx.stream("GET", f"{base}/jobs/{job_id}/events", headers=headers,
                      timeout=httpx.Timeout(timeout, connect=10)) as r:
        r.raise_for_status()
        data: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                yield json.loads("\n".join(data))
                data = []


def progress_line(job_id: str, p: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    return (f"{job_id}  step {p.get('step', 0)}/{p.get('total_steps') or '?'}  loss {num(p.get('loss'), '.4f')}  "
            f"{num(p.get('tokens_per_second'), ',.0f')} tok/s  eta {num(p.get('eta_seconds'), '.0f')} s")


def follow(base: str, job_id: str, on_event: Callable[[dict[str, Any]], None], timeout: float = 1800,
           token: str | None = None) -> None:
    """Follows the stream, reconnecting after the last event seen if the connection drops."""
    last: int | None = None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            for ev in sse_events(base, job_id, last_event_id=last, timeout=timeout, token=token):
                last = ev["id"]
                on_event(ev)
            return
        except httpx.TransportError:
            time.sleep(1)
    raise TimeoutError(f"job {job_id} did not end within {timeout} s")
