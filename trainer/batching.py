"""The rows each optimizer step takes, settled once the data is tokenized: only then is it known how many rows the
data makes and, for a job that counts its batch in examples (`hyperparameters.examples_per_step`, OpenAI's
`batch_size`), how many rows that many examples fill.

- A batch in examples becomes rows by the data's own ratio: `examples_per_step × packed rows ÷ examples`, rounded.
  Where that is under one row (short examples, a small batch) packing would put more examples into each step than
  asked, so the rows are the examples themselves, unpacked: the steps are then exactly examples ÷ batch.
- A global batch larger than the rows the data makes is clamped to them (whole steps need whole batches), never
  refused after the job started.
- The global batch is a multiple of the data-parallel processes; the micro batch is the largest divisor of each
  process's share that is no larger than the one resolved at submit (or measured), so the memory bound holds.

Torch-free arithmetic, so the control plane's tests and the trainer read the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contract.deepspeed.batch import largest_divisor_at_most
from contract.spec import MAX_AUTO_EXAMPLES_PER_STEP, ResolvedJob
from trainer.errors import DataError

# OpenAI's "auto" batch_size: about this share of the training examples.
AUTO_EXAMPLES_SHARE = 0.002


def auto_examples_per_step(examples: int) -> int:
    return max(1, min(MAX_AUTO_EXAMPLES_PER_STEP, round(examples * AUTO_EXAMPLES_SHARE)))


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # rows per optimizer step
    micro: int
    accum: int
    packing: bool
    examples_per_step: int | None  # as resolved ("auto" settled); None for a batch counted in rows
    rows: int  # the training rows the data makes under `packing`
    notes: tuple[str, ...]

    def changes(self, job: ResolvedJob) -> bool:
        hp = job.spec.hyperparameters
        return (self.global_batch, self.micro, self.accum, self.packing, self.examples_per_step) != (
            hp.global_batch_size, job.micro_batch_size, job.gradient_accumulation_steps, job.spec.data.packing,
            hp.examples_per_step)

    def applied(self, job: ResolvedJob) -> ResolvedJob:
        """`job` with this plan: a new value, the DeepSpeed config's batch fields included."""
        spec = job.spec
        hp = spec.hyperparameters.model_copy(update={"global_batch_size": self.global_batch,
                                                     "examples_per_step": self.examples_per_step})
        data = spec.data.model_copy(update={"packing": self.packing})
        cfg = {**job.deepspeed_config, "train_batch_size": self.global_batch,
               "train_micro_batch_size_per_gpu": self.micro, "gradient_accumulation_steps": self.accum}
        return job.model_copy(update={
            "spec": spec.model_copy(update={"hyperparameters": hp, "data": data}), "micro_batch_size": self.micro,
            "gradient_accumulation_steps": self.accum, "deepspeed_config": cfg,
            "notes": [*job.notes, *self.notes]})


def plan(job: ResolvedJob, *, examples: int, packed_rows: int, dp: int) -> BatchPlan:
    """The batch of `job` on data of `examples` training examples that pack into `packed_rows` rows, over `dp`
    data-parallel processes. Raises DataError only when the data cannot give every process one row."""
    hp, packing = job.spec.hyperparameters, job.spec.data.packing
    notes: list[str] = []
    per_step = hp.examples_per_step
    if per_step == "auto":
        per_step = auto_examples_per_step(examples)
        notes.append(f"examples_per_step auto: {per_step} (about {AUTO_EXAMPLES_SHARE:.1%} of {examples} "
                     f"examples, 1 to {MAX_AUTO_EXAMPLES_PER_STEP})")
    if per_step is None:
        rows = packed_rows if packing else examples
        wanted = hp.global_batch_size
    else:
        filled = per_step * packed_rows / examples
        if packing and filled >= 1:
            rows, wanted = packed_rows, round(filled)
            notes.append(f"{per_step} examples per step fill {filled:.2f} packed rows of {hp.seq_len} tokens "
                         f"({examples} examples make {packed_rows} rows): {wanted} rows per step, about "
                         f"{math.ceil(examples / per_step)} steps per epoch as {per_step} examples each would make")
        else:
            packing, rows, wanted = False, examples, per_step
            if job.spec.data.packing:
                notes.append(f"{per_step} examples per step fill {filled:.2f} of a packed row of {hp.seq_len} "
                             f"tokens: rows are the examples themselves, unpacked, {per_step} per step")
    if rows < dp:
        raise DataError(f"the training data makes {rows} rows, fewer than the {dp} data-parallel processes that "
                        "each need one per step; add data or run fewer processes")
    global_batch = min(wanted, rows)
    global_batch = max(dp, global_batch - global_batch % dp)
    if global_batch < wanted:
        notes.append(f"the training data makes {rows} rows, fewer than a global batch of {wanted}: clamped to "
                     f"{global_batch} (a multiple of the {dp} data-parallel processes)")
    elif global_batch != wanted:
        notes.append(f"global batch {wanted} rounded to {global_batch}, a multiple of the {dp} data-parallel "
                     "processes")
    per_rank = global_batch // dp
    micro = largest_divisor_at_most(per_rank, job.micro_batch_size)
    return BatchPlan(global_batch=global_batch, micro=micro, accum=per_rank // micro, packing=packing,
                     examples_per_step=per_step, rows=rows, notes=tuple(notes))
