"""The control-plane loop: ingest events into Postgres, then reap lost workers, forever; beside it the
dispatcher thread sends queued jobs to the workers, and the validator thread checks uploaded files.

Run one per deployment: `python -m controlplane`. It never exits on an outage: Redis or Postgres
going away is logged and retried with a growing pause, and the next pass reconnects (both clients
open new connections by themselves). Nothing is held only in memory: what was not stored stays
pending in the Redis stream, so a restart, even after SIGKILL, continues where this one stopped.
"""

from __future__ import annotations

import logging
import signal
import time

import redis
from sqlalchemy.exc import DBAPIError

from controlplane import metrics
from controlplane.deliverer import Deliverer
from controlplane.dispatcher import Dispatcher
from controlplane.ingest import Ingester, first_line, transient
from controlplane.reaper import Reaper, RedisLossWatch
from controlplane.settings import ControlPlaneSettings
from controlplane.validator import Validator
from core.settings import settings_or_exit
from db.notify import Notifications

log = logging.getLogger("controlplane")

BACKOFF_FIRST_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 5.0  # short: once the outage ends, the backlog should move within seconds


def describe(exc: BaseException) -> str:
    if isinstance(exc, redis.RedisError):
        return f"Redis unavailable: {first_line(exc)}"
    if isinstance(exc, DBAPIError):
        return f"Postgres unavailable: {first_line(exc)}"
    return f"connection failed: {first_line(exc)}"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_or_exit(ControlPlaneSettings, "control plane")
    # Blocking reads wait at most loop_interval; a timeout well above that means the connection is dead.
    timeout = max(5.0, 4 * settings.loop_interval_seconds)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
    watched = [client]
    if settings.broker != settings.redis_url:  # the task messages live in the broker's Redis
        watched.append(redis.Redis.from_url(settings.broker, socket_timeout=timeout, socket_connect_timeout=timeout))
    watch = RedisLossWatch(watched)
    ingester = Ingester(client, batch=settings.ingest_batch)
    reaper = Reaper(client, settings)
    # One LISTEN connection for the process: it wakes the dispatcher (ft_dispatch), the deliverer (ft_webhooks) and
    # the validator (ft_files).
    notifications = Notifications(settings.database_url)
    dispatcher = Dispatcher(client, settings, notifications)
    # Its thread calls step(); counted from outside, so the dispatcher knows nothing of metrics.
    dispatcher.step = metrics.counting_sends(dispatcher.step)  # type: ignore[method-assign]
    deliverer = Deliverer(settings, notifications)  # webhooks: a thread and event loop of its own, off the ingest path
    validator = Validator(settings, notifications)
    metrics.start(settings.controlplane_metrics_port)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    dispatcher.start()
    deliverer.start()
    validator.start()
    notifications.start()
    log.info("control plane running")
    next_reap = 0.0
    pause = BACKOFF_FIRST_SECONDS
    failing_since: float | None = None
    while not stopping:
        try:
            if watch.check():
                ingester.restart()
                reaper.data_lost()
            # The ingester creates its consumer group on first read (and again if Redis lost it).
            ingester.step(block_ms=int(settings.loop_interval_seconds * 1000))
            metrics.ingested(ingester.last_stored)
            # Reap only when the ingester is caught up: a terminal state still in the stream is not a lost worker.
            if ingester.caught_up and time.monotonic() >= next_reap:
                metrics.reaped(reaper.step())
                next_reap = time.monotonic() + settings.loop_interval_seconds
        except Exception as exc:
            if transient(exc):
                log.warning("%s; retrying in %.1f s", describe(exc), pause)
            else:
                log.exception("control-plane pass failed; retrying in %.1f s", pause)
            failing_since = failing_since if failing_since is not None else time.monotonic()
            end = time.monotonic() + pause
            while not stopping and time.monotonic() < end:
                time.sleep(0.1)
            pause = min(pause * 2, BACKOFF_MAX_SECONDS)
            continue
        if failing_since is not None:
            log.info("control plane recovered after %.1f s of failures", time.monotonic() - failing_since)
            failing_since, pause = None, BACKOFF_FIRST_SECONDS
    notifications.stop()
    dispatcher.stop()
    deliverer.stop()
    validator.stop()
    log.info("control plane stopped")


if __name__ == "__main__":
    main()
