"""Property-based fuzzing of the whole HTTP API from its own OpenAPI schema (schemathesis on hypothesis).

Every operation gets schema-valid (positive) and schema-violating (negative) requests against a real
API process on a fresh Postgres database and this session's Redis database. The properties: no 5xx
ever; every response (status, content type, headers, body) is one the schema documents; no answer shows a
path of the server's (tests/serverpaths.py); and the schema holds the server to its word: a schema-valid
request is accepted (or refused only for state no schema can state: a 404, 409, 429, or one of the rules
`beyond_the_schema` names) and a schema-invalid one is refused.

Generated jobs never reach a worker: every body that names no queue, or names one, gets a queue no
worker serves. Path ids are sometimes those of jobs that have ended, so reads and cancels reach real
rows and a followed stream always ends.

Direct tests pin the rules the schema once left unstated.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import hypothesis
import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import CheckFunction
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.apiproc import ApiProcess, add_key, fixed_key, fresh_database, make_roots
from tests.serverpaths import known_directories, leaks, request_text

OWNER = "fuzz-owner-7f3a"
TOKEN = fixed_key("fuzz")  # an admin key of its own owner, stored in the fuzzed API's database
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUEUE = "fuzz-parked"  # no worker serves it
# Examples per operation and mode: every operation gets the positive ones, those with inputs the negative ones too.
# An operation that takes a body (a job, a file, a key, a quota, a webhook) has an input space of many fields and
# gets more; one of path and query parameters alone (ids of a fixed form, a limit, a cursor, a filter) has few
# ways to be right or wrong, and fewer cases reach them all.
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
BODY_EXAMPLES = {GenerationMode.POSITIVE: 100, GenerationMode.NEGATIVE: 60}
# Shares of the cases asked for, so they follow the budgets above: nearly every case reaches the server (an
# operation without inputs runs out of distinct ones first), and most are held to the schema's word.
MIN_REQUESTS_SHARE = 0.8
# ignored_auth re-sends a successful request without the token (once per operation) and expects a 401.
CHECKS: list[CheckFunction] = [status_code_conformance, content_type_conformance, response_schema_conformance,
                               response_headers_conformance, ignored_auth]
# Schema-valid requests accepted (2xx, or a 404/409/429 that depends on state), schema-invalid ones refused: run on
# every negative case, and on the positive ones given the state their rules depend on (`settle`).
CONFORMANCE: list[CheckFunction] = [positive_data_acceptance, negative_data_rejection]
MIN_CONFORMANCE_SHARE = 0.4


@pytest.fixture(scope="module")
def fuzz_api(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    base = tmp_path_factory.mktemp("fuzz")
    with fresh_database() as database:
        # Its own owner: no generated owner name (quotas, key filters) is likely to be it. No quota by default,
        # so generated submits are not cut off at the default's 100 (a 429 would be schema-valid, but dull).
        add_key(database, TOKEN, owner=OWNER)
        # Loopback webhook receivers are allowed, so a schema-valid URL on 127.0.0.1 passes the address rules.
        proc = ApiProcess({"FT_DATABASE_URL": database, "FT_REDIS_URL": redis_url, "FT_QUOTA_MAX_ACTIVE_JOBS": "",
                           "FT_ENV": "production", "FT_WEBHOOK_ALLOW_NETS": "127.0.0.0/8", **make_roots(base),
                           # Uploaded files land in the test's own folder.
                           "FT_STORE_URL": f"file://{base / 'store'}",
                           # A job made through OpenAI's face is parked too.
                           "FT_OPENAI_JOB_DEFAULTS": json.dumps({"resources": {"queue": QUEUE}})},
                          base / "api.log")
        try:
            yield proc.start()
        finally:
            proc.stop()


@pytest.fixture(scope="module")
def ended_jobs(fuzz_api: ApiProcess) -> list[str]:
    ids = []
    with httpx.Client(base_url=fuzz_api.url, headers=AUTH, timeout=30) as c:
        for name in ("ended-1", "ended-2"):
            r = c.post("/jobs", json={"name": name, "model": "tiny", "data": {"train": "train.txt"},
                                      "resources": {"queue": QUEUE}})
            assert r.status_code == 201, r.text
            assert c.post(f"/jobs/{r.json()['id']}/cancel").json()["status"] == "cancelled"
            ids.append(r.json()["id"])
    return ids


def _park(body: Any) -> Any:
    """A native job's body sent to the queue no worker serves (a /v1 job is parked by FT_OPENAI_JOB_DEFAULTS)."""
    if isinstance(body, dict) and "data" in body:
        resources = body.setdefault("resources", {})
        if isinstance(resources, dict):
            resources["queue"] = QUEUE
    return body


