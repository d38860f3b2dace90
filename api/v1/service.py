"""What the OpenAI-compatible routes do beyond parsing: a create mapped onto the native submit (the same
api/services/jobs.py `create`: validation, quotas and idempotency shared), and the native job, event and checkpoint
shaped as OpenAI's FineTuningJob, FineTuningJobEvent and FineTuningJobCheckpoint
(openai/types/fine_tuning/*.py)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import orjson

from api import filewait
from api.access import Principal
from api.errors import ApiError, ErrorCode
from api.services import jobs as native
from api.settings import ApiSettings
from api.v1 import hyperparameters as hp
from api.v1 import names
from contract.codes import EventKind, FailureCode, JobStatus
from contract.codes import Method as NativeMethod
from contract.openai import EventType, Level, OpenAIStatus
from contract.protocol import StateField
from contract.spec import checkpoint_name, checkpoint_ref, is_file_id, is_job_id
from db import finetuning as store
from db import reads
from db.errors import NotFound
from store import checkpoints as stored


def seconds(value: Any) -> int | None:
    """A Unix timestamp of a Postgres timestamp (as JSON text or as a datetime)."""
    if value is None:
        return None
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return int(when.timestamp())


# -- names --

def model_name(job: dict[str, Any], lineage: store.Lineage | None) -> str:
    """The fine-tuned model a job makes (or made), named from its chain's first base model."""
    base = lineage.base if lineage else job["request"]["model"]["name_or_path"]
    return names.fine_tuned_model(base=base, owner=job["owner"], suffix=job["name"], job_id=job["id"])


async def fine_tuned_job(name: str, owner: str | None) -> dict[str, Any]:
    """The succeeded job whose model `name` is; NotFound (field `model`) otherwise."""
    job_id = names.job_of_model(name)
    missing = NotFound(f"there is no fine-tuned model {name!r} of yours", "model")
    if job_id is None:
        raise missing
    try:
        job = orjson.loads(await reads.job(job_id, owner))
    except NotFound:
        raise missing from None
    if job["status"] != JobStatus.SUCCEEDED or model_name(job, (await store.lineage([job_id])).get(job_id)) != name:
        raise missing
    return job


async def checkpoint_job(name: str, owner: str | None) -> tuple[str, int]:
    """(job id, step) of a checkpoint's model name whose job is the caller's and whose name is that job's own;
    NotFound (field `model`) otherwise. Whether the step is committed, the native submit checks."""
    found = names.checkpoint_of_model(name)
    missing = NotFound(f"there is no fine-tuned model checkpoint {name!r} of yours", "model")
    if found is None:
        raise missing
    job_id, step = found
    try:
        job = orjson.loads(await reads.job(job_id, owner))
    except NotFound:
        raise missing from None
    if names.checkpoint_model(model_name(job, (await store.lineage([job_id])).get(job_id)), step) != name:
        raise missing
    return job_id, step


async def native_model(name: str, caller: Principal) -> str:
    """The native model name of a job's `model`: a fine-tuned model's name is its job's id, a checkpoint's model
    name is its job's checkpoint (`job_…@step-N`) (continued fine-tuning); any name the native API takes is taken
    as it is."""
    if names.checkpoint_of_model(name) is not None:
        try:
            return checkpoint_name(*await checkpoint_job(name, caller.owner))
        except NotFound as exc:
            raise hp.bad_request("model", exc.message) from None
    if name.startswith(names.FT_PREFIX):
        try:
            return str((await fine_tuned_job(name, caller.owner))["id"])
        except NotFound as exc:
            raise hp.bad_request("model", exc.message) from None
    return name


# -- create --

