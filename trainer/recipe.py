"""The training recipe: setup -> resume -> train (eval, checkpoint) -> export -> cleanup."""

from __future__ import annotations

import gc
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from contract.codes import EventKind, Method
from contract.spec import ResolvedJob, RunSpec
from trainer import (
    batching,
    checkpoint,
    dpo,
    dsconfig,
    export,
    flops,
    kernels,
    memory,
    oom,
    optim,
    pipeline,
    startup,
    swap,
    tuning,
    uploader,
)
from trainer.checkpoint import StopFlag, TrainerState
from trainer.data import IGNORE, BatchOrder, Blocks, blocks_of, load_examples
from trainer.errors import Interrupted
from trainer.events import emit_rank0
from trainer.fence import Fence
from trainer.modeling import load_model, load_tokenizer, model_location
from trainer.schedule import scheduler_factory
from trainer.threads import loop_threads, pool_of

# Dense bf16 peak FLOP/s per device, for MFU (trainer/flops.py says what each figure counts); an unknown device
# reports the figures null rather than a guess.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _on_gpu() -> bool:
    return get_accelerator().device_name() == "cuda"


# Summed next-token cross entropy of a host batch, through the kernels this process chose (trainer.kernels).
token_loss_sum = kernels.token_loss_sum


def _all_reduce_sum(values: list[float], device: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64 if device == "cpu" else torch.float32, device=device)
    dist.all_reduce(t)
    return t.tolist()


def evaluate(engine: Any, blocks: Blocks, micro: int, rank: int, world: int,
             device: str) -> tuple[float, float]:
    """Token-weighted loss over all validation rows. Every rank runs the same number of forwards (ZeRO-3
    gathers parameters collectively), padding its share with weight-0 repeats of row 0."""
    engine.eval()
    rows = list(range(rank, len(blocks), world))
    per_rank = math.ceil(len(blocks) / world)
    n_micro = math.ceil(per_rank / micro)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(n_micro):
            chunk = rows[i * micro:(i + 1) * micro]
            weight = 1.0 if chunk else 0.0
            batch = blocks.batch(chunk or [0])
            n = float((batch["labels"][:, 1:] != IGNORE).sum())
            total += weight * float(token_loss_sum(engine, batch, device))
            count += weight * n
    engine.train()
    total, count = _all_reduce_sum([total, count], device)
    loss = total / max(count, 1.0)
    return loss, math.exp(min(loss, 50.0))


def _peak_flops() -> float | None:
    if not _on_gpu():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


@dataclass
class Progress:
    """When to emit `progress`: every step for the first 10, then about once a second, and the last."""

    last_emit: float = 0.0
    window_tokens: float = 0.0
    window_pairs: float = 0.0  # Σ d² over the window's documents, for mfu_attended (trainer/flops.py)
    window_start: float = 0.0

    def due(self, step: int, total: int, now: float) -> bool:
        return step <= 10 or step >= total or now - self.last_emit >= 1.0


def _skip_shared_memory_collectives() -> None:
    """On the CPU accelerator DeepSpeed maps a 66 MB /dev/shm segment per rank for its inference all-reduce,
    which training never calls, and never unlinks it: every job would leave them behind, and a node with a
    small /dev/shm could not start one. Marking the op unavailable keeps training on torch.distributed."""
    accel = get_accelerator()
    if accel.device_name() == "cpu":
        deepspeed.ops.__compatible_ops__[accel.get_op_builder("ShareMemCommBuilder").NAME] = False


@dataclass
class Session:
    """What one attempt sets up once and every try of the OOM ladder reuses."""

    run_spec: RunSpec
    rank: int
    world: int
    device: str
    stop: StopFlag
    location: str
    tokenizer: Any
    train_blocks: Blocks
    val_blocks: Blocks | None
    rng: dict[str, Any]
    forced: oom.ForcedOOM
    uploads: uploader.Uploads | None = None  # None: run by hand, checkpoints stay on this disk
    preference: Preference | None = None  # a dpo job's method: its blocks are trainer/pairs.py's


@dataclass
class Preference:
    """What a dpo job's tries share: the loss, the reference and the per-batch counts of its pairs."""

    loss: Any  # trainer.preference.DpoLoss
    reference: dpo.Reference
    counts: dpo.Counts
    stats: dict[str, Any]


