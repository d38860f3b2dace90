"""The preference method (`method.type: dpo`) in the recipe: its data, its reference, each step's loss and the
figures it reports. The loss itself is trainer/preference.py's (trl's, term for term); the rows are
trainer/pairs.py's, both sides of a pair in one forward.

A step's loss is that of its whole global batch, however it is split into micro batches and ranks: the preference
term is a sum over pairs divided by the global batch's pairs, the supervised term (`sft_weight`) a sum of the chosen
answers' negative log-likelihood divided by the global batch's chosen tokens, as trl computes both on one batch.

The reference. `adapters_off`: the same model with its LoRA adapters disabled, one forward without gradients beside
each policy forward, no second copy. `precomputed`: before the first step every pair's reference log-probabilities
are computed by the model as loaded (the reference, by definition), in one pass without gradients, and kept in every
checkpoint, so a resumed job compares against the same numbers. `none`: reference-free (a reference of 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from contract.codes import PREFERENCE_METRICS
from contract.spec import ResolvedJob, RunSpec
from trainer import kernels
from trainer.data import IGNORE, read_split
from trainer.errors import DataError
from trainer.pairs import PairBlocks, encode_pairs, pack_pairs
from trainer.preference import DpoLoss, dpo_loss

METRICS = PREFERENCE_METRICS
ADAPTERS_OFF, PRECOMPUTED, NONE = "adapters_off", "precomputed", "none"


def reference_mode(job: ResolvedJob) -> str:
    dpo = job.spec.method.dpo
    assert dpo is not None
    if dpo.reference == "auto":
        return ADAPTERS_OFF if job.spec.lora is not None else PRECOMPUTED
    return dpo.reference


def loss_config(job: ResolvedJob) -> DpoLoss:
    dpo = job.spec.method.dpo
    assert dpo is not None
    return DpoLoss(beta=dpo.beta, loss=dpo.loss, sft_weight=dpo.sft_weight,
                   length_normalization=dpo.length_normalization)


@dataclass
class PairData:
    train: PairBlocks
    val: PairBlocks | None
    stats: dict[str, Any]


def load(run_spec: RunSpec, tokenizer: Any, *, packing: bool) -> PairData:
    """The job's pairs as rows; a DataError where no pair fits `seq_len`."""
    spec, hp = run_spec.job.spec, run_spec.job.spec.hyperparameters
    train_docs, val_docs = read_split(spec.data, run_spec.paths, hp.seed)
    train, stats = encode_pairs(tokenizer, train_docs, hp.seq_len)
    if not train:
        raise DataError(f"{spec.data.train}: no pair leaves room for an answer within hyperparameters.seq_len "
                        f"{hp.seq_len} ({stats.as_dict()['dropped']}); raise seq_len or shorten the prompts")
    val = encode_pairs(tokenizer, val_docs, hp.seq_len)[0] if val_docs else []
    pad = tokenizer.pad_token_id
    return PairData(pack_pairs(train, hp.seq_len, pad, packing),
                    pack_pairs(val, hp.seq_len, pad, packing) if val else None, stats.as_dict())


