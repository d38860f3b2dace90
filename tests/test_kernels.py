"""The per-device kernel plan (trainer/kernels.py): the same loss and gradients as the stock model.

The CPU tests run the varlen attention path through its segment-by-segment sdpa form (the device form is
FlashAttention's CUDA kernel) and the compiled elementwise path; the CUDA tests, skipped here, run the real
kernels (FlashAttention varlen, Liger) on the GPU machine: `python -m pytest --noconftest tests/test_kernels.py`.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytest.register_assert_rewrite("tests.trainer_support")  # its asserts report values, like a test module's

from contract.deepspeed import resolve  # noqa: E402
from contract.spec import JobSpec  # noqa: E402
from tests.trainer_support import launch, make_job, of, write_run_spec  # noqa: E402
from trainer import kernels  # noqa: E402
from trainer.data import IGNORE, pack  # noqa: E402
from trainer.kernels import KernelPlan  # noqa: E402

# The `corpus` and `tiny_model` fixtures.
pytest_plugins = ["tests.trainer_support"]

CUDA = torch.cuda.is_available()
NEEDS_CUDA = "needs a CUDA GPU: FlashAttention's varlen kernel and Liger's Triton kernels run only there"


@pytest.fixture(autouse=True)
def _restore_rotary() -> Iterator[None]:
    # Patches of the modeling module's rotary function would outlive the test in this process.
    yield
    kernels.restore_rotary()
    torch._dynamo.reset()


def _config(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 97) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def _model(config: LlamaConfig, state: dict[str, torch.Tensor] | None, device: str,
           dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # A copy each: transformers keeps the config object, and a plan changes its attention implementation.
    model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    if state is not None:
        model.load_state_dict(state)
    return model.to(device=device, dtype=dtype)


def _packed_batch(vocab: int, rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Documents of random lengths packed as the trainer packs them, with a padded last row."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    total = 0
    while total < rows * seq - seq // 3:
        n = int(torch.randint(1, seq // 2, (1,), generator=g))
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        docs.append((ids, list(ids)))
        total += n
    blocks = pack(docs, seq, pad_id=0, packing=True)
    return blocks.batch(list(range(len(blocks))))


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str,
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = kernels.token_loss_sum(model, {k: v.clone() for k, v in batch.items()}, device)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _bf16_against_fp32() -> tuple[LlamaConfig, LlamaForCausalLM, LlamaForCausalLM, LlamaForCausalLM]:
    """A small Llama on the GPU three times with the same weights: fp32 (the reference), stock bf16, and bf16 for
    the plan under test."""
    config = _config(hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000)
    exact = _model(config, None, "cuda", torch.float32)
    state = exact.state_dict()
    return config, exact, _model(config, state, "cuda", torch.bfloat16), _model(config, state, "cuda", torch.bfloat16)


Figures = tuple[float, dict[str, torch.Tensor]]


def _assert_no_further_from_fp32(plan: Figures, stock: Figures, exact: Figures) -> None:
    """bf16's own error sets the bar: the plan may not be much further from fp32 than the stock bf16 model."""
    (loss, grads), (loss_stock, grads_stock), (loss_exact, grads_exact) = plan, stock, exact
    assert abs(loss - loss_exact) <= 2 * abs(loss_stock - loss_exact) + 1e-3 * abs(loss_exact)
    for name, g in grads.items():
        err, err_stock = _rel(g, grads_exact[name]), _rel(grads_stock[name], grads_exact[name])
        assert err <= 2 * err_stock + 1e-2, (name, err, err_stock)


def _job(**deepspeed: Any) -> Any:
    return resolve(JobSpec.model_validate({"model": {"name_or_path": "/m"}, "data": {"train": "/d"},
                                           "deepspeed": deepspeed, "resources": {"num_gpus": 1}}))


def test_segments_start_at_rows_and_documents_and_keep_padding_with_its_document() -> None:
    # Row 0: documents of 3 and 5 tokens; row 1: 2 tokens, then 6 whose positions continue (padding).
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
    offsets, longest = kernels.segments(pos, (2, 8))
    assert offsets.tolist() == [0, 3, 8, 10, 16] and offsets.dtype == torch.int32
    assert longest == 6
    # A document spilling into the next row restarts there, and so does its segment.
    offsets, _ = kernels.segments(torch.tensor([[5, 6, 7, 8], [9, 10, 0, 1]]), (2, 4))
    assert offsets.tolist() == [0, 4, 6, 8]
    offsets, longest = kernels.segments(None, (3, 4))
    assert offsets.tolist() == [0, 4, 8, 12] and longest == 4


