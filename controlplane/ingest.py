"""Moves events from the Redis stream into Postgres: job state, progress, checkpoints, durable log.

Reads through a consumer group and acknowledges only after the Postgres commit, so a crash or an
outage re-reads what was not stored: after any failure the ingester reads its own pending entries
again (from "0") before anything new. Each entry's stream id is unique in Postgres, so a re-read
is never stored twice. Events of an attempt that is no longer current are dropped (fencing); events
of the current attempt that arrive after the job ended are kept in the log, but the job's final
state and its row no longer change.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from contract.codes import TERMINAL_STATUSES, EventKind, JobStatus
from contract.protocol import EVENTS_STREAM, INGEST_GROUP
from db import events
from db.engine import session_scope
from db.models import Job, JobEvent

log = logging.getLogger(__name__)

# mfu, mfu_6n, mfu_attended: what each counts is in trainer/flops.py.
PROGRESS_FIELDS = ("step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens_per_second", "eta_seconds",
                   "mfu", "mfu_6n", "mfu_attended", "peak_memory_bytes")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def apply_state(job: Job, data: dict[str, Any]) -> None:
    status = data.get("status")
    if job.status in TERMINAL_STATUSES:
        return  # an ended job's state is final, whatever arrives after it
    if status == JobStatus.STARTING and job.status == JobStatus.QUEUED:
        job.status = JobStatus.STARTING
    elif status == JobStatus.RUNNING and job.status in (JobStatus.QUEUED, JobStatus.STARTING):
        job.status = JobStatus.RUNNING
        job.started_at = job.started_at or _now()
    elif status in TERMINAL_STATUSES:
        job.status = status
        job.finished_at = _now()
        job.error = data.get("error")
        if data.get("output"):
            job.output = data["output"]
        if data.get("usage"):
            job.progress = {**(job.progress or {}), **data["usage"]}


def apply_event(job: Job, kind: str, data: dict[str, Any]) -> None:
    """What an event means for the job row; every event is also kept in the log as it came."""
    if kind == EventKind.STATE:
        apply_state(job, data)
    elif kind == EventKind.STARTED:
        job.progress = {**(job.progress or {}), "step": data.get("resumed_from_step") or 0,
                        "total_steps": data.get("total_steps"), "packing_efficiency": data.get("packing_efficiency")}
    elif kind == EventKind.PROGRESS:
        job.progress = {**(job.progress or {}), **{k: data[k] for k in PROGRESS_FIELDS if k in data}}
    elif kind == EventKind.CHECKPOINT:
        removed = set(data.get("removed") or [])
        removed.add(data.get("path"))
        kept = [c for c in (job.checkpoints or []) if c.get("path") not in removed]
        kept.append({"step": data.get("step"), "path": data.get("path"), "committed": bool(data.get("committed")),
                     "attempt": job.attempt, "created_at": _now().isoformat()})
        job.checkpoints = sorted(kept, key=lambda c: c["step"] or 0)
    elif kind == EventKind.RESOLVED:
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
    elif kind == EventKind.COMPLETED:
        job.output = {**(job.output or {}), **{k: v for k, v in data.items() if k not in ("ts", "rank")}}


def _clean(value: Any) -> Any:
    """Postgres JSONB refuses NUL characters, lone surrogates and NaN or infinite numbers; a log line or a
    diverging loss may carry them. Without this one such event would fail its batch on every retry."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": what happened stays readable
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_clean(str(k)): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _attempt(fields: dict[str, str]) -> int | None:
    try:
        return int(fields.get("attempt", ""))
    except ValueError:
        return None


def _data(fields: dict[str, str]) -> dict[str, Any]:
    raw = fields.get("data") or "{}"
    try:
        data = json.loads(raw)
    except ValueError:
        data = {"raw": raw}
    if not isinstance(data, dict):
        data = {"value": data}
    return _clean(data)


