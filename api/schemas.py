"""The API's schema family: JobCreate (what a client sends), Job (what it gets), pages, events."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    model_validator,
)

from contract import codes, files
from contract.protocol import NodeState, WarmTrainer
from contract.spec import JobSpec, Shown, Text, WebhookUrl, refuse_lax_integers

JobCreate = JobSpec  # the trainer's schema is the one source of truth for a job request

# A Literal, not the enum, so the OpenAPI schema lists the values inline as it always has.
JobStatusName = Literal[tuple(s.value for s in codes.JobStatus)]  # type: ignore[valid-type]
DeliveryStatusName = Literal[tuple(s.value for s in codes.DeliveryStatus)]  # type: ignore[valid-type]
NodeStateName = Literal[tuple(s.value for s in NodeState)]  # type: ignore[valid-type]
WarmTrainerName = Literal[tuple(s.value for s in WarmTrainer)]  # type: ignore[valid-type]


class Progress(BaseModel):
    model_config = ConfigDict(extra="allow")

    step: int = 0
    total_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None


class JobError(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class Checkpoint(BaseModel):
    model_config = ConfigDict(extra="allow")

    step: int
    path: str
    committed: bool


class NodePart(BaseModel):
    model_config = ConfigDict(extra="allow")

    node: str
    devices: list[str] = Field(description="The node's device ids (GPU ids, or CPU process slots)")


class JobSummary(Shown):
    """A job as lists show it: everything but the request and its resolution (read one job for those); the
    request's own shown fields (name, metadata, ...) come from contract.spec.Shown."""

    # A response, not input: the request's strictness does not describe it.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=True)

    id: str
    owner: str = Field(description="The owner of the key that submitted it")
    status: JobStatusName
    attempt: int
    queue: str
    progress: Progress
    error: JobError | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    checkpoints: list[Checkpoint]
    output: dict[str, Any] | None = Field(description="Where the exported model is, once the job succeeded")
    placement: list[NodePart] | None = Field(default=None, description=(
        "Where the current attempt was placed, one entry per node; null while it waits"))
    queued_reason: str | None = Field(default=None, description=(
        "While queued: what it waits for, e.g. 'waiting for 4 free h200 slots on queue default; largest free: 2'"))


class Job(JobSummary):
    request: dict[str, Any] = Field(description="The request as sent")
    resolved: dict[str, Any] = Field(description="The full resolved request and the rendered DeepSpeed config")


class DeepSpeedConfig(RootModel[dict[str, Any]]):
    """The DeepSpeed JSON the service rendered for a job, as `deepspeed --deepspeed_config` takes it. What one
    attempt's ranks received after their own changes (a measured micro batch, the NVMe swap folder) is in that
    attempt's `attempts/N/ds_config.json` in the job's folder."""


class OutputFile(BaseModel):
    path: str = Field(description="Relative to the export, e.g. 'model.safetensors' or 'merged/config.json'")
    bytes: int
    sha256: str = Field(description="The file's SHA-256, hex: what a download must hash to")
    url: str = Field(description="Where to download it: `GET` it (a `Range` header resumes; 206)")


class OutputList(BaseModel):
    """A succeeded job's export, as it is in the artifact store (its manifest)."""

    job_id: str
    format: str = Field(description="huggingface: safetensors weights, config and tokenizer")
    step: int | None = Field(description="The step the model was exported at")
    final_loss: float | None
    bytes: int = Field(description="All files together")
    files: list[OutputFile]


class JobList(BaseModel):
    data: list[JobSummary] = Field(description="Newest first; `GET /jobs/{id}` has each job's request and "
                                               "resolved configuration")
    has_more: bool