@dataclass
class Guard:
    """Where a try is, for the ladder: the phase that would run out of memory, whether it still adapts, the
    setting it runs and the engine to tear down."""

    phase: str = "setup"
    active: bool = True
    step: int = 0
    setting: oom.MemorySetting | None = None
    engine: Any = None


@dataclass
class Try:
    """What a try's setup hands its training loop."""

    job: ResolvedJob
    setting: oom.MemorySetting
    engine: Any
    scheduler: Any
    order: BatchOrder
    total_steps: int
    n_params: int
    n_trainable: int
    adjustments: list[str]
    swap_folder: Path | None
    loop_threads: int | None = None  # the intra-op pool while the loop runs (trainer/threads.py); None: torch's


@dataclass
class Loop:
    """What the training loop of one try carries from step to step."""

    state: TrainerState
    fence: Fence
    ckpt_dir: Path
    pipelined: bool
    flop_counts: Any
    row_pairs: Any
    peak: float | None
    progress: Progress
    run_start: float
    start_step: int
    metrics: dict[str, float] = field(default_factory=dict)  # a dpo job's figures of its last step (trl's names)


def _rng_snapshot() -> dict[str, Any]:
    snap: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        snap["cuda"] = torch.cuda.get_rng_state_all()
    return snap


def _rng_restore(snap: dict[str, Any]) -> None:
    # A retry must initialise (random init) and shuffle exactly as a fresh run with its setting would.
    random.setstate(snap["python"])
    np.random.set_state(snap["numpy"])
    torch.set_rng_state(snap["torch"])
    if "cuda" in snap:
        torch.cuda.set_rng_state_all(snap["cuda"])


def run(run_spec: RunSpec) -> None:
    job, paths = run_spec.job, run_spec.paths
    spec, hp = job.spec, job.spec.hyperparameters
    _seed_everything(hp.seed)
    _skip_shared_memory_collectives()
    deepspeed.init_distributed()
    startup.mark("distributed")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != job.world_size:
        # Batch sizes were resolved for job.world_size; another world size would silently change them.
        raise RuntimeError(f"launched with {world} processes but the job was resolved for {job.world_size}")
    stop = StopFlag()
    location = model_location(spec, paths)
    tokenizer = load_tokenizer(spec, location)
    preference = None
    if spec.method.type == Method.DPO:
        run_spec, train_blocks, val_blocks, preference = _pairs_and_batch(run_spec, tokenizer, world)
    else:
        run_spec, train_blocks, val_blocks = _data_and_batch(run_spec, tokenizer, world)
    startup.mark("data")
    session = Session(run_spec, rank, world, get_accelerator().current_device_name(), stop, location, tokenizer,
                      train_blocks, val_blocks, _rng_snapshot(), oom.ForcedOOM(),
                      uploader.Uploads.for_run(run_spec, rank), preference)
    finished = False
    try:
        _run_tries(session)
        finished = True
    finally:
        if session.uploads is not None:
            # The last checkpoint's commit must not be cut off by the exit; after a SIGTERM or an error the
            # worker kills the group soon, so it gets less time, and an unfinished one stays uncommitted.
            session.uploads.finish(uploader.FINAL_WAIT_SECONDS if finished else uploader.STOP_WAIT_SECONDS)