def first_line(exc: BaseException) -> str:
    """The error without the statement and parameters a driver's message repeats on its next lines."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def transient(exc: BaseException) -> bool:
    """An error of the connection (Postgres or Redis away), not of the data: retrying the same batch helps."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OperationalError, InterfaceError, OSError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class Ingester:
    def __init__(self, client: redis.Redis, *, consumer: str = "ingester", batch: int = 500) -> None:
        self.r = client
        self.consumer = consumer
        self.batch = batch
        # Whether this consumer's pending list was read to its end since the last failure. Until then
        # every read is from "0": entries read but not acknowledged come first, in stream order.
        self._pending_done = False
        # True only after a read of new entries that found fewer than a batch: the stream is read up to
        # now. The reaper waits for it, since a terminal state still in the stream is not a lost worker.
        self.caught_up = False
        # The stream ids the last step stored (each id's first part is when Redis took the event): ingest lag.
        self.last_stored: list[str] = []

    def ensure_group(self) -> None:
        try:
            # From "0", not "$": after Redis lost its data, workers may have written to the new stream
            # before the group existed again, and those entries are to be ingested too.
            self.r.xgroup_create(EVENTS_STREAM, INGEST_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def restart(self) -> None:
        """Read from this consumer's pending entries again, as after a failure."""
        self._pending_done = False
        self.caught_up = False

    def _read(self, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        start = ">" if self._pending_done else "0"
        try:
            reply = self.r.xreadgroup(INGEST_GROUP, self.consumer, {EVENTS_STREAM: start}, count=self.batch,
                                      block=None if start == "0" else block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("the consumer group %s of %s is gone (Redis lost its data?); creating it again",
                        INGEST_GROUP, EVENTS_STREAM)
            self.ensure_group()
            self.restart()
            return []
        entries = [(eid.decode(), {k.decode(): v.decode("utf-8", "replace") for k, v in (fields or {}).items()})
                   for _, msgs in reply or [] for eid, fields in msgs]
        if start == "0" and not entries:
            self._pending_done = True
        self.caught_up = start == ">" and len(entries) < self.batch
        return entries

    def step(self, block_ms: int = 500) -> int:
        """Ingest one batch; returns how many entries it read (0 when caught up or only starting over)."""
        self.caught_up = False
        self.last_stored = []
        entries = self._read(block_ms)
        if not entries:
            return 0
        try:
            self._store(entries)
            ids = [eid for eid, _ in entries]
            self.r.xack(EVENTS_STREAM, INGEST_GROUP, *ids)
            # Acknowledged entries are in Postgres: drop them so the live stream holds only what is in flight.
            self.r.xdel(EVENTS_STREAM, *ids)
            self.last_stored = ids
        except BaseException:
            # Stored or not, these entries are still pending (nothing was acknowledged): read them again,
            # before anything newer, once Postgres and Redis answer. A ">" read would never return them.
            self.restart()
            raise
        return len(entries)

    def _store(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        try:
            with session_scope() as session:
                store(session, entries)
            return
        except Exception as exc:
            if transient(exc):
                raise
            log.warning("a batch of %d events could not be stored (%s); storing them one by one",
                        len(entries), first_line(exc))
        # Something in the batch itself fails: find it, so the others are stored and it cannot stall ingestion.
        for eid, fields in entries:
            try:
                with session_scope() as session:
                    store(session, [(eid, fields)])
                continue
            except Exception as exc:
                if transient(exc):
                    raise
                error = first_line(exc)[:500]
            log.error("event %s of job %s cannot be stored as it came (%s); storing what can be kept of it",
                      eid, fields.get("job_id"), error)
            kept = {**fields, "type": EventKind.UNREADABLE,
                    "data": json.dumps({"type": fields.get("type"), "raw": (fields.get("data") or "")[:20000],
                                        "error": error})}
            try:
                with session_scope() as session:
                    store(session, [(eid, kept)])
            except Exception as exc:
                if transient(exc):
                    raise
                # Not even the text can be stored (the job row itself is refused): keep ingesting the others.
                log.error("event %s is dropped (%s): %s", eid, first_line(exc), kept["data"][:2000])


def store(session: Session, entries: list[tuple[str, dict[str, str]]]) -> None:
    ids = [eid for eid, _ in entries]
    seen = set(session.scalars(select(JobEvent.source_id).where(JobEvent.source_id.in_(ids))))
    by_job: dict[str, list[tuple[str, dict[str, str]]]] = defaultdict(list)
    for eid, fields in entries:
        if not fields:
            log.error("stream entry %s was trimmed from %s before it was stored: its event is lost", eid,
                      EVENTS_STREAM)
        elif eid not in seen and "job_id" in fields:
            by_job[fields["job_id"]].append((eid, fields))
    for job_id in sorted(by_job):  # a fixed lock order: two ingesters can never deadlock
        job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
        if job is None:
            log.warning("%d events of unknown job %r dropped", len(by_job[job_id]), job_id)
            continue
        for eid, fields in by_job[job_id]:
            if _attempt(fields) != job.attempt:
                continue  # a superseded attempt: its worker was replaced, its events are not the job's story
            kind = fields.get("type", "unknown")[:32]
            data = _data(fields)
            if job.status in TERMINAL_STATUSES:
                # The attempt outlived the job's end (a cancel or a lost-worker verdict that raced it, or
                # its events were held up by an outage): keep what it said, change nothing.
                if kind == EventKind.STATE:
                    data = {**data, "ignored": f"the job had already ended as {job.status}"}
            else:
                apply_event(job, kind, data)
            events.append(session, job, kind, data, source_id=eid)
