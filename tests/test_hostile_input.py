"""Inputs that once made the API answer 500 (or worse), each pinned to the 4xx it must get now.

Every case runs against a real API process (uvicorn) requiring API keys, on a fresh database and this
session's Redis database; jobs go to a queue no worker serves. The outage cases point an API at a
dead port or at a proxy the test cuts: the machine's Postgres and Redis are never touched.
"""

from __future__ import annotations

import copy
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.spec import RAW_CONFIG_MAX_BYTES, json_problem
from scripts.stack import ROOT
from tests.apiproc import ApiProcess, TcpProxy, add_key, fixed_key, fresh_database, make_roots
from tests.helpers import free_port, wait_for
from tests.serverpaths import known_directories, leaks, request_text

TOKEN = fixed_key("hostile")  # an admin key, stored in the module's database
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUEUE = "parked-hostile"  # no worker serves it
BASE_JOB: dict[str, Any] = {
    "name": "hostile",
    "model": "tiny",
    "data": {"train": "train.txt"},
    "hyperparameters": {"max_steps": 2, "global_batch_size": 2, "seq_len": 8},
    "resources": {"num_gpus": 1, "queue": QUEUE},
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_roots(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def hostile_db() -> Iterator[str]:
    with fresh_database() as url:
        add_key(url, TOKEN)
        yield url


@pytest.fixture(scope="module")
def guarded(hostile_db: str, redis_url: str, roots: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    proc = ApiProcess({"FT_DATABASE_URL": hostile_db, "FT_REDIS_URL": redis_url,
                       "FT_ENV": "production", **roots}, tmp_path_factory.mktemp("logs") / "guarded.log")
    try:
        yield proc.start()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(guarded: ApiProcess, roots: dict[str, str]) -> Iterator[httpx.Client]:
    """The cases' client: every answer it gets, to every case of this module, is held to showing no server path."""
    directories = known_directories(*roots.values())

    def no_server_path(r: httpx.Response) -> None:
        if not r.headers.get("content-type", "").startswith(("application/json", "text/")):
            return
        r.read()
        try:
            body = r.request.content
        except httpx.RequestNotRead:  # a streamed body (the cut-off cases): what it sent holds no path
            body = b""
        sent = request_text(r.request.method, str(r.request.url), body)
        found = leaks(r.text, directories, sent)
        assert not found, (f"{r.request.method} {r.request.url.path} answered {r.status_code} showing server paths "
                           f"{found}: {r.text[:2000]}")

    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=30,
                      event_hooks={"response": [no_server_path]}) as c:
        yield c


@pytest.fixture(scope="module")
def ended_job(client: httpx.Client) -> str:
    """A cancelled job: every stream of it ends by itself, so a case that wrongly streams cannot hang."""
    r = client.post("/jobs", json=BASE_JOB)
    assert r.status_code == 201, r.text
    assert client.post(f"/jobs/{r.json()['id']}/cancel").json()["status"] == "cancelled"
    return str(r.json()["id"])


def assert_error(r: httpx.Response, status: int, field: str | None = None, *fragments: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:2000])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) >= {"code", "message", "field"} and isinstance(err["message"], str), err
    if field is not None:
        fields = [d["field"] for d in err.get("details") or []] or [err["field"]]
        assert field in fields, err
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])
    return err


def patched(**sections: Any) -> dict[str, Any]:
    job = copy.deepcopy(BASE_JOB)
    for key, value in sections.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) and isinstance(job.get(key), dict) else value
    return job


