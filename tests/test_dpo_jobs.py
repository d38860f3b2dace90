"""Preference jobs through `POST /jobs` on the session's stack: a supervised job first, then a dpo job whose model
is that job's output, on an uploaded file of pairs; what it learnt is checked on the export a user downloads. And
every way a job and its file can disagree about the method is refused at submit, naming the field."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.stack import Stack
from tests.conftest import create_key, job_spec
from tests.helpers import events_of, wait_status
from tests.preference_support import pairs, ranking_accuracy, write_pairs
from tests.test_cli import ft, ft_env
from tests.test_files import checked, upload
from tests.test_jobs_on_files import refused

END = {"succeeded", "failed", "cancelled"}
PARKED = {"queue": "dpo-parked"}  # no worker serves it: a submit is checked and nothing trains
HELD_OUT = pairs(100, seed=99)
DPO_HP = {"max_steps": 30, "learning_rate": 0.003, "warmup_steps": 2, "global_batch_size": 8, "seq_len": 64,
          "eval_every_steps": 15}


@pytest.fixture(scope="module")
def owner(stack: Stack, stack_env: dict[str, str]) -> Iterator[httpx.Client]:
    key = create_key({**os.environ, **stack_env}, "dpo-" + uuid.uuid4().hex[:8], "jobs:write")
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        yield client


def processed(client: httpx.Client, lines: list[Any], name: str = "pairs.jsonl") -> dict[str, Any]:
    created = upload(client, "".join(json.dumps(x) + "\n" for x in lines).encode(), filename=name)
    assert created.status_code == 201, created.text
    return checked(client, created.json()["id"])


@pytest.fixture(scope="module")
def pair_file(owner: httpx.Client) -> str:
    found = processed(owner, pairs(200, seed=1))
    assert found["status"] == "processed" and found["format"] == "preference", found
    assert found["stats"]["examples"] == 200 and set(found["stats"]["characters_per_side"]) == {
        "prompt", "chosen", "rejected"}
    return str(found["id"])


def download(client: httpx.Client, job_id: str, folder: Path) -> Path:
    listing = client.get(f"/jobs/{job_id}/output")
    assert listing.status_code == 200, listing.text
    for f in listing.json()["files"]:
        got = client.get(f["url"])
        assert got.status_code == 200, got.text
        (folder / f["path"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / f["path"]).write_bytes(got.content)
    return folder


def test_sft_then_dpo_from_its_output_learns_the_preferred_answers(owner: httpx.Client, pair_file: str,
                                                                     tmp_path: Path) -> None:
    sft = owner.post("/jobs", json=job_spec(name="sft-first", hyperparameters={"max_steps": 4},
                                            checkpointing={"every_steps": None}))
    assert sft.status_code == 201, sft.text
    assert sft.json()["resolved"]["spec"]["method"] == {"type": "supervised", "dpo": None}
    done = wait_status(owner, sft.json()["id"], END, 300)
    assert done["status"] == "succeeded", done["error"]

    job = owner.post("/jobs", json=job_spec(
        name="dpo-second", model=done["id"], data={"train": pair_file, "validation": None, "validation_fraction": 0.2},
        hyperparameters=DPO_HP, method={"type": "dpo", "dpo": {"beta": 0.1}}, checkpointing={"every_steps": None}))
    assert job.status_code == 201, job.text
    body = job.json()
    assert body["resolved"]["base_model"]["job_id"] == done["id"]
    assert body["resolved"]["spec"]["data"]["format"] == "preference"
    assert body["resolved"]["spec"]["method"]["dpo"]["reference"] == "auto"
    final = wait_status(owner, body["id"], END, 400)
    assert final["status"] == "succeeded", final["error"]

    (started,) = events_of(owner, body["id"], ["started"])
    assert started["method"] == "dpo" and started["reference"] == "precomputed"
    evals = events_of(owner, body["id"], ["eval"])
    assert [e["step"] for e in evals] == [15, 30], evals
    assert evals[-1]["rewards/accuracies"] >= 0.9, evals[-1]
    progress = events_of(owner, body["id"], ["progress"])
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins"} <= progress[-1].keys()
    # The job's own progress, as a dashboard polls it, carries the figures too.
    assert final["progress"]["rewards/accuracies"] == progress[-1]["rewards/accuracies"]

    # `ft` shows the reward figures: in a job's table, and in each eval line of a watch (replayed from the start).
    env = ft_env(str(owner.base_url), owner.headers["Authorization"].removeprefix("Bearer "))
    shown = ft(env, "get", body["id"])
    assert shown.returncode == 0 and "rewards" in shown.stdout and "accuracy" in shown.stdout, shown.stdout
    watched = ft(env, "watch", body["id"])
    assert watched.returncode == 0 and "eval at step 30: loss" in watched.stdout \
        and "accuracy" in watched.stdout, watched.stdout

    base = download(owner, done["id"], tmp_path / "sft")
    tuned = download(owner, body["id"], tmp_path / "dpo")
    assert ranking_accuracy(base, HELD_OUT) <= 0.75
    assert ranking_accuracy(tuned, HELD_OUT) >= 0.9


def test_a_method_and_a_file_that_disagree_are_refused_at_submit_naming_the_field(
        owner: httpx.Client, pair_file: str) -> None:
    chat = processed(owner, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
                     name="chat.jsonl")
    assert chat["status"] == "processed" and chat["format"] == "chat", chat
    on_pairs = {"train": pair_file, "validation": None}
    message = refused(owner.post("/jobs", json=job_spec(data=on_pairs, resources=PARKED)), "data.train")
    assert "preference file" in message and "method.type to 'dpo'" in message, message
    message = refused(owner.post("/jobs", json=job_spec(data={"train": chat["id"], "validation": None},
                                                        method={"type": "dpo"}, resources=PARKED)), "data.train")
    assert "chat file" in message and "preference pairs" in message, message
    message = refused(owner.post("/jobs", json=job_spec(data={**on_pairs, "format": "chat"}, method={"type": "dpo"},
                                                        resources=PARKED)), "data.format")
    assert "dpo job trains on preference pairs" in message, message
    refused(owner.post("/jobs", json=job_spec(data=on_pairs, method={"type": "supervised", "dpo": {"beta": 1}},
                                              resources=PARKED)), "method.dpo")
    refused(owner.post("/jobs", json=job_spec(data=on_pairs, method={"type": "reinforcement"}, resources=PARKED)),
            "method.type")
    for bad in ({"beta": 0}, {"beta": -1}, {"beta": "auto"}, {"loss": "hinge"}, {"reference": "adapters_off"},
                {"sft_weight": -0.5}):
        r = owner.post("/jobs", json=job_spec(data=on_pairs, method={"type": "dpo", "dpo": bad}, resources=PARKED))
        field = "method.dpo." + next(iter(bad))
        refused(r, field)
    ok = owner.post("/jobs", json=job_spec(data=on_pairs, method={"type": "dpo"}, resources=PARKED))
    assert ok.status_code == 201, ok.text


def test_a_dpo_job_none_of_whose_pairs_fits_its_length_is_refused_at_submit(owner: httpx.Client) -> None:
    long_prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 6, "chosen": " Yes.", "rejected": " No."}
    too_long = processed(owner, [long_prompt] * 3 + [{**long_prompt, "prompt": long_prompt["prompt"][:-12]}])
    assert too_long["status"] == "processed", too_long
    before = owner.get("/jobs", params={"limit": 200}).json()["data"]
    spec = job_spec(data={"train": too_long["id"], "validation": None}, method={"type": "dpo"}, resources=PARKED,
                    hyperparameters={"seq_len": 16})
    message = refused(owner.post("/jobs", json=spec), "hyperparameters.seq_len")
    # The shortest prompt is the last line's; the least seq_len that fits it is named.
    assert "line 4" in message and "raise seq_len to at least" in message, message
    assert owner.get("/jobs", params={"limit": 200}).json()["data"] == before
    refused(owner.post("/jobs", params={"dry_run": "true"}, json=spec), "hyperparameters.seq_len")
    least = int(message.rsplit(" ", 1)[-1])
    ok = owner.post("/jobs", json={**spec, "hyperparameters": {**spec["hyperparameters"], "seq_len": least}})
    assert ok.status_code == 201, ok.text
    owner.post(f"/jobs/{ok.json()['id']}/cancel")
    # One pair that fits, after three that do not, lets the job through: the trainer keeps that pair.
    one_fits = processed(owner, [long_prompt] * 3 + [{"prompt": "Hi", "chosen": " Yes.", "rejected": " No."}])
    spec["data"]["train"] = one_fits["id"]
    # The dry run shows what the trainer will keep, cut and drop, counted with the job's tokenizer.
    dry = owner.post("/jobs", params={"dry_run": "true"}, json=spec)
    assert dry.status_code == 200, dry.text
    pairs = dry.json()["pairs"]
    assert pairs["complete"] and pairs["lines_read"] == 4 and pairs["pairs_kept"] == 1, pairs
    assert pairs["dropped"] == {"prompt_too_long": 3} and pairs["dropped_lines"] == [1, 2, 3], pairs
    assert pairs["shortest_prompt_line"] == 4 and pairs["tokens"]["prompt"] == pairs["shortest_prompt"] > 0, pairs
    ok = owner.post("/jobs", json=spec)
    assert ok.status_code == 201, ok.text
    owner.post(f"/jobs/{ok.json()['id']}/cancel")


def test_the_example_dpo_job_is_accepted(owner: httpx.Client, roots: dict[str, Path]) -> None:
    """examples/dpo-job.json as `make demo` leaves its data (scripts/demo.py writes the pairs beside the corpus)."""
    write_pairs(roots["data"] / "demo" / "pairs.jsonl", 200, seed=1, shape="openai")
    job = json.loads((Path(__file__).parent.parent / "examples" / "dpo-job.json").read_text())
    job["resources"]["queue"] = PARKED["queue"]
    r = owner.post("/jobs", json=job)
    assert r.status_code == 201, r.text
    assert r.json()["resolved"]["spec"]["method"]["dpo"]["beta"] == 0.1
    owner.post(f"/jobs/{r.json()['id']}/cancel")


def test_a_file_of_malformed_pairs_is_refused_line_by_line_and_trains_nothing(owner: httpx.Client) -> None:
    good = pairs(3, seed=5)
    lines = [good[0],
             {"prompt": "p", "chosen": " same.", "rejected": " same."},
             {"prompt": "p", "chosen": "", "rejected": " x."},
             {"input": {"messages": [{"role": "user", "content": "q"}]},
              "preferred_output": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
              "non_preferred_output": [{"role": "assistant", "content": "c"}]},
             {"prompt": "p", "chosen": " x."}]
    found = processed(owner, lines)
    assert found["status"] == "error", found
    by_line = {e["line"]: e["message"] for e in found["errors"]}
    assert set(by_line) == {2, 3, 4, 5}, by_line
    assert "same answer" in by_line[2] and "empty" in by_line[3] and "2 messages" in by_line[4] \
        and "rejected" in by_line[5], by_line
    r = owner.post("/jobs", json=job_spec(data={"train": found["id"], "validation": None}, method={"type": "dpo"},
                                          resources=PARKED))
    assert "validation found errors" in refused(r, "data.train")
    # No pair at all, and a file of demonstrations declared as pairs: each refused by the same check.
    blank = checked(owner, upload(owner, b"\n\n  \n", filename="blank.jsonl", fmt="preference").json()["id"])
    assert blank["status"] == "error" and blank["errors"] == [{"line": None, "message": "is empty"}], blank
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    declared = checked(owner, upload(owner, (json.dumps(chat) + "\n").encode(), filename="c.jsonl",
                                     fmt="preference").json()["id"])
    assert declared["status"] == "error" and declared["errors"][0]["line"] == 1, declared
    assert "chat example" in declared["errors"][0]["message"], declared


class _OneLine(io.RawIOBase):
    """A pair file of one line of `size` bytes made as it is read: the start of a pair, then letters, no newline."""

    def __init__(self, size: int) -> None:
        self.head = b'{"prompt": "'
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left)
        view = memoryview(buffer)
        head, self.head = self.head[:n], self.head[n:]
        view[:len(head)] = head
        view[len(head):n] = b"a" * (n - len(head))
        self.left -= n
        return n


def test_a_file_of_one_line_past_the_line_limit_is_refused_at_its_line_and_trains_nothing(
        owner: httpx.Client) -> None:
    """Stored whole (the upload limit is larger), then refused by the check at line 1 for its length, read in
    constant memory; a job on it is refused at submit naming the field. 80 MiB here, past the 64 MiB line limit;
    FT_TEST_ONE_LINE_BYTES runs the same with another size (bench/RESULTS.md names the 1 GiB run)."""
    size = int(os.environ.get("FT_TEST_ONE_LINE_BYTES", 80 << 20))
    r = owner.post("/files", data={"purpose": "fine-tune", "format": "preference"},
                   files={"file": ("one-line.jsonl", _OneLine(size), "application/octet-stream")}, timeout=600)
    assert r.status_code == 201, r.text
    assert r.json()["bytes"] == size
    found = checked(owner, r.json()["id"], timeout=600)
    assert found["status"] == "error", found
    assert found["errors"] == [{"line": 1, "message": f"is longer than {64 << 20} bytes"}], found["errors"]
    r = owner.post("/jobs", json=job_spec(data={"train": found["id"], "validation": None}, method={"type": "dpo"},
                                          resources=PARKED))
    assert "validation found errors" in refused(r, "data.train")
    assert owner.delete(f"/files/{found['id']}").status_code in (200, 204)
