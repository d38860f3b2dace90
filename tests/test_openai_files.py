"""`/v1/files` driven by the official `openai` Python SDK against the session's real stack: uploads of OpenAI's chat
and prompt/completion JSONL checked by the control plane, pages, content, delete, and each error class the SDK raises
for its cause, from OpenAI's error envelope. No job trains here: the one job submitted sits on a queue no worker
serves."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from api.errors import ApiError, ErrorCode, from_db
from api.v1.errors import envelope as openai_envelope
from api.v1.errors import render
from db.errors import QuotaExceeded
from scripts.stack import Stack
from tests.conftest import create_key

CHAT = [{"messages": [{"role": "system", "content": "Be terse.", "name": "rules"},
                      {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5", "weight": 0},
                      {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]}]
PAIRS = [{"prompt": "2+2=", "completion": " 4"}, {"prompt": "Capital of France:", "completion": " Paris"}]
PARKED = "openai-files-parked"  # no worker serves it


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.fixture(scope="module")
def env(stack_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **stack_env}


@pytest.fixture
def owner(stack: Stack, env: dict[str, str]) -> tuple[str, str]:
    """An owner of the test's own, with no file yet, and its jobs:write key."""
    name = "oai-" + uuid.uuid4().hex[:8]
    return name, create_key(env, name, "jobs:write")


@pytest.fixture
def sdk(stack: Stack) -> Iterator[Callable[[str], OpenAI]]:
    """The official client of the service, as a team moving from OpenAI makes it: only `base_url` changes."""
    made: list[OpenAI] = []

    def make(key: str, **options: Any) -> OpenAI:
        made.append(OpenAI(base_url=f"{stack.api_url}/v1", api_key=key, timeout=30, **options))
        return made[-1]

    yield make
    for client in made:
        client.close()


