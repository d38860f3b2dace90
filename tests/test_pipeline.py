"""Pipeline parallelism (resources.pipeline_stages) under the real launcher on CPU ranks (gloo, no mocks).

Four launches share one tiny 4-layer Llama: the plain engine on 1 rank (the reference), P = 2 on 2 ranks
(checkpoints, eval, export), the same P = 2 job resumed from its step-2 checkpoint, and P = 2 × DP 2 on 4
ranks. All run fp32 ZeRO-1 on the same rows with the same global batch, so the pipelined losses must equal
the reference's up to float32 summation order (see LOSS_RTOL). The refusals at submit need no launch.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

pytest.register_assert_rewrite("tests.trainer_support")

from tests.trainer_support import (  # noqa: E402
    Event,
    assert_loads_and_generates,
    launch,
    make_job,
    of,
    write_run_spec,
)

# The `corpus` fixture.
pytest_plugins = ["tests.trainer_support"]

STEPS = 4
# Same weights, rows and token-weighted objective: the runs differ only in the order float32 sums are taken
# (per-row cross entropy sums, the data-parallel all-reduce, the pipeline's stage boundaries). Measured here
# the gap is about 1e-7 relative over 4 Adam steps; 1e-5 leaves room for other CPUs' kernels while any real
# difference (a wrong mask, a lost position id, a mis-scaled loss) moves the loss by 1e-3 or more.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    from trainer.tiny import build_tiny_model

    # Four decoder layers, so the stages split the decoder itself, not only the embedding from the head.
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama-4", corpus, layers=4)


def _job(model: Path, train: Path, ranks: int, stages: int, **overrides: Any) -> dict[str, Any]:
    """4 steps of global batch 8, micro batch 2, a 10% validation split, fp32 ZeRO-1."""
    job = make_job(model, train, data={"validation_fraction": 0.1},
                   hyperparameters={"max_steps": STEPS, "warmup_steps": 1},
                   deepspeed={"zero_stage": 1, "precision": "fp32"},
                   resources={"num_gpus": ranks, "pipeline_stages": stages},
                   checkpointing={"every_steps": 2, "keep_last": 2})
    for key, value in overrides.items():
        job[key] = {**job[key], **value}
    return job


def _run(tmp: Path, job: dict[str, Any], name: str, ranks: int, job_dir: Path | None = None) -> list[Event]:
    spec = write_run_spec(tmp, job, job_dir=job_dir or tmp / name)
    rc, events, tail = launch(spec, procs=ranks)
    assert rc == 0, tail
    assert not of(events, "error"), tail
    return events


def _losses(events: list[Event]) -> dict[int, float]:
    return {p["step"]: p["loss"] for p in of(events, "progress")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: str, four_layer_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pipeline")
    train = tmp / "train.txt"
    train.write_text(corpus)
    # The reference is the plain engine's arithmetic, not a data-parallel property: one process, accumulating the
    # same global batch, holds it.
    plain = _job(four_layer_model, train, 1, 1)
    out: dict[str, Any] = {"tmp": tmp, "lr": plain["hyperparameters"]["learning_rate"]}
    out["plain"] = _run(tmp, plain, "plain", 1)
    out["p2"] = _run(tmp, _job(four_layer_model, train, 2, 2), "p2", 2)
    # Resume: a fresh job directory holding only the P = 2 run's committed step-2 checkpoint.
    resumed_dir = tmp / "p2-resumed"
    shutil.copytree(tmp / "p2" / "checkpoints" / "step-00000002", resumed_dir / "checkpoints" / "step-00000002")
    out["p2_resumed"] = _run(tmp, _job(four_layer_model, train, 2, 2), "p2-resumed", 2, job_dir=resumed_dir)
    out["p2dp2"] = _run(tmp, _job(four_layer_model, train, 4, 2), "p2dp2", 4)
    return out


def test_pipelined_loss_matches_the_plain_engine(runs: dict[str, Any]) -> None:
    plain = _losses(runs["plain"])
    assert sorted(plain) == list(range(1, STEPS + 1))
    for name, ranks in (("p2", 2), ("p2dp2", 4)):
        (started,) = of(runs[name], "started")
        assert started["world_size"] == ranks
        # Micro batches per data-parallel rank: 8 rows / (2 per micro × data-parallel degree).
        assert started["gradient_accumulation_steps"] == 8 // (2 * (ranks // 2))
        losses = _losses(runs[name])
        assert sorted(losses) == sorted(plain)
        for step, loss in plain.items():
            assert losses[step] == pytest.approx(loss, rel=LOSS_RTOL), (name, step, losses, plain)
        # The evaluation runs through the pipeline too (eval_batch), over the same validation rows.
        assert of(runs[name], "eval")[-1]["loss"] == pytest.approx(of(runs["plain"], "eval")[-1]["loss"],
                                                                   rel=LOSS_RTOL)
    # It trained: the loss fell.
    assert plain[STEPS] < plain[1]


def test_resume_continues_exactly(runs: dict[str, Any]) -> None:
    (started,) = of(runs["p2_resumed"], "started")
    assert started["resumed_from_step"] == 2
    uninterrupted, resumed = _losses(runs["p2"]), _losses(runs["p2_resumed"])
    assert sorted(resumed) == [3, 4]
    # Same stages, ranks and checkpointed state: bit-for-bit the same steps.
    assert [resumed[s] for s in (3, 4)] == [uninterrupted[s] for s in (3, 4)], (resumed, uninterrupted)
    assert of(runs["p2_resumed"], "eval")[-1]["loss"] == of(runs["p2"], "eval")[-1]["loss"]


def test_export_is_a_hugging_face_model(runs: dict[str, Any]) -> None:
    tmp: Path = runs["tmp"]
    out = tmp / "p2" / "output"
    (done,) = of(runs["p2"], "completed")
    assert done["output_dir"] == str(out) and (out / "COMPLETE").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
    assert_loads_and_generates(out)
    # Every weight under its Hugging Face name, and the same values the plain run exported.
    plain = load_file(str(tmp / "plain" / "output" / "model.safetensors"))
    piped: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        piped.update(load_file(str(out / shard)))
    assert sorted(piped) == sorted(plain)
    # Adam moves an element by about lr * sign(gradient) whatever the gradient's size, so an element whose
    # gradient is within float32 summation noise of zero may step the other way in one run: such elements
    # may differ by up to 2 * lr per step. They are rare; a weight under the wrong name, or not trained,
    # differs in nearly every element (by the initial weights' spread, ~0.02, or by the updates, ~lr).
    lr = runs["lr"]
    for name, tensor in plain.items():
        close = torch.isclose(piped[name], tensor, rtol=1e-4, atol=1e-6)
        assert close.float().mean().item() >= 0.999, (name, close.float().mean().item())
        assert (piped[name] - tensor).abs().max().item() <= 2 * lr * STEPS, name


# --- refused at submit --------------------------------------------------------------------------------------

def _spec(**resources: Any) -> dict[str, Any]:
    return {"model": "org/model", "data": {"train": "train.txt"},
            "hyperparameters": {"global_batch_size": 8, "micro_batch_size": 2},
            "resources": {"num_gpus": 4, "pipeline_stages": 2, **resources}}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_refused_with_stages(stage: int) -> None:
    from contract.spec import JobSpec

    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({**_spec(), "deepspeed": {"zero_stage": stage}})
    (err,) = info.value.errors()
    assert err["loc"] == ("resources", "pipeline_stages")
    assert f"needs deepspeed.zero_stage 0 or 1 (got {stage})" in err["msg"]


def test_raw_config_zero_stage_refused_with_stages() -> None:
    from contract.deepspeed import resolve
    from contract.problems import SpecError
    from contract.spec import JobSpec

    with pytest.raises(SpecError) as info:
        resolve(JobSpec.model_validate({**_spec(), "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}))
    assert [e.field for e in info.value.errors] == ["deepspeed.config.zero_optimization.stage"]
    assert "pipeline_stages 2 needs ZeRO stage 0 or 1" in info.value.errors[0].message


def test_stages_default_to_zero_1_and_split_the_batch_over_data_parallel_ranks() -> None:
    from contract.deepspeed import resolve
    from contract.spec import JobSpec

    resolved = resolve(JobSpec.model_validate(_spec()))
    assert resolved.spec.deepspeed.zero_stage == 1
    assert resolved.world_size == 4
    # 8 rows over 2 data-parallel ranks of micro 2: 2 micro batches per pipeline.
    assert (resolved.micro_batch_size, resolved.gradient_accumulation_steps) == (2, 2)
    assert resolved.deepspeed_config["train_batch_size"] == 8


def test_other_pipeline_conflicts_refused() -> None:
    from contract.spec import JobSpec

    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({**_spec(num_gpus=3, on_oom="adapt"), "lora": {}})
    messages = [e["msg"] for e in info.value.errors()]
    assert all(e["loc"] == ("resources", "pipeline_stages") for e in info.value.errors())
    assert any("must divide the world size" in m and "= 3" in m for m in messages), messages
    assert any("does not run with lora" in m for m in messages), messages
    assert any('on_oom "fail"' in m for m in messages), messages


def test_unsplittable_family_refused_at_submit(tmp_path: Path, four_layer_model: Path) -> None:
    from api.services.paths import check_locations
    from api.settings import ApiSettings
    from contract.spec import JobSpec

    models, data = tmp_path / "models", tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("text")
    gpt2 = models / "gpt2-like"
    gpt2.mkdir(parents=True)
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 4}))
    shutil.copytree(four_layer_model, models / "llama")
    settings = ApiSettings(model_root=str(models), data_root=str(data))

    errors = check_locations(JobSpec.model_validate({**_spec(), "model": "gpt2-like"}), settings)
    assert [e.field for e in errors] == ["resources.pipeline_stages"]
    assert "model_type is 'gpt2'" in errors[0].message and "llama" in errors[0].message
    # Stages beyond the decoder layers: each stage needs one.
    errors = check_locations(JobSpec.model_validate({**_spec(num_gpus=8, pipeline_stages=8), "model": "llama"}),
                             settings)
    assert [e.field for e in errors] == ["resources.pipeline_stages"]
    assert "need at least 8 decoder layers, and this model has 4" in errors[0].message
    assert check_locations(JobSpec.model_validate({**_spec(), "model": "llama"}), settings) == []


def test_trainer_refuses_an_unsplittable_model() -> None:
    """A hub model is checked when the trainer loads it, with the same reason."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.errors import ModelLoadError
    from trainer.pipeline import build

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ModelLoadError, match="model_type is 'gpt2'"):
        build(model, 2, "parameters")