def _data_and_batch(run_spec: RunSpec, tokenizer: Any, world: int) -> tuple[RunSpec, Blocks, Blocks | None]:
    """The data's blocks and the run spec with the batch they allow (trainer/batching.py), said in a `resolved`
    event where it differs from the one resolved at submit."""
    job = run_spec.job
    spec, hp = job.spec, job.spec.hyperparameters
    train, val = load_examples(spec.data, run_spec.paths, tokenizer, hp.seed)
    pad = tokenizer.pad_token_id
    blocks = blocks_of(train, val, seq_len=hp.seq_len, pad_id=pad, packing=spec.data.packing, name=spec.data.train)
    chosen = batching.plan(job, examples=len(train), packed_rows=len(blocks[0]),
                           dp=world // spec.resources.pipeline_stages)
    if not chosen.changes(job):
        return run_spec, *blocks
    if chosen.packing != spec.data.packing:
        blocks = blocks_of(train, val, seq_len=hp.seq_len, pad_id=pad, packing=chosen.packing,
                           name=spec.data.train)
    emit_rank0(EventKind.RESOLVED, global_batch_size=chosen.global_batch, micro_batch_size=chosen.micro,
               gradient_accumulation_steps=chosen.accum, packing=chosen.packing,
               examples_per_step=chosen.examples_per_step, examples=len(train), rows=chosen.rows,
               reason="; ".join(chosen.notes) or "the batch fits the data")
    return run_spec.model_copy(update={"job": chosen.applied(job)}), *blocks


def _pairs_and_batch(run_spec: RunSpec, tokenizer: Any, world: int) -> tuple[RunSpec, Any, Any, Preference]:
    """A dpo job's pair rows and the batch they allow, as `_data_and_batch` settles a supervised job's: a batch
    unit is a packed row of whole pairs, or one pair unpacked."""
    job = run_spec.job
    spec = job.spec
    data = dpo.load(run_spec, tokenizer, packing=spec.data.packing)
    chosen = batching.plan(job, examples=data.train.pairs, packed_rows=len(data.train) if data.train.packed
                           else data.train.pairs, dp=world // spec.resources.pipeline_stages)
    if chosen.changes(job):
        if chosen.packing != data.train.packed:
            data = dpo.load(run_spec, tokenizer, packing=chosen.packing)
        emit_rank0(EventKind.RESOLVED, global_batch_size=chosen.global_batch, micro_batch_size=chosen.micro,
                   gradient_accumulation_steps=chosen.accum, packing=chosen.packing,
                   examples_per_step=chosen.examples_per_step, examples=data.train.pairs, rows=chosen.rows,
                   reason="; ".join(chosen.notes) or "the batch fits the data")
        run_spec = run_spec.model_copy(update={"job": chosen.applied(job)})
    preference = Preference(dpo.loss_config(run_spec.job), dpo.Reference(dpo.reference_mode(run_spec.job)),
                            dpo.Counts(data.train), data.stats)
    return run_spec, data.train, data.val, preference


def _run_tries(session: Session) -> None:
    run_spec, world = session.run_spec, session.world
    job = run_spec.job
    hp = job.spec.hyperparameters
    setting: oom.MemorySetting | None = None
    tried: list[dict[str, Any]] = []
    while True:
        _rng_restore(session.rng)
        try:
            _train(session, setting)
            return
        except oom.AdaptableOOM as exc:
            failed, phase, step, message = exc.setting, exc.phase, exc.step, exc.message
        # Outside the handler: the traceback, and the engine and model its frames hold, are gone now.
        _free_device_memory()
        tried.append(failed.shown())
        found = oom.next_setting(failed, phase, per_rank=hp.global_batch_size // world,
                                 offload_ok=oom.can_offload(job))
        if found is None:
            raise torch.OutOfMemoryError(
                f"out of memory in the {phase} at step {step} with every setting of the on_oom ladder that applies "
                f"(tried {tried}); last error: {message}")
        setting, change = found
        emit_rank0(EventKind.ADAPTED, phase=phase, step=step, error=message[:500], change=change,
                   previous=failed.shown(), setting=setting.shown(), attempt=run_spec.attempt)
        emit_rank0(EventKind.RESOLVED, micro_batch_size=setting.micro_batch_size,
                   gradient_accumulation_steps=setting.gradient_accumulation_steps,
                   reason=f"on_oom adapt after running out of memory in the {phase}: {change}")


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _with_setting(job: ResolvedJob, setting: oom.MemorySetting) -> ResolvedJob:
    ds = job.spec.deepspeed.model_copy(update={"activation_checkpointing": setting.activation_checkpointing,
                                               "offload_optimizer": setting.offload_optimizer})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"deepspeed": ds}),
                                  "micro_batch_size": setting.micro_batch_size,
                                  "gradient_accumulation_steps": setting.gradient_accumulation_steps})


