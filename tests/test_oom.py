"""`resources.on_oom: "adapt"`: the ladder's order in process, then the trainer under the real launcher on two CPU
ranks with the test seam FT_TEST_FORCE_OOM, which raises torch.OutOfMemoryError where a too-large setting fails
on a GPU (a CPU has no GPU memory to run out of; DeepSpeed, the launcher and the retry are all real)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import oom

pytest.register_assert_rewrite("tests.trainer_support")  # its asserts report values, like a test module's

from tests.trainer_support import launch, make_job, of, write_run_spec  # noqa: E402

# The `corpus` and `tiny_model` fixtures.
pytest_plugins = ["tests.trainer_support"]


def _ladder(phase: str, start: oom.MemorySetting, per_rank: int, offload_ok: bool) -> list[oom.MemorySetting]:
    out, current = [], start
    while (found := oom.next_setting(current, phase, per_rank=per_rank, offload_ok=offload_ok)) is not None:
        current = found[0]
        out.append(current)
    return out


def test_activation_errors_walk_the_whole_ladder_keeping_the_global_batch() -> None:
    start = oom.MemorySetting(12, 1, False, "none")
    steps = _ladder("forward", start, per_rank=12, offload_ok=True)
    # Divisors of the per-process batch, each at most half the last; then checkpointing; then offload.
    assert [(s.micro_batch_size, s.gradient_accumulation_steps) for s in steps] == [
        (6, 2), (3, 4), (1, 12), (1, 12), (1, 12)]
    assert all(s.micro_batch_size * s.gradient_accumulation_steps == 12 for s in steps)
    assert [s.activation_checkpointing for s in steps] == [False, False, False, True, True]
    assert [s.offload_optimizer for s in steps] == ["none"] * 4 + ["cpu"]


def test_setup_and_step_errors_go_straight_to_offload_or_end() -> None:
    start = oom.MemorySetting(8, 1, False, "none")
    for phase in ("setup", "step"):
        (only,) = _ladder(phase, start, per_rank=8, offload_ok=True)
        assert only == oom.MemorySetting(8, 1, False, "cpu")
        assert _ladder(phase, start, per_rank=8, offload_ok=False) == []
    # Already offloaded and checkpointed at micro 1: nothing is left to try.
    assert _ladder("forward", oom.MemorySetting(1, 8, True, "cpu"), per_rank=8, offload_ok=True) == []


def test_the_seam_raises_the_first_n_tries_of_its_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(oom.FORCE_ENV, "forward:2")
    forced = oom.ForcedOOM()
    forced.check("step")
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            forced.check("forward")
    forced.check("forward")
    monkeypatch.setenv(oom.FORCE_ENV, "backward:1")
    with pytest.raises(ValueError, match="PHASE:N"):
        oom.ForcedOOM()


# An adapted run computes each step's gradient from the same rows, only summed in a different grouping (micro 1
# instead of 2); in fp32 that moves the loss by rounding only.
ADAPTED_REL_TOL = 1e-4


def test_adapt_retries_with_smaller_micro_batches_then_checkpointing_and_trains_the_same_run(
        tmp_path: Path, tiny_model: Path, corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    job = make_job(tiny_model, train, hyperparameters={"max_steps": 12}, deepspeed={"precision": "fp32"},
                   checkpointing={"every_steps": None})
    rc, straight, tail = launch(write_run_spec(tmp_path, job, job_dir=tmp_path / "straight"))
    assert rc == 0, tail

    monkeypatch.setenv(oom.FORCE_ENV, "forward:2")
    job["resources"] = {**job["resources"], "on_oom": "adapt"}
    rc, events, tail = launch(write_run_spec(tmp_path, job, job_dir=tmp_path / "adapted"))
    assert rc == 0, tail
    adapted = of(events, "adapted")
    assert [(a["phase"], a["step"]) for a in adapted] == [("forward", 0), ("forward", 0)]
    assert adapted[0]["previous"] == {"micro_batch_size": 2, "gradient_accumulation_steps": 2,
                                      "activation_checkpointing": False, "offload_optimizer": "none"}
    assert adapted[0]["setting"]["micro_batch_size"] == 1 and adapted[0]["setting"]["gradient_accumulation_steps"] == 4
    assert adapted[1]["setting"] == {"micro_batch_size": 1, "gradient_accumulation_steps": 4,
                                     "activation_checkpointing": True, "offload_optimizer": "none"}
    assert "forced out of memory" in adapted[0]["error"] and "the same global batch" in adapted[0]["change"]
    # The job's resolved record follows (the ingester applies `resolved` events); `started` names each setting.
    resolved = of(events, "resolved")
    assert [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in resolved] == [(1, 4), (1, 4)]
    assert all(r["reason"].startswith("on_oom adapt") for r in resolved)
    started = of(events, "started")
    assert [s["memory_setting"] for s in started] == [adapted[0]["previous"], adapted[0]["setting"],
                                                      adapted[1]["setting"]]
    assert started[-1]["micro_batch_size"] == 1 and started[-1]["on_oom"] == "adapt"

    a = {p["step"]: p for p in of(straight, "progress")}
    b = {p["step"]: p for p in of(events, "progress")}
    # Progress is reported every step up to 10, then about once a second, and at the last step.
    common = sorted(a.keys() & b.keys())
    assert set(range(1, 11)) | {12} <= set(common), common
    for step in common:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=ADAPTED_REL_TOL), step
        assert b[step]["tokens_seen"] == a[step]["tokens_seen"], step
    assert (tmp_path / "adapted" / "output" / "COMPLETE").is_file()


def test_an_error_in_the_optimizer_step_offloads_the_optimizer(tmp_path: Path, tiny_model: Path, corpus: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    monkeypatch.setenv(oom.FORCE_ENV, "step:1")
    job = make_job(tiny_model, train, hyperparameters={"max_steps": 6}, resources={"on_oom": "adapt"},
                   checkpointing={"every_steps": None})
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    (adapted,) = of(events, "adapted")
    assert adapted["phase"] == "step" and adapted["setting"]["offload_optimizer"] == "cpu"
    assert adapted["setting"]["micro_batch_size"] == 2 and not adapted["setting"]["activation_checkpointing"]
    final = of(events, "started")[-1]
    assert final["memory_setting"]["offload_optimizer"] == "cpu"
    assert "optimizer offloaded to the CPU by the on_oom ladder" in final["adjustments"]
    assert of(events, "completed")


@pytest.mark.parametrize(("resources", "hyperparameters", "expected"), [
    # The default: an out-of-memory error fails the job as before.
    ({}, {}, "forced out of memory"),
    # adamw_bf16 cannot be offloaded, so an error in the setup has no rung left.
    ({"on_oom": "adapt"}, {"optimizer": "adamw_bf16"}, "with every setting of the on_oom ladder that applies"),
])
def test_without_adapt_or_a_rung_left_the_job_fails_as_out_of_memory(
        tmp_path: Path, tiny_model: Path, corpus: str, monkeypatch: pytest.MonkeyPatch,
        resources: dict[str, str], hyperparameters: dict[str, str], expected: str) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    monkeypatch.setenv(oom.FORCE_ENV, "setup:1" if resources else "forward:1")
    job = make_job(tiny_model, train, hyperparameters={"max_steps": 4, **hyperparameters}, resources=resources)
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc != 0 and not of(events, "adapted") and not of(events, "completed"), tail
    (error,) = {e["message"]: e for e in of(events, "error")}.values()
    assert error["code"] == "out_of_memory" and expected in error["message"], error