# --- the stages compute the model's own forward ------------------------------------------------------------

def _family_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    config = {
        "llama": lambda: LlamaConfig(**shape, tie_word_embeddings=False),
        # Tied: the head is the embedding's weight (TiedLayerSpec), as in the small Qwen2 models.
        "qwen2": lambda: Qwen2Config(**shape, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**shape, head_dim=8, tie_word_embeddings=False),
        # A window shorter than the rows: the stages must build the sliding-window mask the model builds.
        "mistral": lambda: MistralConfig(**shape, sliding_window=6, tie_word_embeddings=False),
    }[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="module")
def single_process_group() -> Iterator[None]:
    """PipelineModule needs a process group; one gloo process is enough to build and run all stages in one."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from tests.trainer_support import free_port

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    with pytest.MonkeyPatch.context() as patch:
        # As the trainer does (trainer/recipe.py): on the CPU, DeepSpeed would otherwise compile its shared-memory
        # all-reduce op into this process's extensions folder, where none is prebuilt, for collectives that building
        # and running the stages never call.
        builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
        if builder is not None:
            patch.setitem(deepspeed.ops.__compatible_ops__, builder.NAME, False)
        deepspeed.init_distributed(dist_backend="gloo")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_stages_compute_the_models_forward(family: str, single_process_group: None) -> None:
    """Packed rows (position ids restarting per document): the pipeline layers' logits are the model's."""
    from trainer.pipeline import build

    model = _family_model(family)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    # Row 0: documents of 10 and 14 tokens; row 1: 5, 12 and 7.
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                       torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)])])
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        pipe = build(model, 1, "parameters")
        got = pipe((ids, pos))
    # 3 decoder layers + embedding, norm and head.
    assert len(pipe.forward_funcs) == 6
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # Packed documents stay apart: other tokens in row 0's first document leave its second one's logits alone.
    other = ids.clone()
    other[0, :10] = (other[0, :10] + 1) % 96
    with torch.no_grad():
        changed = pipe((other, pos))
    torch.testing.assert_close(changed[0, 10:], got[0, 10:], rtol=0, atol=1e-5)
    assert not torch.allclose(changed[0, :10], got[0, :10])


@pytest.mark.parametrize(("family", "builder"), [("llama", "create_causal_mask"),
                                                 ("mistral", "create_sliding_window_causal_mask")])
def test_stages_build_the_mask_once_per_micro_batch(family: str, builder: str, single_process_group: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' mask builders read a value back to the host (whether the rows pack several documents): on a
    GPU each call is a wait for the device. The model's forward builds its mask once; so must the stages, once per
    micro batch, not once per decoder layer. The real builder runs, counted."""
    import transformers.masking_utils as masking

    from trainer.pipeline import build

    real = getattr(masking, builder)
    calls: list[torch.Tensor] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["position_ids"])
        return real(*args, **kwargs)

    monkeypatch.setattr(masking, builder, counted)  # before build: each decoder layer picks its builder there
    model = _family_model(family)
    pipe = build(model, 1, "parameters")  # one stage: embedding, 3 decoder layers, norm, head
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    micro_batches = [torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1),
                     torch.arange(24).expand(2, -1)]
    with torch.no_grad():
        for pos in micro_batches:
            pipe((ids, pos))
    assert len(calls) == len(micro_batches), f"{len(calls)} mask builds for 2 micro batches of 3 decoder layers"
    assert all(c is p for c, p in zip(calls, micro_batches, strict=True))
