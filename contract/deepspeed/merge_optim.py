"""The optimizer and scheduler sections of a raw DeepSpeed config: Adam or AdamW and its params, DeepSpeed's
warm-up schedulers, and what the job keeps where the config leaves either unset."""

from __future__ import annotations

from typing import Any

from contract.deepspeed import fields
from contract.deepspeed.merge_base import MergeState, explicit, is_auto, js, show
from contract.deepspeed.policy import (
    AUTO,
    BOOL,
    DS,
    OPTIMIZER_KINDS,
    OPTIMIZER_MERGED,
    OPTIMIZER_TYPES,
    SCHEDULER_KINDS,
    SCHEDULER_TYPES,
    finite_number,
)
from contract.spec import MAX_STEPS

# Adam switches DeepSpeed reads beside the merged params; each is refused or noted (`_optimizer_special`).
SPECIAL_PARAMS = ("bias_correction", "amsgrad", "set_grad_none", "max_grad_norm")


def _section(m: MergeState, key: str, v: Any) -> dict[str, Any] | None:
    """The block `key` ("optimizer" or "scheduler") as an object, each key DeepSpeed does not read in it
    refused; None if it is not an object."""
    if not isinstance(v, dict):
        m.err(key, f"must be an object, got {show(v)}")
        return None
    known = set(fields.dict_section_keys(key)) | {"params"}
    for k in v:
        if k not in known:
            m.unknown(f"{key}.{k}", k, known, key)
    return v


def _params(m: MergeState, key: str, v: dict[str, Any]) -> dict[str, Any] | None:
    params = v.get("params") or {}
    if not isinstance(params, dict):
        m.err(f"{key}.params", f"must be an object, got {show(params)}")
        return None
    return params


def merge_optimizer(m: MergeState, v: Any) -> None:
    if _section(m, "optimizer", v) is None:
        return
    kind = v.get("type", "AdamW")
    if not isinstance(kind, str):
        m.err("optimizer.type", f"must be an optimizer name such as \"AdamW\", got {show(kind)}")
        return
    if kind.lower() not in OPTIMIZER_TYPES:
        m.err("optimizer.type", f"{kind!r} is an optimizer this service does not run; it trains with Adam or "
                                "AdamW (accepted: Adam, AdamW)", "unrun")
        return
    m.out.optimizer_type = OPTIMIZER_TYPES[kind.lower()]
    if "legacy_fusion" in v and m.knob("optimizer.legacy_fusion", v["legacy_fusion"], BOOL):
        m.out.optimizer_extra["legacy_fusion"] = v["legacy_fusion"]
    params = _params(m, "optimizer", v)
    if params is None:
        return
    defaults = fields.table()["adam_defaults"]
    accepted = OPTIMIZER_MERGED | set(fields.table()["adam_extra_params"])
    for k, pv in params.items():
        field = f"optimizer.params.{k}"
        if k in SPECIAL_PARAMS:
            _optimizer_special(m, field, k, pv, defaults)
        elif k not in accepted:
            m.unknown(field, k, accepted, f"{kind}'s params")
        else:
            _optimizer_param(m, field, k, pv)


def _optimizer_param(m: MergeState, field: str, k: str, pv: Any) -> None:
    hp = m.spec.hyperparameters
    m.out.optimizer_set.add(k)
    if is_auto(pv):
        m.out.optimizer_auto.append(k)
    elif k in OPTIMIZER_KINDS:
        if m.knob(field, pv, OPTIMIZER_KINDS[k]):
            m.out.optimizer_extra[k] = pv
    elif k == "lr":
        m.number(field, pv, lambda x: m.adopt(
            hp, "learning_rate", x, "optimizer.params.lr", "hyperparameters.learning_rate"))
    elif k == "weight_decay":
        m.number(field, pv, lambda x: m.adopt(
            hp, "weight_decay", x, "optimizer.params.weight_decay", "hyperparameters.weight_decay"))
    elif k == "betas":
        if not (isinstance(pv, list) and len(pv) == 2 and all(finite_number(b) for b in pv)):
            m.err(field, f"must be a list of two numbers, got {show(pv)}")
        else:
            m.adopt(hp, "adam_betas", pv, field, "hyperparameters.adam_betas")


