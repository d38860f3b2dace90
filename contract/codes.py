"""The codes every process writes and reads: a job's status, the kind of each event, and the error code a
failed job ends with. Each is a `str` enum, so a member equals the string stored in Postgres and Redis and is
that plain string in JSON; `__str__` makes it so in f-strings too (what enum.StrEnum does, which Python 3.10
lacks).

Standard library only: the API, the control plane, the workers and the trainer all import it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class JobStatus(str, enum.Enum):
    """`jobs.status`: the set the table's `status_valid` constraint allows."""

    def __str__(self) -> str:
        return str(self.value)

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A worker holds the job (a started attempt, or one being cancelled).
ACTIVE_STATUSES = (JobStatus.STARTING, JobStatus.RUNNING, JobStatus.CANCELLING)
# The job has ended: nothing changes it any more.
TERMINAL_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
# What an owner's quota counts: every job that has not ended, queued ones included.
UNFINISHED_STATUSES = (JobStatus.QUEUED, *ACTIVE_STATUSES)


def sql_list(statuses: Iterable[JobStatus]) -> str:
    """The statuses as an SQL list for `status IN ...`: ('queued', 'starting')."""
    return "(" + ", ".join(f"'{s.value}'" for s in statuses) + ")"


class Method(str, enum.Enum):
    """How a job trains (`method.type`): on demonstrations, or on preference pairs."""

    def __str__(self) -> str:
        return str(self.value)

    SUPERVISED = "supervised"
    DPO = "dpo"


# What a dpo job's progress and eval events carry beside `loss`, named as trl logs them: means over the step's (or
# the held-out) pairs of beta · (policy − reference) log-probabilities, their difference, the share of pairs ranked
# right, and the summed log-probabilities of each side.
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                      "logps/rejected")


class EventKind(str, enum.Enum):
    """`job_events.type`: what an event of a job's log is. The trainer emits its own kinds (trainer/events.py),
    the worker adds `log` and `state`, the control plane `state` and `unreadable`."""

    def __str__(self) -> str:
        return str(self.value)

    # Written by the worker (worker/attempt.py) and the control plane (api/): `data.status` says which.
    STATE = "state"
    LOG = "log"  # a line of the ranks' or the supervisor's output
    # Emitted by the trainer (python -m trainer).
    STARTED = "started"
    PROGRESS = "progress"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    RESOLVED = "resolved"  # the batch the trainer settled on the data, or the micro batch it measured or changed
    ADAPTED = "adapted"  # the trainer changed a setting after an out-of-memory error
    RESUMED = "resumed"  # an elastic resume on another world size
    INTERRUPTED = "interrupted"
    COMPLETED = "completed"
    ERROR = "error"
    # Written by the ingester for a stream entry it cannot read (controlplane/ingest.py).
    UNREADABLE = "unreadable"


class WebhookEvent(str, enum.Enum):
    """What a webhook delivery announces (its `event`, the X-FT-Event header): a state the job row reached, a
    requeue, a committed checkpoint."""

    def __str__(self) -> str:
        return str(self.value)

    RUNNING = "job.running"
    SUCCEEDED = "job.succeeded"
    FAILED = "job.failed"
    CANCELLED = "job.cancelled"
    REQUEUED = "job.requeued"
    CHECKPOINT = "job.checkpoint"


class AuditAction(str, enum.Enum):
    """`audit_log.action`: what an actor did."""

    def __str__(self) -> str:
        return str(self.value)

    JOB_SUBMIT = "job.submit"
    JOB_CANCEL = "job.cancel"
    FILE_UPLOAD = "file.upload"
    FILE_DELETE = "file.delete"
    KEY_CREATE = "key.create"
    KEY_REVOKE = "key.revoke"
    QUOTA_SET = "quota.set"
    WEBHOOK_SET = "webhook.set"


class DeliveryStatus(str, enum.Enum):
    """A webhook delivery's state (webhook_deliveries.status): tried until delivered or given up."""

    def __str__(self) -> str:
        return str(self.value)

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"  # given up after the last attempt


class FailureCode(str, enum.Enum):
    """`error.code` of a failed job: whoever decides the failure (trainer, worker or control plane) writes one
    of these. A str, so each is its plain string in JSON and events; `__str__` makes it so in f-strings too
    (what enum.StrEnum does, which Python 3.10 lacks)."""

    def __str__(self) -> str:
        return str(self.value)

    # Decided by the trainer (trainer/errors.py and its subclasses; python -m trainer).
    TRAINER_ERROR = "trainer_error"
    DATA_ERROR = "data_error"
    MODEL_LOAD_ERROR = "model_load_error"
    OUT_OF_MEMORY = "out_of_memory"  # GPU memory (torch) or the host check (trainer/memory.py)
    SUPERSEDED = "superseded"  # a newer attempt holds the job's fence (trainer/fence.py)
    ELASTIC_RESUME_ERROR = "elastic_resume_error"  # a resume on another world size cannot go on (trainer/elastic.py)
    # Decided by the worker from the attempt's end (worker/outcome.py, worker/attempt.py).
    NCCL_TIMEOUT = "nccl_timeout"
    DISK_FULL = "disk_full"  # a write found the job's filesystem full (checkpoint, export, NVMe swap, data cache)
    KILLED = "killed"  # a rank ended by a signal nothing in the service sent
    TIME_LIMIT = "time_limit"
    WORKER_ERROR = "worker_error"  # the supervisor itself failed
    INPUT_UNAVAILABLE = "input_unavailable"  # a stored input could not be fetched into the node's cache
    # The export could not be put in the artifact store within FT_STORE_RETRY_SECONDS (worker/export_store.py):
    # a job succeeds only once its model is there for clients to download.
    STORE_UNAVAILABLE = "store_unavailable"
    # Decided by the control plane (controlplane/reaper.py).
    WORKER_LOST = "worker_lost"


class TrainerExit(enum.IntEnum):
    """`python -m trainer`'s exit codes, as the worker reads them from its launcher."""

    DONE = 0  # output_dir/COMPLETE written
    FAILED = 1  # an `error` event says why
    # Stopped by a SIGTERM (to any rank: the ranks vote at each step boundary) after the checkpoint they saved
    # together; 128 + SIGTERM, as a shell shows a process that SIGTERM ended.
    INTERRUPTED = 143