def _logps(engine: Any, batch: dict[str, torch.Tensor], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities and scored tokens of every sequence of the batch, chosen ones first."""
    return kernels.label_logps(engine, batch, device, batch["sequence_ids"], int(batch["pair_ids"].shape[0]))


@contextmanager
def _adapters_off(engine: Any) -> Iterator[None]:
    with engine.module.disable_adapter():
        yield


class Reference:
    """The reference log-probabilities a batch's pairs are compared with."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.table: dict[str, torch.Tensor] = {}  # PRECOMPUTED: per data set, [pairs, 2] (chosen, rejected)

    def of(self, engine: Any, batch: dict[str, torch.Tensor], device: str,
           which: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.mode == NONE:
            return None, None
        k = int(batch["pair_ids"].shape[0]) // 2
        if self.mode == PRECOMPUTED:
            ref = self.table[which][batch["pair_ids"][:k]].to(device, non_blocking=True)
            return ref[:, 0], ref[:, 1]
        with torch.no_grad(), _adapters_off(engine):
            logp, _ = _logps(engine, batch, device)
        return logp[:k], logp[k:]

    def precompute(self, engine: Any, blocks: PairBlocks, which: str, micro: int, rank: int, world: int,
                   device: str) -> None:
        """Every pair's reference log-probabilities under the model as it is now, in one pass without gradients:
        each rank scores its share, and one all-reduce gives every rank the whole table. Every rank runs the same
        number of forwards (ZeRO-3 gathers parameters collectively), repeating unit 0 where its share runs out."""
        table = torch.zeros(blocks.pairs, 2, dtype=torch.float32, device=device)
        units = list(range(rank, len(blocks), world))
        n_micro = math.ceil(math.ceil(len(blocks) / world) / micro)
        was_training = engine.training
        engine.eval()
        with torch.no_grad():
            for i in range(n_micro):
                chunk = units[i * micro:(i + 1) * micro]
                batch = blocks.batch(chunk or [0])
                logp, _ = _logps(engine, batch, device)
                if chunk:
                    k = logp.shape[0] // 2
                    pairs = batch["pair_ids"][:k].to(device)
                    table[pairs, 0] = logp[:k]
                    table[pairs, 1] = logp[k:]
        if was_training:
            engine.train()
        if world > 1:
            dist.all_reduce(table)  # each pair was scored by exactly one rank; the others hold 0 for it
        self.table[which] = table.cpu()

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.table)

    def restore(self, saved: dict[str, torch.Tensor] | None) -> bool:
        if self.mode != PRECOMPUTED or not saved:
            return False
        self.table = dict(saved)
        return True


@dataclass
class StepSums:
    """What a step adds up over its micro batches, before the one all-reduce."""

    pref: torch.Tensor  # Σ of the preference term over pairs
    nll: torch.Tensor  # Σ of the chosen answers' negative log-likelihood
    metrics: torch.Tensor  # Σ over pairs of each of METRICS


def _zeros(device: str) -> StepSums:
    return StepSums(torch.zeros((), device=device), torch.zeros((), device=device),
                    torch.zeros(len(METRICS), device=device))


def _micro(engine: Any, batch: dict[str, torch.Tensor], reference: Reference, cfg: DpoLoss, device: str,
           which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(Σ preference term, Σ chosen NLL, Σ of each metric) over the batch's pairs, and their count."""
    ref_c, ref_r = reference.of(engine, batch, device, which)
    logp, tokens = _logps(engine, batch, device)
    k = logp.shape[0] // 2
    pc, pr = logp[:k], logp[k:]
    # The supervised term is added over the global batch below, so the loss here is the preference term alone.
    pref_mean, metrics = dpo_loss(pc, pr, ref_c, ref_r, tokens[:k], tokens[k:], None,
                                  DpoLoss(cfg.beta, cfg.loss, 0.0, cfg.length_normalization))
    sums = torch.stack([metrics[name] for name in METRICS]) * k
    return pref_mean * k, -pc.sum(), sums, k


def train_step(engine: Any, blocks: PairBlocks, micro_units: list[list[int]], reference: Reference, cfg: DpoLoss,
               device: str, *, pairs: int, chosen_tokens: int, accum: int, world: int,
               on_boundary: Any = None) -> StepSums:
    """Forward and backward over this rank's micro batches of the step, then the optimizer step. `pairs` and
    `chosen_tokens` are the global batch's; engine.backward divides by the accumulation steps and gradients are
    averaged over ranks, which `accum * world` undoes."""
    sums = _zeros(device)
    scale = accum * world
    for k, units in enumerate(micro_units):
        pref, nll, metrics, _ = _micro(engine, blocks.batch(units), reference, cfg, device, "train")
        loss = pref / max(1, pairs)
        if cfg.sft_weight:
            loss = loss + cfg.sft_weight * nll / max(1, chosen_tokens)
        engine.backward(loss * scale)
        sums.pref += pref.detach()
        sums.nll += nll.detach()
        sums.metrics += metrics
        if on_boundary is not None and k == len(micro_units) - 1:
            on_boundary()
        engine.step()
    return sums


def scored_tokens(blocks: PairBlocks) -> torch.Tensor:
    """Per sequence (in the blocks' order), its scored answer tokens."""
    # Row r's sequences are numbered from row_start[r] in segment order, so a token's sequence is its row's start
    # plus its segment.
    scored = (blocks.labels != IGNORE) & (blocks.segment_ids >= 0)
    sequence = (blocks.row_start[:-1].unsqueeze(1) + blocks.segment_ids)[scored]
    return torch.zeros(int(blocks.seq_row.numel()), dtype=torch.long).index_add_(
        0, sequence, torch.ones_like(sequence))


class Counts:
    """A global batch's pairs, chosen answer tokens and real tokens, read on the host by every rank."""

    def __init__(self, blocks: PairBlocks) -> None:
        self.blocks = blocks
        self.tokens = scored_tokens(blocks)

    def of(self, units: list[int]) -> tuple[int, int, int]:
        blocks = self.blocks
        rows = blocks.unit_rows(units)
        seqs = torch.cat([torch.arange(int(blocks.row_start[r]), int(blocks.row_start[r + 1])) for r in rows])
        chosen = seqs[blocks.seq_side[seqs] == 0]
        return int(chosen.numel()), int(self.tokens[chosen].sum()), int(blocks.real_tokens[rows].sum())


def figures(sums: StepSums, *, pairs: int, chosen_tokens: int, cfg: DpoLoss, device: str,
            extra: list[float]) -> tuple[dict[str, float], list[float]]:
    """The step's loss and metrics over the global batch (one all-reduce, carrying `extra` too)."""
    values = torch.cat([sums.pref.view(1), sums.nll.view(1), sums.metrics,
                        torch.tensor(extra, device=device, dtype=torch.float32)])
    if dist.is_initialized():
        dist.all_reduce(values)
    values = values.tolist()
    loss = values[0] / max(1, pairs)
    if cfg.sft_weight:
        loss += cfg.sft_weight * values[1] / max(1, chosen_tokens)
    out = {"loss": loss}
    out.update({name: v / max(1, pairs) for name, v in zip(METRICS, values[2:2 + len(METRICS)], strict=True)})
    return out, values[2 + len(METRICS):]


def evaluate(engine: Any, blocks: PairBlocks, reference: Reference, cfg: DpoLoss, micro: int, rank: int,
             world: int, device: str) -> dict[str, float]:
    """Loss and metrics over every held-out pair. Every rank runs the same number of forwards, repeating unit 0
    with weight 0 where its share runs out (ZeRO-3 gathers parameters collectively)."""
    engine.eval()
    units = list(range(rank, len(blocks), world))
    n_micro = math.ceil(math.ceil(len(blocks) / world) / micro)
    sums = _zeros(device)
    pairs = 0
    tokens = 0.0
    counts = Counts(blocks)
    with torch.no_grad():
        for i in range(n_micro):
            chunk = units[i * micro:(i + 1) * micro]
            batch = blocks.batch(chunk or [0])
            pref, nll, metrics, k = _micro(engine, batch, reference, cfg, device, "val")
            if chunk:
                sums.pref += pref
                sums.nll += nll
                sums.metrics += metrics
                pairs += k
                tokens += float(counts.of(chunk)[1])
    engine.train()
    totals = torch.tensor([float(pairs), tokens], device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    n_pairs, n_tokens = totals.tolist()
    out, _ = figures(sums, pairs=int(n_pairs), chosen_tokens=int(n_tokens), cfg=cfg, device=device, extra=[])
    return out
