"""Resuming on another number of processes, under the real launcher on CPU ranks (gloo, tiny model, no mocks).

One chain per ZeRO stage (2 and 3) covers both directions: 2 processes train and are stopped (SIGTERM, checkpoint),
1 process resumes through the checkpoint's universal copy and is stopped again, 2 processes resume and finish.
An uninterrupted 2-process run of the same job is the reference. The job fixes the global batch (8 rows), so
the data position, counted in global batches, names the same rows on either world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("tests.trainer_support")

from tests.trainer_support import (  # noqa: E402
    Event,
    launch,
    make_job,
    of,
    stop_after_checkpoint,
    write_run_spec,
)

pytest_plugins = ["tests.trainer_support"]

STEPS = 12
EVERY = 4
# fp32, no dropout, the same rows per step: what differs between world sizes is only the order in which the
# micro batches' gradients are summed (within a rank, then across ranks by the all-reduce), and the weights,
# moments and step counts go through the universal copy in fp32, unchanged. Observed differences are below
# 1e-7 relative; 1e-5 is the bound of the same-world resume test (test_trainer_matrix), and a skipped or
# repeated batch moves the loss by more than 1e-2 here.
LOSS_REL_TOL = 1e-5


def _spec(tmp: Path, job: dict[str, Any], job_dir: Path, procs: int, attempt: int) -> Path:
    path = write_run_spec(tmp, {**job, "resources": {"num_gpus": procs}}, job_dir=job_dir)
    spec = json.loads(path.read_text())
    spec["attempt"] = attempt  # each resume is the job's next attempt, as the worker would start it
    path.write_text(json.dumps(spec))
    return path


@dataclass
class Chain:
    stage: int
    job_dir: Path
    reference: list[Event]
    runs: list[tuple[int, list[Event]]]  # (processes, events) in order


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
          corpus: str) -> Chain:
    stage = request.param
    tmp = tmp_path_factory.mktemp(f"elastic-zero{stage}")
    train = tmp / "train.txt"
    train.write_text(corpus)
    job = make_job(tiny_model, train, hyperparameters={"max_steps": STEPS, "warmup_steps": 2},
                   deepspeed={"zero_stage": stage, "precision": "fp32"},
                   checkpointing={"every_steps": EVERY, "keep_last": 2})
    rc, reference, tail = launch(_spec(tmp, job, tmp / "reference", 2, 1), procs=2)
    assert rc == 0, tail
    (tmp / "events-reference.json").write_text(json.dumps(reference))

    job_dir = tmp / "job"
    runs: list[tuple[int, list[Event]]] = []
    for attempt, (procs, stop_at) in enumerate([(2, EVERY), (1, 2 * EVERY), (2, None)], start=1):
        on_event = stop_after_checkpoint(stop_at) if stop_at else None
        rc, events, tail = launch(_spec(tmp, job, job_dir, procs, attempt), procs=procs, on_event=on_event)
        assert not of(events, "error"), tail
        assert (rc == 0) == (stop_at is None), tail
        runs.append((procs, events))
        # Kept beside the job for a failing run's post-mortem.
        (tmp / f"events-{attempt}.json").write_text(json.dumps(events))
    return Chain(stage, job_dir, reference, runs)


def _stopped_at(events: list[Event]) -> int:
    (stopped,) = of(events, "interrupted")
    return int(stopped["step"])


def test_resume_changes_world_size_through_a_committed_universal_copy(chain: Chain) -> None:
    (_, first), (_, second), (_, third) = chain.runs
    assert not of(first, "resumed")
    for (before, prev), (procs, events) in pairwise(chain.runs):
        (resumed,) = of(events, "resumed")
        (started,) = of(events, "started")
        step = _stopped_at(prev)
        # The job's events say where it resumed from and that the world size changed.
        assert resumed["step"] == started["resumed_from_step"] == step, (resumed, started)
        assert (resumed["from_world_size"], resumed["to_world_size"]) == (before, procs), resumed
        assert resumed["universal"] is True and resumed["converted"] is True, resumed
        assert resumed["path"] == str(chain.job_dir / "checkpoints" / "universal" / f"step-{step:08d}")
        assert started["world_size"] == procs
        # The global batch stays 8 rows: micro 2 x accumulation (8 / 2 / processes) x processes.
        assert started["micro_batch_size"] * started["gradient_accumulation_steps"] * procs == 8, started

    ckpt = chain.job_dir / "checkpoints"
    # Every checkpoint records the world that wrote it; the last two tags are kept as the job says.
    tags = sorted(p.name for p in ckpt.glob("step-*"))
    assert tags == [f"step-{s:08d}" for s in (_stopped_at(second), STEPS)], tags
    assert json.loads((ckpt / tags[-1] / "topology.json").read_text()) == {
        "world_size": 2, "global_batch": 8, "zero_stage": chain.stage}
    assert json.loads((ckpt / tags[0] / "topology.json").read_text())["world_size"] == 1
    # A universal copy is dead weight once a newer checkpoint is committed; no conversion staging is left.
    assert list((ckpt / "universal").iterdir()) == []
    assert not list(ckpt.glob(".universal-attempt-*"))
    assert of(third, "completed")[0]["steps"] == STEPS


def test_steps_learning_rates_data_order_and_losses_continue(chain: Chain) -> None:
    reference = {p["step"]: p for p in of(chain.reference, "progress")}
    seen: dict[int, Event] = {}
    for _, events in chain.runs:
        steps = [p["step"] for p in of(events, "progress")]
        (started,) = of(events, "started")
        # Each run continues right after the step its predecessor checkpointed: nothing trained twice or skipped.
        assert steps[0] == (started["resumed_from_step"] or 0) + 1, steps
        assert not set(steps) & set(seen), (steps, sorted(seen))
        seen.update({p["step"]: p for p in of(events, "progress")})
    # Progress comes every step up to 10, and at the last; steps 11 and 12 of the reference may be merged.
    common = sorted(reference.keys() & seen.keys())
    assert set(range(1, 11)) | {STEPS} <= set(common), common
    for step in common:
        # The schedule is a function of the step alone, restored from the scheduler's state: equal to rounding.
        assert seen[step]["lr"] == pytest.approx(reference[step]["lr"], rel=1e-9), step
        # The same rows in the same order: token counts match step by step, and so does the epoch position.
        assert seen[step]["tokens_seen"] == reference[step]["tokens_seen"], step
        assert seen[step]["epoch"] == reference[step]["epoch"], step
        assert seen[step]["loss"] == pytest.approx(reference[step]["loss"], rel=LOSS_REL_TOL), step
    state = json.loads((chain.job_dir / "checkpoints" / f"step-{STEPS:08d}" / "trainer_state.json").read_text())
    ref_state = json.loads((chain.job_dir.parent / "reference" / "checkpoints" / f"step-{STEPS:08d}"
                            / "trainer_state.json").read_text())
    assert {k: state[k] for k in ("step", "epoch", "next_batch", "tokens_seen")} == \
        {k: ref_state[k] for k in ("step", "epoch", "next_batch", "tokens_seen")}


def test_a_universal_copy_is_converted_once_and_reused(chain: Chain) -> None:
    """An attempt that dies after converting and before its next checkpoint leaves the copy committed; the next
    attempt on that world size loads it without converting again. Driven directly (no launch) on the
    reference's newest tag, written by 2 processes."""
    from trainer import elastic
    from trainer.fence import Fence

    ckpt = chain.job_dir.parent / "reference" / "checkpoints"
    tag = ckpt / f"step-{STEPS:08d}"
    plan = elastic.plan(tag, 1)
    assert plan.universal and plan.written == elastic.Topology(2, 8, chain.stage)
    assert not elastic.plan(tag, 2).universal
    copy, converted = elastic.universal_copy(ckpt, tag, Fence(chain.job_dir.parent / "reference", 2))
    assert converted and (copy / "COMMITTED").is_file() and (copy / "zero").is_dir()
    again, converted = elastic.universal_copy(ckpt, tag, Fence(chain.job_dir.parent / "reference", 3))
    assert again == copy and not converted
    assert not (ckpt / ".universal-attempt-2").exists()


