"""Prometheus metrics of the API at `/metrics`: requests and their latency per route template, and the jobs by
state and queue, read from Postgres when scraped.

Several uvicorn worker processes share one port (`FT_API_WORKERS`), so a scrape reaches one of them at random.
Counters kept per process would each tell a part, and a `process` label would only make those parts come and
go between scrapes. So this uses prometheus-client's multiprocess mode: each process writes its counters and
histogram buckets to its own memory-mapped file (an increment is a store into shared memory: no system call,
no lock shared between processes), and the scraped process sums every file of the directory. The directory is
PROMETHEUS_MULTIPROC_DIR where the operator set one, else one per uvicorn supervisor (the worker processes'
common parent), so a restarted API starts from zero and two API deployments on one host never mix.

Only counters and histograms live in the files (they sum correctly over live and ended processes); what is a
level (jobs by state) is read from Postgres at scrape time, so it is never stale and costs no request anything.
`/metrics` is answered here, before the key check, like the probes: it names routes, states and queues, never a
job, a key or an owner.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

DIR_PREFIX = "ft-api-metrics-"


def _remove_orphans(base: str) -> None:
    """The directories of API supervisors that have exited: nothing will read them again."""
    for name in os.listdir(base):
        pid = name.removeprefix(DIR_PREFIX)
        if name.startswith(DIR_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _multiprocess_dir() -> str:
    """Where this API's processes keep their metric files; set before prometheus_client is imported, which
    reads it then."""
    configured = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if configured:
        return configured
    parent = multiprocessing.parent_process()  # uvicorn --workers: the supervisor; a single process: none
    base = tempfile.gettempdir()
    _remove_orphans(base)
    path = os.path.join(base, f"{DIR_PREFIX}{parent.pid if parent else os.getpid()}")
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


MULTIPROC_DIR = _multiprocess_dir()

from prometheus_client import (  # noqa: E402  (after the directory is set)
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402
from starlette.types import ASGIApp, Message, Receive, Scope, Send  # noqa: E402

from db import reads  # noqa: E402

PATH = "/metrics"
# A client chooses the method: anything else is counted as one value, so it cannot make series without bound.
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
UNROUTED = "unrouted"  # refused before routing (401, 403, 413) or no route: the status says which
REQUESTS = Counter("ft_api_requests_total", "HTTP requests answered, per route template", ["method", "route", "status"])
LATENCY = Histogram("ft_api_request_duration_seconds", "Time to answer a request (a stream: until it ended)",
                    ["method", "route"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
GC_PAUSE = Histogram("ft_api_gc_pause_seconds", "Garbage-collection pauses of the API processes, by generation",
                     ["generation"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))



class _Families(Collector):
    """Metric families computed for one scrape."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        yield from self.families


async def job_families() -> list[Any]:
    jobs = GaugeMetricFamily("ft_jobs", "Jobs by state and queue (from Postgres at scrape time)",
                             labels=["status", "queue"])
    oldest = GaugeMetricFamily("ft_queue_oldest_wait_seconds", "How long the oldest queued job of each queue has "
                               "waited", labels=["queue"])
    up = GaugeMetricFamily("ft_jobs_scrape_ok", "1 when Postgres answered this scrape's job queries")
    try:
        by_state, oldest_queued = await reads.job_counts()
        for status, queue, n in by_state:
            jobs.add_metric([status, queue], n)
        for queue, seconds in oldest_queued:
            oldest.add_metric([queue], seconds)
        up.add_metric([], 1)
    except Exception:  # Postgres down: the request metrics are still worth a scrape
        up.add_metric([], 0)
    return [jobs, oldest, up]


async def exposition() -> bytes:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=MULTIPROC_DIR)
    registry.register(_Families(await job_families()))
    return generate_latest(registry)


class Metrics:
    """ASGI middleware, outermost: times every request and counts it under its route's template (`/jobs/{job_id}`,
    never the raw path, which would make a series per job), and answers GET /metrics itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # Children by labels, so a request looks its series up in a dict rather than through the metric's lock.
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._latencies: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == PATH and scope["method"] == "GET":
            body = await exposition()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        start = time.perf_counter()
        status = 500  # what the server answers if the app raises before starting a response

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # The router put the matched route into the (shared) scope; its path is the template.
            route = scope.get("route")
            method = scope["method"] if scope["method"] in METHODS else "OTHER"
            self.record(method, getattr(route, "path", UNROUTED), status, time.perf_counter() - start)

    def record(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = REQUESTS.labels(method, route, str(status))
        counter.inc()
        latency = self._latencies.get(key[:2])
        if latency is None:
            latency = self._latencies[key[:2]] = LATENCY.labels(method, route)
        latency.observe(seconds)
