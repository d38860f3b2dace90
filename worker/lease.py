"""A part's lease on its attempt: the key in Redis that says its worker is alive, renewed while the part lives.

The control plane treats an attempt part whose lease lapsed (and that is not done) as a lost node, and the
guard (worker/guard.py) ends the part's processes once the lease can no longer be its own.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from contract.protocol import lease_key, released_key

log = logging.getLogger(__name__)
KEEP_SECONDS = 7 * 24 * 3600  # how long an attempt's own keys (stop, part done, released) stay in Redis


def worker_id() -> str:
    """This worker process, as its leases and claims name it."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    def __init__(self, client: redis.Redis, job_id: str, attempt: int, part: int) -> None:
        self.r = client
        self.key = lease_key(job_id, attempt, part)
        self.released = released_key(job_id, attempt, part)
        self.owner = worker_id()
        self.expires_at = 0.0  # epoch seconds: when the last lease this worker set runs out

    def renew(self, ttl: float) -> None:
        sent = time.time()
        try:
            self.r.set(self.key, self.owner, px=int(ttl * 1000))
            self.expires_at = sent + ttl
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    @contextmanager
    def kept(self, ttl: float, every: float) -> Iterator[None]:
        """Renewed every `every` seconds from a thread of its own while the block runs: for work after the ranks
        ended (the export's upload) whose single calls can block longer than a TTL, and whose guard is gone."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(every):
                self.renew(ttl)

        self.renew(ttl)
        thread = threading.Thread(target=beat, name=f"lease {self.key}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def hand_back(self, note: dict[str, Any]) -> None:
        """The part released its attempt (the worker shuts down): say why, and drop the lease at once."""
        try:
            self.r.pipeline(transaction=False).set(self.released, json.dumps(note), ex=KEEP_SECONDS).delete(
                self.key).execute()
        except redis.RedisError as exc:
            log.warning("could not hand the job back (its lease expires by itself): %s", exc)