def _train(session: Session, setting: oom.MemorySetting | None) -> None:
    """One try: setup -> resume -> train (eval, checkpoint) -> export. With `resources.on_oom: "adapt"` an
    out-of-memory error before the end of the first oom.ADAPT_STEPS steps comes out as oom.AdaptableOOM."""
    job = session.run_spec.job
    guard = Guard(setting=setting)
    try:
        _setup_and_train(session, setting, guard)
    except Exception as exc:
        if not (job.spec.resources.on_oom == "adapt" and guard.active and oom.is_oom(exc)):
            raise
        if guard.engine is not None:
            try:
                guard.engine.destroy()
            except Exception:  # noqa: BLE001  # an engine cut off mid-step may fail its own teardown; it is
                pass           # discarded either way, and the retry must go on
            guard.engine = None
        failed = guard.setting or oom.initial(job, job.micro_batch_size, job.gradient_accumulation_steps)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise oom.AdaptableOOM(guard.phase, guard.step, message, failed) from None


def _setup_and_train(session: Session, setting: oom.MemorySetting | None, guard: Guard) -> None:
    run_spec, world, device = session.run_spec, session.world, session.device
    job = run_spec.job if setting is None else _with_setting(run_spec.job, setting)
    spec, hp = job.spec, job.spec.hyperparameters
    train_blocks, tokenizer, location = session.train_blocks, session.tokenizer, session.location
    model = load_model(spec, location, tokenizer)
    startup.mark("model")
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    swap_folder = swap.attempt_folder(run_spec)
    stages = spec.resources.pipeline_stages
    plan = kernels.choose(job, _on_gpu(), model)
    if stages > 1:
        plan = pipeline.kernel_plan(plan)
    kernel_adjustments = kernels.apply(model, plan)
    micro, accum = job.micro_batch_size, job.gradient_accumulation_steps
    if setting is None and job.micro_batch_auto and _on_gpu() and stages == 1 and session.preference is None \
            and tuning.fits_unsharded(model):
        # The API could only estimate; here the GPU is measured. The global batch stays as resolved.
        micro, reason = tuning.probe_micro_batch(model, job, token_loss_sum, device, model.config.vocab_size)
        accum = hp.global_batch_size // (micro * world)
        emit_rank0(EventKind.RESOLVED, micro_batch_size=micro, gradient_accumulation_steps=accum, reason=reason)
    setting = guard.setting = oom.initial(job, micro, accum)
    # A checkpoint of another world size loads through DeepSpeed's universal format (trainer/elastic.py).
    cfg, adjustments = dsconfig.for_try(run_spec, setting, swap_folder=swap_folder, world=world,
                                        committed=checkpoint.committed_tags(Path(run_spec.paths.checkpoint_dir)),
                                        device_name=get_accelerator().device_name())
    adjustments += kernel_adjustments
    zero_cfg = cfg["zero_optimization"]
    share = memory.offloaded_share(zero_cfg.get("offload_optimizer", {}).get("ratio", 1.0), n_trainable // world,
                                   int(zero_cfg.get("sub_group_size", memory.DEEPSPEED_SUB_GROUP_SIZE)))
    memory.check_offload_fits(spec.deepspeed, n_params, n_trainable, memory.local_rank_count(world), world,
                              memory.available_host_bytes(), optimizer_share=share)
    adjustments += kernels.compile_for(model, plan)
    # Data parallelism spans world / stages ranks: the stages of one pipeline read the same rows.
    order = BatchOrder(len(train_blocks), micro=micro, accum=accum, world=world // stages, seed=hp.seed)
    total_steps = hp.max_steps or max(1, math.ceil(hp.epochs * order.batches_per_epoch))
    if stages > 1:
        model = pipeline.build(model, stages, spec.resources.pipeline_partition)
    trainable = [p for p in model.parameters() if p.requires_grad]
    session.forced.check("setup")
    if session.rank == 0:
        dsconfig.write(cfg, Path(run_spec.paths.job_dir), run_spec.attempt)
    guard.engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=optim.client_optimizer(job, trainable), config=cfg,
        lr_scheduler=scheduler_factory(total_steps=total_steps, warmup_steps=hp.warmup_steps,
                                       kind=hp.lr_schedule, min_lr_ratio=hp.min_lr_ratio))
    startup.mark("engine")
    del model  # the engine holds it; a retry must be able to free it
    session.forced.install(guard.engine)
    _loop(session, Try(job, setting, guard.engine, scheduler, order, total_steps, n_params, n_trainable,
                       adjustments, swap_folder, loop_threads(get_accelerator().device_name(), spec.deepspeed)),
          guard)