def _optimizer_special(m: MergeState, field: str, k: str, v: Any, defaults: dict[str, Any]) -> None:
    if k == "max_grad_norm":
        m.err(field, f"is not an optimizer parameter in {DS}, which warns and ignores it; clip with "
                     "gradient_clipping", "unrun")
    elif not isinstance(v, bool):
        m.err(field, f"must be true or false, got {show(v)}")
    elif v == defaults.get(k, v):
        m.notes.append(f"{field} is {js(v)}, DeepSpeed's default; it is not rendered.")
    elif k == "amsgrad":
        m.err(field, f"true is refused by {DS}'s FusedAdam, which has no AMSGrad variant", "unrun")
    else:
        m.err(field, f"{js(v)} is an Adam setting this service does not run (torch's AdamW, which CPU jobs "
                     "use, has no switch for it)", "unrun")


def merge_scheduler(m: MergeState, v: Any) -> None:
    if _section(m, "scheduler", v) is None:
        return
    kind = v.get("type", "")
    schedulers = fields.table()["schedulers"]
    if not isinstance(kind, str) or kind not in schedulers and kind.lower() not in SCHEDULER_TYPES:
        m.err("scheduler.type", f"{show(kind)} is not a {DS} scheduler; accepted: WarmupLR, WarmupDecayLR, "
                                "WarmupCosineLR")
        return
    if kind.lower() not in SCHEDULER_TYPES:
        m.err("scheduler.type", f"{kind} is a {DS} scheduler this service does not run; accepted: WarmupLR, "
                                "WarmupDecayLR, WarmupCosineLR", "unrun")
        return
    canonical = next(n for n in schedulers if n.lower() == kind.lower())
    hp = m.spec.hyperparameters
    m.adopt(hp, "lr_schedule", SCHEDULER_TYPES[kind.lower()], "scheduler.type", "hyperparameters.lr_schedule")
    params = _params(m, "scheduler", v)
    if params is None:
        return
    accepted = set(schedulers[canonical]) | ({"total_num_steps"} if canonical != "WarmupLR" else set())
    given: dict[str, Any] = {}
    for k, pv in params.items():
        field = f"scheduler.params.{k}"
        if k not in accepted:
            m.unknown(field, k, accepted, f"{canonical}'s params")
            continue
        given[k] = pv
        if not is_auto(pv):
            _scheduler_param(m, field, k, pv)
    m.out.scheduler = {"type": canonical, "params": given}


def _scheduler_param(m: MergeState, field: str, k: str, pv: Any) -> None:
    hp = m.spec.hyperparameters
    if k == "warmup_num_steps":
        # DeepSpeed's schedulers refuse a warm-up that is not a positive integer.
        if isinstance(pv, bool) or not isinstance(pv, int) or not 1 <= pv <= MAX_STEPS:
            m.err(field, f"must be an integer from 1 to {MAX_STEPS}, got {show(pv)}",
                  "value" if isinstance(pv, int) and pv < 1 else "bound")
        else:
            m.adopt(hp, "warmup_steps", pv, field, "hyperparameters.warmup_steps")
    elif k == "warmup_max_lr":
        m.number(field, pv, lambda x: m.adopt(
            hp, "learning_rate", x, "scheduler.params.warmup_max_lr", "hyperparameters.learning_rate"))
    elif k == "cos_min_ratio":
        if m.knob(field, pv, SCHEDULER_KINDS[k]):
            m.adopt(hp, "min_lr_ratio", pv, field, "hyperparameters.min_lr_ratio")
    else:
        m.knob(field, pv, SCHEDULER_KINDS[k])


