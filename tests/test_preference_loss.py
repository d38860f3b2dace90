"""The preference loss (trainer/preference.py) against trl's DPOTrainer: loss, gradients and logged metrics.

trl's side is its own `DPOTrainer._compute_loss` on a batch its own collator built, with the fused LM head it puts
on the model: trl's computation end to end, only the optimizer step left out. Ours runs the model's plain logits
through `sequence_logps` and `dpo_loss`, on trl's padded rows (unpacked) and on rows packed as the trainer packs
documents (position ids restarting per document, no attention mask, so the model keeps documents apart).
Everything is fp32 on the CPU, on a Llama of 13k weights built from a config (its vocabulary is most of them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

from trainer import kernels
from trainer.data import IGNORE
from trainer.preference import DpoLoss, dpo_loss, sequence_logps
from trainer.tiny import build_tokenizer

TOL = 1e-5
PAIRS = 5
ROW_LEN = 24  # packed rows: each holds two to four of the sequences below


@dataclass(frozen=True)
class Variant:
    ours: DpoLoss
    trl: dict[str, Any]  # DPOConfig arguments that select the same loss
    reference_free: bool = False


VARIANTS = {
    "sigmoid": Variant(DpoLoss(beta=0.5), {"loss_type": ["sigmoid"]}),
    "ipo": Variant(DpoLoss(beta=0.5, loss="ipo"), {"loss_type": ["ipo"]}),
    # IPO always compares per-token averages, as trl's does: asking for them again changes nothing.
    "ipo+length_normalization": Variant(DpoLoss(beta=0.5, loss="ipo", length_normalization=True),
                                        {"loss_type": ["ipo"]}),
    # trl 1.x spells RPO (the former rpo_alpha) as a second, weighted loss type.
    "sigmoid+sft": Variant(DpoLoss(beta=0.5, sft_weight=0.7),
                           {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.7]}),
    "sigmoid+length_normalization": Variant(DpoLoss(beta=0.5, length_normalization=True),
                                            {"loss_type": ["sigmoid_norm"]}),
    # trl 1.x has no reference-free switch: its precomputed-reference path fed log-probabilities of 0 is one.
    "reference_free": Variant(DpoLoss(beta=0.5), {"loss_type": ["sigmoid"]}, reference_free=True),
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    # DPOTrainer wants one to tokenize its dataset; the batches here are token ids drawn at random.
    return build_tokenizer("a preference pair: a prompt, a chosen and a rejected answer. " * 4, 260, 64)


def _model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                         # Wide weights make peaked predictions, so log-ratios, rewards and losses are far from their
                         # values at a uniform distribution and every term of the loss weighs in the gradients.
                         initializer_range=0.3)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _perturbed(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A reference that differs from the policy, so that every log-ratio and reward is far from 0."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std().clamp_min(0.05))
    return ref


def _pairs(vocab: int, seed: int = 3) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(1, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    # Prompts of at least one token: trl counts a completion that starts the row as one token longer than it
    # scores (its first token has no predictor), a case the trainer's data never makes.
    return [{"prompt_ids": ids(1, 6), "chosen_ids": ids(1, 7), "rejected_ids": ids(1, 7)} for _ in range(PAIRS)]


def _sequences(pairs: list[dict[str, list[int]]]) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of every chosen sequence, then every rejected one: segment k is sequence k."""
    out = []
    for side in ("chosen_ids", "rejected_ids"):
        for p in pairs:
            out.append((p["prompt_ids"] + p[side], [IGNORE] * len(p["prompt_ids"]) + p[side]))
    return out


def _unpacked(pairs: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    seqs = _sequences(pairs)
    width = max(len(ids) for ids, _ in seqs)
    return {
        "input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in seqs]),
        "labels": torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in seqs]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in seqs]),
    }


