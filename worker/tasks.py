"""Celery tasks: thin wrappers that hand a job to the supervisor."""

from __future__ import annotations

from typing import Any

from celery.worker import state

from contract.protocol import RUN_JOB
from worker.attempt import supervise
from worker.celery_app import announce_now, app, disk_full_now, settings


def _shutting_down() -> bool:
    # Set by Celery's SIGTERM (warm) and SIGQUIT (cold) handlers to the exit code, 0 included; the solo pool
    # runs this task in the worker process itself, so the supervisor sees it while the job runs.
    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


@app.task(name=RUN_JOB)
def run_job(job_id: str, attempt: int, run: dict[str, Any]) -> str:
    """Run one attempt of a job; `run` is the AttemptOrder the control plane sent."""
    return supervise(job_id=job_id, attempt=attempt, run=run, settings=settings, stopping=_shutting_down,
                     announce=announce_now, disk_full=disk_full_now).value
