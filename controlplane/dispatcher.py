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
from functools import lru_cache
from typing import Any

import redis
from celery import Celery

from contract.protocol import RUN_JOB, attempt_key, lease_key, node_queue
from contract.spec import AttemptOrder, GangMember, NodeShare
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
                    dispatch(self.r, job_id=job.id, attempt=job.attempt, resolved=job.resolved,
                             placement=job.placement or [], lease_ttl=self.settings.lease_ttl_seconds)
                    # This host's clock: the reaper compares it with when it noticed a Redis data loss.
                    job.dispatched_at = datetime.now(timezone.utc)
            sent += len(jobs)
            if len(jobs) < BATCH:
                return sent


@lru_cache
def producer(broker: str) -> Celery:
    """A Celery app that only sends: the control plane needs the broker and the task's name, not the worker's
    app (its node announcement and signal handlers, worker/celery_app.py)."""
    app = Celery("finetune", broker=broker)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    return app


def dispatch(client: redis.Redis, *, job_id: str, attempt: int, resolved: dict[str, Any],
             placement: list[dict[str, Any]], lease_ttl: float = 10.0) -> None:
    """Publish the current attempt, then send each node of its placement its part, on the node's own queue."""
    # The attempt key goes first: a worker that receives the message must find it current.
    client.set(attempt_key(job_id), attempt)
    # The other nodes of a multi-node job get one lease time to claim their part: the job counts as started
    # once node 0 starts, and a part that no worker claims within that time makes the whole attempt lost.
    for rank in range(1, len(placement)):
        client.set(lease_key(job_id, attempt, rank), "sent", px=int(lease_ttl * 1000))
    for rank, part in enumerate(placement):
        run = order(resolved, attempt, share(part, rank, placement))
        # The reprs that Celery would otherwise build from the whole order on every send (its largest cost
        # here) only label the task in the workers' logs: the ids say everything.
        kwargs = {"job_id": job_id, "attempt": attempt, "run": run}
        label = f"{{job_id: {job_id}, attempt: {attempt}, node: {part['node']}}}"
        producer(ControlPlaneSettings().broker).send_task(RUN_JOB, kwargs=kwargs, queue=node_queue(part["node"]),
                                                  argsrepr="()", kwargsrepr=label)


def share(part: dict[str, Any], rank: int, placement: list[dict[str, Any]]) -> NodeShare:
    master = placement[0]
    gang = [GangMember(node=p["node"], devices=[str(d) for d in p["devices"]]) for p in placement] \
        if len(placement) > 1 else []
    return NodeShare(node=part["node"], devices=[str(d) for d in part["devices"]], kind=part.get("kind", "cpu"),
                     node_rank=rank, num_nodes=len(placement), master_addr=master.get("addr", "127.0.0.1"),
                     master_port=master.get("port"), gang=gang)


def order(resolved: dict[str, Any], attempt: int, placement: NodeShare | None = None) -> dict[str, Any]:
    """The AttemptOrder a node receives, validated here as the worker will validate it."""
    return AttemptOrder.model_validate({"job": resolved, "attempt": attempt, "placement": placement}).model_dump(
        mode="json")