def nested(depth: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(depth - 1):
        node["a"] = {}
        node = node["a"]
    return root


def test_the_base_job_is_accepted(client: httpx.Client) -> None:
    # Every case below changes one thing of this job: its refusal is that thing's doing.
    r = client.post("/jobs", json=patched(metadata={"team": "x", "tags": ["a", "b"], "deep": nested(7)}))
    assert r.status_code == 201, r.text
    assert r.json()["metadata"]["deep"] == nested(7)


# (case, body, field, fragment of the message): each was a 500 before its check existed.
JSON_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("NUL in the name", patched(name="a\u0000b"), "name", "NUL"),
    ("NUL in a metadata value", patched(metadata={"k": "v\u0000"}), "metadata", "NUL"),
    ("NUL in a metadata key", patched(metadata={"k\u0000": "v"}), "metadata", "NUL"),
    ("NUL nested in metadata", patched(metadata={"a": [{"b": ["\u0000"]}]}), "metadata", "NUL"),
    ("NUL in the model path", patched(model="tiny\u0000"), "model.name_or_path", "NUL"),
    ("NUL in the data path", patched(data={"train": "train.txt\u0000"}), "data.train", "NUL"),
    ("NUL in the validation path", patched(data={"train": "train.txt", "validation": "\u0000"}),
     "data.validation", "NUL"),
    ("NUL in a raw config string", patched(deepspeed={"config": {"communication_data_type": "fp16\u0000"}}),
     "deepspeed.config", "NUL"),
    ("NUL in a LoRA module name", patched(lora={"target_modules": ["q_proj\u0000"]}), "lora.target_modules", "NUL"),
    ("a data file name of 300 bytes", patched(data={"train": "d" * 300}), "data.train", "does not exist"),
    ("a model directory name of 300 bytes", patched(model="./" + "m" * 300), "model.name_or_path",
     "does not exist"),
    ("metadata nested 600 deep", patched(metadata=nested(600)), "metadata", "8 levels"),
    ("metadata nested 9 deep", patched(metadata=nested(9)), "metadata", "8 levels"),
    ("metadata over 16 KiB", patched(metadata={"k": "x" * 17_000}), "metadata", "16384"),
    ("metadata with 101 keys", patched(metadata={f"k{i}": i for i in range(101)}), "metadata", "100"),
    ("metadata key of 129 characters", patched(metadata={"k" * 129: 1}), "metadata", "128"),
    ("raw config nested 600 deep", patched(deepspeed={"config": {"zero_optimization": nested(600)}}),
     "deepspeed.config", "levels"),
    ("scheduler params as a list",
     patched(deepspeed={"config": {"scheduler": {"type": "WarmupLR", "params": [1, 2]}}}),
     "deepspeed.config.scheduler.params", "object"),
    ("betas as strings",
     patched(deepspeed={"config": {"optimizer": {"type": "AdamW", "params": {"betas": ["a", "b"]}}}}),
     "deepspeed.config.optimizer.params.betas", "two numbers"),
    ("optimizer as a list", patched(deepspeed={"config": {"optimizer": ["AdamW"]}}),
     "deepspeed.config.optimizer", "object"),
    ("optimizer type as an object", patched(deepspeed={"config": {"optimizer": {"type": {"a": 1}}}}),
     "deepspeed.config.optimizer.type", "AdamW"),
    ("zero stage true", patched(deepspeed={"config": {"zero_optimization": {"stage": True}}}),
     "deepspeed.config.zero_optimization.stage", "0, 1, 2 or 3"),
    ("zero knob as a string", patched(deepspeed={"config": {"zero_optimization": {"overlap_comm": "yes"}}}),
     "deepspeed.config.zero_optimization.overlap_comm", "true or false"),
    ("offload device as a list",
     patched(deepspeed={"config": {"zero_optimization": {"offload_optimizer": {"device": ["cpu"]}}}}),
     "deepspeed.config.zero_optimization.offload_optimizer.device", "cpu"),
    ("fp16 block as a number", patched(deepspeed={"config": {"fp16": 1}}), "deepspeed.config.fp16", "object"),
    ("loss scale power as a string",
     patched(deepspeed={"config": {"fp16": {"enabled": True, "initial_scale_power": "16"}}}),
     "deepspeed.config.fp16.initial_scale_power", "integer"),
    ("activation checkpoints as a string",
     patched(deepspeed={"config": {"activation_checkpointing": {"number_checkpoints": "four"}}}),
     "deepspeed.config.activation_checkpointing.number_checkpoints", "integer"),
    ("gradient clipping true", patched(deepspeed={"config": {"gradient_clipping": True}}),
     "deepspeed.config.gradient_clipping", "number"),
    ("raw train_batch_size 2e8", patched(deepspeed={"config": {"train_batch_size": 200_000_000}}),
     "deepspeed.config.train_batch_size", "1000000"),
    ("raw warmup beyond the bound",
     patched(deepspeed={"config": {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10**19}}}}),
     "deepspeed.config.scheduler.params.warmup_num_steps", "10000000"),
    # No global batch in the job: the product became it, past the bound the trainer checks again.
    ("raw micro x accumulation of 10**9", {**patched(
        deepspeed={"config": {"train_micro_batch_size_per_gpu": 100_000, "gradient_accumulation_steps": 10_000}}),
        "hyperparameters": {"max_steps": 2, "seq_len": 8}},
     "deepspeed.config.gradient_accumulation_steps", "1000000"),
    ("seed 2**64", patched(hyperparameters={"seed": 2**64}), "hyperparameters.seed", "4294967295"),
    ("seed negative", patched(hyperparameters={"seed": -1}), "hyperparameters.seed", "0"),
    ("warmup 10**12 steps", patched(hyperparameters={"warmup_steps": 10**12}), "hyperparameters.warmup_steps", ""),
    ("eval every 10**12 steps", patched(hyperparameters={"eval_every_steps": 10**12}),
     "hyperparameters.eval_every_steps", ""),
    ("micro batch 10**12", patched(hyperparameters={"micro_batch_size": 10**12}),
     "hyperparameters.micro_batch_size", "1000000"),
    ("global batch 10**12", patched(hyperparameters={"global_batch_size": 10**12}),
     "hyperparameters.global_batch_size", ""),
    ("gradient clipping 1e300", patched(hyperparameters={"gradient_clipping": 1e300}),
     "hyperparameters.gradient_clipping", ""),
    ("adam beta 1", patched(hyperparameters={"adam_betas": [0.9, 1.0]}), "hyperparameters.adam_betas.1", ""),
    ("checkpoint every 10**12 steps", patched(checkpointing={"every_steps": 10**12}),
     "checkpointing.every_steps", ""),
    ("LoRA rank 10**9", patched(lora={"rank": 10**9}), "lora.rank", ""),
    ("LoRA alpha 1e300", patched(lora={"alpha": 1e300}), "lora.alpha", ""),
    ("LoRA with no modules", patched(lora={"target_modules": []}), "lora.target_modules", "1 to 64"),
    ("time limit of a year", patched(resources={"num_gpus": 1, "queue": QUEUE, "time_limit_seconds": 31_536_000}),
     "resources.time_limit_seconds", ""),
]


