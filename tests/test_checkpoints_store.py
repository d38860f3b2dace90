"""Every committed checkpoint lives in the artifact store: uploaded beside training, committed by a manifest,
resumed from the store on a node whose disk holds nothing of the job, listed and served by the API.

Against the real things: the session stack (its store is a real S3 server), the real launcher, and for the
outage an S3 server of the test's own, really stopped and started again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.storage import StoreConfig
from scripts.stack import ROOT
from store import checkpoints as stored
from store import layout
from store.objects import Store
from tests.conftest import create_key, job_spec
from tests.helpers import events_of, free_port, job_processes, wait_for, wait_status
from tests.s3_support import CREDENTIALS, S3Server, store_config
from tests.trainer_support import corpus, launch, make_job, of, tiny_model, train_file, write_run_spec  # noqa: F401


def store_of(env: dict[str, str]) -> Store:
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    return Store(store_config(env))


def with_store(spec_path: Path, config: StoreConfig, job_id: str) -> Path:
    run = json.loads(spec_path.read_text())
    run["paths"]["store"] = {"config": config.model_dump(), "job_id": job_id}
    spec_path.write_text(json.dumps(run))
    return spec_path


def test_training_goes_on_while_the_store_is_down_and_commits_once_it_is_back(
        tmp_path: Path, tiny_model: Path, corpus: str, roots: dict[str, Path]) -> None:  # noqa: F811
    server = S3Server(roots["logs"])
    try:
        bucket = server.bucket()
        env = server.env(bucket)
        store = store_of(env)
        job = make_job(tiny_model, train_file(tmp_path, corpus), hyperparameters={"max_steps": 12},
                       checkpointing={"every_steps": 4, "keep_last": 2})
        spec = with_store(write_run_spec(tmp_path, job), store_config(env), "job_outage")
        server.stop()
        seen: dict[str, Any] = {}

        def on_event(event: dict[str, Any], proc: Any) -> None:
            # Steps past the first save go on while its upload waits for the store; then the upload process, in
            # the middle of retrying it, is killed, and the store comes back.
            if event["event"] == "progress" and event["step"] >= 6 and "restarted" not in seen:
                seen["checkpoints_before"] = len(of(seen.setdefault("events", []), "checkpoint"))
                pushers = [int(p.split(":")[0]) for p in job_processes(server.endpoint) if "store.push" in p]
                for pid in pushers:
                    os.kill(pid, signal.SIGKILL)
                seen["killed"] = len(pushers)
                seen["restarted"], seen["restarted_at"] = True, time.time()
                threading.Thread(target=server.start_again, args=([bucket],), daemon=True).start()
            seen.setdefault("events", []).append(event)

        rc, events, tail = launch(spec, on_event=on_event)
        assert rc == 0, tail
        assert seen.get("restarted") and seen["checkpoints_before"] == 0, "a checkpoint was committed while down"
        # One upload process (node 0's), killed mid-request: another took the request over.
        assert seen["killed"] == 1 and "the upload process ended (exit status -9)" in tail, tail[-4000:]
        assert not of(events, "error"), tail
        committed = of(events, "checkpoint")
        assert [c["step"] for c in committed] == [4, 8, 12], (committed, tail[-6000:])
        assert all(c["committed"] and c["key"].endswith(".json") for c in committed)
        # What each save cost training, and how long its upload took: the first one's waited out the outage.
        assert all(c["save_s"] > 0 and c["waited_s"] >= 0 and c["upload_s"] > 0 for c in committed), committed
        (step5,) = [e for e in of(events, "progress") if e["step"] == 5]
        assert committed[0]["upload_s"] >= seen["restarted_at"] - step5["ts"] > 0, committed[0]
        manifests, unreadable = stored.read_all(store, "job_outage")
        assert not unreadable and [m.step for m in manifests] == [12, 8]
        # Nothing but the kept checkpoints' objects (and their part lists) is left.
        named = {f.key for m in manifests for f in m.files}
        left = {i.key for i in store.list(layout.checkpoints_prefix("job_outage"))}
        assert named <= left
        assert {k for k in left - named if "/parts/" not in k and not stored.is_manifest_key("job_outage", k)} \
            == set()
    finally:
        server.stop()


def test_a_store_still_down_at_the_end_costs_the_job_no_wait_and_leaves_no_upload_process(
        tmp_path: Path, tiny_model: Path, corpus: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # One save, the last step's (an earlier one's upload would hold the next save until the store is back).
    job = make_job(tiny_model, train_file(tmp_path, corpus), hyperparameters={"max_steps": 4},
                   checkpointing={"every_steps": 4, "keep_last": 2})
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    # Nothing listens there: every upload of the job fails.
    nowhere = StoreConfig(url="s3://bucket/p", options={"endpoint": f"http://127.0.0.1:{free_port()}"})
    spec = with_store(write_run_spec(tmp_path, job), nowhere, "job_never_stored")
    rc, events, tail = launch(spec)
    assert rc == 0, tail
    assert not of(events, "checkpoint"), "a checkpoint was committed with no store"
    assert "the upload of a checkpoint was given up at the trainer's end (the store is failing)" in tail, tail
    # The upload's own process (store.push) went with the trainer.
    assert not job_processes("jobs/job_never_stored/")


def test_checkpoints_are_committed_in_the_store_listed_served_and_resumed_from_it(
        api: httpx.Client, stack: Any, make_job: Any, stack_env: dict[str, str], roots: dict[str, Path],
        tmp_path: Path) -> None:
    store = store_of(stack_env)
    q = "ckstore"
    leaving = stack.start_worker("ckstore-1", queues=q)
    spec = make_job(name="ckstore", hyperparameters={"max_steps": 60}, resources={"queue": q},
                    checkpointing={"every_steps": 5, "keep_last": 3})
    job = api.post("/jobs", json=spec).json()
    job_id = job["id"]
    wait_for(lambda: len(events_of(api, job_id, ["checkpoint"])) >= 4, 240, "four committed checkpoints")
    # A deploy: the worker's job checkpoints, commits and hands itself back; then this node's disk is lost.
    leaving.send_signal(signal.SIGTERM)
    assert leaving.wait(90) == 0
    stack.procs.pop("ckstore-1")
    wait_status(api, job_id, {"queued"}, timeout=60)
    interrupted = events_of(api, job_id, ["interrupted"])[0]
    manifests, _ = stored.read_all(store, job_id)
    assert manifests[0].step == interrupted["step"] and len(manifests) == 3, [m.step for m in manifests]
    # Committed means in the store: a manifest naming objects with their sizes; keep_last holds there too.
    for m in manifests:
        assert m.files and all(store.head(f.key) == f.bytes for f in m.files)
    shutil.rmtree(roots["artifacts"] / "jobs" / job_id / "checkpoints")
    # The newest manifest names an object that is gone; the one before records another SHA-256 for a file.
    newest, second, third = manifests
    store.delete(newest.files[0].key)
    body = json.loads(store.get_bytes(second.key))
    body["files"][0]["sha256"] = "0" * 64
    store.put_bytes(second.key, json.dumps(body).encode())

    stack.start_worker("ckstore-2", queues=q)
    try:
        final = wait_status(api, job_id, {"succeeded", "failed", "cancelled"}, timeout=400)
    finally:
        stack.stop("ckstore-2")
    assert final["status"] == "succeeded", final["error"]
    evs = events_of(api, job_id)
    a2 = final["attempt"]
    started2 = next(e for e in evs if e["type"] == "started" and e["attempt"] == a2)
    assert started2["resumed_from_step"] == third.step, started2
    first2 = next(e for e in evs if e["type"] == "progress" and e["attempt"] == a2)
    assert first2["step"] == third.step + 1
    # The curve continues from the state the manifest recorded: the next global batch of 8 rows of 64 tokens,
    # and a loss where attempt 1's stood.
    assert 0 < first2["tokens_seen"] - third.trainer_state["tokens_seen"] <= 8 * 64
    assert first2["loss"] == pytest.approx(third.trainer_state["last_loss"], rel=0.15)
    why = [e for e in evs if e["type"] == "log" and e.get("checkpoint")]
    assert any(f"step {newest.step}" in w["line"] and "missing" in w["line"] for w in why), why
    assert any(f"step {second.step}" in w["line"] and "SHA-256" in w["line"] for w in why), why

    # The store keeps the newest three; the API lists them from their manifests and serves their files.
    manifests, _ = stored.read_all(store, job_id)
    assert sorted(m.step for m in manifests) == [50, 55, 60]
    listed = api.get(f"/jobs/{job_id}/checkpoints").json()["data"]
    assert [c["step"] for c in listed] == [50, 55, 60]
    assert all(c["bytes"] == sum(f["bytes"] for f in c["files"]) and c["created_at"] for c in listed)
    state = api.get(f"/jobs/{job_id}/checkpoints/60/trainer_state.json")
    assert state.status_code == 200 and json.loads(state.content)["step"] == 60
    part = api.get(f"/jobs/{job_id}/checkpoints/60/trainer_state.json", headers={"Range": "bytes=0-3"})
    assert part.status_code == 206 and part.content == state.content[:4]
    for bad in ("..%2F..%2Fcheckpoints%2Fstep-00000055.json", "nothing-here.pt"):
        answer = api.get(f"/jobs/{job_id}/checkpoints/60/{bad}")
        assert answer.status_code == 404 and answer.json()["error"]["field"] == "path", answer.text
    assert api.get(f"/jobs/{job_id}/checkpoints/7/trainer_state.json").json()["error"]["field"] == "step"
    # `ft download --checkpoint`: every file of one checkpoint, each checked against the manifest's SHA-256.
    dest = tmp_path / "step-60"
    got = subprocess.run([sys.executable, "-m", "ftcli.main", "download", job_id, str(dest), "--checkpoint", "60",
                          "--json"], env={**os.environ, "FT_API_URL": stack.api_url,
                                          "FT_API_KEY": api.headers["Authorization"].removeprefix("Bearer ")},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert got.returncode == 0, got.stderr[-2000:]
    sixty = next(c for c in listed if c["step"] == 60)
    assert {f["path"]: f["sha256"] for f in sixty["files"]} == {
        f["path"]: hashlib.sha256((dest / f["path"]).read_bytes()).hexdigest() for f in sixty["files"]}
    # Each checkpoint carries the model's config and tokenizer beside DeepSpeed's state: a model can be made of it.
    assert {"hf/config.json", "hf/tokenizer.json"} <= {f["path"] for f in sixty["files"]}
    continued_from_a_checkpoint(api, stack, stack_env, job_id, manifests)


def continued_from_a_checkpoint(api: httpx.Client, stack: Any, stack_env: dict[str, str], job_id: str,
                                manifests: list[stored.Manifest]) -> None:
    """A job on `job_…@step-55` trains from the weights the parent had at step 55; a step that is not committed,
    a misspelt name, another owner's job and a LoRA job's checkpoint are refused, naming the model."""
    def submit(model: str, client: httpx.Client = api, **more: Any) -> httpx.Response:
        return client.post("/jobs", json=job_spec(name="from-ckpt", model=model, **more))

    def refusal(answer: httpx.Response) -> str:
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["field"] == "model.name_or_path", answer.text
        return str(answer.json()["error"]["message"])

    assert "committed: 50, 55, 60" in refusal(submit(f"{job_id}@step-7"))
    assert "@step-<step>" in refusal(submit(f"{job_id}@step-x"))
    other = create_key({**os.environ, **stack_env}, "ckstore-other", "jobs:write")
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {other}"}, timeout=30) as client:
        assert "no job" in refusal(submit(f"{job_id}@step-55", client))
    lora = api.post("/jobs", json=job_spec(name="lora", lora={"rank": 4}, resources={"queue": "nowhere"})).json()
    assert api.post(f"/jobs/{lora['id']}/cancel").status_code == 202
    assert "LoRA" in refusal(submit(f"{lora['id']}@step-8"))

    child = submit(f"{job_id}@step-55", hyperparameters={"max_steps": 2}, checkpointing={"every_steps": None},
                   data={"validation": None})
    assert child.status_code == 201, child.text
    base = child.json()["resolved"]["base_model"]
    assert (base["job_id"], base["step"]) == (job_id, 55)
    assert {f["path"] for f in base["files"]} >= {"hf/config.json", "mp_rank_00_model_states.pt"}
    assert not [f for f in base["files"] if f["path"].startswith("rng-")]
    final = wait_status(api, child.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=300)
    assert final["status"] == "succeeded", final["error"]
    first = next(e["loss"] for e in events_of(api, final["id"], ["progress"]) if e.get("loss") is not None)
    parent_first = next(e["loss"] for e in events_of(api, job_id, ["progress"]) if e.get("loss") is not None)
    at_55 = next(m for m in manifests if m.step == 55).trainer_state["last_loss"]
    # Where the parent stood at step 55 (another batch, so not the same figure), far below a fresh model's start.
    assert first == pytest.approx(at_55, rel=0.2) and first < parent_first - 0.8, (first, at_55, parent_first)


def test_a_checkpoint_of_tied_weights_makes_a_model_folder_that_loads_them_tied(tmp_path: Path) -> None:
    """The stage-0 layout (the module's state dict whole in one file, both names of a tied weight on one tensor),
    written by torch as DeepSpeed writes it: the folder keeps one name and `from_pretrained` ties them again."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from worker import from_checkpoint

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tag = tmp_path / "step-00000003"
    config.save_pretrained(tag / stored.HF_FOLDER)
    assert from_checkpoint.main([str(tag), str(tmp_path / "none")]) == 2  # no model states: refused, not a crash
    torch.save({"module": model.state_dict(), "ds_config": {"bf16": {"enabled": True}}},
               tag / "mp_rank_00_model_states.pt")
    files = from_checkpoint.convert(tag, tmp_path / "out")
    assert files == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight.bfloat16())