def _loop(session: Session, run: Try, guard: Guard) -> None:
    loop = _begin(session, run, guard)
    with pool_of(run.loop_threads):
        _steps(session, run, guard, loop)
    guard.active = False
    _finish(session, run, loop)


def _steps(session: Session, run: Try, guard: Guard, loop: Loop) -> None:
    if session.preference is not None:
        _preference_steps(session, run, guard, loop, session.preference)
        return
    state, order, train_blocks = loop.state, run.order, session.train_blocks
    while state.step < run.total_steps:
        global_rows = order.global_rows(state.epoch, state.next_batch)
        # Every rank knows the whole global batch, so the token-weighted mean needs no extra collective.
        label_tokens = int((train_blocks.labels[global_rows, 1:] != IGNORE).sum())
        real_tokens = int(train_blocks.real_tokens[global_rows].sum())
        loss_sum, lr = _optimizer_step(session, run, guard, loop, label_tokens)
        _advance(state, guard, loop, order, real_tokens)
        loss_total, stop_votes = _all_reduce_sum([float(loss_sum), float(session.stop.requested)], session.device)
        state.last_loss = loss_total / max(1, label_tokens)
        loop.progress.window_tokens += real_tokens
        loop.progress.window_pairs += float(loop.row_pairs[global_rows].sum())
        _report_progress_if_due(session, run, loop, lr)
        _between_steps(session, run, loop, stop_votes)


def _advance(state: TrainerState, guard: Guard, loop: Loop, order: BatchOrder, real_tokens: int) -> None:
    """After an optimizer step: the step, the ladder's window, the tokens seen and the next batch's place."""
    state.step += 1
    guard.step = state.step
    if guard.active and state.step - loop.start_step >= oom.ADAPT_STEPS:
        guard.active = False
    state.tokens_seen += real_tokens
    state.next_batch += 1
    if state.next_batch >= order.batches_per_epoch:
        state.epoch, state.next_batch = state.epoch + 1, 0


def _preference_steps(session: Session, run: Try, guard: Guard, loop: Loop, pref: Preference) -> None:
    """`_steps` for a dpo job: the same batches, stops, checkpoints and evals; the loss of trainer/dpo.py."""
    state, order, blocks = loop.state, run.order, session.train_blocks
    while state.step < run.total_steps:
        units = order.global_rows(state.epoch, state.next_batch)
        pairs, chosen_tokens, real_tokens = pref.counts.of(units)
        if guard.active:
            guard.phase = "forward"

        def at_boundary() -> None:
            if guard.active:
                guard.phase = "step"

        lr = run.scheduler.get_last_lr()[0]
        sums = dpo.train_step(run.engine, blocks, order.micro_rows(state.epoch, state.next_batch, session.rank),
                              pref.reference, pref.loss, session.device, pairs=pairs, chosen_tokens=chosen_tokens,
                              accum=order.accum, world=order.world, on_boundary=at_boundary)
        _advance(state, guard, loop, order, real_tokens)
        figures, (stop_votes,) = dpo.figures(sums, pairs=pairs, chosen_tokens=chosen_tokens, cfg=pref.loss,
                                             device=session.device, extra=[float(session.stop.requested)])
        state.last_loss = figures.pop("loss")
        loop.progress.window_tokens += real_tokens
        loop.progress.window_pairs += float(loop.row_pairs[blocks.unit_rows(units)].sum())
        loop.metrics = figures
        _report_progress_if_due(session, run, loop, lr)
        _between_steps(session, run, loop, stop_votes)


