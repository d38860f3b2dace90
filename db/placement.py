"""The scheduler's statements (controlplane/scheduler.py decides; this reads and writes): the nodes as announced,
the slots placed jobs hold, the waiting jobs in the order they are served, and a job's placement or the reason it
waits. The dispatcher's read of what is placed and not yet sent is here too. Every statement runs in the caller's
session, inside the pass's transaction and under its advisory lock (`lock`).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.codes import UNFINISHED_STATUSES, JobStatus, sql_list
from contract.protocol import WarmTrainer
from db import attempts
from db.engine import run
from db.models import Job

Q = JobStatus.QUEUED
WARM_TRAINER_STATES = frozenset(s.value for s in WarmTrainer)

LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('ft_scheduler', 0))"

UPSERT_NODE = """
INSERT INTO nodes (name, kind, slots, devices, queues, jobs_max, draining, worker, addr, disk_free_bytes, disk_full,
                   warm_trainer, first_seen, last_seen)
VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12, now(), now())
ON CONFLICT (name) DO UPDATE SET kind = EXCLUDED.kind, slots = EXCLUDED.slots, devices = EXCLUDED.devices,
    queues = EXCLUDED.queues, jobs_max = EXCLUDED.jobs_max, draining = EXCLUDED.draining,
    worker = EXCLUDED.worker, addr = EXCLUDED.addr, disk_free_bytes = EXCLUDED.disk_free_bytes,
    disk_full = EXCLUDED.disk_full, warm_trainer = EXCLUDED.warm_trainer, last_seen = now()"""
NODES = """
SELECT name, kind, slots, devices, queues, jobs_max, draining, addr, disk_free_bytes, disk_full,
       last_seen < now() - make_interval(secs => $1) AS gone FROM nodes ORDER BY name"""
HELD = f"""
SELECT id, attempt, status, dispatched_at IS NOT NULL AS sent, placement FROM jobs
WHERE placement IS NOT NULL AND status IN {sql_list(UNFINISHED_STATUSES)}"""
# The waiting jobs a pass looks at, read through ix_jobs_waiting (queue, owner, priority DESC, seq) rather than
# from every waiting row's JSON. Exact for the first $2 of each queue: an owner's job that is not among
# the owner's first $2 by (priority, age) has that many jobs of its owner before it in the queue order
# (higher priority, or equal priority and an earlier turn), so each owner's first $2 are all a pass
# needs. The owners with waiting jobs are found by skipping through the same index, not by a scan.
CANDIDATES = f"""
WITH RECURSIVE owners AS (
    -- Every (queue, owner) with waiting jobs, one index probe each: the next pair after the last one found.
    (SELECT queue, owner FROM jobs WHERE status = '{Q}' AND placement IS NULL ORDER BY queue, owner LIMIT 1)
    UNION ALL
    SELECT nxt.queue, nxt.owner FROM owners AS o CROSS JOIN LATERAL (
        SELECT j.queue, j.owner FROM jobs AS j WHERE j.status = '{Q}' AND j.placement IS NULL
        AND (j.queue, j.owner) > (o.queue, o.owner) ORDER BY j.queue, j.owner LIMIT 1) AS nxt
), q AS (
    SELECT j.* FROM owners AS o CROSS JOIN LATERAL (
        SELECT id, seq, attempt, owner, queue, queued_reason, priority,
               coalesce((resolved->'spec'->'resources'->>'num_gpus')::int, gpus) AS per_node,
               coalesce((resolved->'spec'->'resources'->>'num_nodes')::int, 1) AS num_nodes
        FROM jobs WHERE status = '{Q}' AND placement IS NULL AND queue = o.queue AND owner = o.owner
        ORDER BY priority DESC, seq LIMIT $2) AS j
    WHERE o.queue = ANY($1)
), served AS (
    -- When each waiting owner last had a job sent on the queue: the owner served longest ago goes first.
    SELECT j.owner, j.queue, max(j.dispatched_at) AS last FROM jobs AS j
    WHERE j.dispatched_at IS NOT NULL AND (j.owner, j.queue) IN (SELECT DISTINCT owner, queue FROM q)
    GROUP BY j.owner, j.queue
), turns AS (
    SELECT q.*, row_number() OVER (PARTITION BY q.queue, q.owner, q.priority ORDER BY q.seq) AS turn,
           s.last AS owner_served FROM q LEFT JOIN served AS s USING (owner, queue)
), ranked AS (
    SELECT *, row_number() OVER (PARTITION BY queue ORDER BY priority DESC, turn, owner_served NULLS FIRST, seq)
           AS pos FROM turns
)
SELECT id, attempt, queue, per_node, num_nodes, queued_reason FROM ranked WHERE pos <= $2
ORDER BY priority DESC, turn, owner_served NULLS FIRST, seq"""
PLACE = f"""
UPDATE jobs SET placement = $3::jsonb, queued_reason = NULL, dispatched_at = NULL,
                updated_at = now()