@pytest.mark.parametrize(("body", "field", "fragment"), [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_json_body_cases_are_refused_naming_the_field(client: httpx.Client, body: dict[str, Any], field: str,
                                                       fragment: str) -> None:
    err = assert_error(client.post("/jobs", json=body), 422, field)
    assert err["code"] == "invalid_request"
    assert any(fragment in d["message"] for d in err.get("details") or [err]), err


def raw_body(placeholder_value: str) -> bytes:
    """The base job with metadata.x set to a literal JSON fragment, as a client could write it."""
    text = json.dumps(patched(metadata={"x": "__VALUE__"}))
    return text.replace('"__VALUE__"', placeholder_value).encode()


RAW_CASES: list[tuple[str, bytes, str]] = [
    ("NaN", raw_body("NaN"), "NaN"),
    ("Infinity", raw_body("Infinity"), "Infinity"),
    ("-Infinity", raw_body("-Infinity"), "Infinity"),
    ("a float that overflows", raw_body("1e400"), "range"),
    ("NaN in a number field", json.dumps(BASE_JOB).replace('"max_steps": 2', '"max_steps": NaN').encode(), "NaN"),
    ("an integer of 5000 digits", raw_body("9" * 5000), "digits"),
    ("arrays nested 100000 deep", b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    ("invalid UTF-8", raw_body('"__BAD__"').replace(b"__BAD__", b"\xff\xfe"), "UTF-8"),
    ("a lone surrogate in metadata", raw_body('"\\ud800"'), "surrogate"),
    ("a lone surrogate in the name", json.dumps(patched(name="__N__")).replace("__N__", "\\udc00").encode(), ""),
    ("not JSON at all", b"{'name': 1}", ""),
]


@pytest.mark.parametrize(("raw", "fragment"), [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_raw_body_cases_are_refused_with_422(client: httpx.Client, raw: bytes, fragment: str) -> None:
    r = client.post("/jobs", content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 422)
    assert err["field"] in ("body", "metadata", "name"), err
    assert fragment in err["message"], err


def test_invalid_utf8_case_really_is_invalid() -> None:
    # The case above must send bytes that are not UTF-8, or it tests nothing.
    raw = {c[0]: c[1] for c in RAW_CASES}["invalid UTF-8"]
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")


# (case, method, path, params, headers, field): path, query and header values, each a 500 before.
PARAM_CASES: list[tuple[str, str, str, dict[str, Any], dict[str, Any], str]] = [
    ("NUL in a job id", "GET", "/jobs/job%00x", {}, {}, "job_id"),
    ("NUL in a job id to cancel", "POST", "/jobs/job%00x/cancel", {}, {}, "job_id"),
    ("NUL in a job id's events", "GET", "/jobs/job%00x/events", {}, {}, "job_id"),
    ("NUL in a job id's logs", "GET", "/jobs/job%00x/logs", {}, {}, "job_id"),
    ("a job id of 1000 characters", "GET", "/jobs/" + "j" * 1000, {}, {}, "job_id"),
    ("NUL in the after cursor", "GET", "/jobs", {"after": "job_\u0000"}, {}, "after"),
    ("NUL in the status filter", "GET", "/jobs", {"status": "queued\u0000"}, {}, "status"),
    ("an unknown status", "GET", "/jobs", {"status": "sleeping"}, {}, "status"),
    ("a list limit of 10**30", "GET", "/jobs", {"limit": 10**30}, {}, "limit"),
    ("events after 1e30", "GET", "/jobs/{job}/events", {"after": "1e30"}, {}, "after"),
    ("events after 10**30", "GET", "/jobs/{job}/events", {"after": 10**30}, {}, "after"),
    ("events after 2**31", "GET", "/jobs/{job}/events", {"after": 2**31}, {}, "after"),
    ("events after -1", "GET", "/jobs/{job}/events", {"after": -1}, {}, "after"),
    ("events limit of 10**30", "GET", "/jobs/{job}/events", {"limit": 10**30}, {}, "limit"),
    ("an event type with NUL", "GET", "/jobs/{job}/events", {"type": "log\u0000"}, {}, "type.0"),
    ("21 event types", "GET", "/jobs/{job}/events", {"type": ["log"] * 21}, {}, "type"),
    ("logs after 1e30", "GET", "/jobs/{job}/logs", {"after": "1e30"}, {}, "after"),
    ("logs after 10**30", "GET", "/jobs/{job}/logs", {"after": 10**30}, {}, "after"),
    ("Last-Event-ID of a superscript two", "GET", "/jobs/{job}/events", {},
     {"Accept": "text/event-stream", "Last-Event-ID": "\u00b2".encode()}, "Last-Event-ID"),
    ("Last-Event-ID of 5000 digits", "GET", "/jobs/{job}/events", {},
     {"Accept": "text/event-stream", "Last-Event-ID": "7" * 5000}, "Last-Event-ID"),
    ("Last-Event-ID above INTEGER", "GET", "/jobs/{job}/events", {},
     {"Accept": "text/event-stream", "Last-Event-ID": "9999999999"}, "Last-Event-ID"),
    ("Last-Event-ID of Arabic-Indic digits", "GET", "/jobs/{job}/events", {},
     {"Accept": "text/event-stream", "Last-Event-ID": "\u0663".encode()}, "Last-Event-ID"),
]


@pytest.mark.parametrize(("method", "path", "params", "headers", "field"), [c[1:] for c in PARAM_CASES],
                         ids=[c[0] for c in PARAM_CASES])
def test_path_query_and_header_cases_are_refused_naming_the_parameter(
        client: httpx.Client, ended_job: str, method: str, path: str, params: dict[str, Any],
        headers: dict[str, Any], field: str) -> None:
    r = client.request(method, path.replace("{job}", ended_job), params=params, headers=headers, timeout=10)
    assert_error(r, 422, field)


def test_a_valid_last_event_id_resumes_after_it(client: httpx.Client, ended_job: str) -> None:
    # The control for the header cases above: digits within range stream the events after that id.
    r = client.get(f"/jobs/{ended_job}/events", headers={"Accept": "text/event-stream", "Last-Event-ID": "1"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "id: 1\n" not in r.text and "id: 2\n" in r.text and "cancelled" in r.text


# -- authentication: checked first, on everything but the probes and the docs --


def test_no_key_is_401_before_the_body_is_validated(guarded: ApiProcess) -> None:
    r = httpx.post(guarded.url + "/jobs", json={"colour": "blue"})
    err = assert_error(r, 401, "authorization")
    assert err["code"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"


def test_no_key_is_401_before_a_huge_body_is_read(guarded: ApiProcess) -> None:
    r = httpx.post(guarded.url + "/jobs", content=b"x" * (20 * 1024 * 1024),
                   headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 401)


@pytest.mark.parametrize("value", [
    "Bearer wrong", f"Basic {TOKEN}", TOKEN, "Bearer", "", "Bearer " + TOKEN + "x",
    "Bearer h\u00f6stile-t\u00e9st".encode(), b"Bearer \xff\xfe", ("Bearer " + "\u00e9" * 2000).encode(),
], ids=["wrong", "basic", "no scheme", "no token", "empty", "longer", "non-ASCII", "not UTF-8", "4 KB"])
def test_bad_keys_are_401(guarded: ApiProcess, value: str | bytes) -> None:
    for method, path in (("GET", "/jobs"), ("POST", "/jobs"), ("GET", "/jobs/job_x/events")):
        r = httpx.request(method, guarded.url + path, headers={"Authorization": value}, timeout=10)
        assert_error(r, 401)


def test_the_right_key_in_any_case_of_scheme_is_accepted(guarded: ApiProcess) -> None:
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(guarded.url + "/jobs", headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 200


def test_probes_and_docs_need_no_key(guarded: ApiProcess) -> None:
    for path in ("/healthz", "/readyz", "/docs", "/openapi.json"):
        assert httpx.get(guarded.url + path).status_code == 200, path
    assert_error(httpx.get(guarded.url + "/jobs"), 401)


# -- body size: 1 MiB, counted while the body streams in --


def test_a_20_mb_body_is_413(client: httpx.Client) -> None:
    start = time.monotonic()
    r = client.post("/jobs", content=b" " * (20 * 1024 * 1024), headers={"content-type": "application/json"})
    err = assert_error(r, 413, "body", "1048576")
    assert err["code"] == "payload_too_large" and time.monotonic() - start < 10


def test_a_body_without_content_length_is_cut_off_at_the_limit(client: httpx.Client) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(64):  # 4 MiB, chunked: no Content-Length to check up front
            sent += 65536
            yield b" " * 65536

    r = client.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "body")


def test_a_large_content_length_is_refused_before_any_body_arrives(guarded: ApiProcess) -> None:
    # Only the headers are sent: the 413 must come from the declared length, without waiting for a body.
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        s.sendall((f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:300]


def test_a_body_just_under_the_limit_is_read_and_validated(client: httpx.Client) -> None:
    body = json.dumps(patched(metadata={"pad": "x" * (1024 * 1024 - 600)})).encode()
    assert len(body) <= 1024 * 1024
    assert_error(client.post("/jobs", content=body, headers={"content-type": "application/json"}), 422, "metadata")


# -- startup: a misconfigured API refuses to start --


def test_production_without_an_admin_key_refuses_to_start() -> None:
    with fresh_database() as database:
        env = {**os.environ, "FT_ENV": "production", "FT_DATABASE_URL": database}
        port = str(free_port())
        argv = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", port]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert "the API cannot start" in done.stderr and "no working admin key" in done.stderr, done.stderr[-2000:]
        assert "python -m api.admin.keys create --owner NAME --scopes admin" in done.stderr
        # Several processes, as `make up` and compose run it: the parent stops too (uvicorn's parent exits 0
        # then), rather than restarting its children for ever.
        several = subprocess.run([*argv, "--workers", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=120)
        assert "no working admin key" in several.stderr and "stopping the parent process" in several.stderr
        # A key without the admin scope is not enough, nor an expired admin key.
        add_key(database, fixed_key("writer"), "team", ("jobs:write",))
        add_key(database, fixed_key("expired"), "ops", ("admin",), expires_at=datetime(2020, 1, 1, tzinfo=timezone.utc))
        assert subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120).returncode != 0
        # The control: with an admin key the same command starts and serves.
        add_key(database, fixed_key("admin"))
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 60, "the API with an admin key to start")
        finally:
            proc.terminate()
            proc.wait(15)


@pytest.mark.parametrize(("env", "says"), [
    ({"FT_API_TOKEN": "old-shared-token"}, "FT_API_TOKEN was removed"),
    ({"FT_ALLOW_ANONYMOUS": "true", "FT_ENV": "production"}, "FT_ALLOW_ANONYMOUS is for development only"),
], ids=["the old shared token", "anonymous outside development"])
def test_unsafe_settings_refuse_to_start(hostile_db: str, env: dict[str, str], says: str) -> None:
    argv = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run(argv, cwd=ROOT, env={**os.environ, "FT_DATABASE_URL": hostile_db, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "the API cannot start" in done.stderr and says in done.stderr, done.stderr[-2000:]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- outages: 503 with Retry-After while Postgres or Redis is unreachable, and recovery without a restart --


def assert_unavailable(r: httpx.Response) -> None:
    err = assert_error(r, 503)
    assert err["code"] == "unavailable" and int(r.headers["retry-after"]) > 0, (err, r.headers)


def every_route(c: httpx.Client, job_id: str) -> list[httpx.Response]:
    return [c.post("/jobs", json=BASE_JOB), c.get("/jobs"), c.get(f"/jobs/{job_id}"),
            c.post(f"/jobs/{job_id}/cancel"), c.get(f"/jobs/{job_id}/events"), c.get(f"/jobs/{job_id}/logs"),
            c.get(f"/jobs/{job_id}/events", headers={"Accept": "text/event-stream"}),
            c.get(f"/jobs/{job_id}/logs", params={"follow": "true"})]


def test_postgres_down_then_back_then_restarting(hostile_db: str, redis_url: str, roots: dict[str, str],
                                                 tmp_path: Path) -> None:
    proxy = TcpProxy(5432)
    db_via_proxy = hostile_db.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    api = ApiProcess({"FT_DATABASE_URL": db_via_proxy, "FT_REDIS_URL": redis_url, **roots},
                     tmp_path / "api.log").start()
    try:
        with httpx.Client(base_url=api.url, headers=AUTH, timeout=30) as c:
            # Nothing listens yet: connection refused on every route, readiness says so, liveness does not.
            for r in every_route(c, "job_0000"):
                assert_unavailable(r)
            assert c.get("/readyz").status_code == 503 and c.get("/healthz").status_code == 200

            proxy.restore()  # Postgres "comes up": the same process recovers by itself
            r = c.post("/jobs", json=BASE_JOB)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            assert c.get("/readyz").status_code == 200

            # Followers of the job's events and log must outlive a restart that kills every connection.
            lines: list[str] = []
            ended = {"events": threading.Event(), "logs": threading.Event()}

            def follow(kind: str, params: dict[str, str], headers: dict[str, str]) -> None:
                try:
                    with httpx.Client(base_url=api.url, headers=AUTH, timeout=60) as f, \
                            f.stream("GET", f"/jobs/{job_id}/{kind}", params=params, headers=headers) as s:
                        lines.append(f"{kind}: {s.status_code}")
                        for line in s.iter_lines():
                            lines.append(line)
                except httpx.HTTPError as exc:  # the server broke the stream off
                    lines.append(f"{kind}: {exc!r}")
                finally:
                    ended[kind].set()

            for args in (("events", {}, {"Accept": "text/event-stream"}), ("logs", {"follow": "true"}, {})):
                threading.Thread(target=follow, args=args, daemon=True).start()
            wait_for(lambda: "event: state" in lines, 20, "the event stream's first event")

            proxy.cut()  # a restart: every pooled connection dies, new ones are refused
            for r in every_route(c, job_id):
                assert_unavailable(r)
            time.sleep(3)  # both streams keep retrying meanwhile
            assert not any(e.is_set() for e in ended.values()), f"a stream died with the database: {lines}"

            proxy.restore()
            wait_for(lambda: c.get(f"/jobs/{job_id}").status_code == 200, 20, "the API to recover")
            assert c.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
            for kind, done in ended.items():
                assert done.wait(20), f"the {kind} stream did not end with the job: {lines}"
            assert any('"status": "cancelled"' in line for line in lines), lines
            assert "events: 200" in lines and "logs: 200" in lines and not any("Error" in x for x in lines), lines
        assert "unhandled error" not in api.log() and "Exception in ASGI" not in api.log(), api.log()[-3000:]
    finally:
        api.stop()
        proxy.cut()


def test_redis_down_enqueue_is_deferred_and_cancel_is_503(hostile_db: str, roots: dict[str, str],
                                                           tmp_path: Path) -> None:
    api = ApiProcess({"FT_DATABASE_URL": hostile_db, "FT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
                      **roots}, tmp_path / "api.log").start()
    try:
        with httpx.Client(base_url=api.url, headers=AUTH, timeout=30) as c:
            # The row is committed and the reaper re-sends it once Redis is back: a 201, not a 503.
            r = c.post("/jobs", json=BASE_JOB)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            assert_unavailable(c.post(f"/jobs/{job_id}/cancel"))
            # Nothing was changed by the refused cancel, and reads do not need Redis.
            assert c.get(f"/jobs/{job_id}").json()["status"] == "queued"
            assert c.get("/readyz").status_code == 503
    finally:
        api.stop()


# -- the JSON limits themselves: exact, and cheap whatever the document --


def test_json_size_limit_is_exact() -> None:
    # The walk's early "too large" uses a lower bound of the serialized size: it must never refuse a
    # document that fits, nor accept one that does not.
    rng = random.Random(7)

    def document(depth: int = 0) -> Any:
        r = rng.random()
        if depth < 5 and r < 0.3:
            return {"k" * rng.randint(0, 4) + str(i): document(depth + 1) for i in range(rng.randint(0, 6))}
        if depth < 5 and r < 0.6:
            return [document(depth + 1) for _ in range(rng.randint(0, 6))]
        return rng.choice([0, -1.5, 10**20, None, True, "s" * rng.randint(0, 30), "\u00e9" * rng.randint(0, 5)])

    for _ in range(5000):
        value = {"x": document()}
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
        for limit in (40, 200, 1000):
            problem = json_problem(value, max_bytes=limit, max_depth=8, max_keys=100)
            assert (problem is None) == (size <= limit), (size, limit, problem, value)


def test_json_checks_cost_milliseconds_whatever_the_document() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(900):
        node["a"] = {}
        node = node["a"]
    worst = [{"a": [0] * 500_000}, {"a": "x" * 1_000_000}, {"a": [[{}] * 99 for _ in range(3000)]}, deep,
             {"a": [[0] * 99 for _ in range(160)]}, {"a": [[] for _ in range(10_900)]}]
    start = time.perf_counter()
    problems = [json_problem(v, max_bytes=RAW_CONFIG_MAX_BYTES, max_depth=8, max_keys=100) for v in worst]
    elapsed = time.perf_counter() - start
    assert elapsed < 0.1, f"{elapsed:.3f} s"
    assert [p is None for p in problems] == [False, False, False, False, True, True], problems


def test_integers_beyond_64_bits_in_metadata_are_stored_as_given(client: httpx.Client) -> None:
    """JSON has no integer limit and jsonb keeps any: a huge number in metadata is data, not a 500
    (the schema fuzzer found this one)."""
    r = client.post("/jobs", json=patched(metadata={"big": 2**70, "nested": {"neg": -(2**80)}}))
    assert r.status_code == 201, r.text
    assert r.json()["metadata"] == {"big": 2**70, "nested": {"neg": -(2**80)}}
    assert client.get(f"/jobs/{r.json()['id']}").json()["metadata"]["big"] == 2**70