def _begin(session: Session, run: Try, guard: Guard) -> Loop:
    """Resume from the newest committed checkpoint, announce the start, and start the meters and clocks."""
    paths, hp, train_blocks = session.run_spec.paths, run.job.spec.hyperparameters, session.train_blocks
    ckpt_dir = Path(paths.checkpoint_dir)
    fence = Fence(Path(paths.job_dir), session.run_spec.attempt)
    placement = session.run_spec.placement
    state = checkpoint.resume(run.engine, ckpt_dir, session.rank, fence,
                              node_rank=placement.node_rank if placement else 0) or TrainerState()
    if session.preference is not None:
        _reference_ready(session, run, state, ckpt_dir)
    _emit_started(session, run, state)
    flop_counts = flops.counts(getattr(run.engine.module, "config", None), run.n_params, hp.seq_len)
    row_pairs = flops.attended_pairs(train_blocks.position_ids, train_blocks.real_tokens)
    peak = _peak_flops()
    progress = Progress(window_start=time.time())
    pipelined = pipeline.is_pipeline(run.engine)
    loop = Loop(state, fence, ckpt_dir, pipelined, flop_counts, row_pairs, peak, progress,
                run_start=time.time(), start_step=state.step)
    guard.step = state.step
    accel = get_accelerator()
    if accel.device_name() == "cuda":
        accel.reset_peak_memory_stats()
    return loop


def _reference_ready(session: Session, run: Try, state: TrainerState, ckpt_dir: Path) -> None:
    """A precomputed reference: the one the resumed checkpoint kept, or computed now, before the first step,
    while the model is still the one loaded (the reference by definition)."""
    reference = session.preference.reference  # type: ignore[union-attr]
    if reference.mode != dpo.PRECOMPUTED or reference.table:
        return
    if state.step:
        if not reference.restore(checkpoint.extras(ckpt_dir)):
            raise RuntimeError(f"the checkpoint of step {state.step} keeps no reference log-probabilities; a dpo job "
                               "with a precomputed reference resumes only from its own checkpoints")
        return
    micro = run.setting.micro_batch_size
    for which, blocks in (("train", session.train_blocks), ("val", session.val_blocks)):
        if blocks is not None:
            reference.precompute(run.engine, blocks, which, micro, session.rank, session.world, session.device)


def _emit_started(session: Session, run: Try, state: TrainerState) -> None:
    setting, spec = run.setting, run.job.spec
    emit_rank0(EventKind.STARTED, world_size=session.world, total_steps=run.total_steps,
               resumed_from_step=state.step if state.step else None, micro_batch_size=setting.micro_batch_size,
               gradient_accumulation_steps=setting.gradient_accumulation_steps,
               packing_efficiency=round(session.train_blocks.packing_efficiency, 4), n_params=run.n_params,
               n_trainable_params=run.n_trainable, adjustments=run.adjustments,
               device=get_accelerator().device_name(), attempt=session.run_spec.attempt,
               optimizer=spec.hyperparameters.optimizer, on_oom=spec.resources.on_oom,
               memory_setting=setting.shown(), method=spec.method.type.value, startup=startup.marks(),
               **({} if session.preference is None else {
                   "pairs": session.preference.stats, "reference": session.preference.reference.mode}))


def _optimizer_step(session: Session, run: Try, guard: Guard, loop: Loop,
                    label_tokens: int) -> tuple[torch.Tensor, float]:
    """Forward and backward over each micro batch of this rank's share of the global batch, then the optimizer
    step. Returns the summed token loss (on the device, not yet synced) and the learning rate it used."""
    engine, scheduler, order, state = run.engine, run.scheduler, run.order, loop.state
    train_blocks, device = session.train_blocks, session.device
    # engine.backward divides by the accumulation steps and gradients are averaged over ranks; this
    # scale undoes both so the step's gradient is that of (sum of token losses / global label tokens).
    scale = order.accum * order.world / max(1, label_tokens)
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    if loop.pipelined:
        lr = scheduler.get_last_lr()[0]
        loss_sum += pipeline.train_step(engine, train_blocks, order, state.epoch, state.next_batch, scale)
        return loss_sum, lr
    for k, rows in enumerate(order.micro_rows(state.epoch, state.next_batch, session.rank)):
        if guard.active:
            guard.phase = "forward"
        loss = token_loss_sum(engine, train_blocks.batch(rows), device)
        engine.backward(loss * scale)
        loss_sum += loss.detach().float()  # no host sync per micro batch
        lr = scheduler.get_last_lr()[0]
        if guard.active and k == order.accum - 1:
            # The boundary's engine.step runs the optimizer (and, the first time, allocates its state).
            guard.phase = "step"
        engine.step()
    return loss_sum, lr