def test_varlen_attention_gives_the_packed_mask_models_loss_and_gradients() -> None:
    """Against transformers' own sdpa path, which builds the block-diagonal mask from the same position ids.
    On the CPU the varlen function runs its segment-by-segment sdpa form."""
    config = _config()
    stock = _model(config, None, "cpu", torch.float32)
    fast = _model(config, stock.state_dict(), "cpu", torch.float32)
    kernels.apply(fast, KernelPlan(attention="varlen"))
    assert fast.config._attn_implementation == kernels.VARLEN_ATTENTION
    batch = _packed_batch(config.vocab_size, rows=3, seq=48, seed=1)
    assert int((batch["position_ids"] == 0).sum()) > 3, "the batch must pack several documents per row"
    loss_ref, grads_ref = _loss_and_grads(stock, batch, "cpu")
    loss, grads = _loss_and_grads(fast, batch, "cpu")
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert _rel(g, grads_ref[name]) < 1e-4, name


def test_compiled_elementwise_matches_the_stock_modules_without_graph_breaks() -> None:
    from torch._dynamo.utils import counters

    config = _config()
    stock = _model(config, None, "cpu", torch.float32)
    fast = _model(config, stock.state_dict(), "cpu", torch.float32)
    plan = KernelPlan(elementwise="compiled")
    kernels.apply(fast, plan)
    # aot_eager: dynamo's capture and AOT autograd as in training, without compiling C++ kernels on the CPU.
    (note,) = kernels.compile_for(fast, plan, backend="aot_eager")
    assert "7 modules" in note  # 2 layers × (2 norms + MLP) + the final norm
    counters.clear()
    for rows, seed in ((3, 2), (2, 3), (3, 4)):
        batch = _packed_batch(config.vocab_size, rows=rows, seq=32, seed=seed)
        loss_ref, grads_ref = _loss_and_grads(stock, batch, "cpu")
        loss, grads = _loss_and_grads(fast, batch, "cpu")
        assert loss == pytest.approx(loss_ref, rel=1e-5)
        for name, g in grads.items():
            assert _rel(g, grads_ref[name]) < 1e-5, name
    with torch.no_grad():
        kernels.token_loss_sum(fast, _packed_batch(config.vocab_size, rows=2, seq=32, seed=5), "cpu")
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The compiled functions ran (and were not skipped as eager fallbacks).
    assert counters["stats"]["unique_graphs"] >= 3


def test_a_cpu_node_gets_the_stock_model() -> None:
    model = _model(_config(), None, "cpu", torch.float32)
    plan = kernels.choose(_job(), on_gpu=False, model=model)
    assert plan == KernelPlan()
    assert kernels.apply(model, plan) == [] and kernels.compile_for(model, plan) == []
    # Asked for explicitly, torch.compile still applies on the CPU, to the elementwise functions only.
    plan = kernels.choose(_job(compile="on", zero_stage=3), on_gpu=False, model=model)
    assert plan.elementwise == "compiled" and not plan.compile_blocks and plan.attention == "stock"


def test_the_exported_config_names_no_private_attention(tmp_path: Path) -> None:
    model = _model(_config(), None, "cpu", torch.float32)
    kernels.apply(model, KernelPlan(attention="varlen"))
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert kernels.VARLEN_ATTENTION not in (tmp_path / "config.json").read_text()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation != kernels.VARLEN_ATTENTION
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