async def wait_for_files(settings: ApiSettings, owner: str, file_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Wait, at most FT_OPENAI_FILE_WAIT_SECONDS, for the named files the validator has not decided on yet
    (api/filewait.py): scripts upload and create at once. Returns the rows found, for the submit to use rather than
    read again; what is still undecided then, the native submit refuses, naming it."""
    deadline = time.monotonic() + settings.openai_file_wait_seconds
    found: dict[str, dict[str, Any]] = {}
    for file_id in file_ids:
        row = await filewait.waits.decided(owner, file_id, deadline)
        if row is not None:  # None: refused by the submit, as no file of the caller's
            found[file_id] = row
    return found


async def create(*, settings: ApiSettings, body: hp.FineTuningJobCreate, caller: Principal,
                 idempotency_key: str | None) -> tuple[int, dict[str, Any]]:
    hp.chosen_hyperparameters(body)  # refuses what is not supported before anything is looked up
    model = await native_model(body.model, caller)
    found = await wait_for_files(settings, caller.owner,
                                 [f for f in (body.training_file, body.validation_file) if f and is_file_id(f)])
    defaults = hp.parse_defaults(settings.openai_job_defaults)
    spec, param = hp.native_spec(body, model=model, defaults=defaults)
    try:
        status, answer = await native.create(settings=settings, spec=spec, caller=caller,
                                             idempotency_key=idempotency_key, files_found=found)
    except ApiError as exc:
        raise hp.renamed(exc, param) from None
    job = orjson.loads(answer)
    return status, (await views(settings, [job]))[0]


# -- shapes --

def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


# The failures that are about the training data: OpenAI names the file then.
FILE_FAILURES = (FailureCode.DATA_ERROR, FailureCode.INPUT_UNAVAILABLE)


def _error(job: dict[str, Any]) -> dict[str, Any] | None:
    err = job["error"]
    if job["status"] != JobStatus.FAILED or not err:
        return None
    code = str(err.get("code") or FailureCode.WORKER_ERROR)
    return {"code": code, "message": str(err.get("message") or code),
            "param": "training_file" if code in [c.value for c in FILE_FAILURES] else None}


def is_dpo(job: dict[str, Any]) -> bool:
    return (job["resolved"]["spec"].get("method") or {}).get("type") == NativeMethod.DPO


def method_view(spec: dict[str, Any], hyper: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `method` of a resolved spec: its type and its hyperparameters as resolved, a dpo job's beta too."""
    method = spec.get("method") or {}  # a spec stored before methods existed is supervised
    if method.get("type") == NativeMethod.DPO:
        dpo = hp.MethodType.DPO.value
        return {"type": dpo, dpo: {"hyperparameters": {**hyper, "beta": _number(method["dpo"]["beta"])}}}
    supervised = hp.MethodType.SUPERVISED.value
    return {"type": supervised, supervised: {"hyperparameters": hyper}}


def view(job: dict[str, Any], lineage: store.Lineage | None, default_lr: float) -> dict[str, Any]:
    """A native job (db/reads.py JOB_JSON) as a FineTuningJob."""
    spec = job["resolved"]["spec"]
    resolved_hp = spec["hyperparameters"]
    # OpenAI's batch_size counts examples: "auto" until the trainer settles it on the data, rows for a native job.
    per_step = resolved_hp.get("examples_per_step")
    hyper = {"n_epochs": _number(resolved_hp["epochs"]),
             "batch_size": resolved_hp["global_batch_size"] if per_step is None else per_step,
             "learning_rate_multiplier": round(resolved_hp["learning_rate"] / default_lr, 6)}
    status = names.status(job["status"])
    progress = job["progress"] or {}
    running = status == OpenAIStatus.RUNNING and progress.get("eta_seconds") is not None
    model = job["request"]["model"]["name_or_path"]
    ref = checkpoint_ref(model)
    if lineage is not None and lineage.parent_id is not None and (is_job_id(model) or ref is not None):
        # A continued fine-tune shows the model it was given: its parent's fine-tuned model, or its checkpoint's.
        parent = names.fine_tuned_model(base=lineage.base, owner=lineage.parent_owner or job["owner"],
                                        suffix=lineage.parent_name or "", job_id=lineage.parent_id)
        model = parent if ref is None else names.checkpoint_model(parent, ref[1])
    succeeded = status == OpenAIStatus.SUCCEEDED
    return {
        "id": job["id"], "object": "fine_tuning.job", "model": model, "created_at": seconds(job["created_at"]),
        "finished_at": seconds(job.get("finished_at")), "status": status.value,
        "fine_tuned_model": model_name(job, lineage) if succeeded else None,
        "organization_id": job["owner"], "training_file": job["request"]["data"]["train"],
        "validation_file": job["request"]["data"].get("validation"), "hyperparameters": hyper,
        "method": method_view(spec, hyper),
        "seed": resolved_hp["seed"], "trained_tokens": progress.get("tokens_seen") if succeeded else None,
        "estimated_finish": int(time.time() + float(progress["eta_seconds"])) if running else None,
        "error": _error(job), "result_files": [], "integrations": [], "metadata": job.get("metadata") or {},
        "user_provided_suffix": job["name"] or None,
    }


async def views(settings: ApiSettings, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = await store.lineage([j["id"] for j in jobs])
    default_lr = hp.default_learning_rate(hp.parse_defaults(settings.openai_job_defaults))
    return [view(j, found.get(j["id"]), default_lr) for j in jobs]


STATE_MESSAGES = {JobStatus.QUEUED.value: "Fine-tuning job queued",
                  JobStatus.STARTING.value: "Fine-tuning job starting",
                  JobStatus.RUNNING.value: "Fine-tuning job started",
                  JobStatus.CANCELLING.value: "Fine-tuning job cancelling",
                  JobStatus.SUCCEEDED.value: "The job has successfully completed",
                  JobStatus.CANCELLED.value: "Fine-tuning job cancelled"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rewards(data: dict[str, Any]) -> str:
    """A dpo step's ranking of its pairs, for the event's message (its `data` holds every figure)."""
    accuracy, margin = data.get("rewards/accuracies"), data.get("rewards/margins")
    if not (_is_number(accuracy) and _is_number(margin)):
        return ""
    return f", reward accuracy={accuracy:.2f}, reward margin={margin:.4f}"


def dpo_figures(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """trl's figures of a progress or eval event's data, keyed `prefix` + trl's name."""
    return {prefix + name: float(data[name]) for name in names.DPO_FIGURES if _is_number(data.get(name))}


def _event_message(kind: str, data: dict[str, Any]) -> tuple[str, Level]:
    level = Level.INFO
    if kind == EventKind.STATE:
        status = str(data.get("status"))
        message = STATE_MESSAGES.get(status, f"Fine-tuning job {status}")
        if status == JobStatus.FAILED:
            err = data[StateField.ERROR] if isinstance(data.get(StateField.ERROR), dict) else {}
            level, message = Level.ERROR, f"Fine-tuning job failed: {err.get('message') or err.get('code')}"
        return message, level
    if kind == EventKind.PROGRESS:
        loss, step = data.get("loss"), f"Step {data.get('step')}/{data.get('total_steps')}"
        return (f"{step}: training loss={loss:.4f}{_rewards(data)}" if _is_number(loss) else step), level
    if kind == EventKind.EVAL:
        return f"Step {data.get('step')}: validation loss={data.get('loss')}{_rewards(data)}", level
    if kind == EventKind.CHECKPOINT:
        return f"Checkpoint created at step {data.get('step')}", level
    if kind == EventKind.STARTED:
        return f"Training started: {data.get('total_steps')} steps on {data.get('world_size')} processes", level
    if kind == EventKind.COMPLETED:
        return f"Training completed at step {data.get('steps')}; model exported", level
    if kind == EventKind.ERROR:
        return f"Error: {data.get('message') or data.get('code')}", Level.ERROR
    if kind == EventKind.ADAPTED:
        return (f"Out of memory in the {data.get('phase')} at step {data.get('step')}; continuing with "
                f"{data.get('change')}"), Level.WARN
    if kind == EventKind.RESOLVED:
        return f"Batch settled: {data.get('reason')}", level
    if kind in (EventKind.INTERRUPTED, EventKind.UNREADABLE):
        return f"{kind}: {data.get('reason') or data.get('message') or ''}".rstrip(": "), Level.WARN
    return f"{kind}: {data.get('reason') or data.get('message') or ''}".rstrip(": "), level


def event_view(job_id: str, seq: int, kind: str, created_at: datetime, data: dict[str, Any]) -> dict[str, Any]:
    """A native event (db/finetuning.py `events_newest_first`) as a FineTuningJobEvent."""
    message, level = _event_message(kind, data)
    shown: dict[str, Any] = {}
    if kind == EventKind.PROGRESS:
        shown = {"step": data.get("step"), "total_steps": data.get("total_steps"), "train_loss": data.get("loss"),
                 "learning_rate": data.get("lr"), "tokens_seen": data.get("tokens_seen"), **dpo_figures(data)}
    elif kind == EventKind.EVAL:
        shown = {"step": data.get("step"), "valid_loss": data.get("loss"), **dpo_figures(data, names.EVAL_PREFIX)}
    elif kind == EventKind.CHECKPOINT:
        shown = {"step": data.get("step")}
    elif kind == EventKind.STATE:
        shown = {"status": data.get("status")}
    return {"id": names.event_id(job_id, seq), "object": "fine_tuning.job.event", "created_at": seconds(created_at),
            "level": level.value, "message": message,
            "type": (EventType.METRICS if kind in names.METRIC_KINDS else EventType.MESSAGE).value,
            "data": shown}


# Every event kind but the figures' own, which their read leaves out.
NOT_FIGURES = [k.value for k in EventKind if k not in names.METRIC_KINDS]
FIGURES_PAGE = 500
# How far back a checkpoint page reads for its steps' figures. A page's checkpoints are the newest kept ones, whose
# steps lie within the job's last reports; a job that reported more since has its losses shown all the same
# (db/finetuning.py losses_at) and its reward figures left out.
MAX_FIGURE_EVENTS = 20_000


async def dpo_figures_at(job_id: str, steps: list[int]) -> dict[int, dict[str, float]]:
    """trl's figures at each step: a training step's as the training loss is taken (the last reported at or before
    the step), and the evaluation's at the step, `eval_`-prefixed. Read newest first: an evaluation at a step
    follows the step's report, so the search ends once every step has its training figures."""
    found: dict[int, dict[str, float]] = {s: {} for s in steps}
    train_left, eval_left = set(steps), set(steps)
    before, read = names.MAX_SEQ, 0
    while train_left and read < MAX_FIGURE_EVENTS:
        rows, more = await store.events_newest_first(job_id, before=before, limit=FIGURES_PAGE,
                                                     leave_out=NOT_FIGURES)
        for _, kind, _, data in rows:
            step = data.get("step")
            if not isinstance(step, int):
                continue
            if kind == EventKind.PROGRESS:
                for s in [s for s in train_left if step <= s]:
                    found[s].update(dpo_figures(data))
                    train_left.discard(s)
            elif step in eval_left:
                found[step].update(dpo_figures(data, names.EVAL_PREFIX))
                eval_left.discard(step)
        if not more or not rows:
            break
        before, read = rows[-1][0], read + len(rows)
    return found


def checkpoint_view(job: dict[str, Any], lineage: store.Lineage | None, manifest: stored.Manifest,
                    losses: tuple[float | None, float | None], figures: dict[str, float]) -> dict[str, Any]:
    train_loss, valid_loss = losses
    metrics: dict[str, Any] = {"step": manifest.step}
    if train_loss is not None:
        metrics["train_loss"] = train_loss
    if valid_loss is not None:
        metrics["valid_loss"] = valid_loss
    metrics.update(figures)
    return {"id": names.checkpoint_id(job["id"], manifest.step), "object": "fine_tuning.job.checkpoint",
            "created_at": seconds(manifest.created_at), "step_number": manifest.step, "metrics": metrics,
            "fine_tuned_model_checkpoint": names.checkpoint_model(model_name(job, lineage), manifest.step),
            "fine_tuning_job_id": job["id"]}


def not_found(job_id: str) -> ApiError:
    return ApiError(404, ErrorCode.NOT_FOUND, f"no fine-tuning job with id {job_id!r}", "fine_tuning_job_id")
