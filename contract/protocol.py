"""The protocol between the control plane (api/) and the workers (worker/): the Celery task, the Redis keys and
the event stream. The one place each is spelled (the codes a job and its events carry: contract/codes.py).

Standard library only: importing this never imports torch or any worker module, so the API gets its names
without either.
"""

from __future__ import annotations

import enum

EVENTS_STREAM = "ft:events"
# A stream entry's own key, the publisher's (worker/publisher.py): an entry sent again after a lost reply carries the
# same key, and the ingester stores an event per key, not per stream entry.
EVENT_KEY_FIELD = "key"
RUN_JOB = "worker.run_job"  # the Celery task that runs one attempt (worker/tasks.py)
INGEST_GROUP = "ingest"


def attempt_key(job_id: str) -> str:
    """The job's current attempt, set by the control plane: a worker on another attempt is stale."""
    return f"ft:job:{job_id}:attempt"


def cancel_key(job_id: str) -> str:
    return f"ft:job:{job_id}:cancel"


# A cancel key lives long enough to outlive any attempt it may still have to stop: written by the API, re-asserted
# by the control plane's reaper.
CANCEL_KEY_TTL = 30 * 24 * 3600


def _part(part: int) -> str:
    # A multi-node job runs one part per node (its node rank); part 0 keeps the single-node job's names.
    return f":{part}" if part else ""


def lease_key(job_id: str, attempt: int, part: int = 0) -> str:
    """Refreshed by the worker while it supervises its part of the attempt; its expiry means the worker is gone."""
    return f"ft:job:{job_id}:lease:{attempt}{_part(part)}"


def claim_key(job_id: str, attempt: int, part: int = 0) -> str:
    """Set once, so a redelivered task message cannot start the same part of an attempt twice."""
    return f"ft:job:{job_id}:claim:{attempt}{_part(part)}"


def released_key(job_id: str, attempt: int, part: int = 0) -> str:
    """Set by a worker that shut down after the attempt checkpointed: the control plane requeues the job
    at once, and does not count it as a lost worker."""
    return f"ft:job:{job_id}:released:{attempt}{_part(part)}"


def part_done_key(job_id: str, attempt: int, part: int) -> str:
    """Set by a node whose part of a multi-node attempt ended and leaves the job's report to another part: its
    ranks finished cleanly (node 0 reports the end), or stopped for, or failed after, the part that failed
    first. Its lease may go now without the part counting as a lost node."""
    return f"ft:job:{job_id}:done:{attempt}{_part(part)}"


def gang_stop_key(job_id: str, attempt: int) -> str:
    """Set (only if absent) by the first part of a multi-node attempt that failed, which then owns the job's
    error; every other part stops its ranks. Its value names that part."""
    return f"ft:job:{job_id}:stop:{attempt}"


def gang_term_key(job_id: str, attempt: int) -> str:
    """Why a part of a multi-node attempt sent its ranks SIGTERM ('released': its worker shuts down; or the time
    limit), set before the signal: the other parts' ranks stop at the same step through their vote, and each part
    reads here what that stop means for its own report."""
    return f"ft:job:{job_id}:term:{attempt}"


def rendezvous_key(job_id: str, attempt: int) -> str:
    """'addr:port' where node 0 of a multi-node attempt listens: the other nodes' launchers wait for it."""
    return f"ft:job:{job_id}:rendezvous:{attempt}"


# -- nodes (worker/node.py announces them, controlplane/scheduler.py places jobs on them) -------------------
NODES_SET = "ft:nodes"  # every node name ever announced: the control plane reads each one's key
NODE_QUEUE_PREFIX = "node."


def node_key(name: str) -> str:
    """The node's announcement (JSON: kind, slots, devices, queues, ...), with a TTL its heartbeat renews."""
    return f"ft:node:{name}"


def node_holder_key(name: str) -> str:
    """The one live worker that holds the node's name (its instance id), with the same TTL: a second worker under
    that name refuses to start, so two processes never consume one node's queue."""
    return f"{node_key(name)}:holder"


def node_queue(name: str) -> str:
    """The Celery queue only this node's worker consumes: the control plane sends it the jobs it placed there."""
    return NODE_QUEUE_PREFIX + name


# Keys that are spelled like a job status or an event kind (contract/codes.py) but name something else: a field
# of a payload or of an API resource. Spelled here, as the statuses are, so a literal of that spelling elsewhere is
# always a mistake.
class StateField(str, enum.Enum):
    """Fields of a `state` event's payload besides its status (the worker writes them, the ingester reads them)."""

    ERROR = "error"  # why the attempt failed: {"code", "message", ...}


class JobField(str, enum.Enum):
    """Fields of the API's Job resource (api/schemas.py) that clients such as ftcli read."""

    PROGRESS = "progress"  # the latest progress event's figures
    ERROR = "error"  # the failure: {"code", "message"}
    RESOLVED = "resolved"  # the resolved job (in a dry run's answer)


ERROR_BODY = "error"  # the one key of every API error answer: {"error": {"code", "message", "field"}}
NODE_STATE = "state"  # a node's field in GET /nodes: a NodeState


class NodeState(str, enum.Enum):
    """A node's state in GET /nodes, as the control plane sees it; only an `up` node is placed on."""

    UP = "up"
    DRAINING = "draining"  # its worker is shutting down (a deploy): its jobs end there and are handed back
    # The filesystem of its jobs' folders has less room than FT_NODE_MIN_FREE_BYTES (worker/node.py): placed on no
    # more, and what it was sent but had not started goes back to the queue, until an announcement finds room.
    DISK_FULL = "disk_full"
    LOST = "lost"  # not seen for the grace period after its announcement expired: it receives nothing


class WarmTrainer(str, enum.Enum):
    """The node's warm trainer (worker/warm.py), as its worker announces it and GET /nodes shows it. Informational:
    a node is placed on whatever this says; an attempt that finds no ready spare waits for one importing or starts
    the DeepSpeed launcher."""

    READY = "ready"  # imported, waiting for the next single-node attempt: its ranks start in about a second
    IMPORTING = "importing"  # started, its imports not yet done (a worker just started, or an attempt just ended)
    NONE = "none"  # none now: an attempt holds it until it ends, or the node runs with FT_WARM_TRAINER=false