WHERE id = $1 AND attempt = $2 AND status = '{Q}' AND placement IS NULL RETURNING id"""
REASON = f"""
UPDATE jobs SET queued_reason = $2
WHERE id = $1 AND status = '{Q}' AND placement IS NULL AND queued_reason IS DISTINCT FROM $2"""
# Jobs of queues no live node serves, in one statement: they are not looked at one by one.
UNSERVED = f"""
UPDATE jobs SET queued_reason = 'waiting for a node serving queue ' || queue || ': none is up'
WHERE status = '{Q}' AND placement IS NULL AND NOT (queue = ANY($1))
  AND queued_reason IS DISTINCT FROM 'waiting for a node serving queue ' || queue || ': none is up'"""


def lock(session: Session) -> None:
    """Hold the scheduler's lock to the end of the transaction: two control planes never place at once."""
    run(session, LOCK)


def refresh_nodes(session: Session, announced: list[dict[str, Any]]) -> set[str]:
    """Upserts each announcement; returns the names as stored."""
    names = set()
    for a in announced:
        name = str(a["name"])[:64]
        names.add(name)
        run(session, UPSERT_NODE, name, str(a.get("kind", "cpu"))[:32], int(a["slots"]),
            json.dumps([str(d) for d in a.get("devices", [])]), [str(q)[:64] for q in a.get("queues", [])],
            int(a.get("jobs_max", 1)), bool(a.get("draining")), str(a.get("worker", ""))[:200],
            str(a.get("addr", "127.0.0.1"))[:200], _bytes(a.get("disk_free_bytes")), bool(a.get("disk_full")),
            _warm(a.get("warm_trainer")))
    return names


def _warm(value: Any) -> str | None:
    # Whatever a worker announces, only a state this version knows is stored.
    return value if value in WARM_TRAINER_STATES else None


def _bytes(value: Any) -> int | None:
    # A worker of an earlier version announces no disk, and one that could not read its disk announces null.
    return None if value is None else int(value)


def nodes(session: Session, *, gone_seconds: float) -> list[Any]:
    """Every node stored, with `gone`: unseen for more than `gone_seconds`."""
    return run(session, NODES, gone_seconds).fetchall()


def held(session: Session) -> list[Any]:
    """The placed jobs that have not ended (id, attempt, status, sent, placement): what holds slots."""
    return run(session, HELD).fetchall()


def take_back(session: Session, job_id: str, attempt: int, reason: str) -> bool:
    """Put a placed job that no worker started back in the queue as its next attempt, unplaced; False where it
    moved on meanwhile (another attempt, started, cancelled, or no longer placed)."""
    job = attempts.locked(session, job_id)
    if job is None or job.attempt != attempt or job.status != JobStatus.QUEUED or job.placement is None:
        return False
    attempts.next_attempt(session, job, reason)
    return True


def mark_unserved(session: Session, served: list[str]) -> None:
    """Give every waiting job of a queue no live node serves its reason, in one statement."""
    run(session, UNSERVED, served)


def candidates(session: Session, served: list[str], *, per_queue: int) -> list[Any]:
    """The waiting jobs of the queues in `served` a pass looks at, in the order they are served: (id, attempt,
    queue, per_node, num_nodes, queued_reason)."""
    return run(session, CANDIDATES, served, per_queue).fetchall()


def place(session: Session, job_id: str, attempt: int, placement: list[dict[str, Any]]) -> bool:
    """Commit where the attempt runs, if it is still queued and unplaced on that attempt (a cancel or requeue that
    got there first wins); returns whether it was placed."""
    return run(session, PLACE, job_id, attempt, json.dumps(placement)).fetchone() is not None


def set_reason(session: Session, job_id: str, reason: str) -> None:
    """Say why the waiting job is not placed (written only when it changed)."""
    run(session, REASON, job_id, reason)


def placed_unsent(session: Session, *, limit: int) -> list[Job]:
    """The placed jobs not yet sent, oldest first, locked; rows another dispatcher (or the reaper's re-drive)
    holds are skipped: theirs this time round."""
    return list(session.scalars(
        select(Job).where(Job.status == JobStatus.QUEUED, Job.dispatched_at.is_(None), Job.placement.is_not(None))
        .order_by(Job.seq).limit(limit).with_for_update(skip_locked=True)))