def test_fuzz_every_operation(fuzz_api: ApiProcess, ended_jobs: list[str], webhook_secret: None) -> None:
    schema = schemathesis.openapi.from_url(fuzz_api.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # 7 job operations, 2 of a job's export, 2 of its checkpoints, 5 of files, 3 of keys, 2 of quotas, the audit
    # log, the nodes, 3 of webhooks, the 2 probes, and OpenAI's face: 5 of /v1/files, 6 of /v1/fine_tuning/jobs,
    # 2 of /v1/models
    assert len(operations) == 41, [op.label for op in operations]
    run = Run(session=_session(), directories=known_directories(
        *(fuzz_api.env[k] for k in ("FT_MODEL_ROOT", "FT_DATA_ROOT", "FT_ARTIFACTS_ROOT", "FT_NVME_ROOT")),
        fuzz_api.env["FT_STORE_URL"].removeprefix("file://")))
    # Reproducible by default (the same requests every run); FT_FUZZ_SEED=<n> explores other ones.
    seed = int(os.environ.get("FT_FUZZ_SEED", "0"))
    failures: list[str] = []
    asked = 0
    start = time.monotonic()
    for op in operations:
        # The key is fixed (fuzz_operation): a route whose one header is the key has nothing in headers to get wrong.
        headers = [h for h in op.headers if h.name.lower() != "authorization"]
        has_inputs = any(len(part) for part in (op.path_parameters, op.query, headers, op.body))
        for mode, examples in (BODY_EXAMPLES if len(op.body) else EXAMPLES).items():
            if mode is GenerationMode.NEGATIVE and not has_inputs:
                continue  # nothing to get wrong
            asked += examples
            try:
                fuzz_operation(op, mode, examples, run, seed=seed, ended=ended_jobs)
            except hypothesis.errors.Unsatisfiable:
                # Only where no schema-violating request exists: a path parameter any string may be, no other input.
                assert mode is GenerationMode.NEGATIVE, op.label
            except BaseException as exc:  # every operation's failure (a FailureGroup), not the first one's
                if isinstance(exc, KeyboardInterrupt):
                    raise
                failures.append(f"{op.label} [{mode.value}]: {str(exc)[:3000]}")
    elapsed = time.monotonic() - start
    counts, statuses = run.counts, run.statuses
    total = sum(counts.values())
    print(f"\nfuzz: {total} requests of {asked} asked in {elapsed:.0f} s, {run.conformance} held to the schema's "
          f"word; statuses {dict(sorted(statuses.items()))}; per operation {counts}")
    assert not failures, "\n\n".join(failures) + "\n\nAPI log:\n" + fuzz_api.log()[-5000:]
    assert total >= MIN_REQUESTS_SHARE * asked, (asked, counts)
    assert run.conformance >= MIN_CONFORMANCE_SHARE * asked, (asked, run.conformance)
    assert not [s for s in statuses if s >= 500], statuses
    # The generator must have reached past validation, or it fuzzed only the 422 path.
    assert statuses.get(201, 0) >= 10 and statuses.get(200, 0) >= 100 and statuses.get(404, 0) >= 10, statuses
    assert "unhandled error" not in fuzz_api.log(), fuzz_api.log()[-5000:]


def _session() -> requests.Session:
    session = requests.Session()
    # The API is on loopback: no proxy applies, and looking one up in the environment for every request costs
    # more than many a request does.
    session.trust_env = False
    return session


@dataclass
class Run:
    """What one fuzz run sends with and counts."""

    session: requests.Session
    directories: list[str]  # the server's own, which no answer may show
    counts: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    conformance: int = 0  # answers held to positive_data_acceptance or negative_data_rejection


def fuzz_operation(op: schemathesis.APIOperation, mode: GenerationMode, examples: int, run: Run, *,
                   seed: int, ended: list[str]) -> None:
    label = f"{op.label} [{mode.value}]"
    positive = mode is GenerationMode.POSITIVE
    # Two in three schema-valid cases get the state their rules depend on, and must then be accepted; the others
    # keep what was generated (files that do not exist, past expiries, hosts that do not resolve), and reach the
    # checks of that state. A schema-invalid case is sent as generated: any change could make it valid.
    settling = st.sampled_from([False, True, True]) if positive else st.just(False)
    # Two in three schema-valid job ids are those of jobs that have ended: reads and cancels reach real rows, and
    # a followed stream always ends.
    picking = st.sampled_from([None, *ended, *ended]) if positive and op.path_parameters.get("job_id") \
        else st.just(None)

    @hypothesis.seed(seed)
    # The key is fixed, not generated: a negative case that drops or mangles it would be sent with it all the same.
    @given(case=op.as_strategy(generation_mode=mode, headers=AUTH), settled=settling, job_id=picking)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    def one(case: schemathesis.Case, settled: bool, job_id: str | None) -> None:
        if job_id is not None:
            case.path_parameters = {**(case.path_parameters or {}), "job_id": job_id}
        if positive:
            _park(case.body)
        if settled:
            settle(case)
        response = case.call(session=run.session, headers=AUTH, timeout=15)
        run.counts[label] = run.counts.get(label, 0) + 1
        run.statuses[response.status_code] = run.statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:1000]}"
        if (response.headers.get("content-type") or [""])[0].startswith(("application/json", "text/")):
            sent = request_text(case.method, response.request.url or "", response.request.body)
            found = leaks(response.content.decode("utf-8", "replace"), run.directories, sent)
            assert not found, f"{label}: {response.status_code} shows server paths {found}: {response.text[:1000]}"
        checks = CHECKS
        if (settled or not positive) and not beyond_the_schema(case, response) and not lost_on_the_wire(case):
            checks = CHECKS + CONFORMANCE
            run.conformance += 1
        case.validate_response(response, checks=checks, headers=AUTH)

    one()


