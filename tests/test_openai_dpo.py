"""OpenAI's preference fine-tuning (`method: {"type": "dpo"}`) through /v1, driven by the official `openai` SDK
against the session's real stack: a file of pairs in OpenAI's DPO shape trained to `succeeded` (the preferred
answer names a colour, the rejected one an animal), the job shown with its method as OpenAI reports it, trl's reward
figures in its metric events and checkpoints, and the exported model, downloaded as a user downloads it, ranking
pairs it never saw. Then each refusal, as a 400 naming OpenAI's param.

One real training run; every other job is cancelled at once or refused before it exists."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from contract.codes import PREFERENCE_METRICS
from scripts.stack import Stack
from tests.conftest import OPENAI_JOB_DEFAULTS
from tests.preference_support import pairs, ranking_accuracy
from tests.test_openai_jobs import BASE, Owner, chat_lines, follow, param_of

HELD_OUT = pairs(100, seed=99, shape="openai")
FIGURES = PREFERENCE_METRICS
# 240 pairs in batches of 8 for one epoch at the deployment's rate (tests/conftest.py OPENAI_JOB_DEFAULTS, 3e-3):
# 30 steps, as tests/test_dpo_trainer.py takes.
DPO = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 1, "batch_size": 8,
                                                  "learning_rate_multiplier": 1}}}

LONG_PAIR = {"input": {"messages": [{"role": "user", "content": "The quick brown fox " * 60}]},
             "preferred_output": [{"role": "assistant", "content": "Blue."}],
             "non_preferred_output": [{"role": "assistant", "content": "A horse."}]}

def lines(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.fixture(scope="module")
def owner(stack: Stack, stack_env: dict[str, str]) -> Iterator[Owner]:
    o = Owner(stack, stack_env, "oai-dpo")
    yield o
    o.close()


@pytest.fixture(scope="module")
def files(owner: Owner) -> dict[str, str]:
    return {"train": owner.upload(lines(pairs(240, seed=1, shape="openai")), "pairs.jsonl"),
            "validation": owner.upload(lines(pairs(40, seed=2, shape="openai")), "held-out.jsonl"),
            "chat": owner.upload(chat_lines(16), "chat.jsonl"),
            # Every prompt beyond the deployment's seq_len (64 tokens): no pair leaves room for an answer.
            "long": owner.upload(lines([LONG_PAIR] * 3), "long.jsonl")}


@pytest.fixture(scope="module")
def trained(owner: Owner, files: dict[str, str]) -> Any:
    job = owner.sdk.fine_tuning.jobs.create(model=BASE, training_file=files["train"],
                                            validation_file=files["validation"], suffix="prefers", method=DPO)
    assert job.method.type == "dpo" and job.method.supervised is None, job.method
    native = owner.http.get(f"/jobs/{job.id}").json()["resolved"]["spec"]
    assert native["method"]["type"] == "dpo" and native["method"]["dpo"]["beta"] == 0.1
    assert native["data"]["format"] == "preference"
    hp = native["hyperparameters"]
    assert (hp["epochs"], hp["examples_per_step"]) == (1.0, 8)
    assert hp["learning_rate"] == pytest.approx(OPENAI_JOB_DEFAULTS["hyperparameters"]["learning_rate"])
    return follow(owner, job.id)


def test_a_dpo_job_trains_to_succeeded_and_shows_its_method_as_openai_does(owner: Owner, trained: Any) -> None:
    assert trained.status == "succeeded", trained.error
    assert trained.fine_tuned_model == f"ft:{BASE}:{owner.name}:prefers:{trained.id}"
    method = trained.method
    assert method.type == "dpo" and method.supervised is None and method.dpo is not None
    shown = method.dpo.hyperparameters
    assert (shown.beta, shown.n_epochs, shown.batch_size, shown.learning_rate_multiplier) == (0.1, 1, 8, 1)
    top = trained.hyperparameters
    assert (top.n_epochs, top.batch_size, top.learning_rate_multiplier) == (1, 8, 1)
    assert trained.trained_tokens and trained.trained_tokens > 0


def test_metric_events_and_checkpoints_carry_the_reward_figures(owner: Owner, trained: Any) -> None:
    events = list(owner.sdk.fine_tuning.jobs.list_events(trained.id, limit=100))
    steps = [e.data for e in events if e.type == "metrics" and "train_loss" in e.data]
    assert steps and all(set(FIGURES) <= d.keys() for d in steps), steps[:2]
    evals = [e.data for e in events if e.type == "metrics" and "valid_loss" in e.data]
    assert evals and all({f"eval_{f}" for f in FIGURES} <= d.keys() for d in evals), evals
    # Newest first: the last evaluation ranks the held-out pairs of the validation file.
    assert evals[0]["eval_rewards/accuracies"] >= 0.9 and evals[0]["eval_rewards/margins"] > 0, evals[0]
    assert evals[0]["valid_loss"] < 0.5, evals[0]
    assert any("reward accuracy=" in e.message for e in events if e.type == "metrics")

    checkpoints = list(owner.sdk.fine_tuning.jobs.checkpoints.list(trained.id))
    assert checkpoints
    for c in checkpoints:
        metrics = c.metrics.to_dict()
        assert metrics["step"] == c.step_number and metrics["train_loss"] > 0
        assert set(FIGURES) <= metrics.keys(), metrics
    # The last step is checkpointed (every 2 steps) and evaluated: its checkpoint shows the evaluation's figures too.
    last = checkpoints[0].metrics.to_dict()
    assert last["step"] == evals[0]["step"] and last["valid_loss"] == evals[0]["valid_loss"]
    assert all(last[f"eval_{f}"] == evals[0][f"eval_{f}"] for f in FIGURES), (last, evals[0])


def test_the_exported_model_ranks_pairs_it_never_saw(owner: Owner, trained: Any, roots: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """Downloaded as a user downloads it (GET /jobs/{id}/output), loaded in transformers."""
    listing = owner.http.get(f"/jobs/{trained.id}/output")
    assert listing.status_code == 200, listing.text
    for f in listing.json()["files"]:
        got = owner.http.get(f["url"])
        assert got.status_code == 200, got.text
        (tmp_path / f["path"]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f["path"]).write_bytes(got.content)
    base = roots["models"] / BASE
    # Each answer scored where the job saw it: after the prompt as the trainer renders the conversation.
    ranked = (ranking_accuracy(base, HELD_OUT), ranking_accuracy(tmp_path, HELD_OUT))
    assert ranked[0] <= 0.75 and ranked[1] >= 0.9, ranked


def test_an_auto_beta_is_the_default_and_is_shown(owner: Owner, files: dict[str, str]) -> None:
    job = owner.sdk.fine_tuning.jobs.create(model=BASE, training_file=files["train"],
                                            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": "auto"}}})
    owner.sdk.fine_tuning.jobs.cancel(job.id)
    assert job.method.type == "dpo" and job.method.dpo is not None and job.method.dpo.hyperparameters.beta == 0.1
    assert owner.http.get(f"/jobs/{job.id}").json()["resolved"]["spec"]["method"]["dpo"]["beta"] == 0.1


DPO_BETA = "method.dpo.hyperparameters.beta"


@pytest.mark.parametrize(("change", "param", "says"), [
    ({"method": {"type": "reinforcement", "reinforcement": {}}}, "method.type", "reinforcement"),
    ({"training_file": "train"}, "training_file", "supervised"),  # pairs for a supervised job
    ({"training_file": "chat", "method": DPO}, "training_file", "dpo"),
    ({"validation_file": "chat", "method": DPO}, "validation_file", "dpo"),
    ({"training_file": "long", "method": DPO}, "training_file", "within seq_len 64"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}}, DPO_BETA, "above 0"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": -0.5}}}}, DPO_BETA, "above 0"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": "strong"}}}}, DPO_BETA, '"auto"'),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 1e9}}}}, DPO_BETA, "at most"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 0}}}},
     "method.dpo.hyperparameters.n_epochs", "auto"),
    ({"method": {"type": "dpo", "supervised": {}}}, "method.supervised", "dpo"),
    ({"method": {"type": "supervised", "dpo": {}}}, "method.dpo", "supervised"),
])
def test_a_bad_dpo_create_is_a_bad_request_naming_its_param(owner: Owner, files: dict[str, str],
                                                           change: dict[str, Any], param: str, says: str) -> None:
    body: dict[str, Any] = {"model": BASE, "training_file": files["train"], **change}
    for field in ("training_file", "validation_file"):
        if field in change:
            body[field] = files[change[field]]
    with pytest.raises(openai.BadRequestError) as caught:
        owner.sdk.fine_tuning.jobs.create(**body)
    assert param_of(caught.value) == param and says in caught.value.message, caught.value.body
