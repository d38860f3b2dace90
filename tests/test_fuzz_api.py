"""Property-based fuzzing of the whole HTTP API from its own OpenAPI schema (schemathesis on hypothesis).

Every operation gets schema-valid (positive) and schema-violating (negative) requests against a real
API process on a fresh Postgres database and this session's Redis database. The properties: no 5xx
ever, and every response (status, content type, headers, body) is one the schema documents.

Generated jobs never reach a worker: every body that names no queue, or names one, gets a queue no
worker serves. Path ids are sometimes those of jobs that have ended, so reads and cancels reach real
rows and a followed stream always ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import CheckFunction
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.apiproc import ApiProcess, add_key, fixed_key, fresh_database, make_roots

TOKEN = fixed_key("fuzz")  # an admin key of its own owner, stored in the fuzzed API's database
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUEUE = "fuzz-parked"  # no worker serves it
# Examples per operation and mode: the 15 operations with inputs get 400 each; the two probes have one input.
EXAMPLES = {GenerationMode.POSITIVE: 250, GenerationMode.NEGATIVE: 150}
MIN_REQUESTS = 2000
# ignored_auth re-sends a successful request without the token (once per operation) and expects a 401.
CHECKS: list[CheckFunction] = [status_code_conformance, content_type_conformance, response_schema_conformance,
                               response_headers_conformance, ignored_auth]


@pytest.fixture(scope="module")
def fuzz_api(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    base = tmp_path_factory.mktemp("fuzz")
    with fresh_database() as database:
        # Its own owner: no generated owner name (quotas, key filters) is likely to be it. No quota by default,
        # so generated submits are not cut off at the default's 100 (a 429 would be schema-valid, but dull).
        add_key(database, TOKEN, owner="fuzz-owner-7f3a")
        proc = ApiProcess({"FT_DATABASE_URL": database, "FT_REDIS_URL": redis_url, "FT_QUOTA_MAX_ACTIVE_JOBS": "",
                           "FT_ENV": "production", **make_roots(base)}, base / "api.log")
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
    if isinstance(body, dict):
        resources = body.setdefault("resources", {})
        if isinstance(resources, dict):
            resources["queue"] = QUEUE
    return body


def test_fuzz_every_operation(fuzz_api: ApiProcess, ended_jobs: list[str]) -> None:
    schema = schemathesis.openapi.from_url(fuzz_api.url + "/openapi.json")

    @schema.hook("flatmap_body")
    def real_locations(_: Any, body: Any) -> st.SearchStrategy[Any]:
        # Most bodies get the model directory and data file that exist, so they pass the location checks
        # and reach Postgres with whatever names, metadata and raw configs were generated.
        if isinstance(body, dict) and isinstance(body.get("data"), dict):
            real = {**body, "model": "tiny", "data": {**body["data"], "train": "train.txt"}}
            real["data"].pop("validation", None)
            return st.sampled_from([body, real, real]).map(_park)
        return st.just(_park(body))

    @schema.hook("flatmap_path_parameters")
    def real_ids(_: Any, params: dict[str, Any] | None) -> st.SearchStrategy[dict[str, Any] | None]:
        if not params or "job_id" not in params:
            return st.just(params)
        return st.sampled_from([params["job_id"], *ended_jobs]).map(lambda job_id: {**params, "job_id": job_id})

    operations = [result.ok() for result in schema.get_all_operations()]
    # 6 job operations, 3 of keys, 2 of quotas, the audit log, the nodes, 3 of webhooks and the 2 probes
    assert len(operations) == 18, [op.label for op in operations]
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}
    session = requests.Session()
    # Reproducible by default (the same requests every run); FT_FUZZ_SEED=<n> explores other ones.
    seed = int(os.environ.get("FT_FUZZ_SEED", "0"))
    start = time.monotonic()
    for op in operations:
        has_inputs = any(len(part) for part in (op.path_parameters, op.query, op.headers, op.body))
        for mode, examples in EXAMPLES.items():
            if mode is GenerationMode.NEGATIVE and not has_inputs:
                continue  # nothing to get wrong
            fuzz_operation(op, mode, examples, session, counts, statuses, seed=seed)
    elapsed = time.monotonic() - start
    total = sum(counts.values())
    print(f"\nfuzz: {total} requests in {elapsed:.0f} s; statuses {dict(sorted(statuses.items()))}; "
          f"per operation {counts}")
    assert total >= MIN_REQUESTS, counts
    assert not [s for s in statuses if s >= 500], statuses
    # The generator must have reached past validation, or it fuzzed only the 422 path.
    assert statuses.get(201, 0) >= 10 and statuses.get(200, 0) >= 100 and statuses.get(404, 0) >= 10, statuses
    assert "unhandled error" not in fuzz_api.log(), fuzz_api.log()[-5000:]


def fuzz_operation(op: schemathesis.APIOperation, mode: GenerationMode, examples: int, session: requests.Session,
                   counts: dict[str, int], statuses: dict[int, int], *, seed: int) -> None:
    label = f"{op.label} [{mode.value}]"

    @hypothesis.seed(seed)
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    def one(case: schemathesis.Case) -> None:
        response = case.call(session=session, headers=AUTH, timeout=15)
        counts[label] = counts.get(label, 0) + 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:1000]}"
        case.validate_response(response, checks=CHECKS, headers=AUTH)

    one()
