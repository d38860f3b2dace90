"""The names the OpenAI-compatible face gives what the service already has: a fine-tuned model's name
(`ft:<base>:<owner>:<suffix>:<job id>`) and its checkpoints' names, event and checkpoint ids, and a job's status
in OpenAI's vocabulary. Ids of jobs and files stay the service's own (`job_…`, `file_…`): the SDK passes them
through untouched."""

from __future__ import annotations

import re

from contract.codes import PREFERENCE_METRICS, EventKind, JobStatus
from contract.openai import OpenAIStatus
from contract.spec import is_job_id

FT_PREFIX = "ft:"
CHECKPOINT_MARK = ":ckpt-step-"
JOB_ID = r"job_[0-9a-f]{20}"
_JOB_AT_END = re.compile(rf":({JOB_ID})$")
_CHECKPOINT = re.compile(rf":({JOB_ID}):ckpt-step-([0-9]{{1,12}})$")
# The forms of the ids the face makes, as the schema states them for a page's `after`.
EVENT_ID = rf"^ftevent-{JOB_ID}-[0-9]{{1,10}}$"
CHECKPOINT_ID = rf"^ftckpt-{JOB_ID}-[0-9]{{1,12}}$"
_EVENT_ID = re.compile(rf"^ftevent-({JOB_ID})-([0-9]{{1,10}})$")
_CHECKPOINT_ID = re.compile(rf"^ftckpt-({JOB_ID})-([0-9]{{1,12}})$")


# A job being cancelled will not train on: clients polling for an end see it as cancelled at once, as OpenAI
# answers a cancel. Files are checked before a job exists, so no job is ever `validating_files`.
STATUS = {JobStatus.QUEUED: OpenAIStatus.QUEUED, JobStatus.STARTING: OpenAIStatus.RUNNING,
          JobStatus.RUNNING: OpenAIStatus.RUNNING, JobStatus.CANCELLING: OpenAIStatus.CANCELLED,
          JobStatus.SUCCEEDED: OpenAIStatus.SUCCEEDED, JobStatus.FAILED: OpenAIStatus.FAILED,
          JobStatus.CANCELLED: OpenAIStatus.CANCELLED}


def status(native: str) -> OpenAIStatus:
    return STATUS[JobStatus(native)]


METRIC_KINDS = (EventKind.PROGRESS, EventKind.EVAL)
# A dpo job's figures beside its loss, named as trl logs them: a training step's bare, an evaluation's with
# EVAL_PREFIX. OpenAI defines no DPO figures of its own, so /v1 shows trl's.
DPO_FIGURES = PREFERENCE_METRICS
EVAL_PREFIX = "eval_"
# Event ids carry the event's seq, an INTEGER: a page from the newest event starts before this.
MAX_SEQ = 2**31 - 1


def fine_tuned_model(*, base: str, owner: str, suffix: str, job_id: str) -> str:
    """The model a job makes, named as OpenAI names one; `base` is the model the first job of a chain of
    continued fine-tunes started from."""
    return f"{FT_PREFIX}{base}:{owner}:{suffix}:{job_id}"


def checkpoint_model(model: str, step: int) -> str:
    return f"{model}{CHECKPOINT_MARK}{step}"


def job_of_model(name: str) -> str | None:
    """The job id a fine-tuned model's name ends with, or None. The caller still compares the whole name with
    the job's own: the id alone is not proof of the rest."""
    if not name.startswith(FT_PREFIX):
        return None
    found = _JOB_AT_END.search(name)
    return found.group(1) if found else None


def checkpoint_of_model(name: str) -> tuple[str, int] | None:
    """(job id, step) of a checkpoint's model name, or None."""
    if not name.startswith(FT_PREFIX):
        return None
    found = _CHECKPOINT.search(name)
    return (found.group(1), int(found.group(2))) if found else None


def event_id(job_id: str, seq: int) -> str:
    return f"ftevent-{job_id}-{seq}"


def event_seq(value: str, job_id: str) -> int | None:
    """The sequence number of an event id of `job_id`'s, or None where it is not one."""
    found = _EVENT_ID.match(value)
    return int(found.group(2)) if found and found.group(1) == job_id else None


def checkpoint_id(job_id: str, step: int) -> str:
    return f"ftckpt-{job_id}-{step}"


def checkpoint_step(value: str, job_id: str) -> int | None:
    found = _CHECKPOINT_ID.match(value)
    return int(found.group(2)) if found and found.group(1) == job_id else None


def continues_from(model: str) -> str | None:
    """The job a native model name continues from (`job_…`), or None."""
    return model if is_job_id(model) else None
