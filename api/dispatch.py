"""Hands an attempt to the workers: publish the current attempt, then enqueue its id and spec."""

from __future__ import annotations

from typing import Any

import redis

from worker.celery_app import app as celery_app
from worker.keys import RUN_JOB, attempt_key


def dispatch(client: redis.Redis, *, job_id: str, attempt: int, job_dir: str, run: dict[str, Any],
             queue: str) -> None:
    # The attempt key goes first: a worker that receives the message must find it current.
    client.set(attempt_key(job_id), attempt)
    # The reprs that Celery would otherwise build from the whole run spec on every send (its largest cost
    # here) only label the task in the workers' logs: the ids say everything.
    celery_app.send_task(RUN_JOB, kwargs={"job_id": job_id, "attempt": attempt, "job_dir": job_dir, "run": run},
                         queue=queue, argsrepr="()", kwargsrepr=f"{{job_id: {job_id}, attempt: {attempt}}}")


def run_spec(job_dir: str, resolved: dict[str, Any]) -> dict[str, Any]:
    """The RunSpec a worker hands to the trainer (without the attempt, which the worker adds)."""
    return {"job": resolved, "paths": {"job_dir": job_dir, "checkpoint_dir": f"{job_dir}/checkpoints",
                                        "output_dir": f"{job_dir}/output"}}
