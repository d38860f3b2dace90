"""Faults against the real stack: a frozen worker, a worker stopped for a deploy, a rank killed, a worker
killed in the middle of a checkpoint save. After each: the job ends as it should, never two attempts at
once, every trainer event stored exactly once, nothing left running.

Each test runs its job on a queue of its own, served by workers it starts, so the faults stay inside it.
(Control plane, Postgres and Redis outages: tests/test_outages.py. A worker killed by SIGKILL:
tests/test_jobs_e2e.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chaos_support import AttemptSampler, assert_history_exact, committed_markers, rank_pids
from tests.helpers import events_of, job_processes, wait_for, wait_no_processes, wait_status
from trainer.checkpoint import SAVE_PAUSE_ENV

LEASE_TTL = 3.0  # FT_LEASE_TTL_SECONDS of the test stack (tests/conftest.py)

StartWorker = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def workers(stack: Any) -> Iterator[StartWorker]:
    started: list[str] = []

    def start(name: str, queue: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        name = f"{name}-{uuid.uuid4().hex[:4]}"
        started.append(name)
        return stack.start_worker(name, queues=queue, env=env)

    yield start
    for name in started:
        proc = stack.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a frozen worker cannot act on SIGTERM
        if name in stack.procs:
            stack.stop(name)


def queue(name: str) -> str:
    return f"chaos-{name}-{uuid.uuid4().hex[:6]}"


def first(evs: list[dict[str, Any]], kind: str, attempt: int) -> dict[str, Any]:
    return next(e for e in evs if e["type"] == kind and e["attempt"] == attempt)


def running_attempt(api: httpx.Client, job_id: str) -> int:
    """The attempt that is training now (an attempt number may have been used up before it started)."""
    return int(wait_for(lambda: events_of(api, job_id, ["started"]), 240, "the trainer to start")[-1]["attempt"])


def assert_next_attempt_owns_the_results(job_dir: Path, faulted: int, resumed_from: int) -> None:
    """Nothing committed by the faulted attempt after the next one resumed: every checkpoint left is the
    next attempt's or older than the resume point, and the export is the next attempt's."""
    for marker in committed_markers(job_dir):
        assert marker["attempt"] == faulted + 1 or marker["step"] <= resumed_from, marker
    assert json.loads((job_dir / "output" / "COMPLETE").read_text())["attempt"] == faulted + 1


def test_a_frozen_worker_is_fenced_and_its_job_runs_exactly_once(api: httpx.Client, make_job: Any,
                                                                  workers: StartWorker,
                                                                  roots: dict[str, Path]) -> None:
    q = queue("freeze")
    # Its saves linger, so that the freeze lands while attempt 1 still trains: a warm trainer runs the whole job in
    # the seconds between the first checkpoint and the fence otherwise.
    frozen = workers("frozen", q, {SAVE_PAUSE_ENV: "2"})
    spec = make_job(name="freeze", hyperparameters={"max_steps": 40}, resources={"queue": q},
                    checkpointing={"every_steps": 6, "keep_last": 2})
    job = api.post("/jobs", json=spec).json()
    job_dir = roots["artifacts"] / "jobs" / job["id"]
    sampler = AttemptSampler(job["id"])
    sampler.start()
    a1 = running_attempt(api, job["id"])
    wait_for(lambda: events_of(api, job["id"], ["checkpoint"]), 240, "a committed checkpoint")
    os.kill(frozen.pid, signal.SIGSTOP)  # as a stuck host or a network partition looks from outside
    frozen_at = time.monotonic()
    assert rank_pids(job["id"], a1), "attempt 1 ended before its worker froze: nothing was left to fence"
    workers("rescuer", q)
    # The frozen worker cannot act; its guard ends the ranks once the lease it saw has expired.
    wait_no_processes(f"{job['id']}/attempts/{a1}/", LEASE_TTL + 10,
             "the frozen attempt's processes to end")
    fenced_after = time.monotonic() - frozen_at
    assert fenced_after <= LEASE_TTL + 3, f"attempt 1 kept running {fenced_after:.1f} s after its worker froze"
    assert "lease expired" in json.loads((job_dir / "attempts" / str(a1) / "FENCED").read_text())["reason"]

    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=400)
    sampler.stop()
    assert final["status"] == "succeeded" and final["attempt"] == a1 + 1, final["error"]
    assert not sampler.overlaps, f"two attempts ran at once: {sampler.overlaps[:3]}"
    assert sampler.seen == {a1, a1 + 1}
    evs = assert_history_exact(api, job["id"], job_dir)
    resumed = first(evs, "started", a1 + 1)["resumed_from_step"]
    assert resumed and resumed >= 6
    assert_next_attempt_owns_the_results(job_dir, a1, resumed)

    # Woken up, the old worker learns it lost the job and says nothing more about it.
    os.kill(frozen.pid, signal.SIGCONT)
    time.sleep(LEASE_TTL)
    assert frozen.poll() is None, "the woken worker keeps serving"
    assert api.get(f"/jobs/{job['id']}").json()["status"] == "succeeded"
    assert events_of(api, job["id"]) == evs, "nothing of the superseded attempt reached the job"
    assert not job_processes(job["id"])


def test_a_worker_stopped_for_a_deploy_checkpoints_and_its_job_resumes_elsewhere(api: httpx.Client,
                                                                                 make_job: Any,
                                                                                 workers: StartWorker,
                                                                                 roots: dict[str, Path]) -> None:
    q = queue("deploy")
    leaving = workers("leaving", q)
    spec = make_job(name="deploy", hyperparameters={"max_steps": 40}, resources={"queue": q},
                    checkpointing={"every_steps": 40, "keep_last": 2})
    job = api.post("/jobs", json=spec).json()
    job_dir = roots["artifacts"] / "jobs" / job["id"]
    sampler = AttemptSampler(job["id"])
    sampler.start()
    a1 = running_attempt(api, job["id"])
    wait_for(lambda: events_of(api, job["id"], ["progress"]), 240, "the first progress event")
    leaving.send_signal(signal.SIGTERM)  # what a deploy or `docker stop` sends
    workers("rescuer", q)
    # Warm shutdown: the worker waits for its job to checkpoint and hand itself back, then exits cleanly.
    assert leaving.wait(60) == 0

    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=400)
    sampler.stop()
    assert final["status"] == "succeeded" and final["attempt"] == a1 + 1, final["error"]
    assert not sampler.overlaps
    evs = assert_history_exact(api, job["id"], job_dir)
    interrupted = first(evs, "interrupted", a1)
    assert interrupted["reason"] == "SIGTERM"
    states = [(e["attempt"], e["status"]) for e in evs if e["type"] == "state"]
    assert (a1, "released") in states and (a1, "lost") not in states, "a deploy is not a lost worker"
    assert first(evs, "started", a1 + 1)["resumed_from_step"] == interrupted["step"], "no step trained twice"
    assert_next_attempt_owns_the_results(job_dir, a1, interrupted["step"])
    assert not job_processes(job["id"])


def test_a_rank_killed_by_a_signal_fails_the_job_as_killed_naming_the_rank(api: httpx.Client, make_job: Any,
                                                                           workers: StartWorker) -> None:
    # A worker of the default priority, low (the suite's stack runs its ranks at normal, tests/conftest.py).
    q = queue("rank-kill")
    workers("rank-kill", q, {"FT_TRAINER_PRIORITY": "low"})
    job = api.post("/jobs", json=make_job(name="rank-kill", hyperparameters={"max_steps": 100_000},
                                          resources={"queue": q})).json()
    a1 = running_attempt(api, job["id"])
    wait_for(lambda: events_of(api, job["id"], ["progress"]), 240, "the first progress event")
    pids = rank_pids(job["id"], a1)
    assert sorted(pids) == [0, 1], pids
    # The ranks run nicer than the guard that watches the lease (worker/priority.py).
    guards = [int(line.split(":", 1)[0]) for line in job_processes(f"{job['id']}/attempts/{a1}/")
              if "-m worker.guard" in line or "-m worker.spare" in line]  # the warm trainer guards too
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids.values()] == [10, 10]
    assert guards and [os.getpriority(os.PRIO_PROCESS, pid) for pid in guards] == [0] * len(guards)
    os.kill(pids[1], signal.SIGKILL)  # as the kernel's out-of-memory killer does
    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=60)
    error = final["error"]
    assert final["status"] == "failed" and error["code"] == "killed", error
    assert error["message"].startswith("rank 1 was killed by SIGKILL"), error["message"]
    assert error["rank"] == "1" and error["signal"] == "SIGKILL"
    wait_no_processes(job["id"], 10, "every process of the job to be gone")


def test_a_worker_killed_while_saving_a_checkpoint_resumes_from_the_last_committed_one(
        api: httpx.Client, make_job: Any, workers: StartWorker, roots: dict[str, Path]) -> None:
    q = queue("midsave")
    # Its saves linger between the shards and the commit, so that the kill lands mid-save on a loaded machine.
    doomed = workers("doomed", q, {SAVE_PAUSE_ENV: "1.5"})
    spec = make_job(name="midsave", hyperparameters={"max_steps": 16}, resources={"queue": q},
                    checkpointing={"every_steps": 4, "keep_last": 2})
    job = api.post("/jobs", json=spec).json()
    job_dir = roots["artifacts"] / "jobs" / job["id"]
    sampler = AttemptSampler(job["id"])
    sampler.start()
    a1 = running_attempt(api, job["id"])
    staging = job_dir / "checkpoints" / f".attempt-{a1}"

    def caught_mid_save() -> tuple[int, int] | None:
        """Freeze the ranks while a save is staged and not yet committed: (step being saved, last committed).
        Not the first save: the next attempt must be seen resuming from a committed one."""
        if not committed_markers(job_dir) or not any(staging.glob("step-*")):
            return None
        pids = rank_pids(job["id"], a1)
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        staged = sorted(staging.glob("step-*"))
        if staged and len(pids) == 2:
            committed = [m["step"] for m in committed_markers(job_dir)]
            return int(staged[-1].name.removeprefix("step-")), max(committed, default=0)
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)  # the save finished between the two looks: try the next one
        return None

    saving, last_committed = wait_for(caught_mid_save, 240, "a checkpoint save in progress", interval=0.05)
    assert saving > last_committed
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    wait_no_processes(f"{job['id']}/attempts/{a1}/", 10, "the killed attempt's processes to end")
    workers("rescuer", q)

    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=400)
    sampler.stop()
    assert final["status"] == "succeeded" and final["attempt"] == a1 + 1, final["error"]
    assert not sampler.overlaps
    evs = assert_history_exact(api, job["id"], job_dir)
    resumed = first(evs, "started", a1 + 1)["resumed_from_step"] or 0
    assert resumed == last_committed, "the half-written save is ignored"
    assert not staging.exists(), "the next attempt removed the half-written save"
    assert_next_attempt_owns_the_results(job_dir, a1, last_committed)
    assert not job_processes(job["id"])


def test_a_job_whose_workers_keep_vanishing_fails_as_worker_lost(api: httpx.Client, make_job: Any,
                                                                 stack_env: dict[str, str]) -> None:
    import psycopg

    job = api.post("/jobs", json=make_job(name="vanishing", resources={"queue": queue("nobody")})).json()
    url = stack_env["FT_DATABASE_URL"].replace("+psycopg", "")
    for lost in range(1, 4):  # FT_MAX_ATTEMPTS is 3
        # As if a worker had started the current attempt and vanished with its lease.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE jobs SET status = 'running' WHERE id = %s AND status = 'queued'", (job["id"],))
        expect = {"failed"} if lost == 3 else {"queued"}
        final = wait_status(api, job["id"], expect | {"succeeded", "cancelled"}, timeout=30)
        assert final["status"] in expect, final
    assert final["error"]["code"] == "worker_lost", final["error"]
    assert "3 of 3 allowed attempts lost their worker" in final["error"]["message"]
    states = [e["status"] for e in events_of(api, job["id"], ["state"])]
    assert states.count("lost") == 2 and states[-1] == "failed", states
