"""The preference (DPO) loss: per-sequence log-probabilities of labelled tokens, and the pairwise loss over them.

The semantics are those of trl 1.x's `DPOTrainer` (`loss_type` "sigmoid", "sigmoid_norm", "ipo", and "sft" as
the weighted second loss that RPO adds), proven equal in loss, gradients and logged metrics by
tests/test_preference_loss.py. trl itself is a test dependency only; nothing here imports it.

Label alignment is the trainer's (trainer/data.py, trainer/kernels.py): `labels[:, t]` is the token at position t
(or IGNORE), and `logits[:, t]` predicts position t + 1, so token t is scored by `logits[:, t - 1]` and
`labels[:, 0]` is never scored. Packed rows keep documents apart by position ids that restart at 0 per document
(the model builds its block-diagonal attention from them); this module only needs to know which token belongs
to which sequence, from `segment_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from trainer.data import IGNORE

# Logits upcast to fp32 at once (64 MiB): 128 tokens' rows at a 128k vocabulary.
CHUNK_ELEMENTS = 1 << 24
# Logits the fused head computes at once (512 MiB in fp32): 1,024 positions at a 128k vocabulary, matrix products
# wide enough to keep a GPU busy.
HEAD_CHUNK_ELEMENTS = 1 << 27

LossKind = Literal["sigmoid", "ipo"]


class _LabelLogProb(torch.autograd.Function):
    """log softmax(logits)[target] at the listed rows, without a second vocabulary-wide tensor.

    torch's log_softmax keeps its fp32 output (rows × vocabulary) for the backward pass; here only one logsumexp
    per row is kept, and the softmax is recomputed chunk by chunk in the backward pass. Rows not listed (prompt,
    padding) are never touched, as most rows of a preference batch are prompt."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        out = torch.empty(index.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty(index.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, index.shape[0], chunk):
            end = start + chunk
            rows = logits.index_select(0, index[start:end]).float()
            lse[start:end] = torch.logsumexp(rows, dim=-1)
            out[start:end] = rows.gather(1, targets[start:end].unsqueeze(1)).squeeze(1) - lse[start:end]
        ctx.save_for_backward(logits, index, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, index, targets, lse = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        for start in range(0, index.shape[0], ctx.chunk):
            end = start + ctx.chunk
            idx = index[start:end]
            d = _softmax_grad(logits.index_select(0, idx).float(), lse[start:end], targets[start:end],
                              grad[start:end].float())
            grad_logits.index_copy_(0, idx, d.to(grad_logits.dtype))
        return grad_logits, None, None, None


def _softmax_grad(rows: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g · d/dx (x[y] - logsumexp(x)) = g · (onehot(y) - softmax(x)), in place of `rows` (fp32)."""
    g = g.unsqueeze(1)
    return rows.sub_(lse.unsqueeze(1)).exp_().mul_(-g).scatter_add_(1, targets.unsqueeze(1), g)


class _HeadLabelLogProb(torch.autograd.Function):
    """log softmax(hidden @ weightᵀ + bias)[target] for hidden states of scored positions only: the LM head and the
    log-softmax in one, chunk by chunk, so at most one chunk's logits exist, in the forward pass and again (they
    are recomputed) in the backward pass. The head's matrix products run for the scored positions alone, where
    the stock head runs them for every position of the batch, prompt and padding included."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            rows = F.linear(hidden[start:end], weight, bias).float()
            lse[start:end] = torch.logsumexp(rows, dim=-1)
            out[start:end] = rows.gather(1, targets[start:end].unsqueeze(1)).squeeze(1) - lse[start:end]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 sums of the head's gradient across chunks, as the supervised fused loss keeps them.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            h = hidden[start:end]
            d = _softmax_grad(F.linear(h, weight, bias).float(), lse[start:end], targets[start:end],
                              grad[start:end].float())
            if grad_hidden is not None:
                grad_hidden[start:end] = d.to(weight.dtype) @ weight
            if grad_weight is not None:
                # Each chunk's product in the weight's dtype, as the stock head's backward computes it.
                grad_weight.add_(d.to(weight.dtype).t() @ h)
            if grad_bias is not None:
                grad_bias.add_(d.sum(0))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None)


