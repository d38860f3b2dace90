"""Merge a raw DeepSpeed config into a job: the part of resolving a job (contract/deepspeed/resolver.py) that
reads what the user wrote for DeepSpeed.

Pure Python, no torch: the API runs it to validate and to show the user every value chosen, and the
trainer gets the same result. A raw DeepSpeed config is read as the pinned DeepSpeed reads it, field by field,
with DeepSpeed's own names, aliases, deprecated names, types and defaults (contract/deepspeed/fields.py, a table built
from DeepSpeed's config models). Each field DeepSpeed accepts is merged into the job under one canonical name,
or refused with the true reason: it writes files, opens connections or imports code, DeepSpeed itself has
removed it, or it is a DeepSpeed feature this service does not run. A field DeepSpeed does not know is refused
with the closest known name. `"auto"` takes the job's value; a field the config leaves unset takes DeepSpeed's
default unless the job sets it. Where the service runs something other than what DeepSpeed would with the same
file, `notes` says so in one sentence.

The walk is here; each section is merged by a module of its own (merge_optim.py, merge_zero.py,
merge_precision.py, merge_passthrough.py) over the state and checks of merge_base.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from contract.deepspeed import fields
from contract.deepspeed.merge_base import MergeState, explicit, is_auto, show
from contract.deepspeed.merge_optim import finish_optimizer, finish_scheduler, merge_optimizer, merge_scheduler
from contract.deepspeed.merge_passthrough import dangerous, pass_aio, pass_model, pass_timers
from contract.deepspeed.merge_precision import finish_precision, merge_activation_checkpointing, merge_precision
from contract.deepspeed.merge_zero import merge_zero_optimization
from contract.deepspeed.policy import (
    DANGEROUS_KEYS,
    DS,
    IGNORED_TOP,
    MERGED_TOP,
    PASSTHROUGH_KINDS,
    PASSTHROUGH_SECTIONS,
    UNRUN_TOP,
)
from contract.spec import MAX_BATCH

__all__ = ["Merger", "explicit", "is_auto"]

Section = Callable[[MergeState, Any], None]

# The sections folded into the job's own fields (policy.MERGED_TOP) other than the batch and clipping fields,
# which the Merger reads itself, and those passed through as DeepSpeed reads them (policy.PASSTHROUGH_SECTIONS).
SECTIONS: dict[str, Section] = {
    "optimizer": merge_optimizer,
    "scheduler": merge_scheduler,
    "fp16": lambda m, v: merge_precision(m, "fp16", v),
    "bf16": lambda m, v: merge_precision(m, "bf16", v),
    "activation_checkpointing": merge_activation_checkpointing,
    "zero_optimization": merge_zero_optimization,
}
PASSED: dict[str, Section] = {
    "comms_logger": lambda m, v: pass_model(m, "comms_logger", v),
    "timers": pass_timers,
    "aio": pass_aio,
}
BATCH_FIELDS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Top-level numbers a job field also sets, by (section, field) of the job spec: the config's value becomes the job's
# (a conflict with one the job gives is refused naming both), "auto" keeps the job's, and a config that leaves it
# unset gets DeepSpeed's default, as running that config alone would. render.py writes the field back.
ADOPTED_TOP: dict[str, tuple[str, str]] = {"gradient_clipping": ("hyperparameters", "gradient_clipping")}


class Merger(MergeState):
    """Walks a raw DeepSpeed config and folds each field into the job spec, collecting errors and notes."""

    def run(self) -> None:
        aliases = fields.table()["top_level_aliases"]
        inert = set(fields.table()["inert_top_level"])
        for key, value in self.raw.items():
            if key.startswith("_"):
                continue  # a comment: DeepSpeed ignores keys it does not read
            if key in aliases:
                canonical = aliases[key]
                if canonical in self.raw:
                    self.err(key, f"and {canonical} are two names of one field; {DS} reads {canonical} and ignores "
                                  f"{key}, keep one", "conflict")
                    continue
                self.notes.append(f"{key} is {DS}'s old name of {canonical}, rendered as {canonical}.")
                key = canonical
            message = fields.removed("", key)
            if message:
                self.err(key, f"is not accepted: {DS} refuses it: {message}", "removed")
            elif key in DANGEROUS_KEYS:
                dangerous(self, key, value)
            elif key in UNRUN_TOP:
                if value != fields.top_level_default(key):
                    self.err(key, f"is {DS}'s {UNRUN_TOP[key]}, which this service does not run", "unrun")
            elif key in BATCH_FIELDS:
                self._batch_field(key, value)
            elif key in ADOPTED_TOP:
                self._adopt_top(key, value)
            elif key in MERGED_TOP:
                SECTIONS[key](self, value)
            elif key in PASSTHROUGH_KINDS:
                if self.knob(key, value, PASSTHROUGH_KINDS[key]):
                    self.out.passthrough[key] = value
            elif key in PASSTHROUGH_SECTIONS:
                PASSED[key](self, value)
            elif key in IGNORED_TOP:
                self.notes.append(f"{key} is not rendered: {IGNORED_TOP[key]}.")
            elif key in inert:
                self.notes.append(f"{key} is not rendered: {DS} reads no such key and would ignore it.")
            else:
                known = MERGED_TOP | set(PASSTHROUGH_KINDS) | PASSTHROUGH_SECTIONS
                hint = fields.closest(key, fields.top_level_keys() | inert)
                self.err(key, f"is not a field {DS} knows" + (f"; did you mean {hint!r}?" if hint else "")
                         + f" (accepted: {', '.join(sorted(known))})", "unknown")
        self._finish()

    # -- batch and clipping --

    def _batch_field(self, key: str, value: Any) -> None:
        if is_auto(value):
            self.batch_auto.add(key)
            return
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BATCH:
            self.err(key, f'must be an integer from 1 to {MAX_BATCH} or "auto", got {show(value)}', "bound")
            return
        self.batch[key] = value

    def _adopt_top(self, key: str, v: Any) -> None:
        """A top-level number the job also has a field for (ADOPTED_TOP): the config's value becomes the job's."""
        self.out.top_given.add(key)
        section_name, name = ADOPTED_TOP[key]
        section = getattr(self.spec, section_name)
        if is_auto(v):
            if not explicit(section, name):
                self.notes.append(f'{key} is "auto": the job\'s {getattr(section, name)} applies.')
            return
        self.number(key, v, lambda x: self.adopt(section, name, x, key, f"{section_name}.{name}"))

    def _finish(self) -> None:
        """What the config left unset or "auto"."""
        ds, out = self.spec.deepspeed, self.out
        finish_precision(self)
        if not out.stage_given and not explicit(ds, "zero_stage"):
            ds.zero_stage = fields.lookup("zero_optimization", "stage").default  # type: ignore[union-attr]
            self.notes.append(f"zero_optimization.stage is unset: ZeRO stage {ds.zero_stage}, {DS}'s default.")
        for key, (section_name, name) in ADOPTED_TOP.items():
            # A config left it unset: DeepSpeed's default, which running that config alone would have used.
            section = getattr(self.spec, section_name)
            if key not in out.top_given and not explicit(section, name):
                setattr(section, name, float(fields.top_level_default(key)))
        finish_optimizer(self)
        finish_scheduler(self)
