"""The control-plane loop: ingest events into Postgres, then reap lost workers, forever.

Run one per deployment: `python -m api.controlplane`.
"""

from __future__ import annotations

import logging
import signal
import time

import redis

from api.ingest import Ingester
from api.reaper import Reaper
from api.settings import get_settings

log = logging.getLogger("controlplane")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url)
    ingester = Ingester(client, batch=settings.ingest_batch)
    reaper = Reaper(client, settings)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("control plane running")
    next_reap = 0.0
    while not stopping:
        try:
            # The ingester creates its consumer group on first read (and again if Redis lost it).
            caught_up = ingester.step(block_ms=int(settings.loop_interval_seconds * 1000)) < settings.ingest_batch
            # Reap only when the ingester is caught up: a terminal state still in the stream is not a lost worker.
            if caught_up and time.monotonic() >= next_reap:
                reaper.step()
                next_reap = time.monotonic() + settings.loop_interval_seconds
        except (redis.RedisError, OSError) as exc:
            log.warning("redis unavailable (%s); retrying", exc)
            time.sleep(1)
        except Exception:
            log.exception("control-plane pass failed; retrying")
            time.sleep(1)
    log.info("control plane stopped")


if __name__ == "__main__":
    main()
