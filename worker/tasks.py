"""Celery tasks: thin wrappers that hand a job to the supervisor."""

from __future__ import annotations

from typing import Any

from worker.celery_app import app, settings
from worker.supervisor import supervise

RUN_JOB = "worker.run_job"


@app.task(name=RUN_JOB)
def run_job(job_id: str, attempt: int, job_dir: str, run: dict[str, Any]) -> str:
    """Run one attempt of a job; `run` is the RunSpec the control plane resolved."""
    return supervise(job_id=job_id, attempt=attempt, job_dir=job_dir, run=run, settings=settings).value
