"""Trainer options beyond the ZeRO stage / offload / precision matrix (fp16, ZeRO-3 parameter and partial
optimizer offload, NVMe offload, LoRA, chat data), under the real launcher on two CPU ranks (gloo, no mocks).

Each launch checks several things at once (exit code, falling loss, eval events, a loadable export) because a
launch costs ~15-60 s. fp16 on DeepSpeed's CPU accelerator depends on the CPU (oneDNN fp16: AVX512-FP16 or AMX):
where it is there the fp16 job must train, where it is not it must fail with DeepSpeed's clear error; its rendered
config (loss scaling) is covered in tests/test_dsconfig.py. These are apart from tests/test_trainer_matrix.py so
that the suite's two workers (`--dist loadfile`) share the launches.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.helpers import NO_ASYNC_IO, async_io_buildable

pytest.register_assert_rewrite("tests.trainer_support")  # its asserts report values, like a test module's

from tests.trainer_support import (  # noqa: E402
    STEPS,
    assert_completed,
    assert_loads_and_generates,
    assert_loss_falls,
    launch,
    of,
    small_job,
    train_and_check,
    train_file,
    write_run_spec,
)

# The `corpus` and `tiny_model` fixtures.
pytest_plugins = ["tests.trainer_support"]


def _cpu_has_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def test_fp16_trains_where_the_cpu_has_it_and_is_refused_clearly_where_not(tmp_path: Path, tiny_model: Path,
                                                                           corpus: str) -> None:
    job = small_job(tiny_model, train_file(tmp_path, corpus), deepspeed={"zero_stage": 2, "precision": "fp16"})
    if _cpu_has_fp16():
        # DeepSpeed's dynamic loss scaling: the loss must still fall and the export load.
        train_and_check(tmp_path, job)
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
    job = small_job(tiny_model, train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": 3, "offload_param": "cpu", "precision": "bf16"})
    train_and_check(tmp_path, job)


def test_zero3_partial_optimizer_offload_trains_and_exports(tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    # Half of the sub-groups stepped by CPU Adam, half by an optimizer on the device (here also the CPU).
    job = small_job(tiny_model, train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "precision": "bf16",
                                "config": {"zero_optimization": {"sub_group_size": 20_000,
                                                                 "offload_optimizer": {"device": "cpu",
                                                                                       "ratio": 0.5}}}})
    train_and_check(tmp_path, job)


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
    job = small_job(wide_model, train_file(tmp_path, corpus),
                     deepspeed={"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                                "nvme_path": str(nvme), "precision": "bf16"})
    seen: set[str] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_files, args=(nvme, seen, stop))
    watcher.start()
    try:
        events = train_and_check(tmp_path, job)
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

    job = small_job(tiny_model, train_file(tmp_path, corpus), hyperparameters={"learning_rate": 1e-2},
                     lora={"rank": 4, "alpha": 8, "target_modules": "all-linear", "merge_on_export": True})
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    (started,) = of(events, "started")
    assert 0 < started["n_trainable_params"] < started["n_params"] / 10, started
    assert_loss_falls(events)
    out = tmp_path / "job" / "output"
    assert_completed(events, tail, out, STEPS)

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
    job = small_job(tiny_model, train, data={"format": "chat"})
    train_and_check(tmp_path, job)
