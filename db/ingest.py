"""The ingester's writes (controlplane/ingest.py reads the stream and acknowledges): each event kept in the job's
durable log as it came, and what it means for the job row (`apply_event`). Events of an attempt that is no
longer current are dropped (fencing); events of the current attempt that arrive after the job ended are kept in
the log, but the job's final state and its row no longer change.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.codes import PREFERENCE_METRICS, TERMINAL_STATUSES, EventKind, JobStatus
from contract.protocol import EVENT_KEY_FIELD, EVENTS_STREAM, StateField
from db import attempts, journal
from db.models import Job, JobEvent

log = logging.getLogger(__name__)

# mfu, mfu_6n, mfu_attended: what each counts is in trainer/flops.py.
PROGRESS_FIELDS = ("step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens_per_second", "eta_seconds",
                   "mfu", "mfu_6n", "mfu_attended", "peak_memory_bytes", "tokens_seen", *PREFERENCE_METRICS)


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
        job.error = data.get(StateField.ERROR)
        if data.get("output"):
            job.output = data["output"]
        if data.get("usage"):
            job.progress = {**(job.progress or {}), **data["usage"]}


def resolved_after(resolved: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The job's resolved spec once the trainer settled the batch on the data or the device (a `resolved` event):
    the job shows what ran, in every place that holds it."""
    out = dict(resolved)
    ds = dict(out.get("deepspeed_config", {}))
    spec = dict(out.get("spec", {}))
    hp = dict(spec.get("hyperparameters", {}))
    for key, ds_key in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                        ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        if isinstance(data.get(key), int):
            out[key] = ds[ds_key] = data[key]
    if isinstance(data.get("micro_batch_size"), int):
        hp["micro_batch_size"] = data["micro_batch_size"]
    if isinstance(data.get("global_batch_size"), int):
        hp["global_batch_size"] = ds["train_batch_size"] = data["global_batch_size"]
    if isinstance(data.get("examples_per_step"), int):
        hp["examples_per_step"] = data["examples_per_step"]
    if isinstance(data.get("packing"), bool) and isinstance(spec.get("data"), dict):
        spec["data"] = {**spec["data"], "packing": data["packing"]}
    if spec:
        out["spec"] = {**spec, "hyperparameters": hp}
    out["deepspeed_config"] = ds
    out["notes"] = [*out.get("notes", []), str(data.get("reason", ""))]
    return out


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
        job.resolved = resolved_after(job.resolved, data)
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


SOURCE_ID_LENGTH = JobEvent.__table__.c.source_id.type.length  # type: ignore[attr-defined]


def source_of(entry_id: str, fields: dict[str, str]) -> str:
    """What an event is stored once under (`source_id`): the key its publisher gave it, which an entry sent again
    after a lost reply repeats; the stream entry's id for an entry without one."""
    key = fields.get(EVENT_KEY_FIELD, "")
    return key if 0 < len(key) <= SOURCE_ID_LENGTH else entry_id


def store(session: Session, entries: list[tuple[str, dict[str, str]]]) -> None:
    """Store a batch of stream entries (id, fields): each event in the job's log, and what it means in the job's
    row; an entry already stored (its id is a `source_id`) is skipped."""
    keyed = [(source_of(eid, fields), fields) for eid, fields in entries]
    seen = set(session.scalars(select(JobEvent.source_id).where(JobEvent.source_id.in_([k for k, _ in keyed]))))
    by_job: dict[str, list[tuple[str, dict[str, str]]]] = defaultdict(list)
    for eid, fields in keyed:
        if not fields:
            log.error("stream entry %s was trimmed from %s before it was stored: its event is lost", eid,
                      EVENTS_STREAM)
        elif eid not in seen and "job_id" in fields:
            seen.add(eid)  # the same event sent twice within one batch
            by_job[fields["job_id"]].append((eid, fields))
    for job_id in sorted(by_job):  # a fixed lock order: two ingesters can never deadlock
        job = attempts.locked(session, job_id)
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
            journal.append(session, job, kind, data, source_id=eid)
