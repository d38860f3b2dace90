"""The preference method (method.type dpo) under the real `deepspeed` launcher on CPU processes: it learns a rule
the base model does not know, with either reference, packed and unpacked, and a stopped job resumes against the
reference its checkpoint kept. The loss itself is proven equal to trl's in tests/test_preference_loss.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.codes import PREFERENCE_METRICS
from tests.preference_support import pairs, ranking_accuracy, write_pairs
from tests.trainer_support import corpus, launch, make_job, of, stop_after_checkpoint, tiny_model, write_run_spec

__all__ = ["corpus", "tiny_model"]

HELD_OUT = pairs(100, seed=99)
METRICS = PREFERENCE_METRICS


def dpo_job(model: Path, train: Path, **overrides: Any) -> dict[str, Any]:
    """30 steps of 8 pairs (2 per micro batch, 2 ranks, accumulation 2), a fifth of the pairs held out and evaluated
    every 10 steps, a checkpoint every 10."""
    job = make_job(model, train, data={"format": "preference", "validation_fraction": 0.2},
                   hyperparameters={"max_steps": 30, "learning_rate": 3e-3, "warmup_steps": 2, "global_batch_size": 8,
                                    "micro_batch_size": 2, "seq_len": 64, "eval_every_steps": 10},
                   method={"type": "dpo", "dpo": {"beta": 0.1}})
    for key, value in overrides.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) and key in job else value
    return job


def check_learned(events: list[dict[str, Any]], tail: str, out: Path, base: Path) -> None:
    assert not of(events, "error"), tail
    started = of(events, "started")[0]
    assert started["method"] == "dpo" and started["pairs"]["pairs_kept"] == 160, started
    progress = of(events, "progress")
    assert all(name in progress[-1] for name in METRICS), progress[-1]
    # The first step's policy is the reference: every reward is 0, and the loss is log 2.
    assert progress[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    evals = of(events, "eval")
    assert [e["step"] for e in evals] == [10, 20, 30], evals
    assert evals[-1]["rewards/accuracies"] >= 0.9 and evals[-1]["rewards/margins"] > 0, evals[-1]
    assert evals[-1]["loss"] < 0.5 < math.log(2), evals[-1]
    # What a user loads: the export, in transformers, ranks pairs it never saw.
    assert ranking_accuracy(base, HELD_OUT) <= 0.75
    assert ranking_accuracy(out, HELD_OUT) >= 0.9


def test_full_fine_tuning_learns_with_a_precomputed_reference_and_resumes_against_it_on_another_world_size(
        tmp_path: Path, tiny_model: Path) -> None:
    """ZeRO-3 with its optimizer offloaded, on two processes, stopped at its step-10 checkpoint, resumed on one
    (through the checkpoint's universal copy): the reference is the table the first attempt computed, not one
    computed again from the resumed weights (which would equal the policy and make every reward 0), and the job
    learns as an uninterrupted one does."""
    train = write_pairs(tmp_path / "pairs.jsonl", 200, seed=1)
    job = dpo_job(tiny_model, train, deepspeed={"zero_stage": 3, "offload_optimizer": "cpu"},
                  checkpointing={"every_steps": 10, "keep_last": 2})
    rc, first, tail = launch(write_run_spec(tmp_path, job), on_event=stop_after_checkpoint(10))
    assert rc != 0 and of(first, "interrupted"), tail
    (started,) = of(first, "started")
    assert started["reference"] == "precomputed" and started["world_size"] == 2
    kept = torch.load(tmp_path / "job" / "checkpoints" / "step-00000010" / "extras.pt", weights_only=True)
    assert kept["train"].shape == (160, 2) and bool((kept["train"] < 0).all())
    one = write_run_spec(tmp_path, {**job, "resources": {**job["resources"], "num_gpus": 1}})
    rc, events, tail = launch(one, procs=1)
    assert rc == 0, tail
    (resumed,) = of(events, "started")
    assert resumed["resumed_from_step"] in (10, 11) and resumed["world_size"] == 1, resumed
    after = of(events, "progress")[0]
    assert abs(after["rewards/margins"]) > 1e-3 and abs(after["rewards/chosen"]) > 1e-4, after
    check_learned(first + events, tail, tmp_path / "job" / "output", tiny_model)


def test_lora_learns_against_its_base_with_adapters_off_unpacked_after_an_out_of_memory_step(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first forward fails as a device out of memory would (trainer/oom.py's seam): the on_oom ladder halves the
    # micro batch and the job goes on with the same global batch of pairs.
    monkeypatch.setenv("FT_TEST_FORCE_OOM", "forward:1")
    train = write_pairs(tmp_path / "pairs.jsonl", 200, seed=1)
    job = dpo_job(tiny_model, train, data={"packing": False}, resources={"on_oom": "adapt"},
                  hyperparameters={"learning_rate": 1e-2},
                  lora={"rank": 8, "alpha": 16, "target_modules": "all-linear", "merge_on_export": True},
                  checkpointing={"every_steps": None})
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    started = of(events, "started")[-1]  # the try after the ladder's step
    assert started["reference"] == "adapters_off" and started["n_trainable_params"] < started["n_params"] / 2
    (adapted,) = of(events, "adapted")
    assert adapted["setting"]["micro_batch_size"] == 1 and started["micro_batch_size"] == 1, adapted
    check_learned(events, tail, tmp_path / "job" / "output", tiny_model)

