"""The Celery application: Redis broker, JSON only, one job per worker with nothing prefetched."""

from __future__ import annotations

from celery import Celery

from worker.settings import WorkerSettings

settings = WorkerSettings()

app = Celery("finetune", broker=settings.broker, include=["worker.tasks"])
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    task_ignore_result=True,
    # Ack after the job, and reserve one message per process: a busy worker never holds a second job
    # that an idle worker could run.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    # A redelivered message of a finished or superseded attempt is harmless: the task checks the attempt.
    broker_transport_options={"visibility_timeout": 7 * 24 * 3600},
    task_default_queue="default",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
