"""Whether one node can take one share of a job: the rule the scheduler places by (controlplane/scheduler.py) and
the dry run reports (api/services/estimate.py), written once so the two cannot disagree.

Pure: a node's figures and the job's needs in, the answer out. A share is `need` devices on one node of the job's
queue; a node takes it now when it is usable (announcing, not draining, its disk not full), below its job limit and
has that many devices free.
"""

from __future__ import annotations


def free_now(*, free: int, jobs: int, jobs_max: int) -> int:
    """The devices a new job can have on the node now: none once it runs as many jobs as it may."""
    return free if jobs < jobs_max else 0


def why_not_now(*, usable: bool, free: int, jobs: int, jobs_max: int, need: int) -> str | None:
    """Why the node cannot take the share now; None where it can."""
    if not usable:
        return "it is not up (lost, draining or its disk full)"
    if jobs >= jobs_max:
        return f"it runs {jobs} job(s), its limit (jobs_max {jobs_max})"
    if free < need:
        return f"{free} of its slots are free; the share needs {need}"
    return None


def fits_now(*, usable: bool, free: int, jobs: int, jobs_max: int, need: int) -> bool:
    """Whether the node takes a share of `need` devices now."""
    return why_not_now(usable=usable, free=free, jobs=jobs, jobs_max=jobs_max, need=need) is None


def why_never(*, queues: list[str], slots: int, queue: str, need: int) -> list[str]:
    """Why the node could never take the share, whatever runs on it; empty where it could."""
    reasons = []
    if queue not in queues:
        reasons.append(f"it serves {', '.join(queues)}, not resources.queue {queue!r}")
    if need > slots:
        reasons.append(f"resources.num_gpus is {need}; the node has {slots} slots")
    return reasons