def _on_the_wire(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int | float) else value


def lost_on_the_wire(case: schemathesis.Case) -> bool:
    """A schema-violating query that reaches the server as a valid one: a boolean where a string is declared goes
    as the word `true`, which the string may be (`GET /jobs/{id}/events?type=true` names an event type), while
    schemathesis spells it `True` when it judges what was sent."""
    meta = case.meta
    others = (ParameterLocation.PATH, ParameterLocation.HEADER, ParameterLocation.BODY)
    if meta is None or not meta.is_negative_at(ParameterLocation.QUERY) or any(map(meta.is_negative_at, others)):
        return False
    for name, value in (case.query or {}).items():
        parameter = case.operation.query.get(name)
        if parameter is None:
            return False
        sent = [_on_the_wire(v) for v in value] if isinstance(value, list) else _on_the_wire(value)
        valid = parameter.get_validator().is_valid
        if not (valid(sent) or valid([sent])):
            return False
    return True


# -- the schema says what the server enforces --

# Rules of a job no JSON schema can state: between fields (the batch arithmetic, pipeline and offload rules, what a
# training method asks of the data format and the rest of the job) and about the cluster. A schema-valid job may get
# a 422 naming one of these, and only these.
CROSS_FIELD = ("hyperparameters.", "deepspeed.", "resources.pipeline_stages", "resources.num_gpus",
               "resources.num_nodes", "lora", "data.validation_fraction", "model.trust_remote_code", "data.format",
               "method.dpo.reference")


@pytest.fixture(scope="module")
def webhook_secret(fuzz_api: ApiProcess) -> None:
    """The fuzz owner's signing secret: a job may name a webhook URL only once its owner has one."""
    with httpx.Client(base_url=fuzz_api.url, headers=AUTH, timeout=30) as c:
        assert c.put(f"/owners/{OWNER}/webhook", json={}).status_code == 200


