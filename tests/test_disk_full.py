"""A node whose disk is full takes no work and hands back what it cannot start (docs/guarantees.md).

The node's own reading of its disk (statvfs on a real folder), the scheduler's decision on a full node, a worker
part that meets a real ENOSPC before its launch (a write to /dev/full, which every write finds full), and the real
stack: a worker whose threshold is above its disk's free space, and one whose first attempt's fence write is
/dev/full.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis

from contract.codes import FailureCode
from contract.protocol import (
    NodeState,
    attempt_key,
    gang_stop_key,
    lease_key,
    node_key,
    part_done_key,
    released_key,
)
from controlplane.scheduler import PlacingNode as Placed
from controlplane.scheduler import take_back_reason, waiting_reason
from tests.helpers import events_of, wait_for, wait_status
from trainer.fence import FENCE_FILE
from worker.attempt import Attempt, supervise
from worker.node import Announcer, disk_state
from worker.outcome import Status
from worker.settings import WorkerSettings

END = {"succeeded", "failed", "cancelled"}
HUGE = 1 << 62  # more free bytes than any disk has: a node with this threshold is always full
needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(),
                                    reason="needs /dev/full, whose writes find the disk full (ENOSPC)")


def node(api: httpx.Client, name: str) -> dict[str, Any] | None:
    return next((n for n in api.get("/nodes").json()["data"] if n["name"] == name), None)


# -- the node's reading of its disk ---------------------------------------------------------------------
def test_the_announcement_says_the_room_left_on_the_disk_of_the_job_folders_and_whether_it_is_full(
        tmp_path: Path, redis_url: str) -> None:
    room = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    roomy, full = disk_state(tmp_path, 0), disk_state(tmp_path, HUGE)
    assert roomy["disk_full"] is False and full["disk_full"] is True
    assert 0 < roomy["disk_free_bytes"] and abs(roomy["disk_free_bytes"] - room) < 64 * 1024**2
    # The jobs' folder is made by the node's first job: until then the filesystem it will be made on is read.
    later = disk_state(tmp_path / "jobs" / "not-yet", HUGE)
    assert later["disk_full"] is True and later["disk_free_bytes"] > 0

    # Every beat reads the disk again, into what it writes to the node's key.
    client = redis.Redis.from_url(redis_url)
    name = f"disk-{uuid.uuid4().hex[:6]}"
    threshold = [0]
    announcer = Announcer(client, {"name": name, "draining": False}, heartbeat=60, ttl=30,
                          disk=lambda: disk_state(tmp_path, threshold[0]))
    announcer.claim()
    try:
        announcer.start()
        said = json.loads(client.get(node_key(name)) or b"{}")
        assert said["disk_full"] is False and said["disk_free_bytes"] > 0 and said["draining"] is False
        threshold[0] = HUGE
        announcer.beat()
        assert json.loads(client.get(node_key(name)) or b"{}")["disk_full"] is True
        threshold[0] = 0  # room again: the next announcement says so
        announcer.drain()
        said = json.loads(client.get(node_key(name)) or b"{}")
        assert said["disk_full"] is False and said["draining"] is True
    finally:
        announcer.release()
        client.delete(node_key(name))


# -- the scheduler's decision -----------------------------------------------------------------------------
def row(name: str, *, disk_full: bool = False, draining: bool = False, gone: bool = False) -> SimpleNamespace:
    """A node as db/placement.py's NODES statement returns it."""
    return SimpleNamespace(name=name, kind="cpu", slots=2, devices=["0", "1"], queues=["q"], jobs_max=2,
                           draining=draining, addr="127.0.0.1", disk_free_bytes=1024, disk_full=disk_full, gone=gone)


def test_a_node_whose_disk_is_full_is_placed_on_no_more_and_what_it_has_not_started_goes_back() -> None:
    full, roomy = Placed.of(row("a", disk_full=True), True), Placed.of(row("b"), True)
    assert not full.usable and full.disk_full and not full.fits(1)
    assert roomy.usable and roomy.fits(1)
    # Its last announcement's word on the disk counts only while it announces: otherwise it is not up at all.
    silent = Placed.of(row("a", disk_full=True), False)
    assert not silent.usable and not silent.disk_full
    nodes = {"a": full, "b": roomy}
    assert take_back_reason([{"node": "a", "devices": ["0"]}], nodes) == (
        "placed on a, whose disk filled before it started the job")
    assert take_back_reason([{"node": "b", "devices": ["0"]}], nodes) is None
    gang = {**nodes, "c": Placed.of(row("c", gone=True), False)}
    assert take_back_reason([{"node": "c", "devices": ["0"]}, {"node": "a", "devices": ["0"]}], gang) == (
        "placed on c, which is gone or draining and a, whose disk filled before it started the job")
    # A disk that freed: the next announcement makes the node usable again.
    assert Placed.of(row("a"), True).usable


