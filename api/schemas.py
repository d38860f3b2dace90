"""The API's schema family: JobCreate (what a client sends), Job (what it gets), pages, events."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer.spec import JobSpec

JobCreate = JobSpec  # the trainer's schema is the one source of truth for a job request

JobStatus = Literal["queued", "starting", "running", "cancelling", "succeeded", "failed", "cancelled"]


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


class JobSummary(BaseModel):
    """A job as lists show it: everything but the request and its resolution (read one job for those)."""

    id: str
    name: str
    status: JobStatus
    attempt: int
    queue: str
    progress: Progress
    error: JobError | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    checkpoints: list[Checkpoint]
    output: dict[str, Any] | None = Field(description="Where the exported model is, once the job succeeded")
    metadata: dict[str, Any]


class Job(JobSummary):
    request: dict[str, Any] = Field(description="The request as sent")
    resolved: dict[str, Any] = Field(description="The full resolved request and the rendered DeepSpeed config")


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


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)
