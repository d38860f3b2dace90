"""The OpenAI-compatible fine-tuning face (/v1/fine_tuning/jobs, /v1/models) driven by the official `openai` SDK
against the session's real stack: a chat file trained to `succeeded`, a job continued from its fine-tuned model,
events paged newest first, checkpoints, job pages, a cancel, and each refusal as the SDK's own error type.

Two real training runs in all (the first job and the one continued from it); every other job is cancelled at once
or refused before it exists."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from scripts.stack import Stack
from tests.conftest import OPENAI_JOB_DEFAULTS, create_key
from tests.helpers import events_of, wait_for

END = {"succeeded", "failed", "cancelled"}
BASE = "tiny-llama"  # FT_BASE_MODELS of the session's stack (tests/conftest.py)


def chat_lines(n: int, seed: int = 0) -> bytes:
    rows = [{"messages": [{"role": "system", "content": "You answer sums."},
                          {"role": "user", "content": f"What is {i} plus {i + seed}?"},
                          {"role": "assistant", "content": f"{i} plus {i + seed} is {2 * i + seed}."}]}
            for i in range(n)]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class Owner:
    """An owner of its own: a key, the SDK on /v1, and a raw client for what the native API still serves."""

    def __init__(self, stack: Stack, stack_env: dict[str, str], prefix: str) -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.key = create_key({**os.environ, **stack_env}, self.name, "jobs:write")
        # No retries: a 429 or 409 must surface at once, not after the SDK's back-off.
        self.sdk = openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key=self.key, max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)

    def upload(self, content: bytes, name: str = "train.jsonl") -> str:
        return self.sdk.files.create(file=(name, content), purpose="fine-tune").id

    def close(self) -> None:
        self.sdk.close()
        self.http.close()


@pytest.fixture(scope="module")
def owner(stack: Stack, stack_env: dict[str, str]) -> Iterator[Owner]:
    o = Owner(stack, stack_env, "oai")
    yield o
    o.close()


@pytest.fixture(scope="module")
def stranger(stack: Stack, stack_env: dict[str, str]) -> Iterator[Owner]:
    o = Owner(stack, stack_env, "oai-other")
    yield o
    o.close()


def follow(owner: Owner, job_id: str, timeout: float = 400) -> Any:
    return wait_for(lambda: (j := owner.sdk.fine_tuning.jobs.retrieve(job_id)).status in END and j, timeout,
                    f"{job_id} to end")


@pytest.fixture(scope="module")
def files(owner: Owner) -> dict[str, str]:
    return {"train": owner.upload(chat_lines(96)), "validation": owner.upload(chat_lines(8, seed=3), "val.jsonl")}


@pytest.fixture(scope="module")
def first(owner: Owner, files: dict[str, str]) -> Any:
    """A job made the way OpenAI's scripts make one (right after the upload, hyperparameters at the top level),
    followed to its end."""
    job = owner.sdk.fine_tuning.jobs.create(
        model=BASE, training_file=files["train"], validation_file=files["validation"], suffix="first", seed=7,
        metadata={"team": "blue", "run": "a"},
        hyperparameters={"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 2})
    assert job.object == "fine_tuning.job" and job.status in ("queued", "running"), job
    assert job.hyperparameters.n_epochs == 1 and job.hyperparameters.batch_size == 8
    assert job.hyperparameters.learning_rate_multiplier == 2 and job.seed == 7
    assert job.fine_tuned_model is None and job.trained_tokens is None and job.finished_at is None
    assert job.training_file == files["train"] and job.validation_file == files["validation"]
    assert job.organization_id == owner.name and job.metadata == {"team": "blue", "run": "a"}
    # The same job, natively: the body mapped onto the spec over the deployment's defaults.
    native = owner.http.get(f"/jobs/{job.id}").json()
    hp = native["resolved"]["spec"]["hyperparameters"]
    assert hp["learning_rate"] == pytest.approx(2 * OPENAI_JOB_DEFAULTS["hyperparameters"]["learning_rate"])
    assert (hp["epochs"], hp["examples_per_step"], hp["seed"], hp["seq_len"]) == (1.0, 8, 7, 64)
    assert native["resolved"]["spec"]["data"]["format"] == "chat" and native["name"] == "first"
    return follow(owner, job.id)


def test_a_job_trains_to_succeeded_with_its_fine_tuned_model_and_tokens(owner: Owner, first: Any) -> None:
    assert first.status == "succeeded", first.error
    assert first.fine_tuned_model == f"ft:{BASE}:{owner.name}:first:{first.id}"
    assert first.trained_tokens and first.trained_tokens > 0
    assert first.finished_at >= first.created_at and first.error is None and first.estimated_finish is None
    assert first.method.type == "supervised" and first.method.supervised.hyperparameters.batch_size == 8
    assert first.result_files == []


# batch_size 1 is the "auto" of 60 examples; tests/test_batching.py runs every size on every file without a stack.
@pytest.mark.parametrize(("examples", "batch_size"), [(400, 16), (10, 32), (60, "auto")])
def test_batch_size_counts_examples_on_small_files_as_openai_defines_it(owner: Owner, examples: int,
                                                                      batch_size: int | str) -> None:
    """An ordinary small file trains with OpenAI's batch_size (examples per step): the steps are OpenAI's
    `ceil(examples / batch_size)` per epoch, within what packing and the two processes' whole rows allow, as the
    `resolved` event states; the job shows the batch in examples it ran."""
    job = owner.sdk.fine_tuning.jobs.create(model=BASE, training_file=owner.upload(chat_lines(examples)),
                                            hyperparameters={"n_epochs": 1, "batch_size": batch_size})
    done = follow(owner, job.id)
    assert done.status == "succeeded", done.error
    native = owner.http.get(f"/jobs/{job.id}").json()
    (resolved,) = [e for e in events_of(owner.http, job.id, ["resolved"]) if "examples_per_step" in e]
    b = resolved["examples_per_step"]
    assert b == (batch_size if batch_size != "auto" else max(1, round(examples * 0.002)))
    assert done.hyperparameters.batch_size == done.method.supervised.hyperparameters.batch_size == b
    hp = native["resolved"]["spec"]["hyperparameters"]
    assert (hp["examples_per_step"], hp["global_batch_size"]) == (b, resolved["global_batch_size"])
    assert native["resolved"]["deepspeed_config"]["train_batch_size"] == resolved["global_batch_size"]
    steps = native["progress"]["total_steps"]
    assert steps == resolved["rows"] // resolved["global_batch_size"]
    # Each step's examples: rows per step x examples per row, which the rounding to whole rows (and to the two
    # processes' multiple) keeps within one row and one process's share of the batch asked for.
    per_row = examples / resolved["rows"]
    assert abs(resolved["global_batch_size"] * per_row - min(b, examples)) <= 2 * max(per_row, 1), resolved
    listed = [e.message for e in owner.sdk.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(f"{b} examples per step" in m for m in listed), listed


def test_events_page_newest_first_without_gaps_or_duplicates(owner: Owner, first: Any) -> None:
    page = owner.sdk.fine_tuning.jobs.list_events(first.id, limit=5)
    assert len(page.data) == 5 and page.has_more
    seen = [e for e in owner.sdk.fine_tuning.jobs.list_events(first.id, limit=5)]  # auto-paging
    ids = [e.id for e in seen]
    assert len(ids) == len(set(ids)) > 5
    seqs = [int(i.rsplit("-", 1)[1]) for i in ids]
    # Every event but the output lines, newest first, exactly once: what the native log holds.
    native = [e["id"] for e in events_of(owner.http, first.id) if e["type"] != "log"]
    assert seqs == sorted(native, reverse=True)
    assert seen[0].message == "The job has successfully completed" and seen[-1].message == "Fine-tuning job queued"
    metrics = [e for e in seen if e.type == "metrics" and "train_loss" in (e.data or {})]
    assert metrics and all(isinstance(e.data["step"], int) and isinstance(e.data["train_loss"], float)
                           for e in metrics)
    assert all(e.object == "fine_tuning.job.event" and e.level in ("info", "warn", "error") for e in seen)


def test_checkpoints_are_the_stores_committed_ones_newest_first(owner: Owner, first: Any) -> None:
    listed = list(owner.sdk.fine_tuning.jobs.checkpoints.list(first.id))
    stored = sorted((c["step"] for c in owner.http.get(f"/jobs/{first.id}/checkpoints").json()["data"]),
                    reverse=True)
    assert [c.step_number for c in listed] == stored and stored
    for c in listed:
        assert c.fine_tuned_model_checkpoint == f"{first.fine_tuned_model}:ckpt-step-{c.step_number}"
        assert c.fine_tuning_job_id == first.id and c.metrics.step == c.step_number
        assert c.metrics.train_loss is not None and c.metrics.train_loss > 0
    one = owner.sdk.fine_tuning.jobs.checkpoints.list(first.id, limit=1)
    assert [c.id for c in one.data] == [listed[0].id] and one.has_more is (len(listed) > 1)


def test_models_list_the_base_models_and_the_callers_fine_tuned_ones(owner: Owner, stranger: Owner,
                                                                      first: Any) -> None:
    ids = [m.id for m in owner.sdk.models.list()]
    assert BASE in ids and first.fine_tuned_model in ids
    found = owner.sdk.models.retrieve(first.fine_tuned_model)
    assert (found.id, found.owned_by, found.object) == (first.fine_tuned_model, owner.name, "model")
    assert owner.sdk.models.retrieve(BASE).owned_by == "system"
    assert first.fine_tuned_model not in [m.id for m in stranger.sdk.models.list()]
    with pytest.raises(openai.NotFoundError):
        stranger.sdk.models.retrieve(first.fine_tuned_model)
    with pytest.raises(openai.NotFoundError):
        owner.sdk.models.retrieve(f"ft:{BASE}:{owner.name}:wrong-suffix:{first.id}")
    with pytest.raises(openai.NotFoundError):
        owner.sdk.models.retrieve("org/no-such-model")  # a `/` in the id: the SDK sends it as %2F


def test_a_job_on_the_fine_tuned_model_continues_from_it(owner: Owner, files: dict[str, str], first: Any) -> None:
    job = owner.sdk.fine_tuning.jobs.create(
        model=first.fine_tuned_model, training_file=files["train"], suffix="second",
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 0.5}}})
    assert job.model == first.fine_tuned_model and job.hyperparameters.learning_rate_multiplier == 0.5
    native = owner.http.get(f"/jobs/{job.id}").json()
    assert native["resolved"]["base_model"]["job_id"] == first.id
    done = follow(owner, job.id)
    assert done.status == "succeeded", done.error
    # Named from the chain's first base model, as OpenAI names a model fine-tuned from a fine-tuned one.
    assert done.fine_tuned_model == f"ft:{BASE}:{owner.name}:second:{job.id}"

    def first_loss(job_id: str) -> float:
        return next(e["loss"] for e in events_of(owner.http, job_id, ["progress"]) if e.get("loss") is not None)

    assert first_loss(job.id) < first_loss(first.id) - 0.5  # it starts where the first one ended


def test_a_cancelled_job_and_pages_of_jobs(owner: Owner, files: dict[str, str], first: Any) -> None:
    job = owner.sdk.fine_tuning.jobs.create(model=BASE, training_file=files["train"], metadata={"team": "red"})
    cancelled = owner.sdk.fine_tuning.jobs.cancel(job.id)
    assert cancelled.id == job.id and cancelled.status == "cancelled"
    with pytest.raises(openai.ConflictError):
        owner.sdk.fine_tuning.jobs.cancel(first.id)  # it has ended
    page = owner.sdk.fine_tuning.jobs.list(limit=1)
    assert len(page.data) == 1 and page.has_more and page.data[0].id == job.id  # newest first
    every = [j.id for j in owner.sdk.fine_tuning.jobs.list(limit=1)]  # auto-paging, one job a page
    assert every[0] == job.id and first.id in every and len(every) == len(set(every)) >= 3
    assert [j.id for j in owner.sdk.fine_tuning.jobs.list(metadata={"team": "blue"})] == [first.id]
    assert [j.id for j in owner.sdk.fine_tuning.jobs.list(metadata={"team": "red"})] == [job.id]


def param_of(exc: openai.APIStatusError) -> Any:
    return exc.body["param"] if isinstance(exc.body, dict) else None  # type: ignore[index]


@pytest.mark.parametrize(("change", "param"), [
    ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"learning_rate_multiplier": -1}}, "hyperparameters.learning_rate_multiplier"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 0}}}},
     "method.supervised.hyperparameters.batch_size"),
    ({"method": {"type": "dpo", "dpo": {}}}, "training_file"),  # a dpo job on a chat file
    ({"method": {"type": "reinforcement"}}, "method.type"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
    ({"model": f"ft:{BASE}:someone:x:job_{'0' * 20}"}, "model"),
    ({"suffix": "has:colon"}, "suffix"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"training_file": "file_" + "0" * 24}, "training_file"),
])
def test_a_bad_create_is_a_bad_request_naming_its_param(owner: Owner, files: dict[str, str], change: dict[str, Any],
                                                        param: str) -> None:
    body = {"model": BASE, "training_file": files["train"], **change}
    with pytest.raises(openai.BadRequestError) as caught:
        owner.sdk.fine_tuning.jobs.create(**body)
    assert param_of(caught.value) == param, caught.value.body


def test_a_job_on_a_checkpoints_model_continues_from_that_checkpoint(owner: Owner, stranger: Owner,
                                                                     files: dict[str, str], first: Any) -> None:
    """Mapped onto the native `job_…@step-N` and resolved against the store's manifest (tests/
    test_checkpoints_store.py trains one to the end); this job is cancelled at once."""
    ckpt = list(owner.sdk.fine_tuning.jobs.checkpoints.list(first.id))[-1]
    job = owner.sdk.fine_tuning.jobs.create(model=ckpt.fine_tuned_model_checkpoint, training_file=files["train"],
                                            suffix="from-ckpt")
    owner.sdk.fine_tuning.jobs.cancel(job.id)
    assert job.model == ckpt.fine_tuned_model_checkpoint
    native = owner.http.get(f"/jobs/{job.id}").json()
    assert native["request"]["model"]["name_or_path"] == f"{first.id}@step-{ckpt.step_number}"
    base = native["resolved"]["base_model"]
    assert (base["job_id"], base["step"]) == (first.id, ckpt.step_number)
    assert owner.sdk.fine_tuning.jobs.retrieve(job.id).model == ckpt.fine_tuned_model_checkpoint
    for model, client in ((f"{first.fine_tuned_model}:ckpt-step-9999", owner),
                          (ckpt.fine_tuned_model_checkpoint.replace(":first:", ":other:"), owner),
                          (ckpt.fine_tuned_model_checkpoint, stranger)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.sdk.fine_tuning.jobs.create(model=model, training_file=files["train"])
        assert param_of(caught.value) == "model", caught.value.body


def test_another_owners_file_and_model_are_refused(owner: Owner, stranger: Owner, first: Any,
                                                    files: dict[str, str]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stranger.sdk.fine_tuning.jobs.create(model=BASE, training_file=files["train"])
    assert param_of(caught.value) == "training_file"
    with pytest.raises(openai.BadRequestError) as caught:
        stranger.sdk.fine_tuning.jobs.create(model=first.fine_tuned_model, training_file=files["train"])
    assert param_of(caught.value) == "model"


def test_unknown_and_another_owners_jobs_are_not_found(owner: Owner, stranger: Owner, first: Any) -> None:
    unknown = "job_" + "0" * 20
    for call in (lambda: owner.sdk.fine_tuning.jobs.retrieve(unknown),
                 lambda: owner.sdk.fine_tuning.jobs.list_events(unknown),
                 lambda: owner.sdk.fine_tuning.jobs.checkpoints.list(unknown),
                 lambda: stranger.sdk.fine_tuning.jobs.retrieve(first.id),
                 lambda: stranger.sdk.fine_tuning.jobs.cancel(first.id),
                 lambda: stranger.sdk.fine_tuning.jobs.list_events(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert first.id not in [j.id for j in stranger.sdk.fine_tuning.jobs.list()]
    with pytest.raises(openai.BadRequestError) as caught:
        owner.sdk.fine_tuning.jobs.list_events(first.id, after="not-an-event")
    assert param_of(caught.value) == "after"


def test_a_wrong_key_and_a_quota_hit(stack: Stack, stack_env: dict[str, str], api: httpx.Client,
                                     files: dict[str, str]) -> None:
    wrong = openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="ftk_" + "x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.fine_tuning.jobs.list()
    capped = Owner(stack, stack_env, "oai-capped")
    try:
        assert api.put(f"/owners/{capped.name}/quota", json={"max_active_jobs": 0}).status_code == 200
        train = capped.upload(chat_lines(8))
        with pytest.raises(openai.RateLimitError) as caught:
            capped.sdk.fine_tuning.jobs.create(model=BASE, training_file=train)
        assert "max_active_jobs" in str(caught.value.message)
        assert list(capped.sdk.fine_tuning.jobs.list()) == []
    finally:
        capped.close()
