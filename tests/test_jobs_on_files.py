"""Jobs on stored files (`"data": {"train": "file_…"}`) against the session's stack, whose store is an S3 server:
the submit takes only a processed file of the caller's and records its bytes and SHA-256; the node fetches it into
its cache and trains on it; a file whose object is gone from the store fails the job with `input_unavailable`."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.stack import Stack
from store.objects import Store
from tests.conftest import create_key, job_spec
from tests.helpers import events_of, wait_status
from tests.s3_support import store_config
from tests.test_files import checked, upload

END = {"succeeded", "failed", "cancelled"}
PARKED = {"queue": "files-parked"}  # no worker serves it: a submit is checked and nothing trains


@pytest.fixture(scope="module")
def owner(stack: Stack, stack_env: dict[str, str]) -> Iterator[httpx.Client]:
    key = create_key({**os.environ, **stack_env}, "onfiles-" + uuid.uuid4().hex[:8], "jobs:write")
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def store(stack_env: dict[str, str]) -> Store:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        os.environ.setdefault(var, stack_env[var])
    return Store(store_config(stack_env))


def processed(client: httpx.Client, content: bytes, fmt: str | None = None) -> str:
    created = upload(client, content, fmt=fmt)
    assert created.status_code == 201, created.text
    found = checked(client, created.json()["id"])
    assert found["status"] == "processed", found
    return str(found["id"])


def refused(r: httpx.Response, field: str) -> str:
    assert r.status_code == 422, r.text
    fields = {d["field"]: d["message"] for d in r.json()["error"]["details"]}
    assert field in fields, fields
    return fields[field]


@pytest.fixture(scope="module")
def trained(owner: httpx.Client, roots: dict[str, Path]) -> dict[str, Any]:
    """A job of the owner's, on a stored file, run to its end."""
    corpus = (roots["data"] / "corpus" / "train.txt").read_bytes()
    file_id = processed(owner, corpus)
    job = owner.post("/jobs", json=job_spec(name="on-a-file", data={"train": file_id, "validation": None,
                                                                     "validation_fraction": 0.1},
                                            hyperparameters={"max_steps": 8}, checkpointing={"every_steps": 8}))
    assert job.status_code == 201, job.text
    stored = job.json()["resolved"]["inputs"]["data.train"]
    assert stored == {"file_id": file_id, "key": f"files/{file_id}", "bytes": len(corpus),
                      "sha256": hashlib.sha256(corpus).hexdigest()}
    assert job.json()["request"]["data"]["train"] == file_id  # the request as sent
    return {"corpus": corpus, "stored": stored, "final": wait_status(owner, job.json()["id"], END, 400)}


def test_a_job_trains_on_a_stored_file_fetched_into_the_nodes_cache(trained: dict[str, Any],
                                                                     roots: dict[str, Path]) -> None:
    final = trained["final"]
    assert final["status"] == "succeeded", final["error"]
    # The node read its own verified copy, named by the file's SHA-256.
    assert (roots["cache"] / "sha256" / trained["stored"]["sha256"]).read_bytes() == trained["corpus"]


def test_a_job_continues_from_a_succeeded_jobs_exported_model(owner: httpx.Client, api: httpx.Client,
                                                              trained: dict[str, Any], make_job: Any) -> None:
    base = trained["final"]
    assert base["status"] == "succeeded", base["error"]
    data = {"train": trained["stored"]["file_id"], "validation": None}
    job = owner.post("/jobs", json=make_job(name="continued", model=base["id"], data=data,
                                            hyperparameters={"max_steps": 4}, checkpointing={"every_steps": 4}))
    assert job.status_code == 201, job.text
    listed = job.json()["resolved"]["base_model"]
    exported = {f["path"]: f["sha256"] for f in base["output"]["files"]}
    assert listed["job_id"] == base["id"] and {f["path"]: f["sha256"] for f in listed["files"]} == exported
    final = wait_status(owner, job.json()["id"], END, 400)
    assert final["status"] == "succeeded", final["error"]

    def first_loss(job_id: str) -> float:
        return float(next(e["loss"] for e in events_of(owner, job_id, ["progress"]) if e.get("loss") is not None))

    # It starts where the first job ended, not from the base model's random start.
    assert first_loss(final["id"]) < first_loss(base["id"]) - 0.5
    # Only a succeeded job of the caller's is a model.
    theirs = api.post("/jobs", json=make_job(model=base["id"], data=data, resources=PARKED))
    assert "no job" in refused(theirs, "model.name_or_path")
    parked = owner.post("/jobs", json=make_job(data=data, resources=PARKED)).json()
    unfinished = owner.post("/jobs", json=make_job(model=parked["id"], data=data, resources=PARKED))
    assert "queued" in refused(unfinished, "model.name_or_path")
    assert owner.post(f"/jobs/{parked['id']}/cancel").status_code == 202


def test_a_submit_takes_only_a_processed_file_of_the_callers_in_its_format(
        owner: httpx.Client, api: httpx.Client, make_job: Any) -> None:
    text_file = processed(owner, b"some text\n\nmore text\n", "text")
    chat = processed(owner, b'{"messages": [{"role": "user", "content": "hi"}, '
                            b'{"role": "assistant", "content": "hello"}]}\n')
    broken = upload(owner, b'{"messages": []}\n', fmt="chat").json()["id"]
    assert checked(owner, broken)["status"] == "error"
    theirs = processed(api, b"the default owner's text\n")

    def submit(client: httpx.Client, **data: Any) -> httpx.Response:
        return client.post("/jobs", json=make_job(data={"validation": None, **data}, resources=PARKED))

    assert "no file" in refused(submit(owner, train=theirs), "data.train")
    assert "no file" in refused(submit(owner, train="file_" + "0" * 24), "data.train")
    assert "error" in refused(submit(owner, train=broken), "data.train")
    assert "chat" in refused(submit(owner, train=chat, format="text"), "data.format")
    assert "text" in refused(submit(owner, train=chat, validation=text_file), "data.validation")
    # A dry run refuses alike and makes nothing.
    dry = owner.post("/jobs", params={"dry_run": "true"},
                     json=make_job(data={"train": broken, "validation": None}, resources=PARKED))
    assert "error" in refused(dry, "data.train")
    # The format left out is the file's own.
    ok = submit(owner, train=chat)
    assert ok.status_code == 201, ok.text
    assert ok.json()["resolved"]["spec"]["data"]["format"] == "chat"
    assert owner.post(f"/jobs/{ok.json()['id']}/cancel").status_code == 202


def test_a_stored_file_gone_from_the_store_fails_the_job_with_input_unavailable(
        owner: httpx.Client, make_job: Any, store: Store) -> None:
    file_id = processed(owner, b"a file whose object an operator deleted by hand\n" * 50)
    store.delete(f"files/{file_id}")
    job = owner.post("/jobs", json=make_job(name="input-gone", data={"train": file_id, "validation": None}))
    assert job.status_code == 201, job.text
    final = wait_status(owner, job.json()["id"], END, 300)
    assert final["status"] == "failed" and final["error"]["code"] == "input_unavailable", final
    assert file_id in final["error"]["message"]