@dataclass(frozen=True)
class Scored:
    """The positions a batch's log-probabilities are read at, worked out from its labels alone (on the host, so
    nothing waits on the device): `index` into the flattened (rows × T) positions, the token each predicts, the
    sequence each belongs to, and per sequence how many there are."""

    index: torch.Tensor
    targets: torch.Tensor
    owner: torch.Tensor
    counts: torch.Tensor

    def to(self, device: torch.device | str) -> Scored:
        return Scored(*(t.to(device, non_blocking=True) for t in (self.index, self.targets, self.owner,
                                                                  self.counts)))


def scored_positions(labels: torch.Tensor, segment_ids: torch.Tensor | None = None, *,
                     num_segments: int | None = None) -> Scored:
    """Which positions score which token of which sequence (the layouts of `sequence_logps`)."""
    rows = labels.shape[0]
    ignore_col = labels.new_full((rows, 1), IGNORE)
    targets = torch.cat([labels[:, 1:], ignore_col], dim=1)
    if segment_ids is None:
        owner = torch.arange(rows, device=labels.device).unsqueeze(1).expand_as(labels)
        num_segments = rows
    else:
        owner = torch.cat([segment_ids[:, 1:], segment_ids.new_full((rows, 1), -1)], dim=1)
        # A document's first token would be scored from the previous document's last state; padding is no sequence.
        targets = targets.masked_fill((owner != segment_ids) | (owner < 0), IGNORE)
        if num_segments is None:
            num_segments = int(segment_ids.max()) + 1 if segment_ids.numel() else 0
    flat = targets.reshape(-1)
    index = (flat != IGNORE).nonzero().flatten()
    owner = owner.reshape(-1)[index]
    counts = torch.zeros(num_segments, dtype=torch.long, device=labels.device).index_add(
        0, owner, torch.ones_like(owner))
    return Scored(index, flat[index], owner, counts)


def sum_by_sequence(per_token: torch.Tensor, scored: Scored) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the sum of the scored positions' log-probabilities, and how many there are."""
    logp = per_token.new_zeros(scored.counts.shape[0]).index_add(0, scored.owner, per_token)
    return logp, scored.counts


