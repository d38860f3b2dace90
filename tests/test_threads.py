"""The training loop's intra-op pool (trainer/threads.py): one thread on an accelerator, torch's size wherever the
host does the heavy work, and torch's size again once the loop is over."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contract.deepspeed import resolve
from contract.spec import DeepSpeedOptions, JobSpec
from trainer.threads import LOOP_THREADS, loop_threads, pool_of


def _options(deepspeed: dict[str, Any]) -> DeepSpeedOptions:
    """The resolved deepspeed options of a job with these, as the trainer gets them (a raw config merged in)."""
    job = JobSpec.model_validate({"model": "org/model", "data": {"train": "train.txt"}, "deepspeed": deepspeed})
    return resolve(job).spec.deepspeed


HOST_STEPS_THE_OPTIMIZER = {
    "optimizer on the CPU": {"zero_stage": 2, "offload_optimizer": "cpu"},
    "optimizer on NVMe": {"zero_stage": 3, "offload_optimizer": "nvme", "nvme_path": "/nvme/job"},
    "parameters on the CPU": {"zero_stage": 3, "offload_param": "cpu"},
    "part of the optimizer on the CPU": {"config": {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}},
    "a raw config's deprecated cpu_offload": {"config": {"zero_optimization": {"stage": 2, "cpu_offload": True}}},
}


def test_on_an_accelerator_the_loop_gets_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for deepspeed in ({}, {"zero_stage": 3}, {"zero_stage": 2, "precision": "bf16"}):
        assert loop_threads("cuda", _options(deepspeed)) == LOOP_THREADS == 1, deepspeed


@pytest.mark.parametrize("case", list(HOST_STEPS_THE_OPTIMIZER))
def test_torch_keeps_its_pool_where_the_host_does_the_heavy_work(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert loop_threads("cuda", _options(HOST_STEPS_THE_OPTIMIZER[case])) is None
    # Training on the CPU: the pool is the training device.
    assert loop_threads("cpu", _options({})) is None


def test_an_operators_omp_num_threads_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert loop_threads("cuda", _options({})) is None


def test_the_pool_is_set_inside_the_block_and_restored_after_it_even_on_an_error() -> None:
    original = torch.get_num_threads()
    torch.set_num_threads(2)  # a size the block must change and restore, on a host of any core count
    try:
        x = torch.arange(1 << 20, dtype=torch.float64)
        with pool_of(1):
            assert torch.get_num_threads() == 1
            assert float(x.sum()) == float((1 << 20) * ((1 << 20) - 1) / 2)  # a parallel region runs on it
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="mid-loop"), pool_of(1):
            raise RuntimeError("mid-loop")
        assert torch.get_num_threads() == 2
        with pool_of(None):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original)
