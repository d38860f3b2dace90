"""Prometheus metrics of the control plane, on its own port (`FT_CONTROLPLANE_METRICS_PORT`; unset: none).

One process, so plain in-process metrics (no multiprocess files): how far ingest lags behind the workers (each
stream entry's id is the millisecond the worker published it; the lag is from then to the commit that stored it),
the events stored, what the reaper acted on (requeues, jobs ended as lost, re-drives) and the task messages the
dispatcher sent. Running jobs' figures (step, loss, tokens/s, MFU, peak GPU memory), labelled with job id, owner
and queue, are read from Postgres when scraped, from the rows the ingester keeps up to date: a job that ended is
not running, so it leaves the gauges at the next scrape, and no series outlives its job (bounded cardinality).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from db import attempts
from db.engine import session_scope

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
INGEST_LAG = Histogram("ft_ingest_lag_seconds", "From a worker publishing an event to the control plane storing it "
                       "in Postgres", buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
                       registry=REGISTRY)
INGEST_LAST_LAG = Gauge("ft_ingest_last_lag_seconds", "The lag of the newest event stored", registry=REGISTRY)
INGESTED = Counter("ft_ingest_events_total", "Events stored in Postgres", registry=REGISTRY)
REAPED = Counter("ft_reaper_actions_total", "Jobs the reaper requeued (lost or released worker), ended as lost, or "
                 "re-drove after a Redis data loss", registry=REGISTRY)
DISPATCHED = Counter("ft_dispatched_total", "Task messages the dispatcher sent (first sends, requeues, re-drives)",
                     registry=REGISTRY)

# progress key -> (metric, help)
FIGURES = {
    "step": ("ft_job_step", "The running job's last reported optimizer step"),
    "total_steps": ("ft_job_total_steps", "The running job's total steps"),
    "loss": ("ft_job_loss", "The running job's last training loss"),
    "tokens_per_second": ("ft_job_tokens_per_second", "The running job's training throughput"),
    # What each MFU counts: trainer/flops.py.
    "mfu": ("ft_job_mfu", "The running job's model FLOPs utilisation (0-1), 6N plus attention over the whole row"),
    "mfu_6n": ("ft_job_mfu_6n", "The running job's model FLOPs utilisation (0-1), 6N alone"),
    "mfu_attended": ("ft_job_mfu_attended", "The running job's model FLOPs utilisation (0-1), 6N plus attention "
                     "over the documents attended"),
    "peak_memory_bytes": ("ft_job_peak_memory_bytes", "The running job's peak GPU memory per device"),
}
LABELS = ["job_id", "owner", "queue"]


class RunningJobs(Collector):
    """Per running job, its figures from the job row, read at scrape time (in the scrape's own thread)."""

    def collect(self) -> Iterator[Any]:
        families = {key: GaugeMetricFamily(name, doc, labels=LABELS) for key, (name, doc) in FIGURES.items()}
        ok = GaugeMetricFamily("ft_running_jobs_scrape_ok", "1 when Postgres answered this scrape")
        try:
            with session_scope() as session:
                rows = attempts.running(session)
            for job_id, owner, queue, progress in rows:
                for key, family in families.items():
                    value = (progress or {}).get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        family.add_metric([job_id, owner, queue], float(value))
            ok.add_metric([], 1)
        except Exception as exc:
            log.warning("metrics: could not read running jobs: %s", type(exc).__name__)
            ok.add_metric([], 0)
        yield from families.values()
        yield ok


REGISTRY.register(RunningJobs())


def start(port: int | None) -> int | None:
    """Serves the metrics on `port` (FT_CONTROLPLANE_METRICS_PORT; all interfaces: Prometheus scrapes it from its
    own container); returns the port, or None where it is unset."""
    if port is None:
        return None
    start_http_server(port, registry=REGISTRY)
    log.info("metrics on port %s", port)
    return int(port)


def ingested(entry_ids: list[str]) -> None:
    """Records the entries a pass stored: the id's first part is when Redis took it from the worker (ms)."""
    if not entry_ids:
        return
    now = time.time()
    for entry_id in entry_ids:
        lag = max(0.0, now - int(entry_id.split("-", 1)[0]) / 1000)
        INGEST_LAG.observe(lag)
    INGEST_LAST_LAG.set(lag)
    INGESTED.inc(len(entry_ids))


def reaped(job_ids: list[str]) -> None:
    REAPED.inc(len(job_ids))


def counting_sends(step: Callable[[], int]) -> Callable[[], int]:
    """The dispatcher's step, counting what it sent (it returns the number)."""
    def counted() -> int:
        sent = step()
        DISPATCHED.inc(sent)
        return sent
    return counted
