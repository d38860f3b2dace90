"""Placement: which node's slots each queued job gets. The one place this is decided.

A pass, run by the dispatcher thread (controlplane/dispatcher.py) before it sends anything:

1. copies the nodes' announcements from Redis (worker/node.py) into the `nodes` table, `last_seen` by the
   database's clock; only a node announcing now is placed on (one whose key just expired, as a frozen
   worker's does with its job's lease, is not lost yet but must not get that job back);
2. takes back the placements on nodes gone (unseen for a lease TTL beyond the grace), draining or whose disk is
   full that no worker started yet (no lease): such a job goes out again as its next attempt, so the old node,
   should it come back, finds its message stale;
3. places queued jobs, in order: higher `resources.priority` first (the `priority` column, read through the
   index ix_jobs_waiting); among equal priorities owners take turns (each owner's oldest, then each owner's
   second oldest, ...; within a round the owner whose last job was sent on the queue longest ago, or never,
   first), then the oldest first. A job goes
   to the live node of its queue with the fewest free slots that still fit it (best fit keeps large
   holes for large jobs), on the lowest free devices; a node whose disk is full (its announcement says so,
   worker/node.py) gets nothing until an announcement finds room again. Its placement is committed; the
   dispatcher sends it to that node's own queue only afterwards, so no message ever names slots Postgres does
   not hold.

No starvation of large jobs, by reservation: the first job of a queue that does not fit reserves the
node of its queue closest to fitting it, and no later job is placed on that node, so the node's slots
come free for it as its jobs end. Later jobs still fill the other nodes (backfill).

Race-free: a pass runs under a transaction-level advisory lock (two control planes never place at once),
every count is read inside it, and a placement is written only if the job is still queued and unplaced
on the same attempt (a cancel or requeue that got there first wins).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy.orm import Session

from contract.codes import JobStatus
from contract.protocol import NODES_SET, lease_key, node_key
from controlplane.settings import ControlPlaneSettings
from core import placement as rule
from db import placement as store
from db.engine import session_scope

log = logging.getLogger(__name__)

PER_QUEUE = 50  # jobs of one queue looked at per pass: a long blocked queue must not hide the others


@dataclass
class PlacingNode:
    """A node as one scheduling pass places on it: what it announced, and the slots the pass has handed out so far
    (GET /nodes shows its state as contract.protocol.NodeState)."""

    name: str
    kind: str
    slots: int
    devices: list[str]
    queues: list[str]
    jobs_max: int
    usable: bool  # announcing now, not draining, its disk not full
    addr: str = "127.0.0.1"
    # Unseen for a lease TTL beyond the grace: not a blip of Redis or of this control plane (which stop every
    # node's refresh at once) but a node that is gone. Only then are its unstarted placements taken back.
    gone: bool = False
    # Announcing, not draining, and its disk full: what it was placed and has not started would fail there on its
    # first write, so that goes back to the queue too (its worker hands back any it takes meanwhile).
    disk_full: bool = False
    used: set[str] = field(default_factory=set)
    jobs: int = 0
    reserved_by: str | None = None

    @classmethod
    def of(cls, row: Any, announcing: bool) -> PlacingNode:
        """The node as stored (db/placement.py `nodes`); `announcing`: its key is in Redis now."""
        up = announcing and not row.draining
        return cls(row.name, row.kind, row.slots, list(row.devices), list(row.queues), row.jobs_max,
                   usable=up and not row.disk_full, addr=row.addr, gone=bool(row.gone) or row.draining,
                   disk_full=up and bool(row.disk_full))

    @property
    def free(self) -> list[str]:
        return [d for d in self.devices if d not in self.used]

    @property
    def free_now(self) -> int:
        """The devices a new job can have here now (none at its job limit)."""
        return rule.free_now(free=len(self.free), jobs=self.jobs, jobs_max=self.jobs_max)

    def fits(self, need: int) -> bool:
        return rule.fits_now(usable=self.usable, free=len(self.free), jobs=self.jobs, jobs_max=self.jobs_max,
                             need=need)


def read_announcements(client: redis.Redis) -> list[dict[str, Any]]:
    names = sorted(n.decode() for n in client.smembers(NODES_SET))
    if not names:
        return []
    values = client.mget([node_key(n) for n in names])
    out = []
    for raw in values:
        if raw is None:
            continue  # expired: the node stopped heartbeating
        try:
            out.append(json.loads(raw))
        except ValueError:
            log.warning("a node announcement is not JSON: %r", raw[:200])
    return out


def take_back_reason(parts: list[dict[str, Any]], nodes: dict[str, PlacingNode]) -> str | None:
    """Why a placed job that no worker started goes back to the queue (a node of its placement is gone, draining or
    its disk full); None while every node of it may still start it."""
    gone = [p["node"] for p in parts if p["node"] not in nodes or nodes[p["node"]].gone]
    full = [p["node"] for p in parts if p["node"] not in gone and nodes[p["node"]].disk_full]
    why = ([f"{', '.join(gone)}, which is gone or draining"] if gone else []) + (
        [f"{', '.join(full)}, whose disk filled"] if full else [])
    return f"placed on {' and '.join(why)} before it started the job" if why else None


def waiting_reason(need: int, count: int, queue: str, nodes: list[PlacingNode]) -> str:
    serving = [n for n in nodes if queue in n.queues and n.usable]
    full = sorted(n.name for n in nodes if queue in n.queues and n.disk_full)
    if not serving and full:
        return f"waiting for a node serving queue {queue} with room on its disk: the disk of {', '.join(full)} is full"
    if not serving:
        return f"waiting for a node serving queue {queue}: none is up"
    # The queue's nodes that would count but for their full disk, named in whatever else the job waits for.
    also = f" ({', '.join(full)}: disk full)" if full else ""
    kinds = "/".join(sorted({n.kind for n in serving}))
    big_enough = [n for n in serving if n.slots >= need]
    if len(big_enough) < count:
        biggest = max(n.slots for n in serving)
        return (f"queue {queue} has {len(big_enough)} node(s) of at least {need} {kinds} slots{also} (the largest "
                f"has {biggest}); the job needs {count}: it waits for such nodes to join")
    free = sorted((n.free_now for n in serving), reverse=True)
    if count == 1:
        return f"waiting for {need} free {kinds} slots on queue {queue}{also}; largest free: {free[0]}"
    return (f"waiting for {count} nodes with {need} free {kinds} slots each on queue {queue}{also}; free slots of "
            f"its nodes: {', '.join(map(str, free))}")


class Scheduler:
    def __init__(self, client: redis.Redis, settings: ControlPlaneSettings) -> None:
        self.r = client
        self.settings = settings

    def step(self) -> int:
        """One placement pass; returns how many jobs it placed (or took back from a lost node)."""
        announced = read_announcements(self.r)
        with session_scope() as session:
            store.lock(session)
            # Placed on only while announcing now. A node whose key expired is not lost yet (the grace covers a
            # blip of Redis), but it takes no new job: a frozen worker's key expires with the lease of its job,
            # whose requeue would otherwise go straight back to the frozen node, costing the job an attempt.
            announcing = store.refresh_nodes(session, announced)
            nodes = {row.name: PlacingNode.of(row, row.name in announcing)
                     for row in store.nodes(session, gone_seconds=self.settings.lease_grace_seconds
                                            + self.settings.lease_ttl_seconds)}
            changed = self._take_back(session, nodes)
            changed += self._place(session, nodes)
        return changed

    def _take_back(self, session: Session, nodes: dict[str, PlacingNode]) -> int:
        """Count the slots placed jobs hold; a job placed on a node that is lost, draining or whose disk is full,
        and not started there (no lease), is put back in the queue as its next attempt."""
        held = store.held(session)
        back = []
        for job in held:
            parts = job.placement or []
            reason = take_back_reason(parts, nodes)
            if job.status == JobStatus.QUEUED and reason and not self.r.exists(lease_key(job.id, job.attempt)):
                back.append((job.id, job.attempt, reason))
                continue
            for p in parts:
                node = nodes.get(p["node"])
                if node is not None:
                    node.used.update(str(d) for d in p.get("devices", []))
                    node.jobs += 1
        for job_id, attempt, reason in back:
            if not store.take_back(session, job_id, attempt, reason):
                continue
            log.warning("job %s attempt %d: %s; placing it again", job_id, attempt, reason)
        return len(back)

    def _place(self, session: Session, nodes: dict[str, PlacingNode]) -> int:
        # A queue whose only nodes have a full disk is looked at too, so that its jobs say so (waiting_reason).
        served = sorted({q for n in nodes.values() if n.usable or n.disk_full for q in n.queues})
        store.mark_unserved(session, served)
        placed = 0
        blocked_queues: set[str] = set()
        for job in store.candidates(session, served, per_queue=PER_QUEUE):
            need, count = job.per_node, job.num_nodes
            fitting = [n for n in nodes.values() if job.queue in n.queues and n.reserved_by is None
                       and n.fits(need)]
            if len(fitting) < count:
                # All or nothing: a gang that does not fit whole holds no slot, so two gangs can never each
                # hold part of what the other needs.
                reason = waiting_reason(need, count, job.queue, list(nodes.values()))
                if job.queue not in blocked_queues:
                    blocked_queues.add(job.queue)
                    self._reserve(job.id, job.queue, need, count, nodes)
                if reason != job.queued_reason:
                    store.set_reason(session, job.id, reason)
                continue
            chosen = sorted(fitting, key=lambda n: (len(n.free), n.name))[:count]  # best fit; node rank 0 first
            placement = [{"node": n.name, "kind": n.kind, "devices": n.free[:need], "addr": n.addr} for n in chosen]
            if not store.place(session, job.id, job.attempt, placement):
                continue  # cancelled or requeued meanwhile: it holds nothing
            for n, part in zip(chosen, placement, strict=True):
                n.used.update(part["devices"])
                n.jobs += 1
            placed += 1
            log.info("job %s placed on %s", job.id, "; ".join(f"{p['node']} [{','.join(p['devices'])}]"
                                                              for p in placement))
        return placed

    @staticmethod
    def _reserve(job_id: str, queue: str, need: int, count: int, nodes: dict[str, PlacingNode]) -> None:
        """Hold back the `count` nodes of the queue closest to fitting the blocked job (nodes that could ever
        fit it; none if too few could)."""
        able = [n for n in nodes.values() if queue in n.queues and n.usable and n.slots >= need
                and n.reserved_by is None]
        if len(able) >= count:
            for n in sorted(able, key=lambda n: (-len(n.free), n.jobs, n.name))[:count]:
                n.reserved_by = job_id
