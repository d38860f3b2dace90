"""The rows per step a job runs (trainer/batching.py), on real tokenized data: OpenAI's `batch_size` (examples per
step) on small and larger chat files, and a native global batch the data cannot fill, clamped rather than failed.

The steps are what `BatchOrder` runs (whole global batches per epoch); OpenAI's definition is `ceil(examples /
batch_size)` per epoch. Unpacked, the trainer runs `examples // batch_size` (a last partial batch is dropped: every
step is the same size); packed, each step's examples are `batch_size` to within half a row's worth.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from contract.deepspeed import resolve
from contract.spec import JobSpec
from tests.trainer_support import corpus, tiny_model  # noqa: F401  (fixtures)
from trainer import batching
from trainer.data import BatchOrder, blocks_of, encode
from trainer.errors import DataError

SEQ_LEN = 64


def chat(n: int, words: int = 3) -> list[Any]:
    filler = " ".join(["and then some more"] * words)
    return [[{"role": "user", "content": f"What is {i} plus {i}? {filler}"},
             {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}] for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def resolved(**hp: Any) -> Any:
    return resolve(JobSpec.model_validate({"model": "m", "data": {"train": "t", "format": "chat"},
                                           "hyperparameters": {"seq_len": SEQ_LEN, **hp}}))


def steps_of(tokenizer: Any, examples: int, world: int = 1, words: int = 3, **hp: Any) -> tuple[int, Any]:
    """Steps per epoch the trainer runs, and its plan, for `examples` chat examples."""
    job = resolved(**hp)
    encoded = encode(tokenizer, chat(examples, words), "chat")
    packed, _ = blocks_of(encoded, [], seq_len=SEQ_LEN, pad_id=tokenizer.pad_token_id, packing=True, name="t")
    plan = batching.plan(job, examples=examples, packed_rows=len(packed), dp=world)
    rows, _ = blocks_of(encoded, [], seq_len=SEQ_LEN, pad_id=tokenizer.pad_token_id, packing=plan.packing,
                        name="t")
    assert len(rows) == plan.rows
    job = plan.applied(job)
    assert job.micro_batch_size * job.gradient_accumulation_steps * world == job.spec.hyperparameters.global_batch_size
    assert job.deepspeed_config["train_batch_size"] == plan.global_batch
    order = BatchOrder(len(rows), micro=plan.micro, accum=plan.accum, world=world, seed=1)
    return order.batches_per_epoch, plan


@pytest.mark.parametrize("examples", [10, 60, 400])
@pytest.mark.parametrize("batch", [1, 16, 32, "auto"])
def test_openai_batch_size_runs_the_steps_its_definition_gives(tokenizer: Any, examples: int,
                                                               batch: int | str) -> None:
    steps, plan = steps_of(tokenizer, examples, examples_per_step=batch)
    b = batching.auto_examples_per_step(examples) if batch == "auto" else batch
    assert plan.examples_per_step == b
    openai_steps = math.ceil(examples / b)
    if not plan.packing:
        # One example a row: the steps are OpenAI's, less a last partial batch.
        assert steps == max(1, examples // b), (steps, plan)
        assert openai_steps - 1 <= steps <= openai_steps
    else:
        # Each step holds batch_size examples to within half a row's worth of examples (the rounding to rows).
        # A batch larger than the file takes the whole file each step.
        per_row = examples / plan.rows
        assert abs(plan.global_batch * per_row - min(b, examples)) <= per_row / 2 + 1e-9, plan
        assert steps == plan.rows // plan.global_batch
    assert plan.notes  # the choice is said in the `resolved` event


def test_a_batch_that_fills_whole_rows_stays_packed(tokenizer: Any) -> None:
    steps, plan = steps_of(tokenizer, 400, words=0, examples_per_step=32)
    assert plan.packing and plan.global_batch < 32 and plan.rows < 400
    assert steps == plan.rows // plan.global_batch


def test_a_native_batch_larger_than_the_data_is_clamped_with_a_notice(tokenizer: Any) -> None:
    steps, plan = steps_of(tokenizer, 10, global_batch_size=16, micro_batch_size=8)
    assert plan.packing and plan.global_batch == plan.rows < 16 and steps == 1
    assert any("clamped" in n for n in plan.notes)


def test_a_native_batch_is_a_multiple_of_the_processes_and_the_micro_batch_never_grows(tokenizer: Any) -> None:
    job = resolve(JobSpec.model_validate({"model": "m", "data": {"train": "t"}, "resources": {"num_gpus": 4},
                                          "hyperparameters": {"global_batch_size": 64, "micro_batch_size": 8}}))
    plan = batching.plan(job, examples=100, packed_rows=30, dp=4)
    assert (plan.global_batch, plan.micro, plan.accum) == (28, 7, 1)
    unchanged = batching.plan(job, examples=1000, packed_rows=300, dp=4)
    assert not unchanged.changes(job) and unchanged.notes == ()


def test_data_that_cannot_give_every_process_a_row_is_a_data_error() -> None:
    job = resolve(JobSpec.model_validate({"model": "m", "data": {"train": "t"}, "resources": {"num_gpus": 4}}))
    with pytest.raises(DataError, match="fewer than the 4 data-parallel processes"):
        batching.plan(job, examples=3, packed_rows=3, dp=4)


@pytest.mark.parametrize("extra", [{"hyperparameters": {"global_batch_size": 8}},
                                   {"deepspeed": {"config": {"train_batch_size": 8}}}])
def test_examples_per_step_with_a_row_batch_as_well_is_refused_naming_both(extra: dict[str, Any]) -> None:
    from contract.problems import SpecError

    body: dict[str, Any] = {"model": "m", "data": {"train": "t"}, "hyperparameters": {"examples_per_step": 4}}
    for key, value in extra.items():
        body[key] = {**body.get(key, {}), **value}
    with pytest.raises(SpecError) as err:
        resolve(JobSpec.model_validate(body))
    assert any("examples_per_step" in e.message for e in err.value.errors), json.dumps(str(err.value))