def finish_optimizer(m: MergeState) -> None:
    """An optimizer the config left unset runs the job's; one it set takes Adam's defaults for what it left out."""
    hp, out = m.spec.hyperparameters, m.out
    adam = fields.table()["adam_defaults"]
    if out.optimizer_type is None:
        name = "AdamW" if hp.optimizer == "adamw" else f"optimizer {hp.optimizer}"
        m.notes.append(f"optimizer is unset: the job's {name} runs (lr {hp.learning_rate}, betas "
                       f"{list(hp.adam_betas)}, eps {adam['eps']}, weight_decay {hp.weight_decay}).")
        return
    unset = {"lr": "learning_rate", "betas": "adam_betas", "weight_decay": "weight_decay"}
    for key, job_field in unset.items():
        from_scheduler = key == "lr" and "hyperparameters.learning_rate" in m.set_by_config
        if key not in out.optimizer_set and not explicit(hp, job_field) and not from_scheduler:
            setattr(hp, job_field, tuple(adam[key]) if key == "betas" else adam[key])
    if out.optimizer_auto:
        values = {"lr": hp.learning_rate, "betas": list(hp.adam_betas), "eps": adam["eps"],
                  "weight_decay": hp.weight_decay}
        shown = ", ".join(f"{k} {values.get(k, 'default')}" for k in out.optimizer_auto)
        m.notes.append(f'optimizer.params {", ".join(out.optimizer_auto)} are "auto": the job\'s values '
                       f"apply ({shown}).")


def finish_scheduler(m: MergeState) -> None:
    """The job's schedule, and what DeepSpeed's scheduler named in the config would have done differently."""
    hp, sched = m.spec.hyperparameters, m.out.scheduler
    if sched is None:
        if "scheduler" not in m.raw:
            m.notes.append(f"scheduler is unset: the job's {hp.lr_schedule} schedule runs, with "
                       f"{hp.warmup_steps} warm-up steps.")
        return
    kind, params = sched["type"], sched["params"]
    defaults = fields.table()["schedulers"][kind]
    if "warmup_num_steps" not in params and not explicit(hp, "warmup_steps"):
        hp.warmup_steps = int(defaults["warmup_num_steps"])
    if kind == "WarmupCosineLR" and "cos_min_ratio" not in params and not explicit(hp, "min_lr_ratio"):
        hp.min_lr_ratio = float(defaults["cos_min_ratio"])
    if is_auto(params.get("warmup_num_steps")) and not explicit(hp, "warmup_steps"):
        m.notes.append(f'scheduler.params.warmup_num_steps is "auto": the job\'s {hp.warmup_steps} applies.')
    n = hp.warmup_steps
    warm = f"a linear warm-up over {n} steps from lr/{n} at the first step" if n else "no warm-up"
    shape = {"constant": "then holds lr", "linear": f"then decays linearly to {hp.min_lr_ratio} × lr",
             "cosine": f"then decays along a cosine to {hp.min_lr_ratio} × lr"}[hp.lr_schedule]
    start = "warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr"
    start_value = params.get(start, defaults[start])
    warmup_type = params.get("warmup_type", defaults["warmup_type"])
    if is_auto(warmup_type):
        warmup_type = defaults["warmup_type"]
    m.notes.append(
        f"scheduler {kind} is run by the trainer: {warm}, {shape} over the job's steps; {DS}'s {kind} would "
        f"warm up {'logarithmically' if warmup_type == 'log' else 'linearly'} from {start} "
        f"{defaults[start] if is_auto(start_value) else start_value} at step 0.")
    if "total_num_steps" in params:
        m.notes.append("scheduler.params.total_num_steps is not used: the schedule spans the job's total "
                       "steps.")
    if params.get("last_batch_iteration", -1) not in (-1, AUTO):
        m.notes.append("scheduler.params.last_batch_iteration is not used: a resumed job continues its "
                       "schedule from its own checkpoint.")
