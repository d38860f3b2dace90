"""The trainer across DeepSpeed's configurations, under the real launcher on two CPU ranks (gloo, no mocks).

Each launch checks several things at once (exit code, falling loss, eval events, a loadable export) because
a launch costs ~15 s. fp16 on DeepSpeed's CPU accelerator depends on the CPU (oneDNN fp16: AVX512-FP16 or
AMX): where it is there the fp16 job must train, where it is not it must fail with DeepSpeed's clear error;
its rendered config (loss scaling) is covered in tests/test_dsconfig.py.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import NO_ASYNC_IO, async_io_buildable

pytest.register_assert_rewrite("tests.trainer_support")  # its asserts report values, like a test module's

from tests.trainer_support import (  # noqa: E402
    Event,
    assert_loads_and_generates,
    launch,
    make_job,
    of,
    straight_and_resumed,
    write_run_spec,
)

# The `corpus` and `tiny_model` fixtures.
pytest_plugins = ["tests.trainer_support"]

STEPS = 12


def _small_job(model: Path, train: Path, **overrides: Any) -> dict[str, Any]:
    """12 steps of global batch 8 (micro 2 x accumulation 2 x 2 ranks), seq_len 64, a 10% validation split."""
    base = make_job(model, train, data={"validation_fraction": 0.1},
                    hyperparameters={"max_steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 2,
                                     "eval_every_steps": 6},
                    checkpointing={"every_steps": None})
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return base


def _train_file(tmp_path: Path, corpus: str) -> Path:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    return train


def _assert_loss_falls(events: list[Event]) -> None:
    losses = [p["loss"] for p in of(events, "progress")]
    assert len(losses) >= 6 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def _assert_eval_events(events: list[Event], steps: list[int]) -> None:
    evals = of(events, "eval")
    assert [e["step"] for e in evals] == steps, evals
    for e in evals:
        assert math.isfinite(e["loss"]) and e["loss"] > 0
        assert e["perplexity"] == pytest.approx(math.exp(e["loss"]), rel=1e-9)


def _assert_completed(events: list[Event], tail: str, out: Path, steps: int) -> None:
    assert not of(events, "error"), tail
    (done,) = of(events, "completed")
    assert done["steps"] == steps and done["output_dir"] == str(out)
    assert json.loads((out / "COMPLETE").read_text())["step"] == steps


def _train_and_check(tmp_path: Path, job: dict[str, Any]) -> list[Event]:
    """Launch a standard job and check what every successful one must show: loss falls, evals at 6 and the
    end, completion marker, and an export that loads and generates."""
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    _assert_loss_falls(events)
    # The validation split (validation_fraction) is evaluated every 6 steps and once at the end.
    _assert_eval_events(events, [6, STEPS])
    out = tmp_path / "job" / "output"
    _assert_completed(events, tail, out, STEPS)
    assert_loads_and_generates(out)
    return events


# Stage 0 has no optimizer partition to offload, so it runs without offload only.
MATRIX = [
    (0, "none", "bf16"),
    (0, "none", "fp32"),
    (1, "none", "bf16"),
    (1, "cpu", "bf16"),
    (2, "none", "bf16"),
    (2, "cpu", "bf16"),
    (3, "none", "bf16"),
    (3, "cpu", "fp32"),
]


@pytest.mark.parametrize(("stage", "offload", "precision"), MATRIX,
                         ids=[f"zero{s}-offload_{o}-{p}" for s, o, p in MATRIX])
def test_zero_stage_offload_precision_trains_evaluates_and_exports(
        tmp_path: Path, tiny_model: Path, corpus: str, stage: int, offload: str, precision: str) -> None:
    job = _small_job(tiny_model, _train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": stage, "offload_optimizer": offload, "precision": precision})
    events = _train_and_check(tmp_path, job)
    (started,) = of(events, "started")
    assert started["world_size"] == 2 and started["total_steps"] == STEPS
    assert started["micro_batch_size"] == 2 and started["gradient_accumulation_steps"] == 2


def _cpu_has_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def test_fp16_trains_where_the_cpu_has_it_and_is_refused_clearly_where_not(tmp_path: Path, tiny_model: Path,
                                                                           corpus: str) -> None:
    job = _small_job(tiny_model, _train_file(tmp_path, corpus), deepspeed={"zero_stage": 2, "precision": "fp16"})
    if _cpu_has_fp16():
        # DeepSpeed's dynamic loss scaling: the loss must still fall and the export load.
        _train_and_check(tmp_path, job)
        return
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 1, tail
    # Every rank fails the same way in deepspeed.initialize, and each says why.
    errors = of(events, "error")
    assert {e["rank"] for e in errors} == {0, 1}, tail
    for error in errors:
        assert error["message"] == "Type fp16 is not supported on your device.", error
    assert not of(events, "completed") and not (tmp_path / "job" / "output" / "COMPLETE").exists()


def test_zero3_parameter_offload_trains_and_exports(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    job = _small_job(tiny_model, _train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": 3, "offload_param": "cpu", "precision": "bf16"})
    _train_and_check(tmp_path, job)


def test_zero3_partial_optimizer_offload_trains_and_exports(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    # Half of the sub-groups stepped by CPU Adam, half by an optimizer on the device (here also the CPU).
    job = _small_job(tiny_model, _train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "precision": "bf16",
                                "config": {"zero_optimization": {"sub_group_size": 20_000,
                                                                 "offload_optimizer": {"device": "cpu",
                                                                                       "ratio": 0.5}}}})
    _train_and_check(tmp_path, job)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    """Hidden 512: its MLP partitions reach DeepSpeed's 1 MiB minimum for swapping to NVMe (the tiny model's
    stay in host buffers, and nothing would touch the disk)."""
    from trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide") / "wide-llama", corpus, hidden=512, heads=8, kv_heads=4)


def _watch_files(root: Path, seen: set[str], stop: threading.Event) -> None:
    while not stop.is_set():
        seen.update(str(p.relative_to(root)) for p in root.rglob("*.swp"))
        stop.wait(0.05)


# CI installs libaio-dev (.ci/run), so this runs there; the rendering of NVMe blocks is tested without it.
@pytest.mark.skipif(not async_io_buildable(), reason=NO_ASYNC_IO)
def test_nvme_offload_swaps_in_its_own_folder_and_removes_it(tmp_path: Path, wide_model: Path,
                                                             corpus: str) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    job = _small_job(wide_model, _train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                                "nvme_path": str(nvme), "precision": "bf16"})
    seen: set[str] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_files, args=(nvme, seen, stop))
    watcher.start()
    try:
        events = _train_and_check(tmp_path, job)
    finally:
        stop.set()
        watcher.join()
    # Optimizer state and parameters of both ranks went through files in this attempt's own folder...
    for part in ("optimizer", "bfloat16params"):
        for rank in (0, 1):
            assert any(f.startswith(f"job-attempt-1/zero_stage_3/{part}/rank{rank}/") for f in seen), sorted(seen)
    (started,) = of(events, "started")
    assert any(str(nvme / "job-attempt-1") in a for a in started["adjustments"]), started
    # ...which is gone once the attempt has ended; the operator's folder itself stays.
    assert nvme.is_dir() and list(nvme.iterdir()) == []


def test_lora_trains_adapter_only_and_merges_on_export(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    job = _small_job(tiny_model, _train_file(tmp_path, corpus), hyperparameters={"learning_rate": 1e-2},
                     lora={"rank": 4, "alpha": 8, "target_modules": "all-linear", "merge_on_export": True})
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    (started,) = of(events, "started")
    assert 0 < started["n_trainable_params"] < started["n_params"] / 10, started
    _assert_loss_falls(events)
    out = tmp_path / "job" / "output"
    _assert_completed(events, tail, out, STEPS)

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter), sorted(adapter)
    lora_b = {n: t for n, t in adapter.items() if "lora_B" in n}
    # B starts at zero; a trained adapter has moved it.
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b.values())
    assert not (out / "model.safetensors").exists()

    merged_dir = out / "merged"
    assert_loads_and_generates(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16).state_dict()
    assert merged.keys() == base.keys()
    changed = {n for n in base if not torch.equal(base[n], merged[n])}
    # Only the adapted linears differ from the base model; embeddings, norms and lm_head are the base's own.
    adapted = {n.split("base_model.model.", 1)[1].replace(".lora_B.weight", ".weight") for n in lora_b}
    assert changed and changed <= adapted, sorted(changed - adapted)
    # ... and each differs by exactly the adapter's delta, scale * B @ A (to bf16 rounding).
    name_b = next(iter(sorted(lora_b)))
    a = adapter[name_b.replace("lora_B", "lora_A")].float()
    delta = (8 / 4) * lora_b[name_b].float() @ a
    target = name_b.split("base_model.model.", 1)[1].replace(".lora_B.weight", ".weight")
    torch.testing.assert_close(merged[target].float() - base[target].float(), delta, atol=2e-2, rtol=0.0)


def test_chat_jsonl_trains_and_exports(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    paragraphs = [p.replace("\n", " ") for p in corpus.split("\n\n") if len(p) > 100][:120]
    train = tmp_path / "chat.jsonl"
    with train.open("w") as f:
        for i, text in enumerate(paragraphs):
            messages = [{"role": "system", "content": "You explain Python."},
                        {"role": "user", "content": f"Explain item {i}."},
                        {"role": "assistant", "content": text[:300]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    job = _small_job(tiny_model, train, data={"format": "chat"})
    _train_and_check(tmp_path, job)


# Exact resume: fp32, no dropout, one data order per seed. Losses and learning rates of a resumed run must match
# an uninterrupted one to this relative tolerance at every step both report (fp32 on CPU is deterministic, so
# the difference is in practice 0; the tolerance only absorbs summation-order noise).
RESUME_REL_TOL = 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_interrupted_and_resumed_run_matches_uninterrupted_run(tmp_path: Path, tiny_model: Path, corpus: str,
                                                              stage: int) -> None:
    from safetensors.torch import load_file

    train = _train_file(tmp_path, corpus)
    job = make_job(tiny_model, train, hyperparameters={"max_steps": 16, "warmup_steps": 2},
                   deepspeed={"zero_stage": stage, "precision": "fp32"},
                   checkpointing={"every_steps": 8, "keep_last": 3})
    straight, first, second, stopped = straight_and_resumed(tmp_path, job, stop_after_checkpoint=8)
    # The step in flight when SIGTERM came finished and was checkpointed.
    assert 8 < stopped["step"] < 16
    assert [c["step"] for c in of(first, "checkpoint")] == [8, stopped["step"]]
    resumed_steps = [p["step"] for p in of(second, "progress")]
    assert resumed_steps[0] == stopped["step"] + 1 and resumed_steps[-1] == 16

    a = {p["step"]: p for p in of(straight, "progress")}
    b = {p["step"]: p for p in of(first, "progress") + of(second, "progress")}
    # Progress is reported every step up to 10, then about once a second; steps 1-10 and 16 are always there.
    common = sorted(a.keys() & b.keys())
    assert set(range(1, 11)) | {16} <= set(common), common
    for step in common:
        for field in ("loss", "lr"):
            assert b[step][field] == pytest.approx(a[step][field], rel=RESUME_REL_TOL), (step, field)
        # Same rows in the same order: token counts match step by step.
        assert b[step]["tokens_seen"] == a[step]["tokens_seen"], step

    # The end state is the same model, weight for weight.
    wa = load_file(tmp_path / "a" / "output" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "output" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wb[name].float().sub(wa[name].float()).abs().max() <= 1e-5 * max(1.0, wa[name].abs().max()), name
