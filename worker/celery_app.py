"""The Celery application: Redis broker, JSON only, one job per pool slot with nothing prefetched."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown, worker_shutting_down
from kombu.transport import redis as kombu_redis

from worker.node import Announcer, NameTaken, NodeSettings, describe, own_queue_only
from worker.scratch import Sweeper
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


# -- the node: announce it, consume only its own queue (worker/node.py) ----------------------------
_announcer: Announcer | None = None
_sweeper: Sweeper | None = None


EXIT_NAME_TAKEN = 3  # the node's name is held by another live worker (nothing was consumed)


def _leave_node(holder: str) -> None:
    # Another worker holds the name now and consumes the node's queue: this one must stop taking its jobs.
    # SIGTERM is a deploy's warm shutdown: running jobs (already fenced, their leases lapsed) are handed back.
    os.kill(os.getpid(), signal.SIGTERM)


@celeryd_after_setup.connect
def _join_as_node(sender: str, instance: Any, **_: Any) -> None:
    """Before the worker consumes anything: it takes the node's name (or exits: another live worker has
    it), its queues become the node's served queues, and it takes tasks only from the node's own queue,
    where the control plane sends exactly what fits the node's slots."""
    global _announcer, _sweeper
    node = NodeSettings()
    served = own_queue_only(instance.app.amqp.queues, node.name)
    record = describe(node, served, jobs_max=int(getattr(instance, "concurrency", 1) or 1))
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    _sweeper = Sweeper(settings, node.min_free_bytes)
    announcer = Announcer(client, record, heartbeat=settings.heartbeat_seconds, ttl=settings.lease_ttl_seconds,
                          on_lost=_leave_node, warm=_warm_state,
                          # Each beat sweeps the idle job folders that are due, then reads the disk (worker/scratch.py).
                          disk=_sweeper.disk)
    while True:
        try:
            announcer.claim()
            break
        except NameTaken as exc:
            print(f"error: {exc}", file=sys.__stderr__, flush=True)
            # Celery stops the worker with this code; no consumer, pool thread or heartbeat has started.
            raise SystemExit(EXIT_NAME_TAKEN) from None
        except redis.RedisError as exc:
            # As the broker connection does on startup: wait for Redis rather than fail.
            logging.getLogger(__name__).warning("cannot claim node name %r yet: %s", node.name, exc)
            time.sleep(settings.heartbeat_seconds)
    _announcer = announcer
    if record["jobs_max"] < record["slots"]:
        logging.getLogger(__name__).warning(
            "node %s offers %d slots but its pool runs %d job(s) at once: start it with `python -m worker` "
            "(a threads pool of one thread per slot)", node.name, record["slots"], record["jobs_max"])


@worker_ready.connect
def _announce(**_: Any) -> None:
    from worker.attempt import warm_up

    # The spare first: the node's first announcement says whether it is importing, and `none` then means none comes.
    warm_up(settings)
    if _announcer is not None:
        _announcer.start()


def _warm_state() -> dict[str, str]:
    from worker.attempt import spares

    return {"warm_trainer": spares(settings).state().value}


def disk_full_now() -> bool:
    """Whether the node's disk is full now, as its next announcement will say (worker/node.py `disk_state`)."""
    return _sweeper is not None and bool(_sweeper.read().get("disk_full"))


def announce_now() -> None:
    """Renew the node's announcement now rather than at the next heartbeat: an attempt that found the disk full
    hands its job back, and the scheduler must read the full disk before it places that job again."""
    if _announcer is not None:
        _announcer.beat()


@worker_shutting_down.connect
def _drain(**_: Any) -> None:
    # A deploy: the node takes no new placements; its running jobs are released and requeued elsewhere.
    if _announcer is not None:
        _announcer.drain()


@worker_shutdown.connect
def _release_name(**_: Any) -> None:
    # The pool has finished (its jobs handed back): the name is free for a worker restarted under it.
    if _announcer is not None:
        _announcer.release()
    from worker.attempt import spares

    spares(settings).close()


# -- a broker outage must not end the worker -----------------------------------------------------------
def _tolerate_closed_connection(method: Callable[..., Any]) -> Callable[..., Any]:
    """When Redis goes away, Celery (5.7) closes the consumer's broker connection while kombu's Redis QoS
    still has to restore or acknowledge messages through it, and kombu then asks the closed connection for
    its host (`None.hostname`): an AttributeError that Celery takes as unrecoverable, so the whole worker,
    and with it every job of its node, would end on a Redis restart. Swallowed here: the message stays in
    Redis's unacked set and is delivered again later, which is harmless (a task drops an attempt that was
    already claimed)."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except AttributeError as exc:
            logging.getLogger(__name__).warning("broker connection closed under %s (%s): left for redelivery",
                                                method.__name__, exc)
            return None

    return wrapped


for _name in ("ack", "reject", "restore_unacked"):
    setattr(kombu_redis.QoS, _name, _tolerate_closed_connection(getattr(kombu_redis.QoS, _name)))
