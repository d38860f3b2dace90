"""The batch arithmetic: the global batch, the micro batch and the accumulation steps of a job, from the job's
own fields and a raw config's, checked against each other and the number of data-parallel processes; an
`auto` micro batch is the largest that fits the deployment's token budget (`ResolveLimits`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from contract.deepspeed.merge import Merger, explicit
from contract.deepspeed.policy import DS
from contract.problems import FieldError
from contract.spec import MAX_BATCH, JobSpec


@dataclass
class ResolveLimits:
    """Inputs to `auto` choices that depend on the deployment, not on the job."""

    # Tokens one process may hold in one micro batch when no probe has measured the device.
    auto_micro_batch_tokens: int = 16384


def _divisors_desc(n: int) -> list[int]:
    """Every divisor of n, largest first, in O(sqrt n): divisors come in pairs d, n // d."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of n that is at most cap (at least 1): the micro batch a per-process batch allows."""
    return next(d for d in _divisors_desc(n) if d <= cap)


def resolve_batch(spec: JobSpec, world: int, raw_batch: dict[str, int | None], limits: ResolveLimits,
                   errors: list[FieldError], notes: list[str], merger: Merger | None = None) -> tuple[int, int, int]:
    hp = spec.hyperparameters
    if hp.examples_per_step is not None:
        given = [f for f, set_ in (("hyperparameters.global_batch_size", explicit(hp, "global_batch_size")),
                                   ("deepspeed.config.train_batch_size", raw_batch["train_batch_size"] is not None),
                                   ("deepspeed.config.gradient_accumulation_steps",
                                    raw_batch["gradient_accumulation_steps"] is not None)) if set_]
        for field in given:
            errors.append(FieldError(field, "cannot be given with hyperparameters.examples_per_step, from which the "
                                            "trainer chooses the rows per step; give one of them", "conflict"))
        if given:
            return hp.global_batch_size, 1, 1
        notes.append(f"examples_per_step {hp.examples_per_step}: the trainer chooses the global batch (rows per "
                     "step) from the data's token counts and says so in a `resolved` event; the batch below is "
                     "its starting point, the micro batch an upper bound")
    g_raw = raw_batch["train_batch_size"]
    m_raw = raw_batch["train_micro_batch_size_per_gpu"]
    a = raw_batch["gradient_accumulation_steps"]
    if merger is not None and not explicit(hp, "global_batch_size"):
        if g_raw is None and "train_batch_size" in merger.batch_auto:
            notes.append(f'train_batch_size is "auto": the job\'s global batch {hp.global_batch_size} applies.')
        elif g_raw is None and m_raw is None and not merger.batch_auto:
            notes.append(f"the config sets no batch size ({DS} needs train_batch_size or "
                         f"train_micro_batch_size_per_gpu): the job's global batch {hp.global_batch_size} applies.")
        elif g_raw is None and m_raw is not None and a is None and m_raw * world <= MAX_BATCH:
            # DeepSpeed derives the global batch from the micro batch alone, with no accumulation.
            a = 1

    if g_raw is not None and explicit(hp, "global_batch_size") and g_raw != hp.global_batch_size:
        errors.append(FieldError("deepspeed.config.train_batch_size",
                                 f"is {g_raw} but hyperparameters.global_batch_size is {hp.global_batch_size}; "
                                 "remove one or make them equal", "conflict"))
        return hp.global_batch_size, 1, 1
    m_hp = hp.micro_batch_size if isinstance(hp.micro_batch_size, int) else None
    if m_raw is not None and m_hp is not None and m_raw != m_hp:
        errors.append(FieldError("deepspeed.config.train_micro_batch_size_per_gpu",
                                 f"is {m_raw} but hyperparameters.micro_batch_size is {m_hp}; "
                                 "remove one or make them equal", "conflict"))
        return hp.global_batch_size, 1, 1
    m = m_raw if m_raw is not None else m_hp
    g_explicit = g_raw is not None or explicit(hp, "global_batch_size")
    g = g_raw if g_raw is not None else hp.global_batch_size

    if m is not None and a is not None:
        implied = m * a * world
        if implied > MAX_BATCH:
            # The product is stored as the job's global batch, which the trainer re-validates against the bound.
            errors.append(FieldError("deepspeed.config.gradient_accumulation_steps",
                                     f"train_micro_batch_size_per_gpu ({m}) × gradient_accumulation_steps ({a}) × "
                                     f"processes ({world}) = {implied}, above the largest global batch {MAX_BATCH}",
                                     "bound"))
            return min(g, MAX_BATCH), 1, 1
        if g_explicit and implied != g:
            field = "deepspeed.config.train_batch_size" if g_raw is not None else "hyperparameters.global_batch_size"
            fixes = [f"set train_batch_size to {implied}"]
            if g % (m * world) == 0:
                fixes.append(f"or gradient_accumulation_steps to {g // (m * world)}")
            errors.append(FieldError(
                field,
                f"train_batch_size ({g}) must equal train_micro_batch_size_per_gpu ({m}) × "
                f"gradient_accumulation_steps ({a}) × processes ({world}) = {implied}; " + " ".join(fixes), "batch"))
            return g, m, a
        if not g_explicit:
            notes.append(f"global batch {implied} = micro {m} × accumulation {a} × processes {world}")
        return implied, m, a

    if g % world:
        # Name the field the user wrote: the raw config's value wins over the job's when both are given.
        field = "deepspeed.config.train_batch_size" if g_raw is not None else "hyperparameters.global_batch_size"
        errors.append(FieldError(field,
                                 f"{g} is not divisible by the number of processes ({world}); "
                                 f"use a multiple of {world}", "batch"))
        return g, 1, 1
    per_rank = g // world
    if m is not None:
        if per_rank % m:
            ok = [d for d in _divisors_desc(per_rank)][:4]
            field = ("deepspeed.config.train_micro_batch_size_per_gpu" if m_raw is not None
                     else "hyperparameters.micro_batch_size")
            errors.append(FieldError(field,
                                     f"{m} does not divide the per-process batch {per_rank} "
                                     f"(global {g} / {world} processes); accepted: "
                                     f"{', '.join(map(str, ok))} or \"auto\"", "batch"))
            return g, m, 1
        return g, m, per_rank // m
    if a is not None:
        if per_rank % a:
            errors.append(FieldError("deepspeed.config.gradient_accumulation_steps",
                                     f"{a} does not divide the per-process batch {per_rank} (global {g} / {world})",
                                     "batch"))
            return g, 1, a
        m = per_rank // a
        notes.append(f"micro batch auto: {m} = per-process batch {per_rank} / accumulation {a}")
        return g, m, a
    cap = max(1, limits.auto_micro_batch_tokens // hp.seq_len)
    m = largest_divisor_at_most(per_rank, cap)
    if g_raw is not None and m != per_rank:
        notes.append(f"train_batch_size {g} with no micro batch: {DS} would run micro {per_rank} × accumulation 1 "
                     f"per process; the job runs micro {m} × accumulation {per_rank // m}, the same global batch.")
    notes.append(f"micro batch auto: {m}, the largest divisor of the per-process batch {per_rank} that keeps "
                 f"micro × seq_len ({m * hp.seq_len}) within the {limits.auto_micro_batch_tokens}-token budget; "
                 f"accumulation {per_rank // m} keeps the global batch {g}")
    return g, m, per_rank // m
