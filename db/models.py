"""ORM models: a job and its ordered, durable event log; API keys, quotas, idempotency keys and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from contract.codes import UNFINISHED_STATUSES, JobStatus, sql_list
from db.engine import Base


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"status IN {sql_list(JobStatus)}", name="status_valid"),
        # Keyset pages of the job list, newest first, filtered by status or queue.
        Index("ix_jobs_status_seq", "status", "seq"),
        Index("ix_jobs_queue_seq", "queue", "seq"),
        Index("ix_jobs_undispatched", "updated_at",
              postgresql_where=text(f"status = '{JobStatus.QUEUED}' AND dispatched_at IS NULL")),
        # A caller's own jobs, newest first (every non-admin list), and what its quota counts.
        Index("ix_jobs_owner_seq", "owner", "seq"),
        Index("ix_jobs_owner_unfinished", "owner", postgresql_include=["gpus"],
              postgresql_where=text(f"status IN {sql_list(UNFINISHED_STATUSES)}")),
        Index("ix_jobs_placed", "status",
              postgresql_where=text(f"placement IS NOT NULL AND status IN {sql_list(UNFINISHED_STATUSES)}")),
        # The scheduler's read of waiting jobs: per queue and owner, highest priority then oldest (migration 0006).
        Index("ix_jobs_waiting", "queue", "owner", text("priority DESC"), "seq",
              postgresql_where=text(f"status = '{JobStatus.QUEUED}' AND placement IS NULL")),
    )

    # Internal order for "newest first" and cursors; the public id is opaque.
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, nullable=False)
    name: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    queue: Mapped[str] = mapped_column(String(64), nullable=False, default="default")
    # The submitting key's owner (the API always sets it; rows written around the API land under `default`,
    # where jobs from before keys are).
    owner: Mapped[str] = mapped_column(String(64), nullable=False, server_default="default")
    gpus: Mapped[int] = mapped_column(Integer, nullable=False, server_default="1")  # what max_gpus counts
    # resources.priority, copied out of the spec on insert so the scheduler orders by an index, not by JSON.
    priority: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    request: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    resolved: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    progress: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    checkpoints: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, default=list)
    output: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    job_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, nullable=False, default=dict)
    event_seq: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now(),
                                                 onupdate=func.now())
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Where the scheduler placed the attempt ([{"node", "devices"}], one per node of a gang); null while it
    # waits, and then `queued_reason` says for what.
    # none_as_null: None is SQL NULL (unplaced), not the JSON value null, which IS NOT NULL would count as placed.
    placement: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB(none_as_null=True), nullable=True)
    queued_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class Node(Base):
    """A worker's node as the control plane last saw it announced in Redis (worker/node.py)."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), nullable=False)
    slots: Mapped[int] = mapped_column(Integer, nullable=False)
    devices: Mapped[list[str]] = mapped_column(JSONB, nullable=False)
    queues: Mapped[list[str]] = mapped_column(ARRAY(String(64)), nullable=False)
    jobs_max: Mapped[int] = mapped_column(Integer, nullable=False)
    draining: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    worker: Mapped[str] = mapped_column(String(200), nullable=False, server_default="")
    addr: Mapped[str] = mapped_column(String(200), nullable=False, server_default="127.0.0.1")
    # The room left on the filesystem of its job folders, and whether that is below the node's FT_NODE_MIN_FREE_BYTES.
    disk_free_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    disk_full: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    # Its warm trainer as last announced (contract.protocol.WarmTrainer); null from a worker that announces none.
    warm_trainer: Mapped[str | None] = mapped_column(String(16), nullable=True)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (
        UniqueConstraint("job_id", "seq", name="uq_job_events_job_seq"),
        Index("ix_job_events_job_type_seq", "job_id", "type", "seq"),
    )

    pk: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False)
    # Per-job, gap-free and ordered: the id clients see and resume from (SSE Last-Event-ID).
    seq: Mapped[int] = mapped_column(Integer, nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    type: Mapped[str] = mapped_column(String(32), nullable=False)
    data: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    # The Redis stream entry it came from: redelivery after a crash must not duplicate it.
    source_id: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_owner", "owner"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # SHA-256 of the whole key; the key itself is never stored (see api/access.py for why SHA-256).
    secret_hash: Mapped[bytes] = mapped_column(LargeBinary(32), unique=True, nullable=False)
    prefix: Mapped[str] = mapped_column(String(16), nullable=False)  # the key's first characters, to recognise it
    owner: Mapped[str] = mapped_column(String(64), nullable=False)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(String(16)), nullable=False)
    name: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    created_by: Mapped[str | None] = mapped_column(String(40), nullable=True)  # a key id; null: the CLI
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class OwnerQuota(Base):
    __tablename__ = "owner_quotas"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Null: the service's default (FT_QUOTA_MAX_ACTIVE_JOBS, FT_QUOTA_MAX_GPUS).
    max_active_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


class IdempotencyKey(Base):
    """The first successful answer to `POST /jobs` with an Idempotency-Key, replayed to every retry."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (PrimaryKeyConstraint("owner", "key", name="pk_idempotency_keys"),
                      Index("ix_idempotency_keys_created_at", "created_at"))

    owner: Mapped[str] = mapped_column(String(64), nullable=False)
    key: Mapped[str] = mapped_column(String(255), nullable=False)
    request_hash: Mapped[bytes] = mapped_column(LargeBinary(32), nullable=False)
    job_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


class AuditEntry(Base):
    """Who did what: submits, cancels, key and quota changes. Written in the same transaction as the change."""

    __tablename__ = "audit_log"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())
    key_id: Mapped[str | None] = mapped_column(String(40), nullable=True)  # null: the operator's CLI
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the acting key's owner
    action: Mapped[str] = mapped_column(String(32), nullable=False)
    subject: Mapped[str] = mapped_column(String(64), nullable=False)  # a job id, key id or owner
    data: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