class Event(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: int = Field(description="Ordered per job; resume after it with `after` or Last-Event-ID")
    type: str
    attempt: int
    created_at: datetime


class EventPage(BaseModel):
    data: list[Event]
    has_more: bool
    next_after: int | None = Field(description="Pass as `after` to read on")


class NodeJob(BaseModel):
    id: str
    status: JobStatusName
    devices: list[str]


class Node(BaseModel):
    name: str
    kind: str = Field(description="Device kind, e.g. h200 or cpu")
    queues: list[str] = Field(description="The job queues it serves")
    slots_total: int
    slots_free: int = Field(description="0 while the node is lost, draining or its disk full: it receives nothing then")
    jobs: list[NodeJob] = Field(description="Placed jobs that have not ended")
    jobs_max: int = Field(description="Jobs its worker runs at once")
    last_seen: datetime
    disk_free_bytes: int | None = Field(description=(
        "Room left on the disk of its job folders, as last announced; null where its worker could not read it"))
    warm_trainer: WarmTrainerName | None = Field(description=(
        "Its warm trainer, as last announced: ready (the next single-node attempt's ranks start from an imported "
        "trainer), importing, or none (an attempt holds it, or FT_WARM_TRAINER=false); null from a worker that "
        "announces none"))
    state: NodeStateName = Field(description=(
        "up; draining: its worker is shutting down; disk_full: its disk has less room than the node's "
        "FT_NODE_MIN_FREE_BYTES, so it takes no job until it has; lost: it stopped heartbeating"))


class NodeList(BaseModel):
    data: list[Node]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)


# -- access: keys, quotas, the audit log --

OWNER_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
ScopeName = Literal["jobs:read", "jobs:write", "admin"]
# RFC 3339, what the schema's `format: date-time` means: a time zone is required (Z or an offset).
_RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?"
                      r"(?:[Zz]|[+-][0-9]{2}:[0-9]{2})")


def _rfc3339(v: Any) -> Any:
    # pydantic alone would also take a number or a digit string as Unix time, and a date without a time.
    if not isinstance(v, (str, datetime)) or (isinstance(v, str) and not _RFC3339.fullmatch(v)):
        raise ValueError("must be an RFC 3339 date-time with a time zone, like 2027-01-01T00:00:00Z")
    return v


DateTime = Annotated[AwareDatetime, BeforeValidator(_rfc3339)]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    owner: str = Field(pattern=OWNER_PATTERN, description="The team or project the key acts for; its jobs' owner")
    scopes: list[ScopeName] = Field(min_length=1, max_length=3, description="jobs:read (list, read, events, logs), "
                                    "jobs:write (submit, cancel; implies jobs:read), admin (everything)")
    name: Text = Field(default="", max_length=200, description="What the key is for (shown in lists)")
    expires_at: DateTime | None = Field(default=None, description=(
        "When the key stops working, in the future and at most 36600 days (100 years) away; null: never"))


class Key(BaseModel):
    """A key as lists show it: never its secret."""

    id: str
    prefix: str = Field(description="The key's first characters, to recognise it (say, in a leaked file)")
    owner: str
    scopes: list[ScopeName]
    name: str
    created_at: datetime
    created_by: str | None = Field(description="The key id that created it; null: the operator's CLI")
    expires_at: datetime | None
    last_used_at: datetime | None = Field(description="Updated at most about once a minute")
    revoked: bool
    revoked_at: datetime | None


class KeyCreated(Key):
    key: str = Field(description="The secret: shown this once, stored only as a hash")


class KeyList(BaseModel):
    data: list[Key] = Field(description="Newest first")
    has_more: bool


class QuotaSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_active_jobs: int | None = Field(default=None, ge=0, le=1_000_000, description=(
        "Jobs of the owner that have not ended (queued ones included); null: the service default"))
    max_gpus: int | None = Field(default=None, ge=0, le=1_000_000, description=(
        "GPUs (`resources.num_gpus`) of those jobs together; null: the service default"))
    max_stored_bytes: int | None = Field(default=None, ge=0, le=2**62, description=(
        "Bytes the owner's uploaded files may take in the store together; null: the service default"))

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        return refuse_lax_integers(cls, data)  # false is no quota of 0 GPUs


class QuotaUsage(BaseModel):
    active_jobs: int
    gpus: int
    stored_bytes: int = Field(description="What the owner's uploaded files take in the store")


class Quota(BaseModel):
    owner: str
    max_active_jobs: int | None = Field(description="In effect; null: no limit")
    max_gpus: int | None = Field(description="In effect; null: no limit")
    max_stored_bytes: int | None = Field(description="In effect; null: no limit")
    set: QuotaSet = Field(description="What an admin set for this owner (null fields take the default)")
    usage: QuotaUsage


class Actor(BaseModel):
    key_id: str | None = Field(description="The acting key; null: the operator's CLI or development's anonymous "
                                           "caller")
    owner: str | None


