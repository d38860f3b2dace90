"""`GET /jobs/{id}` answered before FastAPI's router (api/polls.py), against a real API process in production mode
on a fresh database: a found job is the same answer as before (headers, bytes, owners kept apart, a change seen
at once), every other answer is the app's own (404, 422, 405, 401, 403), and the metrics count each under
the route's template."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from tests.apiproc import ApiProcess, add_key, fixed_key, fresh_database, make_roots

ADMIN_KEY = fixed_key("polladmin")
MINE = fixed_key("pollmine")
THEIRS = fixed_key("polltheirs")
WRITER_ONLY = fixed_key("pollnoread")


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    with fresh_database() as url:
        add_key(url, ADMIN_KEY, owner="ops")
        add_key(url, MINE, owner="team-p", scopes=("jobs:write",))
        add_key(url, THEIRS, owner="team-o", scopes=("jobs:read",))
        add_key(url, WRITER_ONLY, owner="team-p", scopes=())
        yield url


@pytest.fixture(scope="module")
def api(database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    base = tmp_path_factory.mktemp("poll")
    proc = ApiProcess({"FT_DATABASE_URL": database, "FT_ENV": "production", **make_roots(base)}, base / "api.log")
    proc.start()
    yield proc
    proc.stop()
    assert "unhandled error" not in proc.log(), proc.log()[-3000:]


def get(api: ApiProcess, path: str, key: str | None, method: str = "GET") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, api.url + path, headers=headers, timeout=30)


def error(r: httpx.Response, status: int, code: str, field: str | None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert (body["code"], body["field"]) == (code, field), body
    return body


def requests_counted(api: ApiProcess, status: int) -> float:
    text = httpx.get(api.url + "/metrics", timeout=30).text
    pattern = (r'ft_api_requests_total\{method="GET",route="/jobs/\{job_id\}",status="' + str(status)
               + r'"\} ([0-9.e+]+)')
    found = re.search(pattern, text)
    return float(found[1]) if found else 0.0


def test_a_found_job_is_the_same_answer_and_every_other_answer_is_the_apps(api: ApiProcess, database: str) -> None:
    submitted = httpx.post(api.url + "/jobs", headers={"Authorization": f"Bearer {MINE}"}, timeout=30, json={
        "name": "polled", "model": "tiny", "data": {"train": "train.txt"},
        "hyperparameters": {"max_steps": 2, "global_batch_size": 2, "seq_len": 8},
        "resources": {"num_gpus": 1, "queue": "parked-poll"}})
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["id"]
    ok_before, missing_before = requests_counted(api, 200), requests_counted(api, 404)

    first, again = get(api, f"/jobs/{job_id}", MINE), get(api, f"/jobs/{job_id}", MINE)  # a miss, then a hit
    assert first.status_code == again.status_code == 200
    assert first.content == again.content == submitted.content
    assert first.headers["content-type"] == "application/json"
    assert int(first.headers["content-length"]) == len(first.content)
    assert get(api, f"/jobs/{job_id}", ADMIN_KEY).content == first.content  # an admin sees every owner's
    assert get(api, f"/jobs/{job_id}?fields=ignored", MINE).content == first.content

    # Another owner's job does not exist for a caller; nor does an unknown one; a malformed id is a 422.
    assert error(get(api, f"/jobs/{job_id}", THEIRS), 404, "not_found", "id")["message"] == \
        error(get(api, "/jobs/job_unknown", MINE), 404, "not_found", "id")["message"].replace("job_unknown", job_id)
    error(get(api, "/jobs/a.b", MINE), 422, "invalid_request", "job_id")
    error(get(api, "/jobs/" + "x" * 41, MINE), 422, "invalid_request", "job_id")
    assert get(api, f"/jobs/{job_id}", MINE, method="HEAD").status_code == 405
    error(get(api, f"/jobs/{job_id}", None), 401, "unauthorized", "authorization")
    error(get(api, f"/jobs/{job_id}", WRITER_ONLY), 403, "forbidden", "scope")

    # A change made behind the API's back is the very next answer.
    with psycopg.connect(database.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("UPDATE jobs SET metadata = '{\"mark\": \"changed\"}' WHERE id = %s", (job_id,))
    assert get(api, f"/jobs/{job_id}", MINE).json()["metadata"] == {"mark": "changed"}

    assert requests_counted(api, 200) - ok_before == 5
    assert requests_counted(api, 404) - missing_before == 2
