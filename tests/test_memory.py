"""Host memory for offloaded optimizer state: the check before training and the release before export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.spec import DeepSpeedOptions
from tests.trainer_support import REPO, free_port, ops_dir
from trainer.memory import GiB, HostMemoryError, check_offload_fits, offload_host_bytes, offloaded_share

LLAMA8B, LLAMA7B = 8_030_261_248, 7_157_813_248
# What an H200 node with 128 GiB had available once a rank had loaded its model (bench/RESULTS.md).
NODE_AVAILABLE = int(121.7 * GiB)


def _ds(**kw: object) -> DeepSpeedOptions:
    return DeepSpeedOptions.model_validate({"zero_stage": 2, "precision": "bf16", **kw})


def test_offload_that_the_host_cannot_hold_is_refused_naming_the_setting_and_the_numbers() -> None:
    with pytest.raises(HostMemoryError) as err:
        check_offload_fits(_ds(offload_optimizer="cpu"), LLAMA8B, LLAMA8B, 1, 1, NODE_AVAILABLE)
    assert err.value.code == "out_of_memory"
    message = str(err.value)
    assert 'deepspeed.offload_optimizer="cpu"' in message
    assert "134.6 GiB" in message and "121.7 GiB" in message and "8.03 B trainable" in message


def test_offload_that_fits_or_is_shared_over_nodes_passes() -> None:
    check_offload_fits(_ds(offload_optimizer="cpu"), LLAMA7B, LLAMA7B, 1, 1, NODE_AVAILABLE)
    # Two nodes of two ranks: each node holds half of the partitions.
    check_offload_fits(_ds(offload_optimizer="cpu"), LLAMA8B, LLAMA8B, 2, 4, NODE_AVAILABLE)
    # Nothing offloaded, or nothing known about the host: no check.
    check_offload_fits(_ds(), LLAMA8B, LLAMA8B, 1, 1, 0)
    check_offload_fits(_ds(offload_optimizer="cpu"), LLAMA8B, LLAMA8B, 1, 1, None)


def test_offload_host_bytes_per_parameter() -> None:
    n = 1_000_000
    assert offload_host_bytes(_ds(offload_optimizer="cpu"), n, n, 1, 1) == 18 * n
    assert offload_host_bytes(_ds(offload_optimizer="cpu", precision="fp32"), n, n, 1, 1) == 16 * n
    # LoRA: only the trainable parameters have optimizer state.
    assert offload_host_bytes(_ds(offload_optimizer="cpu"), n, n // 100, 1, 1) == 18 * (n // 100)
    # ZeRO-3 measured 2 bytes more per offloaded parameter; offloaded 16-bit parameters add their own 2.
    assert offload_host_bytes(_ds(zero_stage=3, offload_optimizer="cpu"), n, n, 1, 1) == 20 * n
    stage3 = _ds(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert offload_host_bytes(stage3, n, n, 8, 8) == 22 * n
    assert offload_host_bytes(_ds(offload_optimizer="nvme", nvme_path="/nvme/x", zero_stage=3), n, n, 1, 1) == 0


def test_stage3_partial_offload_limits_measured_on_one_h200_node() -> None:
    # bench/RESULTS.md: 13.3 B at ratio 0.44 (12 of 27 sub-groups on the CPU) trained and exported on a node
    # with 128 GiB; 14.1 B at ratio 0.48 (14 of 29) needs more than the node has and is refused up front.
    llama13b, llama14b = 13_264_949_248, 14_137_397_248
    z3 = _ds(zero_stage=3, offload_optimizer="cpu")
    share13 = offloaded_share(0.44, llama13b, 500_000_000)
    assert share13 == pytest.approx(12 / 27)
    check_offload_fits(z3, llama13b, llama13b, 1, 1, NODE_AVAILABLE, share13)
    share14 = offloaded_share(0.48, llama14b, 500_000_000)
    assert share14 == pytest.approx(14 / 29)
    with pytest.raises(HostMemoryError, match=r"needs about 127\.1 GiB .*14\.14 B trainable"):
        check_offload_fits(z3, llama14b, llama14b, 1, 1, NODE_AVAILABLE, share14)


def test_partial_offload_share_follows_deepspeeds_sub_groups() -> None:
    # The measured 8.0 B run: ratio 0.6 in sub-groups of 5e8 put 11 of 17 groups on the CPU.
    assert offloaded_share(0.6, LLAMA8B, 500_000_000) == pytest.approx(11 / 17)
    assert offloaded_share(1.0, LLAMA8B) == 1.0
    assert offloaded_share(0.5, 10_000) == 1.0  # one sub-group: int(0.5 * 1) = 0 on the GPU
    assert offloaded_share(0.0, LLAMA8B, 500_000_000) == 0.0


def _probe(stage: int, offload: str, precision: str, ratio: float = 1.0) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(ops_dir()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("release_probe.py")), str(stage), offload,
                           precision, str(ratio)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("stage", "offload", "precision", "ratio", "min_bytes_per_param"), [
    (2, "cpu", "bf16", 1.0, 16),  # fp32 master weights 4 + fp32 gradients 4 + two Adam moments 8
    (1, "none", "bf16", 1.0, 12),  # master weights and moments (gradients are not kept between steps)
    (0, "none", "fp32", 1.0, 8),  # the optimizer updates the module's own weights: only the moments go
    (3, "none", "bf16", 1.0, 12),  # the fp32 partitions live on the ZeRO-3 wrapper between steps
    (3, "cpu", "bf16", 0.5, 16),  # half the sub-groups stepped by a second, device-side optimizer
])
def test_release_drops_optimizer_state_and_keeps_trained_weights(stage: int, offload: str, precision: str,
                                                                 ratio: float, min_bytes_per_param: int) -> None:
    out = _probe(stage, offload, precision, ratio)
    assert out["inner_state_entries"] == 0 and out["inner_param_numel"] == 0, out
    assert out["module_unchanged"] is True and out["module_numel"] == out["n_params"], out
    assert int(out["released"]) >= min_bytes_per_param * int(out["n_params"]), out