def _loopback(url: Any) -> Any:
    # Where a schema-valid URL points is the resolver's business, not the schema's: aim it at an allowed address.
    if not isinstance(url, str):
        return url
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, "127.0.0.1" + (f":{parts.port}" if parts.port else ""), parts.path,
                       parts.query, ""))


def settle(case: schemathesis.Case) -> None:
    """Gives a schema-valid case the state its rules depend on (the schema states every other rule): files that
    exist, a parked queue, an expiry in the future, a callable webhook host. A list cursor is left as generated:
    a well-formed id of no row is a 404 (docs/api.md, "Pages"), which a schema-valid request may get."""
    body = case.body
    for params in (case.query, case.headers):
        for name in [n for n, v in (params or {}).items() if v is None]:
            del params[name]  # an optional parameter's `null` is its absence: no header or query value is null
    if isinstance(body, dict) and isinstance(body.get("data"), dict):
        body["model"] = "tiny"
        body["data"] = {**body["data"], "train": "train.txt"}
        body["data"].pop("validation", None)
        _park(body)
        if isinstance(body.get("notifications"), dict):
            body["notifications"]["webhook_url"] = _loopback(body["notifications"].get("webhook_url"))
    if isinstance(body, dict) and case.operation.path == "/owners/{owner}/webhook":
        body["url"] = _loopback(body.get("url"))
    if isinstance(body, dict) and body.get("expires_at") is not None:
        body["expires_at"] = (datetime.now(timezone.utc) + timedelta(days=30)).isoformat()


# What Postgres cannot store, in any string (a NUL, a lone surrogate), and the size, depth and key limits of the
# free-form JSON (metadata, deepspeed.config): the field descriptions say so, the schema's keywords cannot.
V1_STORED = ("training_file", "validation_file", "model", "hyperparameters")
UNSTATABLE = ("NUL character", "surrogate", "bytes of JSON", "levels deep", "keys per object", "has an object with",
              "has a key longer than")


def beyond_the_schema(case: schemathesis.Case, response: requests.Response) -> bool:
    """A 422 for a rule no JSON Schema keyword states: cross-field rules of a job, and the storage rules; under
    /v1 (where a refusal is OpenAI's 400) whether the files and model a job names are stored rows of the caller's,
    and hyperparameters given twice (at the top and under method)."""
    if response.status_code == 400 and case.operation.path.startswith("/v1/"):
        error = response.json()["error"]
        return error.get("param") in V1_STORED or any(m in error["message"] for m in UNSTATABLE)
    if response.status_code != 422:
        return False
    problems = response.json()["error"].get("details") or []
    job = case.method == "POST" and case.operation.path == "/jobs"
    return bool(problems) and all(any(m in p["message"] for m in UNSTATABLE)
                                  or (job and p["field"].startswith(CROSS_FIELD)) for p in problems)


def _error(r: httpx.Response, status: int, field: str) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["field"] == field, error
    return str(error["message"])


