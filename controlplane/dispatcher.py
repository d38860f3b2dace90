"""Places queued jobs and sends them to their nodes: the one place a task message is published (the
outbox's relay).

The API's submit only commits the job row; a requeue or re-drive only puts the row back to queued
with no `dispatched_at`. Each pass first runs the scheduler (controlplane/scheduler.py), which commits where
queued jobs go, then this thread finds the placed rows not yet sent and publishes their current attempt
through Celery to each placed node's own queue, then marks them sent. It wakes on `ft_dispatch` (a
trigger notifies when a row needs sending, migrations 0003, or slots came free, 0005; the control plane's one
LISTEN loop, db/notify.py, hands it over) and looks anyway every POLL_SECONDS, so a lost notification or
listener costs at most that. Exactly one task message per attempt is the goal, at least one is the guarantee:
a crash between publishing and the commit sends the attempt again, and a worker drops a message for an attempt that
was already claimed. A submit thus never waits on Redis or the broker, and a row can never exist
without its message being sent (the gap the API's own send after the commit had).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import redis

from controlplane.dispatch import dispatch
from controlplane.loop import WokenLoop
from controlplane.scheduler import Scheduler
from controlplane.settings import ControlPlaneSettings
from db import placement
from db.engine import session_scope
from db.notify import DISPATCH, Notifications

log = logging.getLogger(__name__)

BATCH = 200  # rows locked and sent per transaction


class Dispatcher(WokenLoop):
    name = "dispatching"
    log = log
    handled_message = "sent %d job(s) to the workers"

    def __init__(self, client: redis.Redis, settings: ControlPlaneSettings,
                 notifications: Notifications | None = None) -> None:
        super().__init__(DISPATCH, notifications)
        self.r = client
        self.settings = settings
        self.scheduler = Scheduler(client, settings)

    def step(self) -> int:
        """Place what fits, then send every placed job that has not been sent; returns how many were sent."""
        self.scheduler.step()
        sent = 0
        while True:
            with session_scope() as session:
                jobs = placement.placed_unsent(session, limit=BATCH)
                for job in jobs:
                    dispatch(self.r, job_id=job.id, attempt=job.attempt, job_dir=job.job_dir,
                             resolved=job.resolved, placement=job.placement or [],
                             lease_ttl=self.settings.lease_ttl_seconds)
                    # This host's clock: the reaper compares it with when it noticed a Redis data loss.
                    job.dispatched_at = datetime.now(timezone.utc)
            sent += len(jobs)
            if len(jobs) < BATCH:
                return sent
