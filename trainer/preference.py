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

LossKind = Literal["sigmoid", "ipo"]


class _LabelLogProb(torch.autograd.Function):
    """log softmax(logits)[target] for the rows with a target, without a second vocabulary-wide tensor.

    torch's log_softmax keeps its fp32 output (rows × vocabulary) for the backward pass; here only one logsumexp
    per row is kept, and the softmax is recomputed chunk by chunk in the backward pass. Rows without a target
    (prompt, padding) are never touched, as most rows of a preference batch are prompt."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        # The scored rows are listed on the host (one synchronisation), as trl's fused head does: they size the loop.
        scored = (targets != IGNORE).nonzero().flatten()
        out = torch.zeros(targets.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty(scored.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, scored.shape[0], chunk):
            idx = scored[start:start + chunk]
            rows = logits.index_select(0, idx).float()
            lse[start:start + chunk] = torch.logsumexp(rows, dim=-1)
            picked = rows.gather(1, targets[idx].unsqueeze(1)).squeeze(1)
            out[idx] = picked - lse[start:start + chunk]
        ctx.save_for_backward(logits, targets, scored, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, scored, lse = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        grad = grad.float()
        for start in range(0, scored.shape[0], ctx.chunk):
            idx = scored[start:start + ctx.chunk]
            g = grad[idx].unsqueeze(1)
            # d/dx (x[y] - logsumexp(x)) = onehot(y) - softmax(x)
            d = torch.exp(logits.index_select(0, idx).float() - lse[start:start + ctx.chunk].unsqueeze(1))
            d.mul_(-g).scatter_add_(1, targets[idx].unsqueeze(1), g)
            grad_logits.index_copy_(0, idx, d.to(grad_logits.dtype))
        return grad_logits, None, None


def _targets(labels: torch.Tensor, segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What `logits[:, t]` is scored against (IGNORE at the last position and wherever nothing is), and the
    sequence each target belongs to (packed only)."""
    rows = labels.shape[0]
    ignore_col = labels.new_full((rows, 1), IGNORE)
    targets = torch.cat([labels[:, 1:], ignore_col], dim=1)
    if segment_ids is None:
        return targets, None
    owner = torch.cat([segment_ids[:, 1:], segment_ids.new_full((rows, 1), -1)], dim=1)
    # A document's first token would be scored from the previous document's last state; padding is no sequence.
    foreign = (owner != segment_ids) | (owner < 0)
    return targets.masked_fill(foreign, IGNORE), owner.clamp(min=0)


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
    targets, owner = _targets(labels, segment_ids)
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    per_token = _LabelLogProb.apply(logits.reshape(rows * seq, vocab), targets.reshape(-1), chunk)
    scored = (targets != IGNORE).reshape(-1)
    if owner is None:
        return per_token.view(rows, seq).sum(dim=1), scored.view(rows, seq).sum(dim=1)
    assert segment_ids is not None
    if num_segments is None:
        num_segments = int(segment_ids.max()) + 1 if segment_ids.numel() else 0
    index = owner.reshape(-1)
    # Unscored tokens carry index 0 and add exactly 0 to it.
    logp = per_token.new_zeros(num_segments).index_add(0, index, per_token)
    count = torch.zeros(num_segments, dtype=torch.long, device=labels.device).index_add(0, index, scored.long())
    return logp, count


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