def _report_progress_if_due(session: Session, run: Try, loop: Loop, lr: float) -> None:
    state, progress, engine, accel = loop.state, loop.progress, run.engine, get_accelerator()
    now = time.time()
    if not progress.due(state.step, run.total_steps, now):
        return
    elapsed = max(now - progress.window_start, 1e-9)
    tps = progress.window_tokens / elapsed
    per_step = (now - loop.run_start) / max(1, state.step - loop.start_step)
    grad_norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    emit_rank0(
        EventKind.PROGRESS, step=state.step, total_steps=run.total_steps,
        epoch=round(state.epoch + state.next_batch / run.order.batches_per_epoch, 4),
        loss=state.last_loss, lr=lr, grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_second=tps, tokens_seen=state.tokens_seen,
        eta_seconds=per_step * (run.total_steps - state.step),
        peak_memory_bytes=accel.max_memory_allocated() if accel.device_name() == "cuda" else None, **loop.metrics,
        **flops.mfu(loop.flop_counts, progress.window_tokens, progress.window_pairs, elapsed,
                    loop.peak * session.world if loop.peak else None))
    progress.last_emit, progress.window_start = now, now
    progress.window_tokens = progress.window_pairs = 0.0


def _between_steps(session: Session, run: Try, loop: Loop, stop_votes: float) -> None:
    """The periodic eval, a stop any rank asked for (checkpoint, then Interrupted), the periodic checkpoint."""
    state, spec = loop.state, run.job.spec
    eval_every = spec.hyperparameters.eval_every_steps if session.val_blocks is not None else None
    if eval_every and state.step % eval_every == 0 and state.step < run.total_steps:
        _evaluate_and_emit(session, run, loop)
    extras = session.preference.reference.state() if session.preference is not None else None
    if stop_votes > 0:
        checkpoint.save(run.engine, loop.ckpt_dir, state, spec.checkpointing.keep_last, session.rank, loop.fence,
                        session.uploads, session.tokenizer, extras=extras)
        emit_rank0(EventKind.INTERRUPTED, step=state.step, reason="SIGTERM")
        raise Interrupted(state.step)
    every = spec.checkpointing.every_steps
    if every and state.step % every == 0:
        checkpoint.save(run.engine, loop.ckpt_dir, state, spec.checkpointing.keep_last, session.rank, loop.fence,
                        session.uploads, session.tokenizer, extras=extras)


def _evaluate_and_emit(session: Session, run: Try, loop: Loop) -> None:
    micro, device = run.setting.micro_batch_size, session.device
    if session.preference is not None:
        pref = session.preference
        figures = dpo.evaluate(run.engine, session.val_blocks, pref.reference, pref.loss, micro, session.rank,
                               session.world, device)
        emit_rank0(EventKind.EVAL, step=loop.state.step, **figures)
        return
    if loop.pipelined:
        loss_v, ppl = pipeline.evaluate(run.engine, session.val_blocks, micro, device)
    else:
        loss_v, ppl = evaluate(run.engine, session.val_blocks, micro, session.rank, session.world, device)
    emit_rank0(EventKind.EVAL, step=loop.state.step, loss=loss_v, perplexity=ppl)


def _finish(session: Session, run: Try, loop: Loop) -> None:
    """After the last step: the final eval, the optimizer state's release, the export, the swap folder."""
    state = loop.state
    if session.val_blocks is not None:
        _evaluate_and_emit(session, run, loop)
    # The optimizer's state is dead weight now; an offloaded one fills most of host memory, where the
    # export then builds the model's files.
    memory.release_optimizer_state(run.engine)
    export.export(run.engine, session.tokenizer, run.job.spec, session.location,
                  Path(session.run_spec.paths.output_dir), session.rank, state.step, state.last_loss, loop.fence)
    # export() ends on a barrier: no rank swaps any more. One process per node clears the node's folder.
    if run.swap_folder is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        swap.remove(run.swap_folder)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
