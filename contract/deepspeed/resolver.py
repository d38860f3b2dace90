"""Resolve a job: merge its raw DeepSpeed config, check the fields that depend on each other, settle the batch,
render the DeepSpeed JSON and check it as DeepSpeed's own parser would, or raise SpecError naming every bad
field."""

from __future__ import annotations

import copy

from contract.deepspeed import fields
from contract.deepspeed.batch import ResolveLimits, resolve_batch
from contract.deepspeed.merge import Merger
from contract.deepspeed.policy import AUTO, DS
from contract.deepspeed.render import render
from contract.problems import FieldError, SpecError
from contract.spec import JobSpec, ResolvedJob


def optimizer_problems(spec: JobSpec, merger: Merger | None) -> list[FieldError]:
    """Why the job's optimizer cannot run with its DeepSpeed settings (read after a raw config's merge)."""
    hp, ds = spec.hyperparameters, spec.deepspeed
    if hp.optimizer == "adamw":
        return []
    field, name = "hyperparameters.optimizer", f'"{hp.optimizer}"'
    errors: list[FieldError] = []
    if ds.precision != "bf16":
        errors.append(FieldError(field, f'{name} keeps the master weights in bf16, so it needs deepspeed.precision '
                                        f'"bf16" (got "{ds.precision}"); set precision to "bf16" or optimizer to '
                                        '"adamw"', "conflict"))
    if ds.zero_stage == 0:
        errors.append(FieldError(field, f"{name} needs ZeRO stage 1, 2 or 3 (got stage 0): only {DS}'s ZeRO "
                                        "optimizers keep master weights in bf16; set deepspeed.zero_stage to 1, 2 or 3 "
                                        'or optimizer to "adamw"', "conflict"))
    if ds.offload_optimizer != "none":
        errors.append(FieldError(field, f"{name} is the trainer's own optimizer, and {DS} steps offloaded optimizer "
                                        f'state only with its own CPU Adam (got offload_optimizer '
                                        f'"{ds.offload_optimizer}"); set deepspeed.offload_optimizer to "none" or '
                                        'optimizer to "adamw" (accepted with offload: "adamw")', "conflict"))
    if merger is not None and merger.out.optimizer_type is not None:
        errors.append(FieldError("deepspeed.config.optimizer",
                                 f"sets {DS}'s optimizer, but hyperparameters.optimizer is {name}, which the trainer "
                                 'builds itself; remove the optimizer block or set optimizer to "adamw"', "conflict"))
    return errors


def _pipeline_problems(spec: JobSpec, merger: Merger | None) -> list[FieldError]:
    """A raw config may set the ZeRO stage after the job's own fields were checked (contract/stages.py)."""
    stage = spec.deepspeed.zero_stage
    if merger is None or stage < 2:
        return []
    return [FieldError("deepspeed.config.zero_optimization.stage",
                       f"is {stage}, but resources.pipeline_stages {spec.resources.pipeline_stages} needs ZeRO stage "
                       "0 or 1: DeepSpeed's pipeline engine does not partition gradients or parameters; set the "
                       "stage to 1 or pipeline_stages to 1", "conflict")]


