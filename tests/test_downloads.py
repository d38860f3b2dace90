"""Models out: a job's export goes to the artifact store (the session stack's is a real S3 server) before the job
may succeed, and clients download it through the API, whole or by range, and with `ft download`, verified and
resumable. The faults: the store down during the export and back a little later (the job succeeds once it is
back), and the store gone past FT_STORE_RETRY_SECONDS (the job fails with store_unavailable, never succeeds)."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.storage import StoreConfig
from store.layout import output_manifest_key, output_prefix
from store.objects import Store
from tests.conftest import create_key
from tests.helpers import events_of, free_port, wait_for, wait_status
from tests.s3_support import CREDENTIALS, S3Server, store_config
from tests.serverpaths import on_server
from tests.test_cli import ft_env

# This checkout's command line (`python -m ftcli.main` is what the `ft` entry point runs), whichever checkout the
# venv's `ft` script was installed from.
FT = [sys.executable, "-m", "ftcli.main"]
ROOT = Path(__file__).resolve().parent.parent
TINY = {"hyperparameters": {"max_steps": 4}, "checkpointing": {"every_steps": 4, "keep_last": 1}}


def store_for(env: dict[str, str]) -> Store:
    """A client of the store `env` names: obstore reads the AWS_* credentials when the client is made."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update({k: env[k] for k in CREDENTIALS})
    try:
        return Store(store_config(env))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def raw_get(base_url: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """A GET of `path` exactly as written: httpx would resolve its dot segments before the server saw them."""
    url = httpx.URL(base_url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def done(api: httpx.Client) -> dict[str, Any]:
    """One tiny job's success, which every download test reads (conftest's make_job is per test)."""
    job = {"name": "download", "model": "tiny-llama",
           "data": {"train": "corpus/train.txt", "validation": "corpus/validation.txt"},
           "hyperparameters": {"max_steps": 4, "learning_rate": 0.003, "warmup_steps": 1, "global_batch_size": 8,
                               "seq_len": 64},
           "deepspeed": {"zero_stage": 2, "precision": "bf16"},
           "resources": {"num_gpus": 2, "time_limit_seconds": 600}, "checkpointing": TINY["checkpointing"]}
    r = api.post("/jobs", json=job)
    assert r.status_code == 201, r.text
    final = wait_status(api, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=400)
    assert final["status"] == "succeeded", final["error"]
    return dict(final)


def test_the_export_is_in_the_store_with_its_manifest_and_listed_by_the_api(
        api: httpx.Client, done: dict[str, Any], stack_env: dict[str, str]) -> None:
    job_id, output = done["id"], done["output"]
    store = store_for(stack_env)
    stored = {item.key.removeprefix(output_prefix(job_id)): item.bytes for item in store.list(output_prefix(job_id))}
    manifest = json.loads(store.get_bytes(output_manifest_key(job_id)))
    assert {f["path"]: f["bytes"] for f in manifest["files"]} == stored
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= stored.keys() and "COMPLETE" not in stored
    assert manifest["step"] == 4 and manifest["bytes"] == sum(stored.values())
    # The job's output: the manifest's files, where they are in the store, and the node's path as before.
    assert output["files"] == manifest["files"] and output["store"] == output_prefix(job_id)
    assert output["bytes"] == manifest["bytes"]
    assert (on_server(output["path"], stack_env["FT_ARTIFACTS_ROOT"]) / "model.safetensors").is_file()

    listing = api.get(f"/jobs/{job_id}/output")
    assert listing.status_code == 200, listing.text
    body = listing.json()
    assert body["step"] == 4 and body["format"] == "huggingface"
    for f in body["files"]:
        got = api.get(f["url"])
        assert got.status_code == 200 and got.headers["x-content-sha256"] == f["sha256"]
        assert sha256(got.content) == f["sha256"] == sha256(store.get_bytes(output_prefix(job_id) + f["path"]))
        assert len(got.content) == f["bytes"]


def test_a_file_downloads_by_range_and_a_range_outside_it_is_416(api: httpx.Client, done: dict[str, Any]) -> None:
    url = f"/jobs/{done['id']}/output/model.safetensors"
    whole = api.get(url)
    size = len(whole.content)
    assert whole.headers["accept-ranges"] == "bytes" and int(whole.headers["content-length"]) == size
    part = api.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == whole.content[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{size}"
    rest = api.get(url, headers={"Range": f"bytes={size - 100}-"})
    assert rest.status_code == 206 and rest.content == whole.content[-100:]
    suffix = api.get(url, headers={"Range": "bytes=-7"})
    assert suffix.status_code == 206 and suffix.content == whole.content[-7:]
    assert suffix.headers["content-range"] == f"bytes {size - 7}-{size - 1}/{size}"
    beyond = api.get(url, headers={"Range": f"bytes={size}-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{size}"


@pytest.mark.parametrize("path", ["../../../etc/passwd", "%2e%2e/%2e%2e/request.json", "..%2Foutput.json",
                                  "%2Fetc%2Fpasswd", "/etc/passwd", "COMPLETE", "not-there.bin",
                                  "merged/../config.json"])
def test_only_files_the_manifest_lists_are_served(api: httpx.Client, done: dict[str, Any], path: str) -> None:
    status, body = raw_get(str(api.base_url), f"/jobs/{done['id']}/output/{path}", dict(api.headers))
    assert status == 404 and body["error"]["field"] == "path", (path, status, body)


def test_another_owners_job_is_not_found_and_a_job_without_an_export_says_so(
        api: httpx.Client, done: dict[str, Any], stack: Any, stack_env: dict[str, str], make_job: Any) -> None:
    other = create_key({**os.environ, **stack_env}, f"dl-other-{uuid.uuid4().hex[:6]}", "jobs:read")
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {other}"}, timeout=30) as c:
        for path in ("output", "output/model.safetensors"):
            r = c.get(f"/jobs/{done['id']}/{path}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    parked = api.post("/jobs", json=make_job(name="no-export", resources={"queue": "parked-dl"})).json()
    try:
        for path in ("output", "output/config.json"):
            r = api.get(f"/jobs/{parked['id']}/{path}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "no_output", r.text
            assert "no export" in r.json()["error"]["message"]
    finally:
        api.post(f"/jobs/{parked['id']}/cancel")


def test_ft_download_verifies_every_file_and_resumes_a_truncated_part(
        done: dict[str, Any], stack: Any, admin_key: str, tmp_path: Path, api: httpx.Client) -> None:
    env = ft_env(stack.api_url, admin_key)
    dest = tmp_path / "model"
    first = subprocess.run([*FT, "download", done["id"], str(dest), "--json"], env=env, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    listed = {f["path"]: f for f in api.get(f"/jobs/{done['id']}/output").json()["files"]}
    assert {f["path"] for f in json.loads(first.stdout)["files"]} == listed.keys()
    for path, f in listed.items():
        assert sha256((dest / path).read_bytes()) == f["sha256"]

    # Interrupted: half the weights in their .part file; another file's .part holds wrong bytes of the right size.
    weights = dest / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    (dest / "model.safetensors.part").write_bytes(data[: len(data) // 2])
    config = dest / "config.json"
    size = config.stat().st_size
    config.unlink()
    (dest / "config.json.part").write_bytes(b"x" * size)
    again = subprocess.run([*FT, "download", done["id"], str(dest), "--json"], env=env, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    status = {f["path"]: f["status"] for f in json.loads(again.stdout)["files"]}
    assert status["model.safetensors"] == "continued" and status["config.json"] == "downloaded"
    assert {s for p, s in status.items() if p not in ("model.safetensors", "config.json")} == {"present"}
    assert weights.read_bytes() == data and sha256(config.read_bytes()) == listed["config.json"]["sha256"]
    assert not list(dest.rglob("*.part"))

    plain = subprocess.run([*FT, "download", done["id"], str(dest)], env=env, capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert plain.returncode == 0 and "each matching its SHA-256" in plain.stdout, plain.stderr


def test_ft_download_fetches_a_large_file_in_chunks_resumes_only_the_missing_ones_and_catches_a_bad_one(
        done: dict[str, Any], stack: Any, admin_key: str, tmp_path: Path, api: httpx.Client) -> None:
    """The chunk size is made small here so that the tiny job's weights span several chunks."""
    env = ft_env(stack.api_url, admin_key)
    listed = {f["path"]: f for f in api.get(f"/jobs/{done['id']}/output").json()["files"]}
    size = listed["model.safetensors"]["bytes"]
    chunk = max(1024, size // 5 + 1)
    count = -(-size // chunk)
    assert count >= 3, f"the weights ({size} bytes) must span several chunks"
    dest = tmp_path / "model"

    def run() -> dict[str, dict[str, Any]]:
        done_ = subprocess.run([*FT, "download", done["id"], str(dest), "--json", "--chunk-size", str(chunk),
                                "--connections", "3"], env=env, capture_output=True, text=True, timeout=120,
                               cwd=ROOT)
        assert done_.returncode == 0, done_.stderr
        assert not list(dest.rglob("*.part")) and not list(dest.rglob("*.chunks"))
        return {f["path"]: f for f in json.loads(done_.stdout)["files"]}

    first = run()["model.safetensors"]
    weights = dest / "model.safetensors"
    data = weights.read_bytes()
    assert first["status"] == "downloaded" and first["transferred"] == size and sha256(data) == first["sha256"]

    def leave(done_chunks: list[int], content: bytes) -> None:
        """What a run stopped part way leaves: the .part at its full size and the list of chunks that arrived."""
        weights.unlink()
        (dest / "model.safetensors.part").write_bytes(content)
        (dest / "model.safetensors.part.chunks").write_text(
            json.dumps({"bytes": size, "chunk_bytes": chunk, "done": done_chunks}))

    def holding(chunks: list[int], source: bytes) -> bytes:
        kept = bytearray(size)
        for i in chunks:
            kept[i * chunk:(i + 1) * chunk] = source[i * chunk:(i + 1) * chunk]
        return bytes(kept)

    # Interrupted after chunks 0 and 2: only the others are fetched again.
    leave([0, 2], holding([0, 2], data))
    resumed = run()["model.safetensors"]
    assert resumed["status"] == "continued" and weights.read_bytes() == data
    assert resumed["transferred"] == size - len(data[0:chunk]) - len(data[2 * chunk:3 * chunk])

    # A .part a one-request run left (a prefix, no list): the chunks inside it are kept.
    weights.unlink()
    (dest / "model.safetensors.part").write_bytes(data[: chunk + chunk // 2])
    prefix = run()["model.safetensors"]
    assert prefix["status"] == "continued" and prefix["transferred"] == size - chunk and weights.read_bytes() == data

    # A chunk the list names as whole but whose bytes are wrong: the hash catches it and the file comes again.
    bad = bytearray(holding([0, 1], data))
    bad[chunk + 7] ^= 0xFF
    leave([0, 1], bytes(bad))
    caught = run()["model.safetensors"]
    assert caught["status"] == "downloaded" and weights.read_bytes() == data
    assert caught["transferred"] == (size - 2 * chunk) + size


# -- the store down during the export ------------------------------------------------------------------------


@pytest.fixture
def own_worker(stack: Any) -> Iterator[Any]:
    started: list[str] = []

    def start(queue: str, env: dict[str, str]) -> None:
        name = f"dl-{uuid.uuid4().hex[:4]}"
        started.append(name)
        stack.start_worker(name, queues=queue, env=env)

    yield start
    for name in started:
        stack.stop(name)


def test_an_export_waits_for_the_store_to_come_back_and_the_job_succeeds(
        api: httpx.Client, make_job: Any, own_worker: Any, roots: dict[str, Path]) -> None:
    server = S3Server(roots["logs"])
    bucket = server.bucket()
    env = server.env(bucket)
    queue = f"dl-store-back-{uuid.uuid4().hex[:6]}"
    own_worker(queue, {**env, "FT_STORE_RETRY_SECONDS": "300"})
    server.stop()  # down before the job starts: the trainer does not need it, the export does
    job = api.post("/jobs", json=make_job(name="store-back", resources={"queue": queue}, **TINY)).json()
    back = None
    try:
        wait_for(lambda: any("is unreachable" in e["line"] for e in events_of(api, job["id"], ["log"])), 400,
                 "the worker to say the store is unreachable")
        assert api.get(f"/jobs/{job['id']}").json()["status"] == "running", "not done before its export is stored"
        back = S3Server(roots["logs"], port=server.port)  # a restarted moto keeps nothing: the bucket anew
        back.bucket(bucket)
        final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=200)
        assert final["status"] == "succeeded", final["error"]
        store = store_for(env)
        manifest = json.loads(store.get_bytes(output_manifest_key(job["id"])))
        assert manifest["files"] == final["output"]["files"]
        for f in manifest["files"]:
            assert sha256(store.get_bytes(output_prefix(job["id"]) + f["path"])) == f["sha256"]
    finally:
        if back is not None:
            back.stop()


def test_a_store_gone_past_the_retry_bound_fails_the_job_with_store_unavailable(
        api: httpx.Client, make_job: Any, own_worker: Any) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"FT_STORE_URL": "s3://gone/service", "FT_S3_ENDPOINT_URL": nowhere, **CREDENTIALS,
           "FT_STORE_RETRY_SECONDS": "2"}
    queue = f"dl-store-gone-{uuid.uuid4().hex[:6]}"
    own_worker(queue, env)
    job = api.post("/jobs", json=make_job(name="store-gone", resources={"queue": queue}, **TINY)).json()
    final = wait_status(api, job["id"], {"succeeded", "failed", "cancelled"}, timeout=400)
    # What the trainer's `completed` event said stays (the model is on the node's disk, for an operator), but
    # nothing claims it is in the store, and there is nothing to download.
    assert final["status"] == "failed" and "store" not in (final["output"] or {})
    assert api.get(f"/jobs/{job['id']}/output").json()["error"]["code"] == "no_output"
    assert final["error"]["code"] == "store_unavailable", final["error"]
    assert "s3://gone/service" in final["error"]["message"]
    assert any("is unreachable" in e["line"] for e in events_of(api, job["id"], ["log"]))


def test_publish_uploads_every_file_then_the_manifest_and_a_cancel_leaves_no_manifest(tmp_path: Path) -> None:
    """worker/export_store.publish driven directly, on a file:// store: sub-folders included, the trainer's marker
    and any link left out, an earlier attempt's stray file and manifest replaced; stopped, it writes no manifest."""
    from worker.export_store import Interrupted, publish

    out = tmp_path / "output"
    (out / "merged").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"w" * 1000)
    (out / "config.json").write_text("{}")
    (out / "merged" / "model.safetensors").write_bytes(b"m" * 10)
    (out / "COMPLETE").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the export's")
    (out / "link.txt").symlink_to(secret)
    (out / "linked").symlink_to(tmp_path, target_is_directory=True)
    store = Store(StoreConfig(url=f"file://{tmp_path / 'store'}"))
    store.put_bytes(output_prefix("job_x") + "stale.bin", b"old")
    store.put_bytes(output_manifest_key("job_x"), b"{}")
    said: list[str] = []
    got = publish(store, job_id="job_x", attempt=2, output_dir=out, completion={"path": str(out), "step": 3},
                  give_up_after=5, interrupted=lambda: None, say=said.append)
    paths = ["config.json", "merged/model.safetensors", "model.safetensors"]
    assert [f["path"] for f in got["files"]] == paths and got["bytes"] == 1012 and got["path"] == str(out)
    assert sorted(i.key for i in store.list(output_prefix("job_x"))) == [output_prefix("job_x") + p for p in paths]
    manifest = json.loads(store.get_bytes(output_manifest_key("job_x")))
    assert manifest["files"] == got["files"] and manifest["attempt"] == 2 and manifest["step"] == 3
    assert got["files"][2]["sha256"] == sha256(b"w" * 1000) and not said

    with pytest.raises(Interrupted) as stopped:
        publish(store, job_id="job_x", attempt=3, output_dir=out, completion={}, give_up_after=5,
                interrupted=lambda: "cancel", say=said.append)
    assert stopped.value.reason == "cancel" and store.head(output_manifest_key("job_x")) is None