def checked(client: OpenAI, file_id: str, timeout: float = 60) -> Any:
    """The file once the control plane's line check decided on it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = client.files.retrieve(file_id)
        if found.status != "uploaded":
            return found
        time.sleep(0.2)
    raise AssertionError(f"{file_id} was not checked within {timeout} s")


def envelope(r: httpx.Response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"], error
    return dict(error)


def test_chat_and_prompt_completion_files_are_uploaded_and_processed(owner: tuple[str, str], sdk: Any,
                                                                     api: httpx.Client) -> None:
    client = sdk(owner[1])
    started = int(time.time())
    chat = client.files.create(file=("chat.jsonl", jsonl(CHAT)), purpose="fine-tune")
    assert chat.id.startswith("file_") and chat.object == "file" and chat.purpose == "fine-tune"
    assert (chat.filename, chat.bytes, chat.expires_at) == ("chat.jsonl", len(jsonl(CHAT)), None)
    assert started - 1 <= chat.created_at <= time.time() + 1 and chat.status in ("uploaded", "processed")
    done = checked(client, chat.id)
    assert (done.status, done.status_details) == ("processed", None)

    pairs = client.files.create(file=("pairs.jsonl", jsonl(PAIRS)), purpose="fine-tune")
    assert checked(client, pairs.id).status == "processed"
    # The same rows as the native face's: one file, read two ways.
    native = {f: api.get(f"/files/{f}").json() for f in (chat.id, pairs.id)}
    assert native[chat.id]["format"] == "chat" and native[chat.id]["stats"]["messages"]["assistant"] == 3
    assert native[pairs.id]["format"] == "completion" and native[pairs.id]["stats"]["examples"] == 2


def test_a_file_that_fails_the_check_says_why_by_line(owner: tuple[str, str], sdk: Any) -> None:
    client = sdk(owner[1])
    bad = jsonl([CHAT[0], {"messages": [{"role": "assistant", "content": "x", "weight": 2}]}, PAIRS[0]])
    done = checked(client, client.files.create(file=("bad.jsonl", bad), purpose="fine-tune").id)
    assert done.status == "error", done
    assert done.status_details is not None and done.status_details.startswith("line 2: messages[0].weight is 2")
    assert "line 3: missing field 'messages'" in done.status_details
    empty = checked(client, client.files.create(file=("empty.jsonl", b"\n"), purpose="fine-tune").id)
    assert (empty.status, empty.status_details) == ("error", "the file is empty")


def test_the_list_pages_as_openai_pages_it(owner: tuple[str, str], sdk: Any, stack: Stack) -> None:
    client = sdk(owner[1])
    ids = [client.files.create(file=(f"{i}.jsonl", jsonl(PAIRS)), purpose="fine-tune").id for i in range(3)]
    newest_first = ids[::-1]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more is True
    # The SDK's auto-paging follows `after` = the last id of each page to the end.
    assert [f.id for f in client.files.list(limit=1)] == newest_first
    assert [f.id for f in client.files.list(order="asc", limit=2)] == ids
    assert [f.id for f in client.files.list(purpose="fine-tune")] == newest_first
    assert list(client.files.list(purpose="batch")) == []
    raw = httpx.get(f"{stack.api_url}/v1/files", params={"limit": 2, "after": newest_first[0]},
                    headers={"Authorization": f"Bearer {owner[1]}"}).json()
    assert raw == {"object": "list", "data": raw["data"], "first_id": newest_first[1], "last_id": newest_first[2],
                   "has_more": False}


def test_content_and_delete(owner: tuple[str, str], sdk: Any) -> None:
    client = sdk(owner[1])
    created = client.files.create(file=("chat.jsonl", jsonl(CHAT)), purpose="fine-tune")
    assert client.files.content(created.id).content == jsonl(CHAT)
    gone = client.files.delete(created.id)
    assert (gone.id, gone.object, gone.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    assert list(client.files.list()) == []


def test_each_error_class_for_its_cause(owner: tuple[str, str], sdk: Any, env: dict[str, str],
                                        make_job: Any, stack: Stack) -> None:
    name, key = owner
    client = sdk(key)
    created = client.files.create(file=("chat.jsonl", jsonl(CHAT)), purpose="fine-tune")

    # A key of the right shape that is no key; then none at all.
    wrong = key[:-1] + ("A" if key[-1] != "A" else "B")
    with pytest.raises(openai.AuthenticationError) as auth:
        sdk(wrong).files.list()
    assert (auth.value.status_code, auth.value.code, auth.value.type) == (401, "invalid_api_key",
                                                                          "invalid_request_error")

    reader = sdk(create_key(env, name, "jobs:read"))
    assert reader.files.retrieve(created.id).id == created.id
    with pytest.raises(openai.PermissionDeniedError) as denied:
        reader.files.delete(created.id)
    assert "jobs:write" in denied.value.message
    with pytest.raises(openai.PermissionDeniedError):
        reader.files.create(file=("x.jsonl", jsonl(PAIRS)), purpose="fine-tune")

    stranger = sdk(create_key(env, "oai-" + uuid.uuid4().hex[:8], "jobs:write"))
    for missing in ("file_" + "0" * 24, "file-abc123", created.id):  # the last one: another owner's
        target = stranger if missing == created.id else client
        for call in (target.files.retrieve, target.files.content, target.files.delete):
            with pytest.raises(openai.NotFoundError) as nf:
                call(missing)
            assert nf.value.code == "not_found"
    assert list(stranger.files.list()) == []

    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("x.jsonl", jsonl(PAIRS)), purpose="assistants")
    assert (bad.value.param, bad.value.type) == ("purpose", "invalid_request_error")
    assert "fine-tune" in bad.value.message

    # In use: a job that has not ended names the file (it waits on a queue no worker serves).
    assert checked(client, created.id).status == "processed"
    native = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    with native:
        job = native.post("/jobs", json=make_job(name="oai-in-use", data={"train": created.id, "validation": None},
                                                 resources={"queue": PARKED}))
        assert job.status_code == 201, job.text
        with pytest.raises(openai.ConflictError) as conflict:
            client.files.delete(created.id)
        assert conflict.value.code == "file_in_use" and job.json()["id"] in conflict.value.message
        # The SDK retries a 409 unless told not to; retrying cannot free the file.
        assert conflict.value.response.headers["x-should-retry"] == "false"
        assert native.post(f"/jobs/{job.json()['id']}/cancel").status_code == 202
    assert client.files.delete(created.id).deleted is True


def test_a_quota_of_stored_bytes_is_a_rate_limit_error(owner: tuple[str, str], sdk: Any, api: httpx.Client) -> None:
    name, key = owner
    assert api.put(f"/owners/{name}/quota", json={"max_stored_bytes": 3000}).status_code == 200
    client = sdk(key)
    kept = client.files.create(file=("a.jsonl", b"a" * 2000), purpose="fine-tune")
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as limited:
        client.files.create(file=("b.jsonl", b"b" * 1500), purpose="fine-tune")
    assert time.monotonic() - started < 5  # not retried with backoff: waiting frees no bytes
    assert (limited.value.type, limited.value.code) == ("insufficient_quota", "insufficient_quota")
    assert "3000" in limited.value.message and limited.value.param == "max_stored_bytes"
    assert [f.id for f in client.files.list()] == [kept.id]


def test_openai_organization_and_project_headers_are_ignored(owner: tuple[str, str], sdk: Any) -> None:
    client = sdk(owner[1], organization="org-elsewhere", project="proj_elsewhere")
    created = client.files.create(file=("p.jsonl", jsonl(PAIRS)), purpose="fine-tune")
    assert [f.id for f in client.files.list()] == [created.id]


def test_malformed_requests_and_unknown_paths_answer_in_the_envelope(owner: tuple[str, str], stack: Stack,
                                                                     env: dict[str, str]) -> None:
    name, key = owner
    reader = create_key(env, name, "jobs:read")
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        envelope(c.get("/v1/files", params={"limit": 0}), 400, "invalid_request", "limit")
        envelope(c.get("/v1/files", params={"order": "sideways"}), 400, "invalid_request", "order")
        envelope(c.post("/v1/files", json={"purpose": "fine-tune"}), 400, "invalid_request", "Content-Type")
        envelope(c.post("/v1/files", files={"file": ("a.jsonl", b"x\n")}), 400, "invalid_request", "purpose")
        envelope(c.post("/v1/files", data={"purpose": "fine-tune", "expires_after[anchor]": "created_at"},
                        files={"file": ("a.jsonl", b"x\n")}), 400, "invalid_request", "expires_after[anchor]")
        envelope(c.delete("/v1/files"), 405, "method_not_allowed")
        envelope(c.get("/v1/files/file_" + "0" * 24), 404, "not_found", "id")
        # An unknown route is a 404 to any valid key, as OpenAI answers one; with a bad key it is still a 401.
        as_reader = {"Authorization": f"Bearer {reader}"}
        unknown = envelope(httpx.get(f"{stack.api_url}/v1/no/such/route", headers=as_reader), 404, "not_found")
        assert "/v1/no/such/route" in unknown["message"]
        for path in ("/v1/no/such/route", "/v1/files"):
            r = httpx.get(f"{stack.api_url}{path}", headers={"Authorization": "Bearer sk-not-a-key"})
            envelope(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        # The body limit answers before any route: a 413 (the SDK's APIStatusError) in the envelope too.
        envelope(c.request("DELETE", "/v1/files/file_" + "0" * 24, content=b"x" * (2 << 20)), 413,
                 "payload_too_large", "body")
        # The native face keeps its own shape.
        native = c.get("/files", params={"limit": 0})
        assert native.status_code == 422 and native.json()["error"]["field"] == "limit"


@pytest.mark.parametrize(("native", "status", "kind", "code", "param"), [
    (ApiError(422, ErrorCode.INVALID_REQUEST, "n_epochs: must be 1 to 50", "hyperparameters.n_epochs"), 400,
     "invalid_request_error", "invalid_request", "hyperparameters.n_epochs"),
    (ApiError(401, ErrorCode.UNAUTHORIZED, "send a valid API key", "authorization"), 401, "invalid_request_error",
     "invalid_api_key", None),
    (ApiError(403, ErrorCode.FORBIDDEN, "this needs the scope 'jobs:write'", "scope"), 403, "invalid_request_error",
     "forbidden", None),
    (from_db(QuotaExceeded("o", (1, None), (1, 0), 2)), 429, "insufficient_quota", "insufficient_quota",
     "max_active_jobs"),
    (ApiError(503, ErrorCode.UNAVAILABLE, "the database is unreachable", headers={"Retry-After": "5"}), 503,
     "server_error", "unavailable", None),
    (ApiError(500, ErrorCode.INTERNAL_ERROR, "an internal error occurred"), 500, "server_error", "internal_error",
     None),
])
def test_each_native_error_has_its_openai_status_type_and_code(native: ApiError, status: int, kind: str, code: str,
                                                               param: str | None) -> None:
    """What no cheap request provokes (an unreachable database, a job quota): the renderer, as the handlers call it."""
    got, body = openai_envelope(native)
    assert (got, body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (status, kind, code, param)
    response = render(native)
    assert response.status_code == status and json.loads(bytes(response.body)) == body
    if status == 503:
        assert response.headers["retry-after"] == "5"  # the SDK waits as long before its retry
    assert (response.headers.get("x-should-retry") == "false") is (status == 429)