def test_a_resume_that_cannot_continue_the_same_data_is_refused_before_converting(chain: Chain) -> None:
    """The checks `checkpoint.resume` makes against the engine before rank 0 converts anything, on the chain's
    last tag (written by 2 processes with global batch 8) resumed on 1 process."""
    from trainer import elastic

    tag = chain.job_dir / "checkpoints" / f"step-{STEPS:08d}"
    plan = elastic.plan(tag, 1)
    elastic.check(plan, load_universal=True, global_batch=8, pipelined=False)
    # Another global batch would count the data position and the schedule in batches of another size.
    with pytest.raises(elastic.ElasticResumeError, match=r"global batch 8 \(2 processes\) but this attempt runs "
                                                         r"global batch 4 .* hyperparameters.global_batch_size to 8"):
        elastic.check(plan, load_universal=True, global_batch=4, pipelined=False)
    with pytest.raises(elastic.ElasticResumeError, match="pipeline-parallel job was written by 2 processes"):
        elastic.check(plan, load_universal=True, global_batch=8, pipelined=True)
    with pytest.raises(elastic.ElasticResumeError, match="checkpoint.load_universal=False"):
        elastic.check(plan, load_universal=False, global_batch=8, pipelined=False)
    assert not (chain.job_dir / "checkpoints" / "universal" / tag.name).exists()