def test_a_job_whose_queue_has_only_full_nodes_waits_saying_so() -> None:
    only_full = [Placed.of(row("a", disk_full=True), True)]
    assert waiting_reason(1, 1, "q", only_full) == (
        "waiting for a node serving queue q with room on its disk: the disk of a is full")
    busy = Placed.of(row("b"), True)
    busy.used = {"0", "1"}
    assert waiting_reason(1, 1, "q", [*only_full, busy]) == (
        "waiting for 1 free cpu slots on queue q (a: disk full); largest free: 0")
    # Draining and lost nodes are no full disk to wait for.
    assert waiting_reason(1, 1, "q", [Placed.of(row("a", disk_full=True, draining=True), True)]) == (
        "waiting for a node serving queue q: none is up")


# -- a worker part that meets ENOSPC before its launch ------------------------------------------------
def full_fence(settings: WorkerSettings, job_id: str, attempt: int) -> None:
    """The fence write of the attempt, as supervised by this process, goes to /dev/full: a real ENOSPC, and the
    supervisor's first write (trainer/fence.py writes the number to a file of the attempt and this pid first)."""
    job_dir = settings.jobs_root / job_id
    job_dir.mkdir(parents=True)
    (job_dir / f".{FENCE_FILE}.{attempt}.{os.getpid()}").symlink_to("/dev/full")


def test_a_trainer_that_dies_saying_nothing_while_the_disk_is_full_fails_as_disk_full(
        tmp_path: Path, redis_url: str) -> None:
    # Its ranks' logs are on the full disk, so nothing of the ENOSPC reached the worker: the disk's state says why.
    def decided(full: bool, exit_code: int, said: dict[str, Any] | None = None) -> dict[str, str]:
        att = Attempt(job_id=f"job_d{uuid.uuid4().hex[:8]}", attempt=1, job_dir=tmp_path, settings=WorkerSettings(
            redis_url=redis_url, artifacts_root=str(tmp_path)), client=redis.Redis.from_url(redis_url),
            run={"placement": {"node": "n-full"}}, disk_full=lambda: full)
        att.trainer_error = said
        outcome = att.decide(None, exit_code, tmp_path / "output", 60)
        assert outcome.status is Status.FAILED and outcome.error is not None
        return outcome.error

    full = decided(True, 1)
    assert full["code"] == "disk_full" and "node n-full was full" in full["message"], full
    assert decided(False, 1)["code"] == "trainer_error"
    # What the trainer said, or a signal that ended a rank, stays the cause.
    assert decided(True, 1, {"code": "data_error", "message": "bad line 3"})["code"] == "data_error"
    assert decided(True, -9)["code"] == "killed"


@needs_dev_full
@pytest.mark.parametrize("parts", [1, 2])
def test_a_disk_full_before_the_launch_hands_the_attempt_back_and_announces_the_node_at_once(
        tmp_path: Path, redis_url: str, parts: int) -> None:
    settings = WorkerSettings(redis_url=redis_url, artifacts_root=str(tmp_path))
    client = redis.Redis.from_url(redis_url)
    job_id = f"job_disk{uuid.uuid4().hex[:8]}"
    part = parts - 1  # of a gang, the last node's part
    client.set(attempt_key(job_id), 1)
    full_fence(settings, job_id, 1)
    announced: list[int] = []
    run = {"placement": {"node": "n-full", "node_rank": part, "num_nodes": parts}}
    status = supervise(job_id=job_id, attempt=1, run=run, settings=settings, client=client,
                       announce=lambda: announced.append(1))
    assert status is Status.RELEASED and announced == [1]
    note = json.loads(client.get(released_key(job_id, 1, part)) or b"{}")
    assert note["reason"].startswith("node n-full's disk is full (No space left on device) before the attempt"), note
    assert not client.exists(lease_key(job_id, 1, part)), "handed back: nothing waits for its lease to lapse"
    if parts > 1:
        # The part holds the gang's stop key: the other parts stop at once, and the job's report is this hand-back.
        assert client.get(gang_stop_key(job_id, 1)) == f"n-full#{part}".encode()


@needs_dev_full
def test_a_gang_part_whose_disk_is_full_after_another_part_failed_leaves_the_report_to_that_part(
        tmp_path: Path, redis_url: str) -> None:
    settings = WorkerSettings(redis_url=redis_url, artifacts_root=str(tmp_path))
    client = redis.Redis.from_url(redis_url)
    job_id = f"job_disk{uuid.uuid4().hex[:8]}"
    client.set(attempt_key(job_id), 1)
    client.set(gang_stop_key(job_id, 1), "n-other#0")  # node 0's part failed first: its error is the job's
    full_fence(settings, job_id, 1)
    run = {"placement": {"node": "n-full", "node_rank": 1, "num_nodes": 2}}
    status = supervise(job_id=job_id, attempt=1, run=run, settings=settings, client=client)
    assert status is Status.STALE
    assert client.get(released_key(job_id, 1, 1)) is None, "no hand-back to race the failure into a requeue"
    assert client.exists(part_done_key(job_id, 1, 1)), "its lease may lapse without looking like a lost node"
    assert client.get(gang_stop_key(job_id, 1)) == b"n-other#0"


