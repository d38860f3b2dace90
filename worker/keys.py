"""Redis names shared by the control plane and the workers: the one place they are spelled."""

EVENTS_STREAM = "ft:events"
RUN_JOB = "worker.run_job"  # the Celery task that runs one attempt (worker/tasks.py)
INGEST_GROUP = "ingest"


def attempt_key(job_id: str) -> str:
    """The job's current attempt, set by the control plane: a worker on another attempt is stale."""
    return f"ft:job:{job_id}:attempt"


def cancel_key(job_id: str) -> str:
    return f"ft:job:{job_id}:cancel"


def lease_key(job_id: str, attempt: int) -> str:
    """Refreshed by the worker while it supervises the attempt; its expiry means the worker is gone."""
    return f"ft:job:{job_id}:lease:{attempt}"


def claim_key(job_id: str, attempt: int) -> str:
    """Set once, so a redelivered task message cannot start the same attempt twice."""
    return f"ft:job:{job_id}:claim:{attempt}"


def released_key(job_id: str, attempt: int) -> str:
    """Set by a worker that shut down after the attempt checkpointed: the control plane requeues the job
    at once, and does not count it as a lost worker."""
    return f"ft:job:{job_id}:released:{attempt}"