def _packed(pairs: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Sequences packed whole into rows as trainer/data.pack lays documents out: positions restart at 0 per
    sequence, padding continues the last one's positions, no attention mask. Chosen and rejected of a pair are
    interleaved so that rows mix both sides and several pairs."""
    seqs = _sequences(pairs)
    order = [k for i in range(PAIRS) for k in (i, PAIRS + i)]
    rows: list[tuple[list[int], list[int], list[int], list[int]]] = []
    cur: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])

    def flush() -> None:
        ids, labels, pos, seg = cur
        pad = ROW_LEN - len(ids)
        rows.append((ids + [pad_id] * pad, labels + [IGNORE] * pad,
                     pos + list(range(pos[-1] + 1, pos[-1] + 1 + pad)), seg + [-1] * pad))

    for k in order:
        ids, labels = seqs[k]
        assert len(ids) <= ROW_LEN
        if len(cur[0]) + len(ids) > ROW_LEN:
            flush()
            cur = ([], [], [], [])
        cur[0].extend(ids)
        cur[1].extend(labels)
        cur[2].extend(range(len(ids)))
        cur[3].extend([k] * len(ids))
    flush()
    names = ("input_ids", "labels", "position_ids", "segment_ids")
    batch = {name: torch.tensor([row[i] for row in rows]) for i, name in enumerate(names)}
    assert len(rows) < len(seqs) and int((batch["position_ids"] == 0).sum()) == len(seqs)
    return batch


def _layout_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's own call (trainer/dpo.py's): the LM head applied to the scored positions alone, through the
    attention the model's kernel plan chose (the stock plan unless a test applied another)."""
    if not getattr(kernels._causal_lm(model), kernels.HEAD_ATTR, False):
        kernels.apply(model, getattr(model, kernels.PLAN_ATTR, kernels.STOCK))
    assert getattr(kernels._causal_lm(model), kernels.HEAD_ATTR, False), "the head was not routed"
    packed = "segment_ids" in batch
    return kernels.label_logps(model, batch, "cpu", batch["segment_ids"] if packed else None,
                               2 * PAIRS if packed else None)


def _ours(model: torch.nn.Module, ref: torch.nn.Module | None, batch: dict[str, torch.Tensor],
          variant: Variant) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logp, tokens = _layout_logps(model, batch)
    ref_chosen = ref_rejected = None
    if not variant.reference_free:
        with torch.no_grad():
            if isinstance(model, PeftModel):
                # LoRA's reference is the base model: the same weights with the adapters off.
                with model.disable_adapter():
                    ref_logp, _ = _layout_logps(model, batch)
            else:
                assert ref is not None
                ref_logp, _ = _layout_logps(ref, batch)
        ref_chosen, ref_rejected = ref_logp.chunk(2)
    policy_chosen, policy_rejected = logp.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens,
                    -policy_chosen, variant.ours)


def _trl(tmp_path: Path, tokenizer: PreTrainedTokenizerFast, variant: Variant, lora: bool,
         ) -> tuple[DPOTrainer, torch.nn.Module | None]:
    """trl's trainer over our model: with LoRA trl makes the PEFT model itself and takes the adapters off for its
    reference, as ours does; without, both get the same perturbed reference."""
    base = _model(tokenizer)
    args = DPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", beta=variant.ours.beta,
                     max_length=None, **variant.trl)
    dataset = Dataset.from_dict({"prompt": ["a prompt"], "chosen": [" chosen"], "rejected": [" rejected"]})
    if lora:
        # Adapters initialised at random: with B = 0 the policy would be its own reference.
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"],
                                 init_lora_weights=False, task_type="CAUSAL_LM")
        trainer = DPOTrainer(model=base, args=args, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)
        ref = None
    else:
        ref = _perturbed(base)
        trainer = DPOTrainer(model=base, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)
    assert trainer.loss_types == variant.trl["loss_type"]
    if variant.reference_free:
        trainer.precompute_ref_logps = True
    trainer.model.train()
    return trainer, ref


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for name, g in got.items():
        # Relative to the tensor's own scale: a tensor of small gradients is held to the same 1e-5.
        scale = float(want[name].abs().max())
        torch.testing.assert_close(g, want[name], rtol=TOL, atol=TOL * scale, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_gradients_and_metrics_equal_trls_packed_and_unpacked(tmp_path: Path, tokenizer: PreTrainedTokenizerFast,
                                                                   name: str, lora: bool) -> None:
    variant = VARIANTS[name]
    trainer, ref = _trl(tmp_path, tokenizer, variant, lora)
    model = trainer.model
    pairs = _pairs(len(tokenizer))
    inputs = trainer.data_collator(pairs)
    if variant.reference_free:
        inputs["ref_chosen_logps"] = torch.zeros(PAIRS)
        inputs["ref_rejected_logps"] = torch.zeros(PAIRS)
    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, inputs, return_outputs=False)
    trl_loss.backward()
    trl_grads = _grads(model)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if lora:
        assert all("lora_" in n for n in trl_grads), "with LoRA only the adapters learn"

    pad = tokenizer.pad_token_id
    for batch in (_unpacked(pairs, pad), _packed(pairs, pad)):
        loss, metrics = _ours(model, ref, batch, variant)
        loss.backward()
        torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=TOL, atol=TOL)
        _assert_grads_equal(_grads(model), trl_grads)
        assert float(metrics["loss"]) == pytest.approx(float(trl_loss.detach()), rel=TOL, abs=TOL)
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                    "logps/rejected"):
            assert float(metrics[key]) == pytest.approx(trl_metrics[key], rel=TOL, abs=TOL), key
        assert not any(m.requires_grad for m in metrics.values())
    # Not a degenerate batch: the policy and its reference (or 0) disagree well beyond the tolerance.
    assert abs(trl_metrics["rewards/margins"]) > 0.5


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_and_unpacked_layouts_give_the_same_gradients(tokenizer: PreTrainedTokenizerFast, lora: bool) -> None:
    from peft import get_peft_model

    model: torch.nn.Module = _model(tokenizer)
    ref = _perturbed(model)
    if lora:
        torch.manual_seed(2)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False, lora_dropout=0.0))
    variant = Variant(DpoLoss(beta=0.5, sft_weight=0.3), {})
    pairs = _pairs(len(tokenizer), seed=11)
    pad = tokenizer.pad_token_id
    results = []
    for batch in (_unpacked(pairs, pad), _packed(pairs, pad)):
        loss, _ = _ours(model, ref, batch, variant)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (loss_u, grads_u), (loss_p, grads_p) = results
    torch.testing.assert_close(loss_p, loss_u, rtol=TOL, atol=TOL)
    _assert_grads_equal(grads_p, grads_u)


