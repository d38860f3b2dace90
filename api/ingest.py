"""Moves events from the Redis stream into Postgres: job state, progress, checkpoints, durable log.

Reads through a consumer group and acknowledges only after the Postgres commit, so a crash
re-reads what was not stored; each entry's stream id is unique in Postgres, so a re-read is
never stored twice. Events of an attempt that is no longer current are dropped (fencing).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.db import session_scope
from api.models import TERMINAL, Job, JobEvent
from api.services import events
from worker.keys import EVENTS_STREAM, INGEST_GROUP

log = logging.getLogger(__name__)

PROGRESS_FIELDS = ("step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens_per_second", "eta_seconds",
                   "mfu", "peak_memory_bytes")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def apply_state(job: Job, data: dict[str, Any]) -> None:
    status = data.get("status")
    if status == "starting" and job.status == "queued":
        job.status = "starting"
    elif status == "running" and job.status in ("queued", "starting"):
        job.status = "running"
        job.started_at = job.started_at or _now()
    elif status in TERMINAL:
        job.status = status
        job.finished_at = _now()
        job.error = data.get("error")
        if data.get("output"):
            job.output = data["output"]
        if data.get("usage"):
            job.progress = {**(job.progress or {}), **data["usage"]}


def apply_event(job: Job, kind: str, data: dict[str, Any]) -> None:
    """What an event means for the job row; every event is also kept in the log as it came."""
    if kind == "state":
        apply_state(job, data)
    elif kind == "started":
        job.progress = {**(job.progress or {}), "step": data.get("resumed_from_step") or 0,
                        "total_steps": data.get("total_steps"), "packing_efficiency": data.get("packing_efficiency")}
    elif kind == "progress":
        job.progress = {**(job.progress or {}), **{k: data[k] for k in PROGRESS_FIELDS if k in data}}
    elif kind == "checkpoint":
        removed = set(data.get("removed") or [])
        removed.add(data.get("path"))
        kept = [c for c in (job.checkpoints or []) if c.get("path") not in removed]
        kept.append({"step": data.get("step"), "path": data.get("path"), "committed": bool(data.get("committed")),
                     "attempt": job.attempt, "created_at": _now().isoformat()})
        job.checkpoints = sorted(kept, key=lambda c: c["step"] or 0)
    elif kind == "resolved":
        # The trainer measured the device and replaced an estimated micro batch: the job shows what ran.
        resolved = dict(job.resolved)
        ds = dict(resolved.get("deepspeed_config", {}))
        for key, ds_key in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                            ("gradient_accumulation_steps", "gradient_accumulation_steps")):
            if isinstance(data.get(key), int):
                resolved[key] = ds[ds_key] = data[key]
        resolved["deepspeed_config"] = ds
        resolved["notes"] = [*resolved.get("notes", []), str(data.get("reason", ""))]
        job.resolved = resolved
    elif kind == "completed":
        job.output = {**(job.output or {}), **{k: v for k, v in data.items() if k not in ("ts", "rank")}}


class Ingester:
    def __init__(self, client: redis.Redis, *, consumer: str = "ingester", batch: int = 500) -> None:
        self.r = client
        self.consumer = consumer
        self.batch = batch
        self._pending_done = False

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(EVENTS_STREAM, INGEST_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _read(self, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        # First what this consumer read but never acknowledged (a crash between commit and ack), then new.
        start = "0" if not self._pending_done else ">"
        try:
            reply = self.r.xreadgroup(INGEST_GROUP, self.consumer, {EVENTS_STREAM: start}, count=self.batch,
                                      block=None if start == "0" else block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # Redis restarted without its data: start the group again
            self._pending_done = False
            return []
        entries = [(eid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                   for _, msgs in reply or [] for eid, fields in msgs]
        if start == "0" and not entries:
            self._pending_done = True
        return entries

    def step(self, block_ms: int = 500) -> int:
        """Ingest one batch; returns how many entries it read (0 when caught up)."""
        entries = self._read(block_ms)
        if not entries:
            return 0
        with session_scope() as session:
            store(session, entries)
        self.r.xack(EVENTS_STREAM, INGEST_GROUP, *[eid for eid, _ in entries])
        # Acknowledged entries are in Postgres: drop them so the live stream holds only what is in flight.
        self.r.xdel(EVENTS_STREAM, *[eid for eid, _ in entries])
        return len(entries)


def store(session: Session, entries: list[tuple[str, dict[str, str]]]) -> None:
    ids = [eid for eid, _ in entries]
    seen = set(session.scalars(select(JobEvent.source_id).where(JobEvent.source_id.in_(ids))))
    by_job: dict[str, list[tuple[str, dict[str, str]]]] = defaultdict(list)
    for eid, fields in entries:
        if eid not in seen and "job_id" in fields:
            by_job[fields["job_id"]].append((eid, fields))
    for job_id in sorted(by_job):  # a fixed lock order: two ingesters can never deadlock
        job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
        if job is None:
            continue
        for eid, fields in by_job[job_id]:
            if int(fields.get("attempt", 0)) != job.attempt or job.status in TERMINAL:
                continue  # a superseded attempt, or a job that already ended: not the job's story
            try:
                data = json.loads(fields.get("data") or "{}")
            except ValueError:
                data = {"raw": fields.get("data")}
            kind = fields.get("type", "unknown")[:32]
            apply_event(job, kind, data)
            events.append(session, job, kind, data, source_id=eid)
