"""Publishes a job attempt's events into the shared Redis stream, tagged with job and attempt."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from contract.protocol import EVENT_KEY_FIELD, EVENTS_STREAM
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
        # Each event's key (EVENT_KEY_FIELD): this publisher's token and the event's place in its order. A call whose
        # reply was lost (a link cut after Redis added the entries) is sent again with the same keys, and the ingester
        # stores each key once (db/ingest.py), so no event is stored twice.
        self.token = uuid.uuid4().hex[:16]
        self.sent = 0  # events acknowledged by Redis

    def _fields(self, kind: str, data: dict[str, Any], place: int) -> dict[str, str]:
        return {"job_id": self.job_id, "attempt": str(self.attempt), "type": kind,
                "ts": repr(time.time()), "data": json.dumps(self.paths.value(data), default=str),
                EVENT_KEY_FIELD: f"{self.token}-{place}"}

    def emit_many(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        """Add `items` to the stream, in order. After a call that raised, the next must start with the same items
        (the caller's unsent list, in order): Redis may have added some or all of them."""
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        for i, (kind, data) in enumerate(items):
            pipe.xadd(EVENTS_STREAM, self._fields(kind, data, self.sent + i), maxlen=STREAM_MAXLEN,
                      approximate=True)
        added = pipe.execute()[-1]
        self.sent += len(items)
        self.last_id = added.decode() if isinstance(added, bytes) else str(added)
