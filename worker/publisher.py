"""Publishes a job attempt's events into the shared Redis stream, tagged with job and attempt."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from contract.protocol import EVENTS_STREAM
from core.serverpaths import ServerPaths

# Bounds the live stream; the control plane copies every entry into Postgres long before this trims.
STREAM_MAXLEN = 200_000


class Publisher:
    def __init__(self, client: redis.Redis, job_id: str, attempt: int, paths: ServerPaths | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.attempt = attempt
        # Every event is what a client reads (its job's row, events, logs, webhooks): no path of the server's.
        self.paths = paths or ServerPaths([])
        # The stream id of the last event this publisher added: what the control plane must have ingested
        # before it acts on a hand-back (controlplane/reaper.py), lest the attempt's last events arrive superseded.
        self.last_id: str | None = None

    def _fields(self, kind: str, data: dict[str, Any]) -> dict[str, str]:
        return {"job_id": self.job_id, "attempt": str(self.attempt), "type": kind,
                "ts": repr(time.time()), "data": json.dumps(self.paths.value(data), default=str)}

    def emit(self, kind: str, **data: Any) -> None:
        added = self.client.xadd(EVENTS_STREAM, self._fields(kind, data), maxlen=STREAM_MAXLEN, approximate=True)
        self.last_id = added.decode() if isinstance(added, bytes) else str(added)

    def emit_many(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        for kind, data in items:
            pipe.xadd(EVENTS_STREAM, self._fields(kind, data), maxlen=STREAM_MAXLEN, approximate=True)
        added = pipe.execute()[-1]
        self.last_id = added.decode() if isinstance(added, bytes) else str(added)
