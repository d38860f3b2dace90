"""What each event means for a job row (no database needed: the rules are plain functions)."""

from __future__ import annotations

from db.ingest import apply_event
from db.models import Job


def job(status: str = "running") -> Job:
    return Job(id="job_x", status=status, attempt=1, progress={}, checkpoints=[], event_seq=0,
               resolved={"micro_batch_size": 8, "gradient_accumulation_steps": 4, "notes": ["estimate"],
                         "deepspeed_config": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
                                              "train_batch_size": 32}})


def test_a_measured_micro_batch_replaces_the_estimate_in_resolved() -> None:
    j = job()
    apply_event(j, "resolved", {"micro_batch_size": 16, "gradient_accumulation_steps": 2,
                                "reason": "micro batch auto (probe): 16, measured peak 102.8 GiB"})
    assert j.resolved["micro_batch_size"] == 16 and j.resolved["gradient_accumulation_steps"] == 2
    ds = j.resolved["deepspeed_config"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (
        16, 2, 32)
    assert j.resolved["notes"][-1].startswith("micro batch auto (probe)")


def test_states_move_forward_only_and_terminal_states_carry_their_details() -> None:
    j = job("cancelling")
    apply_event(j, "state", {"status": "running"})
    assert j.status == "cancelling", "a job being cancelled does not go back to running"
    q = job("queued")
    apply_event(q, "state", {"status": "starting"})
    apply_event(q, "state", {"status": "running"})
    assert q.status == "running" and q.started_at is not None
    apply_event(q, "state", {"status": "failed", "error": {"code": "out_of_memory", "message": "m"},
                             "usage": {"cpu_seconds": 12.5, "wall_seconds": 30.0}})
    assert q.status == "failed" and q.error["code"] == "out_of_memory" and q.finished_at is not None
    assert q.progress["cpu_seconds"] == 12.5


def test_checkpoints_follow_retention() -> None:
    j = job()
    for step in (10, 20, 30):
        removed = [f"/c/step-{step - 20:08d}"] if step > 20 else []
        apply_event(j, "checkpoint", {"step": step, "path": f"/c/step-{step:08d}", "committed": True,
                                      "removed": removed})
    assert [c["step"] for c in j.checkpoints] == [20, 30]
    apply_event(j, "progress", {"step": 31, "total_steps": 40, "loss": 1.5, "tokens_per_second": 10.0,
                                "eta_seconds": 9.0, "epoch": 0.5, "ts": 1.0})
    assert j.progress == {"step": 31, "total_steps": 40, "loss": 1.5, "tokens_per_second": 10.0,
                          "eta_seconds": 9.0, "epoch": 0.5}