def head_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row of `hidden` (scored positions' last states) under the LM head (weight, bias),
    fp32, without the vocabulary-wide logits."""
    return _HeadLabelLogProb.apply(hidden, weight, bias, targets, max(1, HEAD_CHUNK_ELEMENTS // weight.shape[0]))


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor | None = None, *,
                   num_segments: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the sum of log p(label) over its labelled tokens (fp32), and how many tokens that is (int64).

    `logits` is (rows, T, V) in any float dtype and `labels` (rows, T), in the trainer's unshifted convention (see
    the module's docstring); labels equal to IGNORE (-100) are not scored.

    Unpacked (`segment_ids` None): one sequence per row, results of shape (rows,).
    Packed: `segment_ids` (rows, T) gives each token's sequence index, numbered across the whole batch from 0, -1
    on padding; a sequence lies within one row. Results have shape (num_segments,), indexed by segment id
    (`num_segments` defaults to max id + 1, which reads the ids on the host). A token is scored only when the
    token before it belongs to the same sequence, so no sequence is ever scored from another one's states.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"logits (rows, T, V) and labels (rows, T) expected, got {tuple(logits.shape)} "
                         f"and {tuple(labels.shape)}")
    if segment_ids is not None and segment_ids.shape != labels.shape:
        raise ValueError(f"segment_ids must have the labels' shape {tuple(labels.shape)}, "
                         f"got {tuple(segment_ids.shape)}")
    rows, seq, vocab = logits.shape
    scored = scored_positions(labels, segment_ids, num_segments=num_segments)
    per_token = _LabelLogProb.apply(logits.reshape(rows * seq, vocab), scored.index, scored.targets,
                                    max(1, CHUNK_ELEMENTS // vocab))
    return sum_by_sequence(per_token, scored)


@dataclass(frozen=True)
class DpoLoss:
    """How a preference pair is scored (trl 1.x's name for each choice in brackets).

    loss: "sigmoid" (DPO), or "ipo", which always compares per-token average log-ratios (trl divides by the
        completion's tokens for IPO), so `length_normalization` changes nothing for it.
    beta: the inverse temperature of DPO; for IPO the regularisation τ, the target margin being 1 / (2 τ).
    length_normalization: compare per-token average log-ratios instead of sums ("sigmoid_norm").
    sft_weight: weight of the chosen side's negative log-likelihood, averaged over its tokens ("sft" as a second
        loss type with this loss weight; RPO's alpha).
    Label smoothing is not offered: trl 1.x's sigmoid loss has none (its "robust" and "exo_pair" losses do).
    """

    beta: float = 0.1
    loss: LossKind = "sigmoid"
    sft_weight: float = 0.0
    length_normalization: bool = False

    def __post_init__(self) -> None:
        if self.loss not in ("sigmoid", "ipo"):
            raise ValueError(f"loss must be 'sigmoid' or 'ipo', got {self.loss!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if not self.sft_weight >= 0:
            raise ValueError(f"sft_weight must be 0 or more, got {self.sft_weight}")


def _per_token(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # An empty completion averages to 0 rather than a division by zero, as trl's clamp does.
    return values / tokens.clamp(min=1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
             ref_rejected: torch.Tensor | None, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
             chosen_nll: torch.Tensor | None, cfg: DpoLoss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a batch of pairs and trl's metrics for it.

    Every input is per pair, shape (pairs,): summed log-probabilities of the completion under the policy and the
    reference (`sequence_logps`), its scored token counts, and `chosen_nll`, the chosen side's summed negative
    log-likelihood (None: `-policy_chosen`, which it is whenever both come from the same labels). `ref_chosen`
    and `ref_rejected` both None make the loss reference-free (a reference log-probability of 0).

    loss = mean over pairs of the preference term + sft_weight · Σ chosen_nll / Σ chosen_tokens. The preference
    term is a mean over pairs, so micro batches of equal pair counts average to the global batch's loss (weight
    each by its pairs otherwise). The SFT term is a token mean over this call's chosen tokens, as trl computes it
    per micro batch on each process; it does not decompose over pairs.

    Metrics (detached fp32 scalars, means over the pairs, named as trl logs them): "loss", "rewards/chosen",
    "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected". As in trl, the
    rewards are beta · (policy - reference) of the summed log-probabilities and the logps are sums, whatever
    normalisation the loss uses.
    """
    if (ref_chosen is None) != (ref_rejected is None):
        raise ValueError("ref_chosen and ref_rejected must both be given or both be None (reference-free)")
    pc, pr = policy_chosen.float(), policy_rejected.float()
    chosen_ratio = pc if ref_chosen is None else pc - ref_chosen.float()
    rejected_ratio = pr if ref_rejected is None else pr - ref_rejected.float()
    if cfg.loss == "ipo" or cfg.length_normalization:
        delta = _per_token(chosen_ratio, chosen_tokens) - _per_token(rejected_ratio, rejected_tokens)
    else:
        delta = chosen_ratio - rejected_ratio
    if cfg.loss == "ipo":
        per_pair = (delta - 1 / (2 * cfg.beta)) ** 2
    else:
        per_pair = -F.logsigmoid(cfg.beta * delta)
    loss = per_pair.mean()
    if cfg.sft_weight:
        nll = -pc if chosen_nll is None else chosen_nll.float()
        loss = loss + cfg.sft_weight * nll.sum() / chosen_tokens.sum().clamp(min=1)

    with torch.no_grad():
        chosen_rewards = cfg.beta * chosen_ratio.detach()
        rejected_rewards = cfg.beta * rejected_ratio.detach()
        metrics = {
            "loss": loss.detach(),
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "logps/chosen": pc.detach().mean(),
            "logps/rejected": pr.detach().mean(),
        }
    return loss, metrics