def resolve(spec: JobSpec, *, limits: ResolveLimits | None = None) -> ResolvedJob:
    """Make every choice a job leaves open, or raise SpecError naming each bad field."""
    limits = limits or ResolveLimits()
    spec = spec.model_copy(deep=True)
    errors: list[FieldError] = []
    notes: list[str] = []
    merger: Merger | None = None
    raw_batch: dict[str, int | None] = {"train_batch_size": None, "train_micro_batch_size_per_gpu": None,
                                        "gradient_accumulation_steps": None}
    if spec.deepspeed.config is not None:
        merger = Merger(spec, copy.deepcopy(spec.deepspeed.config))
        merger.run()
        errors += merger.errors
        notes += merger.notes
        raw_batch = merger.batch
        # Re-check the cross-field rules on the merged values (the raw config may set stage and offload).
        ds = spec.deepspeed
        if ds.offload_param != "none" and ds.zero_stage != 3:
            errors.append(FieldError(
                "deepspeed.config.zero_optimization.offload_param",
                f"needs ZeRO stage 3 (got stage {ds.zero_stage}): only stage 3 partitions parameters; "
                "set zero_optimization.stage to 3 or remove offload_param", "conflict"))
        zero_errors = any(e.field.startswith("deepspeed.config.zero_optimization") for e in errors)
        # Only for an otherwise valid block: a misspelt key there is the error worth reading first.
        if ds.offload_optimizer != "none" and ds.zero_stage == 0 and not zero_errors:
            errors.append(FieldError(
                "deepspeed.config.zero_optimization.offload_optimizer",
                "needs ZeRO stage 1, 2 or 3 (got stage 0, DeepSpeed's default): at stage 0 DeepSpeed ignores it; "
                "set zero_optimization.stage or remove offload_optimizer", "conflict"))
        ratio = merger.out.offload_extra["offload_optimizer"].get("ratio", 1.0)
        field = "deepspeed.config.zero_optimization.offload_optimizer.ratio"
        if ratio < 1.0 and (ds.zero_stage != 3 or ds.offload_optimizer != "cpu"):
            errors.append(FieldError(field, f"below 1 splits the optimizer between GPU and CPU, which only ZeRO "
                                            f"stage 3 with offload_optimizer \"cpu\" does (got stage "
                                            f"{ds.zero_stage}, offload_optimizer {ds.offload_optimizer!r}); "
                                            "set zero_optimization.stage to 3 or remove ratio", "conflict"))
        for key in ("offload_optimizer", "offload_param"):
            if getattr(ds, key) == "nvme" and not ds.nvme_path:
                errors.append(FieldError(f"deepspeed.config.zero_optimization.{key}.nvme_path",
                                         'offload to "nvme" needs nvme_path, a directory under the NVMe root'))
    errors += optimizer_problems(spec, merger)
    world = spec.resources.num_gpus * spec.resources.num_nodes  # every node runs num_gpus ranks
    stages = spec.resources.pipeline_stages
    if stages > 1:
        # The batch is split over the data-parallel ranks only; each pipeline runs its micro batches in turn.
        errors += _pipeline_problems(spec, merger)
        notes.append(f"pipeline_stages {stages}: data-parallel degree {max(1, world // stages)} = {world} processes "
                     f"/ {stages} stages; the batch fields below count data-parallel ranks as processes")
    dp = world // stages if world % stages == 0 else world
    g, m, a = resolve_batch(spec, dp, raw_batch, limits, errors, notes, merger)
    hp = spec.hyperparameters
    if hp.max_steps is not None and hp.warmup_steps > hp.max_steps:
        errors.append(FieldError("hyperparameters.warmup_steps",
                                 f"{hp.warmup_steps} is more than max_steps ({hp.max_steps})", "bound"))
    ck = spec.checkpointing
    if ck.every_steps is not None and hp.max_steps is not None and ck.every_steps > hp.max_steps:
        notes.append(f"checkpointing.every_steps {ck.every_steps} > max_steps {hp.max_steps}: only the final export")
    if errors:
        raise SpecError(errors)
    auto = hp.micro_batch_size == AUTO and raw_batch["train_micro_batch_size_per_gpu"] is None \
        and raw_batch["gradient_accumulation_steps"] is None
    hp.micro_batch_size = m
    hp.global_batch_size = g
    cfg = render(spec, g, m, a, merger)
    # The last word before a 201: what DeepSpeed's own parser checks, at this job's world size.
    problems = fields.check_rendered(cfg, dp)
    if problems:
        raise SpecError([FieldError("deepspeed.config", f"{DS} would refuse the rendered config: {p}", "value")
                         for p in problems])
    return ResolvedJob(spec=spec, world_size=world, micro_batch_size=m, gradient_accumulation_steps=a,
                       deepspeed_config=cfg, notes=notes, micro_batch_auto=auto)