@pytest.fixture(scope="module")
def api(fuzz_api: ApiProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_api.url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.mark.parametrize(("body", "field"), [({"max_gpus": False}, "max_gpus"), ({"max_gpus": True}, "max_gpus"),
                                             ({"max_active_jobs": True}, "max_active_jobs"),
                                             ({"max_gpus": "3"}, "max_gpus"), ({"max_gpus": 2.5}, "max_gpus")])
def test_a_quota_is_a_number_not_a_boolean(api: httpx.Client, body: dict[str, Any], field: str) -> None:
    _error(api.put("/owners/strict-quota/quota", json=body), 422, field)
    # Nothing was stored: the owner still runs on the defaults, not on a quota of 0 GPUs.
    assert api.get("/owners/strict-quota/quota").json()["set"] == {"max_active_jobs": None, "max_gpus": None,
                                                                   "max_stored_bytes": None}
    assert api.put("/owners/strict-quota/quota", json={field: 0}).json()["set"][field] == 0
    assert api.put("/owners/strict-quota/quota", json={}).status_code == 200


JOB = {"model": "tiny", "data": {"train": "train.txt"}, "resources": {"queue": QUEUE}}


@pytest.mark.parametrize(("section", "name", "value"), [
    ("resources", "num_gpus", True), ("resources", "priority", "5"), ("hyperparameters", "learning_rate", True),
    ("hyperparameters", "learning_rate", "1e-4"), ("hyperparameters", "max_steps", "10"),
    ("hyperparameters", "micro_batch_size", True), ("deepspeed", "zero_stage", True),
    ("resources", "num_nodes", "2"), ("deepspeed", "activation_checkpointing", 1), ("data", "packing", "yes"),
    ("checkpointing", "keep_last", True), ("lora", "rank", True)])
def test_a_job_field_takes_only_its_own_type(api: httpx.Client, section: str, name: str, value: Any) -> None:
    job = {**JOB, section: {**JOB.get(section, {}), name: value}}
    if section == "data":
        job["data"] = {"train": "train.txt", name: value}
    _error(api.post("/jobs", params={"dry_run": "true"}, json=job), 422, f"{section}.{name}")


def test_what_the_schema_documents_beyond_one_type_is_accepted(api: httpx.Client) -> None:
    # true/false for an offload and a bare model name are in the schema, and so they work.
    spec = api.get("/openapi.json").json()["components"]["schemas"]
    offload = spec["DeepSpeedOptions"]["properties"]["offload_optimizer"]["anyOf"]
    assert any(s.get("type") == "boolean" for s in offload)
    assert any(s.get("type") == "string" for s in spec["JobSpec"]["properties"]["model"]["anyOf"])
    r = api.post("/jobs", params={"dry_run": "true"}, json={**JOB, "deepspeed": {"offload_optimizer": True}})
    assert r.status_code == 200, r.text
    assert r.json()["job"]["request"]["deepspeed"]["offload_optimizer"] == "cpu"  # true, as the server reads it


def test_a_405_lists_every_method_of_its_path(api: httpx.Client, ended_jobs: list[str]) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    values = {"job_id": ended_jobs[0], "owner": "allow-owner", "key_id": "key_0000000000000000",
              "file_id": "file_" + "0" * 24, "path": "config.json", "step": 1, "model_id": "some-model"}
    checked = 0
    for template, operations in paths.items():
        documented = {m.upper() for m in operations}
        path = template.format(**values)
        for method in sorted({"GET", "POST", "PUT", "PATCH", "DELETE"} - documented):
            r = api.request(method, path)
            assert r.status_code == 405, (method, path, r.text)
            assert set(r.headers["allow"].split(", ")) == documented, (method, path, r.headers["allow"])
            assert r.json()["error"]["code"] == "method_not_allowed"
            checked += 1
    assert checked >= 50, checked


def _parameter(paths: dict[str, Any], path: str, method: str, name: str) -> dict[str, Any]:
    return next(p for p in paths[path][method]["parameters"] if p["name"] == name)["schema"]


def _string_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in schema.get("anyOf", [schema]) if s.get("type") == "string")


