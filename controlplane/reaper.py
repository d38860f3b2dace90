"""Finds attempts whose worker stopped heartbeating and requeues them as the next attempt.

Also re-asserts the control keys every pass (current attempt, cancel requests), so a Redis that
restarted without its data cannot make workers lose track of their jobs, and re-drives the queued
jobs whose task messages a Redis lost with its data (RedisLossWatch tells when). It never sends a
task itself: a requeued or re-driven job is committed as queued and unsent, and the dispatcher
(controlplane/dispatcher.py) sends it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import redis

from contract.codes import JobStatus
from contract.protocol import (
    CANCEL_KEY_TTL,
    EVENTS_STREAM,
    INGEST_GROUP,
    attempt_key,
    cancel_key,
    lease_key,
    part_done_key,
    released_key,
)
from controlplane.settings import ControlPlaneSettings
from db import attempts
from db.engine import session_scope

log = logging.getLogger(__name__)

# Written by the control plane with a random value and never deleted: if it is gone or changed, the
# Redis lost its data (a restart without persistence, a flush, a failover to an empty replica).
DATASET_KEY = "ft:controlplane:dataset"
# How long after a loss queued jobs are still looked at: a dispatcher that had sent a task just before the
# loss may commit its dispatched_at only a little later.
REDRIVE_WINDOW_SECONDS = 60.0


class RedisLossWatch:
    """Tells when a Redis lost its data set, from a marker key that only a data loss removes."""

    def __init__(self, clients: list[redis.Redis]) -> None:
        self.clients = clients
        self.tokens: list[bytes | None] = [None] * len(clients)
        # Set before the marker is written again: a check that fails halfway still reports the loss next time.
        self.unreported = False

    def check(self) -> bool:
        """True when some Redis lost its data since the last check (and on a first start without a marker:
        then it is new, or lost its data while no control plane ran, and nothing tells which)."""
        for i, client in enumerate(self.clients):
            value = client.get(DATASET_KEY)
            if value is None or (self.tokens[i] is not None and value != self.tokens[i]):
                self.unreported = True
                client.set(DATASET_KEY, secrets.token_hex(16), nx=True)
                value = client.get(DATASET_KEY)
            self.tokens[i] = value
        lost, self.unreported = self.unreported, False
        return lost


class Reaper:
    def __init__(self, client: redis.Redis, settings: ControlPlaneSettings) -> None:
        self.r = client
        self.settings = settings
        self.missing_since: dict[tuple[str, int], float] = {}
        self.last_pass: float | None = None
        # No lease counts as missing before this (monotonic): the leases were lost with Redis's data.
        self.quiet_until = 0.0
        # The latest Redis data loss, while queued jobs may still need re-driving: when it was noticed by
        # this host's clock, and by the database's (worked out on the first pass that reaches the database).
        self.lost_at: datetime | None = None
        self.lost_mono = 0.0
        self.lost_at_db: datetime | None = None
        self.redrive_deadline: float | None = None
        self.redriven: set[str] = set()

    def data_lost(self) -> None:
        """Redis restarted empty: every queued task message, lease and claim key is gone."""
        log.warning("Redis lost its data: re-driving queued jobs; running ones keep their worker if it "
                    "re-creates its lease within %.0f s", self.settings.lease_ttl_seconds)
        self.lost_at, self.lost_mono, self.lost_at_db = datetime.now(timezone.utc), time.monotonic(), None
        self.redrive_deadline = None
        self.redriven = set()
        self.missing_since.clear()
        self.quiet_until = time.monotonic() + self.settings.lease_ttl_seconds

    def step(self) -> list[str]:
        """One pass; returns the ids of jobs it requeued, ended or re-drove."""
        clock = time.monotonic()
        if self.last_pass is not None and clock - self.last_pass > max(self.settings.lease_grace_seconds,
                                                                      self.settings.lease_ttl_seconds):
            # Nobody watched the leases for a while (an outage): what was seen missing before says nothing now.
            self.missing_since.clear()
        acted = self._redrive()
        with session_scope() as session:
            # The jobs a worker holds. Queued jobs need no keys re-asserted: their attempt key is set when
            # they are sent, and after a Redis data loss they are re-sent.
            active = attempts.active(session)
            pipe = self.r.pipeline(transaction=False)
            for job in active:
                pipe.set(attempt_key(job.id), job.attempt)
                if job.status == JobStatus.CANCELLING:
                    pipe.set(cancel_key(job.id), job.attempt, ex=CANCEL_KEY_TTL)
            # A multi-node job has one lease per node's part: it is alive while every part holds its lease
            # or ended cleanly (done), and lost as a whole when one part is missing.
            parts = [max(1, len(job.placement or [])) for job in active]
            for job, n in zip(active, parts, strict=True):
                for part in range(n):
                    pipe.exists(lease_key(job.id, job.attempt, part), part_done_key(job.id, job.attempt, part))
                    pipe.get(released_key(job.id, job.attempt, part))
            asked = 2 * sum(parts)
            replies = pipe.execute()[-asked:] if asked else []
        clock = time.monotonic()
        live = set()
        gathered, at = [], 0
        for n in parts:
            mine = replies[at:at + 2 * n]
            at += 2 * n
            gathered.append((all(mine[::2]), next((r for r in mine[1::2] if r is not None), None)))
        for job, (alive, released) in zip(active, gathered, strict=True):
            key = (job.id, job.attempt)
            live.add(key)
            if released is not None and not alive:
                # Its worker shut down cleanly after a checkpoint, its processes already gone: not a loss.
                note = json.loads(released)
                # Not before the ingester stored the attempt's last events (its checkpoint among them): once
                # the job is on its next attempt they would be dropped as a superseded attempt's.
                if ingested(self.r, note.pop("stream_id", None)) and self._lost(job.id, job.attempt,
                                                                                 released=note):
                    acted.append(job.id)
                continue
            if alive or clock < self.quiet_until:
                self.missing_since.pop(key, None)
                continue
            first = self.missing_since.setdefault(key, clock)
            if clock - first >= self.settings.lease_grace_seconds:
                if self._lost(job.id, job.attempt):
                    acted.append(job.id)
                self.missing_since.pop(key, None)
        self.missing_since = {k: v for k, v in self.missing_since.items() if k in live}
        self.last_pass = time.monotonic()
        return acted

    def _lost(self, job_id: str, attempt: int, released: dict[str, Any] | None = None) -> bool:
        """Requeue (or end) the attempt; `released` is what a worker that handed the job back said."""
        with session_scope() as session:
            done = attempts.reap(session, job_id, attempt, max_attempts=self.settings.max_attempts, released=released)
        if done is not None and done.status == JobStatus.QUEUED:
            log.warning("job %s on attempt %d: %s as attempt %d", job_id, attempt, done.reason, done.attempt)
            # Published now, not when the next attempt is sent (a gang may wait long for nodes): what is left of
            # the old attempt (a surviving node's ranks, held up by a commit that waits for the lost node) is
            # stale at once, so its guard and worker end it and free its slots.
            try:
                self.r.set(attempt_key(job_id), done.attempt)
            except redis.RedisError as exc:
                log.warning("job %s: attempt %d not published yet (its dispatch will): %s", job_id, done.attempt, exc)
        return done is not None

    def _redrive(self) -> list[str]:
        """Re-send the queued jobs whose task messages were in the Redis that lost its data.

        Each goes out as its next attempt, not again as the same one: a worker may have claimed the
        attempt just before the loss, and its claim key went with the data, so a second message for
        that attempt could start it twice. The new attempt number fences such a worker instead: it
        finds the attempt key moved on and stops, and its events are dropped as superseded.
        """
        if self.lost_at is None:
            return []
        if self.redrive_deadline is not None and time.monotonic() > self.redrive_deadline:
            self.lost_at = None
            return []
        with session_scope() as session:
            now_db = attempts.db_now(session)
            if self.lost_at_db is None:
                self.lost_at_db = now_db - timedelta(seconds=time.monotonic() - self.lost_mono)
            sent = attempts.redrive(session, lost_at=self.lost_at, lost_at_db=self.lost_at_db, now_db=now_db,
                                    skip=self.redriven)
        self.redriven.update(job_id for job_id, _ in sent)
        for job_id, attempt in sent:
            log.warning("job %s goes out again as attempt %d after Redis lost its data", job_id, attempt)
        if self.redrive_deadline is None:
            self.redrive_deadline = time.monotonic() + REDRIVE_WINDOW_SECONDS
        return [job_id for job_id, _ in sent]


def _stream_id(value: str | bytes) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def ingested(client: redis.Redis, entry_id: str | None) -> bool:
    """Whether the ingester's consumer group has stored (read and acknowledged) the stream entry `entry_id`
    and everything before it."""
    if not entry_id:
        return True
    try:
        groups = client.xinfo_groups(EVENTS_STREAM)
        group = next((g for g in groups if g["name"] in (INGEST_GROUP, INGEST_GROUP.encode())), None)
        if group is None:
            return True  # no group: Redis lost its data, and the entry with it
        if _stream_id(group["last-delivered-id"]) < _stream_id(entry_id):
            return False
        pending = client.xpending(EVENTS_STREAM, INGEST_GROUP)
        return not pending["pending"] or _stream_id(pending["min"]) > _stream_id(entry_id)
    except redis.ResponseError:
        return True  # no stream: nothing was published that could still be ingested

