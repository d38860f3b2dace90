"""Hands an attempt to the workers: publish the current attempt, then send each node of its placement its
part, on the node's own queue."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import redis
from celery import Celery

from contract.protocol import RUN_JOB, attempt_key, lease_key, node_queue
from contract.spec import GangMember, NodeShare, RunPaths, RunSpec
from controlplane.settings import ControlPlaneSettings


@lru_cache
def producer(broker: str) -> Celery:
    """A Celery app that only sends: the control plane needs the broker and the task's name, not the worker's
    app (its node announcement and signal handlers, worker/celery_app.py)."""
    app = Celery("finetune", broker=broker)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True)
    return app


def dispatch(client: redis.Redis, *, job_id: str, attempt: int, job_dir: str, resolved: dict[str, Any],
             placement: list[dict[str, Any]], lease_ttl: float = 10.0) -> None:
    # The attempt key goes first: a worker that receives the message must find it current.
    client.set(attempt_key(job_id), attempt)
    # The other nodes of a multi-node job get one lease time to claim their part: the job counts as started
    # once node 0 starts, and a part that no worker claims within that time makes the whole attempt lost.
    for rank in range(1, len(placement)):
        client.set(lease_key(job_id, attempt, rank), "sent", px=int(lease_ttl * 1000))
    for rank, part in enumerate(placement):
        run = run_spec(job_dir, resolved, attempt, share(part, rank, placement))
        # The reprs that Celery would otherwise build from the whole run spec on every send (its largest cost
        # here) only label the task in the workers' logs: the ids say everything.
        kwargs = {"job_id": job_id, "attempt": attempt, "job_dir": job_dir, "run": run}
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


def run_spec(job_dir: str, resolved: dict[str, Any], attempt: int = 1,
             placement: NodeShare | None = None) -> dict[str, Any]:
    """The RunSpec a worker hands to the trainer, validated here as the trainer will validate it."""
    spec = RunSpec.model_validate({"job": resolved, "paths": RunPaths(
        job_dir=job_dir, checkpoint_dir=f"{job_dir}/checkpoints", output_dir=f"{job_dir}/output"),
        "attempt": attempt, "placement": placement})
    return spec.model_dump(mode="json")