def test_schema_and_server_agree_on_cursors_resume_points_expiries_and_urls(
        api: httpx.Client, ended_jobs: list[str], webhook_secret: None) -> None:
    """For each rule the schema once left unstated: the schema's own verdict on a value (checked with a JSON
    Schema validator) is the server's. `ok` values are schema-valid and accepted; the others are refused by both."""
    spec = api.get("/openapi.json").json()
    paths, components = spec["paths"], spec["components"]["schemas"]
    key_id = api.get("/keys", params={"owner": OWNER}).json()["data"][0]["id"]
    future = (datetime.now(timezone.utc) + timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cases: list[tuple[dict[str, Any], Any, bool, Any]] = [
        # (schema, value, schema-valid and accepted, the request)
        *[(_string_schema(_parameter(paths, "/jobs", "get", "after")), v, ok, ("GET", "/jobs", {"after": v}, None))
          for v, ok in ((ended_jobs[0], True), ("job_nope", False), ("abc", False), ("JOB_" + "0" * 20, False))],
        *[(_string_schema(_parameter(paths, "/keys", "get", "after")), v, ok, ("GET", "/keys", {"after": v}, None))
          for v, ok in ((key_id, True), ("key_1", False), ("k" * 40, False))],
        *[(_string_schema(_parameter(paths, "/jobs/{job_id}/events", "get", "Last-Event-ID")), v, ok,
           ("GET", f"/jobs/{ended_jobs[0]}/events", None, {"Last-Event-ID": v}))
          for v, ok in (("", True), ("0", True), ("2147483647", True), ("0002147483", True), ("2147483648", False),
                        ("9999999999", False), ("-1", False))],
        *[(_string_schema(components["KeyCreate"]["properties"]["expires_at"]), v, ok,
           ("POST", "/keys", None, {"owner": "x", "scopes": ["jobs:read"], "expires_at": v}))
          for v, ok in ((future, True), (future.rstrip("Z"), False), (future[:10], False), ("1893456000", False))],
        *[(_string_schema(components["OwnerWebhookSet"]["properties"]["url"]), v, ok,
           ("PUT", "/owners/agree-owner/webhook", None, {"url": v}))
          for v, ok in (("http://127.0.0.1:9/hook?x=1", True), ("HTTPS://127.0.0.1/", True),
                        ("ftp://127.0.0.1/", False), ("http://127.0.0.1/#x", False), ("http://127.0.0.1:0/", False),
                        ("http://127.0.0.1/ä", False), ("http://127.0.0.1:65536/", False), ("http:///x", False))],
    ]
    for schema, value, ok, (method, path, params, payload) in cases:
        validator = jsonschema_rs.Draft202012Validator(schema, validate_formats=True)
        assert validator.is_valid(value) is ok, (path, value, schema)
        if method == "GET":
            r = api.get(path, params=params, headers=payload)
        else:
            r = api.request(method, path, json=payload)
        assert (r.status_code < 300) is ok, (method, path, value, r.text)
        if not ok:
            assert r.status_code == 422, r.text
    # A number where a date-time is meant: the schema says string, and the server no longer takes Unix time.
    _error(api.post("/keys", json={"owner": "x", "scopes": ["jobs:read"], "expires_at": 1893456000}), 422,
           "expires_at")


def test_a_list_cursor_of_no_row_is_a_404_naming_after_and_one_of_another_form_is_refused(
        api: httpx.Client, ended_jobs: list[str]) -> None:
    """Ids are random: a well-formed id of no row names no place in its list. It is a 404 the schema documents
    (a schema-valid request may get one), where it was a 422 the schema left no room for; a malformed one is the
    schema's own 422 (400 under /v1)."""
    spec = api.get("/openapi.json").json()["paths"]
    other_job = "job_" + "0" * 20
    cases = [("/jobs", other_job, "job_nope"), ("/files", "file_" + "0" * 24, "file_x"),
             ("/keys", "key_" + "0" * 16, "key_1"), ("/v1/files", "file_" + "0" * 24, "file-abc"),
             ("/v1/fine_tuning/jobs", other_job, "ftjob-abc"),
             (f"/v1/fine_tuning/jobs/{ended_jobs[0]}/events", f"ftevent-{other_job}-1", f"ftevent-{ended_jobs[0]}"),
             (f"/v1/fine_tuning/jobs/{ended_jobs[0]}/checkpoints", f"ftckpt-{other_job}-4", "ckpt-4")]
    for path, unknown, malformed in cases:
        template = path.replace(ended_jobs[0], "{job_id}")
        schema = _string_schema(_parameter(spec, template, "get", "after"))
        validator = jsonschema_rs.Draft202012Validator(schema)
        assert validator.is_valid(unknown) and not validator.is_valid(malformed), (path, schema)
        assert "404" in spec[template]["get"]["responses"], template
        r = api.get(path, params={"after": unknown})
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert error.get("field", error.get("param")) == "after" and unknown in error["message"], error
        r = api.get(path, params={"after": malformed})
        assert r.status_code == (400 if path.startswith("/v1/") else 422), (path, r.text)
    # The control: the id of a row the caller can see is a page (here, past the last job: an empty one).
    oldest = api.get("/jobs", params={"limit": 200}).json()["data"][-1]["id"]
    assert api.get("/jobs", params={"after": oldest}).json() == {"data": [], "has_more": False}
    assert api.get(f"/v1/fine_tuning/jobs/{ended_jobs[0]}/events",
                   params={"after": f"ftevent-{ended_jobs[0]}-9999999999"}).json()["data"], "every event is older"