class AuditEntry(BaseModel):
    id: int = Field(description="Ordered; read on with `after`")
    at: datetime
    actor: Actor
    action: str = Field(description="job.submit, job.cancel, key.create, key.revoke, quota.set, file.upload, "
                                    "file.delete")
    subject: str = Field(description="The job id, key id, file id or owner acted on")
    data: dict[str, Any]


class AuditPage(BaseModel):
    data: list[AuditEntry]
    has_more: bool
    next_after: int = Field(description="Pass as `after` to read on")


class OwnerWebhookSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: WebhookUrl | None = Field(default=None, description=(
        "The default http(s) URL for the owner's jobs that name none (`notifications.webhook_url`); null: none. "
        "Its host must resolve to public addresses only, unless the operator allows a range"))
    rotate_secret: StrictBool = Field(default=False,
                                      description="Replace the signing secret; the answer shows the new one")


class OwnerWebhook(BaseModel):
    owner: str
    url: str | None
    secret_prefix: str = Field(description="The secret's first characters, to tell secrets apart")
    created_at: datetime
    rotated_at: datetime | None
    updated_at: datetime
    secret: str | None = Field(description="The signing secret: only in the answer that made or rotated it")


class Delivery(BaseModel):
    id: str = Field(description="Also sent as X-FT-Delivery; the same on every retry")
    event: str = Field(description="job.running, job.succeeded, job.failed, job.cancelled, job.requeued, "
                                   "job.checkpoint")
    event_id: int = Field(description="The job event it announces (GET /jobs/{id}/events)")
    url: str
    status: DeliveryStatusName = Field(description="failed: given up after the last attempt")
    attempts: int
    next_attempt_at: datetime | None = Field(description="When a pending delivery is tried next")
    last_attempt_at: datetime | None
    last_status_code: int | None = Field(description="The receiver's last HTTP status; null: no answer")
    last_error: str | None
    delivered_at: datetime | None
    created_at: datetime


class DeliveryPage(BaseModel):
    data: list[Delivery]
    has_more: bool
    next_after: int = Field(description="Pass as `after` to read on")


# -- files --

FileStatusName = Literal[tuple(s.value for s in files.FileStatus)]  # type: ignore[valid-type]
FileFormatName = Literal[tuple(f.value for f in files.FileFormat)]  # type: ignore[valid-type]
FilePurposeName = Literal[tuple(p.value for p in files.FilePurpose)]  # type: ignore[valid-type]


class FileProblem(BaseModel):
    line: int | None = Field(description="1-based; null for the file as a whole (empty, no documents)")
    message: str


class FileStats(BaseModel):
    model_config = ConfigDict(extra="allow")

    lines: int
    examples: int = Field(description="Documents (text), records (jsonl), conversations (chat) or pairs (completion)")
    characters: int = Field(description="Of the examples' text: the documents, the `text` fields, the contents, or "
                                        "the prompts and completions")
    messages: dict[str, int] | None = Field(default=None, description="chat: messages per role")


class File(BaseModel):
    id: str
    owner: str
    filename: str
    bytes: int
    sha256: str = Field(description="Of the bytes as stored; `GET /files/{id}/content` sends it as X-Content-SHA256")
    purpose: FilePurposeName
    format: FileFormatName | None = Field(description="As given at upload, or detected by the check; null until "
                                                      "then")
    status: FileStatusName = Field(description="uploaded: stored, waiting for the check; processed: every line "
                                               "passed (see `stats`); error: see `errors`")
    created_at: datetime
    stats: FileStats | None = Field(description="Once processed")
    errors: list[FileProblem] | None = Field(description="Once in error: the first problems (at most 20), each "
                                                         "with its line")


class FileList(BaseModel):
    data: list[File] = Field(description="Newest first")
    has_more: bool


class CheckpointFile(BaseModel):
    path: str = Field(description="Relative to the checkpoint: GET /jobs/{id}/checkpoints/{step}/{path} serves it")
    bytes: int
    sha256: str


class StoredCheckpoint(BaseModel):
    step: int
    attempt: int = Field(description="The attempt that committed it")
    bytes: int = Field(description="All its files together")
    files: list[CheckpointFile]
    created_at: datetime = Field(description="When its manifest was written: the moment it was committed")


class CheckpointList(BaseModel):
    data: list[StoredCheckpoint] = Field(description="The job's committed checkpoints in the artifact store, by step")