def test_packed_rows_through_the_trainers_varlen_attention_give_the_unpacked_gradients(
        tokenizer: PreTrainedTokenizerFast) -> None:
    """The attention a GPU full fine-tune runs (FlashAttention over each document; on the CPU its
    segment-by-segment sdpa form) reads the same packed layout."""
    model = _model(tokenizer)
    ref = _perturbed(model)
    variant = Variant(DpoLoss(beta=0.5, sft_weight=0.3), {})
    pairs = _pairs(len(tokenizer), seed=5)
    pad = tokenizer.pad_token_id
    loss_u, _ = _ours(model, ref, _unpacked(pairs, pad), variant)
    loss_u.backward()
    grads_u = _grads(model)
    for m in (model, ref):
        kernels.apply(m, kernels.KernelPlan(attention="varlen"))
    loss_p, _ = _ours(model, ref, _packed(pairs, pad), variant)
    loss_p.backward()
    torch.testing.assert_close(loss_p.detach(), loss_u.detach(), rtol=TOL, atol=TOL)
    _assert_grads_equal(_grads(model), grads_u)


def _naive(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    targets = labels[:, 1:]
    mask = targets != IGNORE
    picked = logp.gather(2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(1), mask.sum(1)


def test_sequence_logps_scores_next_tokens_and_never_across_segments() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, :2] = IGNORE
    labels[1, 5:] = IGNORE
    got, n = sequence_logps(logits, labels)
    want, n_want = _naive(logits, labels)
    torch.testing.assert_close(got, want)
    assert n.tolist() == n_want.tolist() == [5, 4]
    (g_got,) = torch.autograd.grad(got.sum() * 3, logits)
    (g_want,) = torch.autograd.grad(want.sum() * 3, logits)
    torch.testing.assert_close(g_got, g_want)

    # One row of three segments and padding: the first token of segment 1 has a label, but it would be predicted
    # from segment 0's last state, so it is not scored; neither is anything after the padding starts.
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, -1]])
    lab = torch.tensor([[IGNORE, 3, 4, 5, 6, 7, 8, 9]])
    row_logits = torch.randn(1, 8, 11, generator=g)
    logp, count = sequence_logps(row_logits, lab, seg)
    assert count.tolist() == [2, 1, 1]
    lsm = torch.log_softmax(row_logits[0], dim=-1)
    torch.testing.assert_close(logp, torch.stack([lsm[0, 3] + lsm[1, 4], lsm[3, 6], lsm[5, 8]]))


def test_low_precision_logits_keep_no_vocabulary_wide_fp32_copy_for_backward() -> None:
    """What autograd saves beyond the logits themselves is one float per scored token: bf16 logits are never
    upcast whole, where log_softmax would keep a (tokens × vocabulary) fp32 output."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, 500, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 500, (3, 40), generator=g)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp, _ = sequence_logps(logits * 1, labels)
    vocab_wide = [t for t in saved if t.numel() >= 500 * 40]
    assert all(t.dtype == torch.bfloat16 for t in vocab_wide), [(t.dtype, t.shape) for t in vocab_wide]
    logp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    want, _ = _naive(logits.detach().float(), labels)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-4)


def test_fused_head_equals_the_head_then_log_softmax_and_keeps_no_logits() -> None:
    """`head_logps` (the LM head on scored positions, chunked, logits recomputed in the backward pass) against the
    plain head and log_softmax: values and the gradients of the states, the weight and the bias, over chunks that
    do not divide the rows; at bf16 nothing vocabulary-wide is saved for the backward pass."""
    from trainer import preference

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    bias = torch.randn(300, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    want = torch.log_softmax(hidden @ weight.t() + bias, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight, bias))
    got = preference._HeadLabelLogProb.apply(hidden, weight, bias, targets, 8)  # 5 chunks, the last of 5 rows
    torch.testing.assert_close(got, want)
    for got_grad, want_grad in zip(torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias)), want_grads,
                                   strict=True):
        torch.testing.assert_close(got_grad, want_grad)

    low = hidden.detach().to(torch.bfloat16).requires_grad_()
    low_weight = weight.detach().to(torch.bfloat16).requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp = preference.head_logps(low, low_weight, None, targets)
    assert not [t for t in saved if t.numel() >= 37 * 300], [(t.dtype, t.shape) for t in saved]
    logp.sum().backward()
    assert low.grad is not None and low_weight.grad is not None and low_weight.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(low.detach().float() @ low_weight.detach().float().t(), dim=-1)
    torch.testing.assert_close(logp, ref.gather(1, targets.unsqueeze(1)).squeeze(1), rtol=1e-2, atol=5e-2)