# -- the real stack ---------------------------------------------------------------------------------
def test_a_node_with_a_full_disk_takes_no_job_which_waits_saying_so_and_runs_on_a_node_with_room(
        api: httpx.Client, stack: Any, make_job: Any) -> None:
    # Its threshold is above what its disk has free: as a node whose disk filled, it announces itself full.
    stack.start_worker("full-a", queues="fullq", slots=1, env={"FT_NODE_MIN_FREE_BYTES": str(HUGE)})
    started = ["full-a"]
    try:
        full = wait_for(lambda: (n := node(api, "full-a")) and n["state"] == NodeState.DISK_FULL and n, 60,
                        "node full-a shown with its disk full")
        assert 0 < full["disk_free_bytes"] < HUGE and full["slots_free"] == 0, full
        spec = make_job(name="full", hyperparameters={"max_steps": 2}, resources={"num_gpus": 1, "queue": "fullq"},
                        checkpointing={"every_steps": 1000})
        job = api.post("/jobs", json=spec).json()
        said = "waiting for a node serving queue fullq with room on its disk: the disk of full-a is full"
        wait_for(lambda: api.get(f"/jobs/{job['id']}").json()["queued_reason"] == said, 20, "the job's reason")
        waiting = api.get(f"/jobs/{job['id']}").json()
        assert waiting["status"] == "queued" and waiting["placement"] is None, waiting

        # A node with room joins the queue: the job runs there (not on full-a, first by name among equals).
        stack.start_worker("room-a", queues="fullq", slots=1)
        started.append("room-a")
        final = wait_status(api, job["id"], END, 300)
        assert final["status"] == "succeeded", final["error"]
        assert [p["node"] for p in final["placement"]] == ["room-a"] and final["attempt"] == 1
        states = [e["status"] for e in events_of(api, job["id"], ["state"])]
        assert "failed" not in states and "released" not in states, states
        up = node(api, "room-a")
        assert up is not None and up["state"] == NodeState.UP and up["disk_free_bytes"] > 0, up
        still = node(api, "full-a")
        assert still is not None and still["state"] == NodeState.DISK_FULL and still["jobs"] == [], still
    finally:
        for name in started:
            stack.stop(name)


@needs_dev_full
def test_an_attempt_that_finds_its_nodes_disk_full_before_the_launch_is_handed_back_and_runs_again(
        api: httpx.Client, stack: Any, make_job: Any, roots: dict[str, Path]) -> None:
    spec = make_job(name="enospc", hyperparameters={"max_steps": 2}, resources={"num_gpus": 1, "queue": "enospcq"},
                    checkpointing={"every_steps": 1000})
    job = api.post("/jobs", json=spec).json()  # no node serves its queue yet: it waits
    proc = stack.start_worker("enospc", queues="enospcq", slots=1)
    try:
        # Made before the worker, still starting, could take the job: its first attempt's fence write (`python -m
        # worker` execs Celery in place, so the supervisor keeps this pid) finds the disk full.
        jobs_root = Path(roots["artifacts"]).resolve() / "jobs"
        (jobs_root / job["id"]).mkdir(parents=True)
        (jobs_root / job["id"] / f".{FENCE_FILE}.1.{proc.pid}").symlink_to("/dev/full")
        final = wait_status(api, job["id"], END, 300)
        assert final["status"] == "succeeded", final["error"]
        assert final["attempt"] == 2 and [p["node"] for p in final["placement"]] == ["enospc"]
        states = [(e["attempt"], e["status"], e.get("reason") or "") for e in events_of(api, job["id"], ["state"])]
        released = [s for s in states if s[:2] == (1, "released")]
        assert len(released) == 1 and "node enospc's disk is full" in released[0][2], states
        requeued = [s for s in states if s[:2] == (2, "queued")]
        assert requeued and "handed it back: node enospc's disk is full" in requeued[0][2], states
        assert not [s for s in states if s[1] in ("failed", "lost")], states
        logs = [e["line"] for e in events_of(api, job["id"], ["log"]) if e["attempt"] == 1]
        assert any("disk is full" in line for line in logs), logs
    finally:
        stack.stop("enospc")


@needs_dev_full
def test_a_write_the_disk_refuses_is_named_disk_full_by_the_trainer() -> None:
    """What a checkpoint's save raises on a full disk, provoked for real through /dev/full: torch's archive writer
    says only "unexpected pos" (no OSError), a plain write says ENOSPC; the trainer reports both as disk_full."""
    import torch

    from trainer.__main__ import _error_code

    with pytest.raises(RuntimeError) as saved:
        torch.save({"weights": torch.zeros(100_000)}, "/dev/full")
    with pytest.raises(OSError) as written, open("/dev/full", "wb") as f:  # noqa: PT012
        f.write(b"x" * 1_000_000)
        f.flush()
    assert _error_code(saved.value) == FailureCode.DISK_FULL, saved.value
    assert _error_code(written.value) == FailureCode.DISK_FULL, written.value
    try:
        raise RuntimeError("the checkpoint could not be saved") from written.value
    except RuntimeError as wrapped:
        assert _error_code(wrapped) == FailureCode.DISK_FULL
    assert _error_code(RuntimeError("unexpected pos, said a test")) == FailureCode.TRAINER_ERROR
