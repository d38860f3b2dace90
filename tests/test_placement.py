"""Placement on the real stack: nodes announce themselves, several jobs share a node on disjoint slots, a job
that does not fit waits with its reason, and a lost node is shown as lost.

Each test starts workers of its own (nodes with their own names and queues) on this host: CPU slots, gloo.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from typing import Any

import httpx
import redis

from contract.protocol import NODES_SET, WarmTrainer, attempt_key, gang_stop_key, node_key
from tests.helpers import events_of, job_processes, wait_for, wait_no_processes, wait_status
from tests.preference_support import write_pairs

END = {"succeeded", "failed", "cancelled"}


def node(api: httpx.Client, name: str) -> dict[str, Any] | None:
    return next((n for n in api.get("/nodes").json()["data"] if n["name"] == name), None)


def progressing(api: httpx.Client, job_id: str) -> bool:
    return bool(events_of(api, job_id, ["progress"]))


def test_two_one_slot_jobs_share_a_two_slot_node_and_a_third_waits_with_its_reason(
        api: httpx.Client, stack: Any, make_job: Any) -> None:
    # Before any node serves the queue, a job says so.
    spec = make_job(name="slot", hyperparameters={"max_steps": 100_000}, resources={"num_gpus": 1, "queue": "pair"})
    early = api.post("/jobs", json=spec).json()
    wait_for(lambda: api.get(f"/jobs/{early['id']}").json()["queued_reason"]
             == "waiting for a node serving queue pair: none is up", 10, "the no-node reason")

    stack.start_worker("pair", queues="pair", slots=2)
    try:
        up = wait_for(lambda: (n := node(api, "pair")) and n["state"] == "up" and n, 60, "node pair to announce itself")
        assert up["kind"] == "cpu" and up["queues"] == ["pair"] and up["slots_total"] == 2 and up["jobs_max"] == 2
        # Its first announcement already says whether its warm trainer is importing (the early job takes it then).
        assert up["warm_trainer"] in (WarmTrainer.IMPORTING, WarmTrainer.READY), up

        second = api.post("/jobs", json=spec).json()
        third = api.post("/jobs", json=spec).json()
        first_two = [early["id"], second["id"]]
        for job_id in first_two:
            wait_for(lambda j=job_id: progressing(api, j), 240, f"job {job_id} training")
        # Both train at the same time, each on its own slot of the one node.
        jobs = [api.get(f"/jobs/{j}").json() for j in first_two]
        assert all(j["status"] == "running" for j in jobs), [j["status"] for j in jobs]
        assert sorted(j["placement"][0]["devices"][0] for j in jobs) == ["0", "1"]
        assert {j["placement"][0]["node"] for j in jobs} == {"pair"}
        assert all(job_processes(j) for j in first_two)

        waiting = api.get(f"/jobs/{third['id']}").json()
        assert waiting["status"] == "queued" and waiting["placement"] is None
        assert waiting["queued_reason"] == "waiting for 1 free cpu slots on queue pair; largest free: 0"
        busy = node(api, "pair")
        assert busy is not None and busy["slots_free"] == 0
        assert busy["warm_trainer"] == WarmTrainer.NONE, "an attempt holds the spare until it ends"
        assert sorted(j["id"] for j in busy["jobs"]) == sorted(first_two)

        # A slot comes free: the waiting job takes exactly that slot.
        freed = jobs[0]["placement"][0]["devices"]
        api.post(f"/jobs/{early['id']}/cancel")
        assert wait_status(api, early["id"], END, 30)["status"] == "cancelled"
        placed = wait_for(lambda: api.get(f"/jobs/{third['id']}").json()["placement"], 20, "the third job placed")
        assert [(p["node"], p["kind"], p["devices"]) for p in placed] == [("pair", "cpu", freed)]
        assert api.get(f"/jobs/{third['id']}").json()["queued_reason"] is None
        wait_for(lambda: progressing(api, third["id"]), 240, "the third job training")
        for job_id in (second["id"], third["id"]):
            api.post(f"/jobs/{job_id}/cancel")
        for job_id in (second["id"], third["id"]):
            assert wait_status(api, job_id, END, 30)["status"] == "cancelled"
        for job_id in (early["id"], second["id"], third["id"]):
            wait_no_processes(job_id, 10, f"every process of {job_id} gone")
        # The attempt that held the spare ended: its replacement imports, and the idle node says when it is ready.
        wait_for(lambda: (n := node(api, "pair")) and n["warm_trainer"] == WarmTrainer.READY, 120,
                 "node pair's new warm trainer imported")
    finally:
        stack.stop("pair")
    # Its heartbeat stops: the node is shown as lost (after its key's TTL and the grace) and offers nothing.
    lost = wait_for(lambda: (n := node(api, "pair")) and n["state"] == "lost" and n, 20, "node pair shown as lost")
    assert lost["slots_free"] == 0 and lost["jobs"] == []


def test_a_two_node_job_trains_as_one_world_and_a_lost_node_requeues_the_whole_gang(
        api: httpx.Client, stack: Any, make_job: Any, roots: dict[str, Any], redis_url: str) -> None:
    for name in ("gang-a", "gang-b"):
        stack.start_worker(name, queues="gang", slots=1)
    started_here = ["gang-a", "gang-b"]
    try:
        for name in started_here:
            wait_for(lambda n=name: (x := node(api, n)) and x["state"] == "up", 60, f"node {name} up")
        spec = make_job(name="gang", hyperparameters={"max_steps": 36},
                        resources={"num_gpus": 1, "num_nodes": 2, "queue": "gang"},
                        checkpointing={"every_steps": 6, "keep_last": 2})
        job = api.post("/jobs", json=spec).json()
        assert job["resolved"]["world_size"] == 2
        ckpt = wait_for(lambda: [c for c in events_of(api, job["id"], ["checkpoint"]) if c.get("committed")],
                        300, "a committed checkpoint")[0]
        a1 = ckpt["attempt"]
        running = api.get(f"/jobs/{job['id']}").json()
        parts = running["placement"]
        assert sorted(p["node"] for p in parts) == ["gang-a", "gang-b"] and all(p["devices"] == ["0"] for p in parts)
        started = events_of(api, job["id"], ["started"])
        assert started and started[0]["world_size"] == 2, started
        # Node 1's ranks log with their global rank, tagged with their node.
        logs = [e for e in events_of(api, job["id"], ["log"]) if e.get("rank") == 1]
        assert logs and {e.get("node") for e in logs} == {parts[1]["node"]}
        attempt1 = f"{job['id']}/attempts/{a1}/"
        assert len([p for p in job_processes(attempt1) if " -m trainer " in f" {p} "]) >= 2

        # One node's worker dies: its guard kills its rank, and the other node's rank is stopped too.
        doomed = parts[1]["node"]
        survivor = parts[0]["node"]
        proc = stack.procs.pop(doomed)
        proc.kill()
        proc.wait()
        started_here.remove(doomed)
        wait_no_processes(attempt1, 20, "no process of the attempt left on any node")
        requeued = wait_for(lambda: (j := api.get(f"/jobs/{job['id']}").json())["attempt"] == a1 + 1 and j, 30,
                            "the whole job requeued as one new attempt")
        assert requeued["status"] in ("queued", "starting", "running")
        # The old attempt is stale as soon as the job is requeued, not only once the gang is placed again: the
        # survivor's ranks (whose last commit may wait for the lost node's part) must not hold its slot until then.
        current = redis.Redis.from_url(redis_url)
        wait_for(lambda: current.get(attempt_key(job["id"])) == str(a1 + 1).encode(), 5,
                 "the new attempt published to the workers")

        # A third node joins; the next attempt runs on it and the survivor, from the checkpoint.
        stack.start_worker("gang-c", queues="gang", slots=1)
        started_here.append("gang-c")
        final = wait_status(api, job["id"], END, 400)
        assert final["status"] == "succeeded", final["error"]
        assert final["attempt"] == a1 + 1 and final["progress"]["step"] == 36
        assert sorted(p["node"] for p in final["placement"]) == sorted([survivor, "gang-c"])
        evs = events_of(api, job["id"])
        states = [(e["attempt"], e["status"]) for e in evs if e["type"] == "state"]
        assert (a1, "lost") in states and (a1 + 1, "queued") in states and states[-1] == (a1 + 1, "succeeded")
        resumed = [e for e in evs if e["type"] == "started" and e["attempt"] == a1 + 1]
        assert resumed and resumed[0]["resumed_from_step"] >= ckpt["step"] > 0 and resumed[0]["world_size"] == 2
        first_step = next(e["step"] for e in evs if e["type"] == "progress" and e["attempt"] == a1 + 1)
        assert first_step == resumed[0]["resumed_from_step"] + 1
        assert "model.safetensors" in {f["path"] for f in final["output"]["files"]}
        lost = node(api, doomed)
        assert lost is not None and lost["state"] == "lost"
        # Node 0 reports the end; the other node's ranks may take a moment more to exit.
        wait_no_processes(job["id"], 15, "no process of the job left on any node")
    finally:
        for name in started_here:
            stack.stop(name)


def test_gangs_under_contention_never_hold_part_of_a_placement_and_cancel_stops_every_node(
        api: httpx.Client, stack: Any, make_job: Any, roots: dict[str, Any]) -> None:
    # The second gang is a dpo job: preference training runs across nodes as one world as supervised training does.
    write_pairs(roots["data"] / "duo" / "pairs.jsonl", 200, seed=1)
    for name in ("duo-a", "duo-b"):
        stack.start_worker(name, queues="duo", slots=1)
    try:
        for name in ("duo-a", "duo-b"):
            wait_for(lambda n=name: (x := node(api, n)) and x["state"] == "up", 60, f"node {name} up")
        spec = make_job(name="duo", hyperparameters={"max_steps": 100_000},
                        resources={"num_gpus": 1, "num_nodes": 2, "queue": "duo"})
        dpo = make_job(name="duo-dpo", hyperparameters={"max_steps": 100_000},
                       data={"train": "duo/pairs.jsonl", "validation": None}, method={"type": "dpo"},
                       resources={"num_gpus": 1, "num_nodes": 2, "queue": "duo"})
        # Two gangs that each need both nodes, submitted together: one gets both, the other none.
        jobs = [api.post("/jobs", json=body).json() for body in (spec, dpo)]
        ids = [j["id"] for j in jobs]
        first = wait_for(lambda: next((j for j in ids if api.get(f"/jobs/{j}").json()["placement"]), None), 20,
                         "one gang placed")
        second = next(j for j in ids if j != first)
        for _ in range(10):
            seen = [api.get(f"/jobs/{j}").json() for j in ids]
            assert all(s["placement"] is None or len(s["placement"]) == 2 for s in seen)
        # The second may have been submitted after the scheduler's pass that placed the first: its reason comes
        # with the next pass.
        waiting = wait_for(lambda: (w := api.get(f"/jobs/{second}").json())["queued_reason"] and w, 10,
                           "the second gang's reason")
        assert waiting["placement"] is None and waiting["queued_reason"] == (
            "waiting for 2 nodes with 1 free cpu slots each on queue duo; free slots of its nodes: 0, 0")
        wait_for(lambda: progressing(api, first), 240, "the first gang training")
        # Cancel stops every node's ranks; the waiting gang then gets both nodes whole.
        api.post(f"/jobs/{first}/cancel")
        assert wait_status(api, first, END, 30)["status"] == "cancelled"
        wait_no_processes(first, 15, "no rank of the cancelled gang on any node")
        placed = wait_for(lambda: api.get(f"/jobs/{second}").json()["placement"], 30, "the second gang placed")
        assert sorted(p["node"] for p in placed) == ["duo-a", "duo-b"]
        wait_for(lambda: progressing(api, second), 240, "the second gang training")
        (started,) = events_of(api, ids[1], ["started"])
        assert started["method"] == "dpo" and started["world_size"] == 2, started
        assert "rewards/margins" in events_of(api, ids[1], ["progress"])[0]
        api.post(f"/jobs/{second}/cancel")
        assert wait_status(api, second, END, 30)["status"] == "cancelled"
        wait_no_processes(second, 15, "no rank of the second gang on any node")
    finally:
        for name in ("duo-a", "duo-b"):
            stack.stop(name)


def test_the_queue_runs_by_priority_then_owners_take_turns_then_oldest_first(
        api: httpx.Client, stack: Any, stack_env: dict[str, str], make_job: Any) -> None:
    import os

    from tests.conftest import create_key

    stack.start_worker("single", queues="order", slots=1)
    try:
        wait_for(lambda: (x := node(api, "single")) and x["state"] == "up", 60, "node single up")
        spec = make_job(name="order", hyperparameters={"max_steps": 100_000},
                        resources={"num_gpus": 1, "queue": "order"})
        blocker = api.post("/jobs", json=spec).json()
        wait_for(lambda: api.get(f"/jobs/{blocker['id']}").json()["placement"], 20, "the blocker placed")
        team_b = create_key({**os.environ, **stack_env}, "team-b", "jobs:write")

        def submit(name: str, priority: int = 0, key: str | None = None) -> str:
            body = {**spec, "name": name, "resources": {**spec["resources"], "priority": priority}}
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = api.post("/jobs", json=body, headers=headers)
            assert r.status_code == 201, r.text
            return r.json()["id"]

        # Submitted in this order: owner default's a1 and a2, team-b's b1, default's a3 (all priority 0), then
        # default's urgent at priority 5.
        a1, a2 = submit("a1"), submit("a2")
        b1 = submit("b1", key=team_b)
        a3 = submit("a3")
        urgent = submit("urgent", priority=5)
        for job_id in (a1, a2, b1, a3, urgent):
            wait_for(lambda j=job_id: api.get(f"/jobs/{j}").json()["queued_reason"]
                     == "waiting for 1 free cpu slots on queue order; largest free: 0", 20, f"{job_id}'s reason")
        order = []
        current = blocker["id"]
        for _ in range(5):
            api.post(f"/jobs/{current}/cancel")
            current = wait_for(lambda: next((j for j in (a1, a2, b1, a3, urgent) if j not in order
                                             and api.get(f"/jobs/{j}").json()["placement"]), None), 20,
                               "the next job placed")
            order.append(current)
        api.post(f"/jobs/{current}/cancel")
        # Priority first; then owners take turns: default was just served (urgent), so team-b's oldest goes
        # next, then default's in age order.
        assert order == [urgent, b1, a1, a2, a3]
        for job_id in (blocker["id"], *order):
            wait_no_processes(job_id, 20, f"every process of {job_id} gone")
    finally:
        stack.stop("single")


def test_a_gang_part_failing_on_its_own_stops_the_other_node_and_fails_the_job_once_with_its_error(
        api: httpx.Client, stack: Any, make_job: Any, redis_url: str) -> None:
    # Node 1's worker makes its rank run out of memory at its first optimizer step (the trainer's test seam,
    # read from the worker's environment as a GPU's real error would come from its node): a failure of that
    # part alone, while node 0's rank waits for it in a collective.
    stack.start_worker("solo-a", queues="solo", slots=1)
    stack.start_worker("solo-b", queues="solo", slots=1, env={"FT_TEST_FORCE_OOM": "step:1"})
    try:
        for name in ("solo-a", "solo-b"):
            wait_for(lambda n=name: (x := node(api, n)) and x["state"] == "up", 60, f"node {name} up")
        spec = make_job(name="solo", hyperparameters={"max_steps": 12},
                        resources={"num_gpus": 1, "num_nodes": 2, "queue": "solo"})
        job = api.post("/jobs", json=spec).json()
        final = wait_status(api, job["id"], END, 300)
        assert [(p["node"], p["devices"]) for p in final["placement"]] == [("solo-a", ["0"]), ("solo-b", ["0"])]
        assert final["status"] == "failed" and final["attempt"] == 1, final
        assert final["error"]["code"] == "out_of_memory" and "FT_TEST_FORCE_OOM" in final["error"]["message"]
        # One failure, reported by the part that failed; node 0's part followed it and reported nothing.
        states = events_of(api, job["id"], ["state"])
        failed = [e for e in states if e["status"] == "failed"]
        assert len(failed) == 1 and (failed[0]["node"], failed[0]["node_rank"]) == ("solo-b", 1), failed
        assert not [e for e in states if e["status"] in ("lost", "released")], states
        # Node 1's failure stopped the gang through the stop key, which names that part.
        stop = redis.Redis.from_url(redis_url).get(gang_stop_key(job["id"], 1))
        assert stop == b"solo-b#1"
        wait_no_processes(job["id"], 20, "no rank of the job left on any node")
        for name in ("solo-a", "solo-b"):
            wait_for(lambda n=name: (x := node(api, n)) and x["slots_free"] == 1 and not x["jobs"], 20,
                     f"node {name}'s slot free")
    finally:
        for name in ("solo-a", "solo-b"):
            stack.stop(name)


def test_a_deploy_of_one_node_of_a_gang_releases_it_and_it_resumes_from_that_checkpoint_once_the_node_is_back(
        api: httpx.Client, stack: Any, make_job: Any) -> None:
    for name in ("deploy-a", "deploy-b"):
        stack.start_worker(name, queues="deploy", slots=1)
    started_here = ["deploy-a", "deploy-b"]
    try:
        for name in started_here:
            wait_for(lambda n=name: (x := node(api, n)) and x["state"] == "up", 60, f"node {name} up")
        # No periodic checkpoint before the deploy: the one it resumes from is the one SIGTERM makes.
        spec = make_job(name="deploy", hyperparameters={"max_steps": 30},
                        resources={"num_gpus": 1, "num_nodes": 2, "queue": "deploy"},
                        checkpointing={"every_steps": 1000, "keep_last": 2})
        job = api.post("/jobs", json=spec).json()
        wait_for(lambda: any(e["step"] >= 3 for e in events_of(api, job["id"], ["progress"])), 300,
                 "the gang past step 3")
        attempt1 = f"{job['id']}/attempts/1/"
        # A deploy stops node 1's worker with SIGTERM; Celery's warm shutdown lets the job's part end first.
        proc = stack.procs.pop("deploy-b")
        started_here.remove("deploy-b")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: (x := node(api, "deploy-b")) and x["state"] == "draining", 20, "node deploy-b draining")
        assert proc.wait(120) == 0
        requeued = wait_for(lambda: (j := api.get(f"/jobs/{job['id']}").json())["attempt"] == 2 and j, 30,
                            "the job handed back as attempt 2")
        wait_no_processes(attempt1, 20, "no rank of attempt 1 left on any node")
        interrupted = events_of(api, job["id"], ["interrupted"])
        assert len(interrupted) == 1 and interrupted[0]["attempt"] == 1
        saved = interrupted[0]["step"]
        committed = [c for c in events_of(api, job["id"], ["checkpoint"]) if c.get("committed")]
        assert [(c["attempt"], c["step"]) for c in committed] == [(1, saved)] and saved >= 3
        states = [(e["attempt"], e["status"]) for e in events_of(api, job["id"], ["state"])]
        assert (1, "released") in states and (2, "queued") in states and (1, "lost") not in states, states
        # Node 0 alone cannot hold the gang: it waits, placed nowhere.
        waiting = wait_for(lambda: (j := api.get(f"/jobs/{job['id']}").json())["queued_reason"] and j, 30,
                           "the reason it waits")
        assert requeued["status"] == "queued" and waiting["placement"] is None, waiting
        assert waiting["queued_reason"].startswith(("queue deploy has 1 node(s)", "waiting for 2 nodes")), waiting

        # The node is back (the deploy's new worker): the gang runs again, from the step SIGTERM saved.
        stack.start_worker("deploy-b", queues="deploy", slots=1)
        started_here.append("deploy-b")
        final = wait_status(api, job["id"], END, 400)
        assert final["status"] == "succeeded", final["error"]
        assert final["attempt"] == 2 and final["progress"]["step"] == 30
        assert sorted(p["node"] for p in final["placement"]) == ["deploy-a", "deploy-b"]
        evs = events_of(api, job["id"])
        resumed = [e for e in evs if e["type"] == "started" and e["attempt"] == 2]
        assert resumed and resumed[0]["resumed_from_step"] == saved and resumed[0]["world_size"] == 2
        first_step = next(e["step"] for e in evs if e["type"] == "progress" and e["attempt"] == 2)
        assert first_step == saved + 1
        wait_no_processes(job["id"], 15, "no process of the job left on any node")

        # A gang's time limit stops it the same way (SIGTERM, the ranks' vote, a checkpoint), but ends the job: the
        # part whose ranks stopped with the timed-out part's leaves it the report, and hands nothing back.
        timed = api.post("/jobs", json=make_job(
            name="deploy-limit", hyperparameters={"max_steps": 100_000},
            resources={"num_gpus": 1, "num_nodes": 2, "queue": "deploy", "time_limit_seconds": 15},
            checkpointing={"every_steps": 1000, "keep_last": 2})).json()
        ended = wait_status(api, timed["id"], END, 200)
        assert ended["status"] == "failed" and ended["error"]["code"] == "time_limit", ended["error"]
        assert ended["attempt"] == 1, ended
        states = [(e["attempt"], e["status"]) for e in events_of(api, timed["id"], ["state"])]
        assert not [s for s in states if s[1] in ("released", "lost")], states
        wait_no_processes(timed["id"], 15, "no process of the timed-out gang left on any node")
    finally:
        for name in started_here:
            stack.stop(name)


def test_a_draining_node_takes_no_new_job_while_the_one_on_it_ends_there(
        api: httpx.Client, stack: Any, make_job: Any) -> None:
    # Draining is what a worker's SIGTERM (a deploy) announces: its node is placed on no more, and the job
    # on it ends there, the trainer checkpointing before the job goes back to the queue.
    stack.start_worker("drain", queues="drainq", slots=2)
    proc = stack.procs["drain"]
    try:
        wait_for(lambda: (x := node(api, "drain")) and x["state"] == "up", 60, "node drain up")
        spec = make_job(name="drain", hyperparameters={"max_steps": 100_000},
                        resources={"num_gpus": 1, "queue": "drainq"}, checkpointing={"every_steps": 1000})
        on_it = api.post("/jobs", json=spec).json()
        wait_for(lambda: progressing(api, on_it["id"]), 240, "the job on the node training")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: (x := node(api, "drain")) and x["state"] == "draining", 20, "node drain draining")
        # One of its two slots is free, yet a new job of its queue is not placed there.
        late = api.post("/jobs", json=spec).json()
        reason = wait_for(lambda: api.get(f"/jobs/{late['id']}").json()["queued_reason"], 20, "the late job's reason")
        still = node(api, "drain")
        assert still is not None and still["state"] == "draining", still
        assert reason == "waiting for a node serving queue drainq: none is up"
        assert api.get(f"/jobs/{late['id']}").json()["placement"] is None
        # The job on it ends there: a checkpoint at the step it reached, then back to the queue as attempt 2.
        assert proc.wait(120) == 0
        wait_for(lambda: api.get(f"/jobs/{on_it['id']}").json()["attempt"] == 2, 30, "the job handed back")
        interrupted = events_of(api, on_it["id"], ["interrupted"])
        assert len(interrupted) == 1 and interrupted[0]["attempt"] == 1
        committed = [c for c in events_of(api, on_it["id"], ["checkpoint"]) if c.get("committed")]
        assert [(c["attempt"], c["step"]) for c in committed] == [(1, interrupted[0]["step"])]
        wait_no_processes(on_it["id"], 20, "no process of the job left on the node")
        assert api.get(f"/jobs/{late['id']}").json()["placement"] is None
        for job_id in (on_it["id"], late["id"]):
            api.post(f"/jobs/{job_id}/cancel")
            assert wait_status(api, job_id, END, 30)["status"] == "cancelled"
    finally:
        stack.stop("drain")


def test_a_node_that_stopped_announcing_takes_no_new_job_within_its_grace(api: httpx.Client, make_job: Any,
                                                                          stack_env: dict[str, str]) -> None:
    """A node whose announcement expired is not lost yet, but receives nothing: a frozen worker's key expires
    with its job's lease, and the requeued job must not go straight back to it (it would cost an attempt)."""
    client = redis.Redis.from_url(stack_env["FT_REDIS_URL"])
    name, q = "ghost-" + uuid.uuid4().hex[:6], "ghostq-" + uuid.uuid4().hex[:6]
    record = {"name": name, "kind": "cpu", "slots": 2, "devices": ["0", "1"], "queues": [q], "jobs_max": 2,
              "draining": False, "worker": f"celery@{name}", "addr": "127.0.0.1"}
    client.set(node_key(name), json.dumps(record), px=60_000)
    client.sadd(NODES_SET, name)
    wait_for(lambda: node(api, name) is not None, 10, "the node to be seen")
    client.delete(node_key(name))  # it stopped announcing, as a frozen worker does
    stopped = time.monotonic()
    job = api.post("/jobs", json=make_job(name="ghosted", resources={"queue": q})).json()
    # Within the grace (2 s here) the node is still "live" by its last_seen; it must not be given the job.
    while time.monotonic() - stopped < 1.5:
        assert api.get(f"/jobs/{job['id']}").json()["placement"] is None
        time.sleep(0.1)
    api.post(f"/jobs/{job['id']}/cancel")
    client.srem(NODES_SET, name)