def test_launched_zero3_with_compile_trains_and_exports_within_the_recompile_limit(
        tmp_path: Path, tiny_model: Path, corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO-3 puts hooks on every submodule; compiling whole blocks traced them and hit the recompile limit,
    leaving parts eager. The compiled tensor functions stay outside them: torch's own log shows each
    compiled once per grad mode (training, then the final evaluation), and no limit reached."""
    log = tmp_path / "torch.log"
    monkeypatch.setenv("TORCH_LOGS", "recompiles,graph_code")
    monkeypatch.setenv("TORCH_LOGS_OUT", str(log))
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    job = make_job(tiny_model, train, deepspeed={"zero_stage": 3, "precision": "bf16", "compile": "on"},
                   hyperparameters={"max_steps": 6}, data={"validation_fraction": 0.1},
                   checkpointing={"every_steps": None})
    rc, events, tail = launch(write_run_spec(tmp_path, job))
    assert rc == 0, tail
    (started,) = of(events, "started")
    assert any("torch.compile on RMSNorm, rotary and SwiGLU" in a for a in started["adjustments"]), started
    assert (tmp_path / "job" / "output" / "COMPLETE").exists()
    text = log.read_text()
    assert text.count("TRACED GRAPH") >= 6, "the compiled functions' graphs must be in the log"
    recompiles = Counter(re.findall(r"\[(rank\d)\].*Recompiling function (\w+)", text))
    assert recompiles and max(recompiles.values()) <= 2, recompiles
    assert "recompile_limit" not in text + tail and "cache_size_limit" not in text + tail


@pytest.mark.skipif(not CUDA, reason=NEEDS_CUDA)
def test_flash_varlen_matches_the_segmentwise_reference_on_cuda() -> None:
    torch.manual_seed(0)
    lengths = [1, 7, 130, 64, 300, 2, 511]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = sum(lengths)
    q = torch.randn(n, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = kernels._flash_varlen(q, k, v, offsets.cuda(), max(lengths), 0.125)
    ref_inputs = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = kernels._segmentwise(*ref_inputs, offsets, 0.125)
    assert _rel(out.double().cpu(), ref) < 1e-2
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double().cpu())
    for t, r in zip((q, k, v), ref_inputs, strict=True):
        assert _rel(t.grad.double().cpu(), r.grad) < 2e-2


@pytest.mark.skipif(not CUDA, reason=NEEDS_CUDA)
@pytest.mark.parametrize("elementwise", ["liger", "compiled"])
def test_the_cuda_plan_matches_the_stock_model(elementwise: str) -> None:
    """bf16 on the GPU: the full plan (varlen attention, Liger or compiled elementwise, Liger's fused loss)
    against the stock sdpa model with its fp32 cross entropy, both against an fp32 stock reference."""
    if elementwise == "liger" and kernels.liger()[0] is None:
        pytest.skip(f"liger-kernel is not importable here: {kernels.liger()[1]}")
    config, exact, stock, fast = _bf16_against_fp32()
    plan = KernelPlan(attention="varlen", elementwise=elementwise, fused_loss=elementwise == "liger")
    kernels.apply(fast, plan)
    kernels.compile_for(fast, plan)
    batch = _packed_batch(config.vocab_size, rows=4, seq=256, seed=7)
    batch["labels"][0, :5] = IGNORE
    loss_exact, grads_exact = _loss_and_grads(exact, batch, "cuda")
    loss_stock, grads_stock = _loss_and_grads(stock, batch, "cuda")
    loss, grads = _loss_and_grads(fast, batch, "cuda")
    _assert_no_further_from_fp32((loss, grads), (loss_stock, grads_stock), (loss_exact, grads_exact))


def _preference_loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], weights: torch.Tensor,
                               ) -> tuple[float, dict[str, torch.Tensor]]:
    """A weighted sum of every packed document's log-probability, through the trainer's dpo call."""
    model.zero_grad(set_to_none=True)
    starts = batch["position_ids"] == 0
    # Each document its own sequence, numbered across the batch; padding continues its document, as packed.
    segment_ids = (starts.flatten().cumsum(0) - 1).view_as(starts)
    logp, count = kernels.label_logps(model, {k: v.clone() for k, v in batch.items()}, "cuda", segment_ids,
                                      int(starts.sum()))
    loss = (logp * weights.to(logp.device)).sum()
    loss.backward()
    assert int(count.sum()) > 0
    return float(loss.detach()), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
                                  if p.grad is not None}


@pytest.mark.skipif(not CUDA, reason=NEEDS_CUDA)
def test_the_dpo_head_on_scored_positions_matches_the_stock_logits_on_cuda() -> None:
    """bf16 on the GPU, a dpo job's plan (varlen attention, Liger's elementwise kernels, the LM head applied to the
    scored positions alone, chunked) against the stock model's full logits, both against fp32."""
    if kernels.liger()[0] is None:
        pytest.skip(f"liger-kernel is not importable here: {kernels.liger()[1]}")
    config, exact, stock, fast = _bf16_against_fp32()
    kernels.apply(fast, KernelPlan(attention="varlen", elementwise="liger"))
    batch = _packed_batch(config.vocab_size, rows=4, seq=256, seed=9)
    batch["labels"][:, :40] = IGNORE  # a prompt: positions the head must skip
    weights = torch.randn(int((batch["position_ids"] == 0).sum()), generator=torch.Generator().manual_seed(1))
    loss_exact, grads_exact = _preference_loss_and_grads(exact, batch, weights)
    loss_stock, grads_stock = _preference_loss_and_grads(stock, batch, weights)
    assert not getattr(stock, kernels.HEAD_ATTR, False)
    loss, grads = _preference_loss_and_grads(fast, batch, weights)
    assert getattr(fast, kernels.HEAD_ATTR, False)
    _assert_no_further_from_fp32((loss, grads), (loss_stock, grads_stock), (loss_exact, grads_exact))
