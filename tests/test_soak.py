"""The soak's parts that can be proven without running it (soak/): its plan is the seed's alone, its fault proxy
cuts and delays a real link, and each of its checks catches the violation planted in a recorded history."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from soak import checks, schedule
from soak.checks import (
    Answer,
    CheckpointFile,
    Delivery,
    FollowerStream,
    JobEnd,
    JobProcess,
    MemorySample,
    ProcSample,
    Received,
)
from soak.history import History, render
from soak.proxy import ProxyHub
from soak.schedule import DURATIONS, Fault, counts, drawable, plan
from store.objects import Store
from tests.s3_support import store_config

WORKERS = ["node1", "node2"]


# ------------------------------------------------------------------------------------------------ the plan

def test_the_schedule_is_a_pure_function_of_the_seed() -> None:
    one = plan(39, 1800, WORKERS)
    assert one == plan(39, 1800, WORKERS)
    assert one != plan(40, 1800, WORKERS)
    assert [f.at for f in one] == sorted(f.at for f in one)
    # One at a time, each healed before the run's end and before the next begins.
    assert all(a.at + a.duration < b.at for a, b in zip(one, one[1:], strict=False))
    assert one[-1].at + one[-1].duration <= 1800


def test_a_long_run_draws_every_kind_of_fault_on_every_target() -> None:
    faults = plan(7, 2 * 3600, WORKERS)
    assert all(n > 0 for n in counts(faults).values()), counts(faults)
    drawn = {(f.kind, f.target) for f in faults}
    assert drawn == drawable(WORKERS, private_postgres=True)
    assert set(counts(faults)) == set(DURATIONS)


def test_a_process_is_restarted_as_often_as_it_is_killed_and_the_manner_moves_no_fault(
        monkeypatch: pytest.MonkeyPatch) -> None:
    faults = plan(7, 2 * 3600, WORKERS, overlap=0.4, at_once=3)
    ends = [f for f in faults if f.kind in ("sigkill", "sigterm") and f.target != "rank"]
    restarts = [f for f in ends if f.kind == "sigterm"]
    assert 0.3 < len(restarts) / len(ends) < 0.7, (len(restarts), len(ends))
    assert {f.target for f in restarts} == {"api", "controlplane", *WORKERS}
    assert not any(f.kind == "sigterm" and f.target == "rank" for f in faults)
    # Without restarts the seed draws the same faults at the same times: a restart stands where a kill stood.
    monkeypatch.setattr(schedule, "RESTART_SHARE", 0.0)
    kills_only = plan(7, 2 * 3600, WORKERS, overlap=0.4, at_once=3)
    assert not any(f.kind == "sigterm" for f in kills_only)
    assert [(f.at, f.target, f.duration, "sigkill" if f.kind == "sigterm" else f.kind) for f in faults] == \
        [(f.at, f.target, f.duration, f.kind) for f in kills_only]


def test_an_overlapping_plan_joins_faults_on_other_targets_and_none_at_all_keeps_the_seeds_plan() -> None:
    assert plan(39, 1800, WORKERS, overlap=0.0) == plan(39, 1800, WORKERS)
    faults = plan(11, 3600, WORKERS, overlap=0.4)
    assert faults == plan(11, 3600, WORKERS, overlap=0.4)
    assert [f.index for f in faults] == list(range(len(faults)))
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    assert all(f.at + f.duration <= 3600 for f in faults)

    def end(f: Fault) -> float:
        return f.at + max(f.duration, 1.0)  # a kill holds while its process starts again

    pairs = [(a, b) for i, a in enumerate(faults) for b in faults[i + 1:] if b.at < end(a)]
    assert pairs, "no two faults held at once"
    for a, b in pairs:
        # Never more than two at once, never on one thing (the heal of one would end the other).
        assert b.index == a.index + 1, (a, b)
        assert a.target != b.target, (a, b)
        assert not ({a.kind, b.kind} & {"store_down", "store_slow"} and
                    (a.target.endswith("->store") or b.target.endswith("->store"))), (a, b)
        assert not [c for c in faults if c.index > b.index and c.at < max(end(a), end(b))], (a, b)


def test_more_than_two_faults_hold_together_up_to_at_once_each_on_its_own_thing() -> None:
    # At 2, the draws are the ones made before `at_once` existed: a seed's overlapping plan stays what it was.
    assert plan(11, 3600, WORKERS, overlap=0.4, at_once=2) == plan(11, 3600, WORKERS, overlap=0.4)
    faults = plan(134, 3600, WORKERS, overlap=0.5, at_once=3)
    assert faults == plan(134, 3600, WORKERS, overlap=0.5, at_once=3)
    assert [f.index for f in faults] == list(range(len(faults)))
    assert all(f.at + f.duration <= 3600 for f in faults)

    def holding(t: float) -> list[Fault]:
        return [f for f in faults if f.at <= t < f.at + max(f.duration, 1.0)]

    most = [holding(f.at) for f in faults]
    assert max(map(len, most)) == 3, "no three faults held together"
    for group in most:
        assert len(group) <= 3, group
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                assert a.target != b.target, group
                assert not ({a.kind, b.kind} & {"store_down", "store_slow"} and
                            (a.target.endswith("->store") or b.target.endswith("->store"))), group


def test_without_a_private_postgres_it_is_never_restarted() -> None:
    assert all(f.target != "postgres" or f.kind != "restart"
               for f in plan(3, 3600, WORKERS, private_postgres=False))


# ------------------------------------------------------------------------------------------------ the proxy

def echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def roundtrip(port: int, payload: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(payload)
        return s.recv(1024)


def test_the_fault_proxy_passes_delays_and_cuts_a_real_link() -> None:
    server, port = echo_server()
    hub = ProxyHub()
    try:
        proxy = hub.add("link", port)
        assert roundtrip(proxy.port) == b"ping"
        hub.set("link", "delay", 0.3)
        t0 = time.monotonic()
        assert roundtrip(proxy.port) == b"ping"
        assert time.monotonic() - t0 >= 0.5  # held once each way
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as held:
            hub.set("link", "cut")
            held.sendall(b"x")
            with pytest.raises(OSError):
                assert held.recv(1024) == b""  # reset, or closed: nothing comes back
                raise ConnectionResetError
        with pytest.raises(OSError):
            assert roundtrip(proxy.port) == b""
            raise ConnectionResetError
        hub.set("link", "pass")
        assert roundtrip(proxy.port) == b"ping"
    finally:
        hub.close()
        server.close()


# ------------------------------------------------------------------------------------------------ planted

def names(found: tuple[int, list[checks.Violation]]) -> list[str]:
    return [v.check for v in found[1]]


def test_two_trainer_groups_of_one_job_at_once_are_caught() -> None:
    calm = [ProcSample(1.0, {"job_a": {1}, "job_b": {2}}), ProcSample(2.0, {"job_a": {2}})]
    assert checks.one_attempt_at_a_time(calm) == (3, [])
    planted = [*calm, ProcSample(3.0, {"job_a": {2, 3}}), ProcSample(3.5, {"job_a": {2, 3}})]
    count, found = checks.one_attempt_at_a_time(planted)
    assert count == 5 and [(v.job, v.at) for v in found] == [("job_a", 3.0)]


STORED = {"job_a": [{"seq": i, "attempt": 1 if i < 4 else 2, "type": "state" if i in (1, 4) else "progress",
                     "data": {"ts": float(i)}} for i in range(1, 7)]}


def stream(seqs: list[int]) -> FollowerStream:
    rows = {r["seq"]: r for r in STORED["job_a"]}
    return FollowerStream("f1", "job_a", [Received(q, rows[q]["type"], rows[q]["attempt"]) for q in seqs], [2, 4])


def test_a_dropped_duplicated_or_altered_event_at_a_follower_is_caught() -> None:
    assert checks.followers_match_store([stream([1, 2, 3, 4, 5, 6])], STORED) == (6, [])
    assert names(checks.followers_match_store([stream([1, 2, 4, 5])], STORED)) == ["followers_match_store"]
    assert names(checks.followers_match_store([stream([1, 2, 2, 3])], STORED)) == ["followers_match_store"]
    altered = stream([1, 2, 3])
    altered.events[2] = Received(3, "checkpoint", 1)
    assert names(checks.followers_match_store([altered], STORED)) == ["followers_match_store"]
    # An event Postgres does not hold (a follower ahead of the store) is caught too.
    ahead = FollowerStream("f2", "job_a", [Received(q, "progress", 2) for q in range(1, 8)])
    assert names(checks.followers_match_store([ahead], STORED)) == ["followers_match_store"]


def test_an_event_lost_against_the_ranks_own_logs_is_caught() -> None:
    printed = {("job_a", 1, 0): [("progress", 2.0), ("progress", 3.0)],
               ("job_a", 2, 0): [("progress", 5.0), ("progress", 6.0)]}
    assert checks.no_event_lost(printed, STORED, {"job_a": 2}, set()) == (4, [])
    lost = {**printed, ("job_a", 2, 0): [("progress", 5.0), ("progress", 5.5), ("progress", 6.0)]}
    assert names(checks.no_event_lost(lost, STORED, {"job_a": 2}, set())) == ["no_event_lost"]
    # A superseded attempt may have printed more than was stored (the rest was fenced off), never other things.
    fenced = {**printed, ("job_a", 1, 0): [("progress", 2.0), ("progress", 3.0), ("progress", 3.5)]}
    assert checks.no_event_lost(fenced, STORED, {"job_a": 2}, set())[1] == []
    other = {**printed, ("job_a", 1, 0): [("progress", 2.0), ("progress", 9.0)]}
    assert names(checks.no_event_lost(other, STORED, {"job_a": 2}, set())) == ["no_event_lost"]
    # While Redis restarted empty a loss is allowed; a duplicate never is.
    assert checks.no_event_lost(lost, STORED, {"job_a": 2}, {("job_a", 2)})[1] == []
    twice = {"job_a": [*STORED["job_a"], {"seq": 7, "attempt": 2, "type": "progress", "data": {"ts": 6.0}}]}
    assert names(checks.no_event_lost(printed, twice, {"job_a": 2}, {("job_a", 2)})) == ["no_event_lost"]
    # Another rank's event (its error as its peer died) is held against that rank's log, not rank 0's.
    error = {"seq": 7, "attempt": 2, "type": "error", "data": {"ts": 6.5, "rank": 1}}
    with_error = {"job_a": [*STORED["job_a"], error]}
    assert checks.no_event_lost({**printed, ("job_a", 2, 1): [("error", 6.5)]}, with_error, {"job_a": 2},
                                set())[1] == []
    assert names(checks.no_event_lost({**printed, ("job_a", 2, 1): [("error", 6.5)]}, STORED, {"job_a": 2},
                                      set())) == ["no_event_lost"]


def test_a_resume_from_a_checkpoint_never_committed_or_at_the_wrong_step_is_caught() -> None:
    def ev(seq: int, attempt: int, kind: str, **data: Any) -> dict[str, Any]:
        return {"seq": seq, "attempt": attempt, "type": kind, "data": data}

    log = [ev(1, 1, "state", status="queued"), ev(2, 1, "started"), ev(3, 1, "progress", step=1),
           ev(4, 1, "progress", step=2), ev(5, 1, "checkpoint", step=2, committed=False),
           ev(6, 1, "checkpoint", step=2, committed=True), ev(7, 2, "started", resumed_from_step=2),
           ev(8, 2, "progress", step=3)]
    assert checks.resumes_from_a_commit({"job_a": log}, set()) == (1, [])
    # A resume from a step whose checkpoint was written but never committed.
    uncommitted = [e for e in log if e["seq"] != 6]
    assert names(checks.resumes_from_a_commit({"job_a": uncommitted}, set())) == ["resumes_from_a_commit"]
    # A resume that skips or repeats steps.
    skipped = [*log[:-1], ev(8, 2, "progress", step=5)]
    assert names(checks.resumes_from_a_commit({"job_a": skipped}, set())) == ["resumes_from_a_commit"]
    # While Redis restarted empty the commit's event may be lost: counted, not held to it.
    assert checks.resumes_from_a_commit({"job_a": uncommitted}, {("job_a", 2)}) == (1, [])

    # The ingester drops what a superseded attempt's worker publishes late (its commit, held up by a cut link to
    # Redis): the store's own access log says whether the manifest was written before the resuming attempt's fence.
    def put(key: str) -> str:
        return f'127.0.0.1 - - [07/Dec/2026 15:50:36] "PUT /bucket/service/jobs/job_a/{key} HTTP/1.1" 200 -\n'
    in_time = put("fences/attempt-00000001.json") + put("checkpoints/step-00000002.attempt-1.json") + put(
        "fences/attempt-00000002.json")
    assert checks.store_commits(in_time) == {"job_a": {(1, 2)}}
    assert checks.resumes_from_a_commit({"job_a": uncommitted}, set(), checks.store_commits(in_time)) == (1, [])
    # A manifest the store took only after attempt 2 had taken over is never trusted: no ground for the resume.
    late = put("fences/attempt-00000001.json") + put("fences/attempt-00000002.json") + put(
        "checkpoints/step-00000002.attempt-1.json")
    assert checks.store_commits(late) == {}
    assert names(checks.resumes_from_a_commit({"job_a": uncommitted}, set(), checks.store_commits(late))) == [
        "resumes_from_a_commit"]
    # Nor is a write the store refused, or a manifest of another step.
    refused = in_time.replace('" 200 -', '" 503 -')
    other = in_time.replace("step-00000002", "step-00000004")
    for text in (refused, other):
        assert names(checks.resumes_from_a_commit({"job_a": uncommitted}, set(), checks.store_commits(text))) == [
            "resumes_from_a_commit"]


def test_a_corrupted_or_missing_checkpoint_file_is_caught(tmp_path: Path) -> None:
    store = Store(store_config({"FT_STORE_URL": f"file://{tmp_path}"}))
    good, bad = b"weights" * 1000, b"optimizer" * 1000
    store.put_bytes("jobs/job_a/checkpoints/step-2/a.pt", good)
    store.put_bytes("jobs/job_a/checkpoints/step-2/b.pt", bad)
    files = [CheckpointFile("job_a", "step-2.json", "jobs/job_a/checkpoints/step-2/a.pt",
                            hashlib.sha256(good).hexdigest()),
             CheckpointFile("job_a", "step-2.json", "jobs/job_a/checkpoints/step-2/b.pt",
                            hashlib.sha256(bad).hexdigest())]
    assert checks.checkpoints_read_back(files, store.get_bytes) == (2, [])
    corrupted = bytearray(bad)
    corrupted[100] ^= 0xFF
    store.put_bytes("jobs/job_a/checkpoints/step-2/b.pt", bytes(corrupted))
    store.delete("jobs/job_a/checkpoints/step-2/a.pt")
    found = checks.checkpoints_read_back(files, store.get_bytes)[1]
    assert [("gone" in v.message, "reads back" in v.message) for v in found] == [(True, False), (False, True)]


def test_an_upload_that_downloads_otherwise_or_not_at_all_is_caught() -> None:
    acked = {"file_1": "aa", "file_2": "bb"}
    assert checks.uploads_identical(acked, {"file_1": "aa", "file_2": "bb"}) == (2, [])
    assert len(checks.uploads_identical(acked, {"file_1": "ab", "file_2": None})[1]) == 2


def test_a_webhook_never_received_received_twice_or_announced_twice_is_caught() -> None:
    rows = [{"id": "whd_1", "job_id": "job_a", "event_seq": 3, "event": "job.running", "status": "delivered",
             "attempts": 2, "last_status_code": 200, "last_error": None},
            {"id": "whd_2", "job_id": "job_a", "event_seq": 9, "event": "job.succeeded", "status": "delivered",
             "attempts": 1, "last_status_code": 200, "last_error": None}]
    jobs = {"job_a": {"status": "succeeded", "webhook_url": "http://127.0.0.1/hook"}}
    got = [Delivery(1.0, "whd_1", "job.running", "job_a", 3, 500), Delivery(2.0, "whd_1", "job.running", "job_a", 3,
                                                                            200),
           Delivery(5.0, "whd_2", "job.succeeded", "job_a", 9, 200)]
    assert checks.webhooks_once(rows, got, jobs, []) == (2, [])
    assert len(checks.webhooks_once(rows, got[:2], jobs, [])[1]) == 1  # whd_2 never got a 2xx
    twice = [*got, Delivery(9.0, "whd_2", "job.succeeded", "job_a", 9, 200)]
    assert names(checks.webhooks_once(rows, twice, jobs, [])) == ["webhooks_once"]
    assert checks.webhooks_once(rows, twice, jobs, [(6.0, 8.0)])[1] == []  # the deliverer was killed between
    again = [*rows, {**rows[1], "id": "whd_3"}]
    assert len(checks.webhooks_once(again, [*got, Delivery(6.0, "whd_3", "job.succeeded", "job_a", 9, 200)],
                                    jobs, [])[1]) == 1
    assert len(checks.webhooks_once(rows[:1], got[:2], jobs, [])[1]) == 1  # the end was never announced


def test_a_5xx_other_than_a_503_with_retry_after_during_an_outage_is_caught() -> None:
    down = [(10.0, 20.0)]
    fine = [Answer(1.0, "GET", "/jobs", 200, None), Answer(12.0, "GET", "/jobs", 503, "5"),
            Answer(30.0, "GET", "/jobs", 503, "5")]
    assert checks.no_unexplained_5xx(fine, down, slack=15) == (3, [])
    for planted in (Answer(12.0, "POST", "/jobs", 500, None), Answer(12.0, "GET", "/jobs", 503, None),
                    Answer(50.0, "GET", "/jobs", 503, "5"), Answer(1.0, "GET", "/files", 502, None)):
        assert names(checks.no_unexplained_5xx([*fine, planted], down, slack=15)) == ["no_unexplained_5xx"]


def test_unbounded_memory_a_late_job_and_an_orphan_are_caught() -> None:
    samples = [MemorySample(t, "api", 200 * 2**20 + int(t) * 2**20) for t in range(0, 600, 5)]
    assert checks.memory_bounded(samples, {"api": 1024 * 2**20})[1] == []
    assert names(checks.memory_bounded(samples, {"api": 512 * 2**20})) == ["memory_bounded"]
    ends = {"job_a": JobEnd("succeeded", 100.0), "job_b": JobEnd("running", None), "job_c": JobEnd("failed", 400.0)}
    assert sorted(v.job for v in checks.terminal_in_bound(ends, 300.0)[1]) == ["job_b", "job_c"]
    seen = [JobProcess(105.0, 41, "job_a", "python -m trainer"), JobProcess(180.0, 42, "job_a", "python -m trainer")]
    assert [v.job for v in checks.no_orphan_process(seen, {"job_a": 100.0}, grace=30)[1]] == ["job_a"]


def test_a_job_failed_by_the_supervisors_own_exception_is_caught() -> None:
    rows = [{"id": "job_a", "status": "failed", "error": {"code": "disk_full", "message": "No space left"}},
            {"id": "job_b", "status": "succeeded", "error": None}, {"id": "job_c", "status": "running", "error": None}]
    assert checks.no_worker_error(rows) == (2, [])
    planted = [*rows, {"id": "job_d", "status": "failed", "error": {"code": "worker_error", "message": "OSError()"}}]
    assert [v.job for v in checks.no_worker_error(planted)[1]] == ["job_d"]


def test_a_violation_is_printed_with_the_history_around_it() -> None:
    history = History()
    history.add("nemesis", "sigkill node1: SIGKILL pid 7", t=10.0)
    history.add("client", "submitted sft", "job_a", t=11.0)
    history.add("client", "submitted sft", "job_b", t=11.5)
    history.add("client", "running (attempt 2)", "job_a", t=200.0)
    history.add("nemesis", "sigstop api: SIGSTOP pid 8", t=100.0)
    text = render(history.around(12.0, "job_a"))
    assert "sigkill node1" in text and "attempt 2" in text and "job_b" not in text and "sigstop api" not in text
