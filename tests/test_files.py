"""The files API against the session's real stack, whose store is an S3 server: uploads streamed into the store and
checked by the control plane's validator (the trainer's own line checks), pages, downloads whole and by range,
deletes, owners kept apart, and the hostile uploads (cut short, abandoned, lying about their length, too large,
over the quota, with a path in their name), after each of which nothing is listed and nothing is stored."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import httpx
import psycopg
import pytest

from scripts.stack import ROOT, Stack
from tests.apiproc import ApiProcess
from tests.conftest import create_key

CHAT_LINE = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def form(parts: list[tuple[str, bytes, bytes | None]], boundary: str = "tst-boundary-1234") -> tuple[bytes, str]:
    """A multipart/form-data body of (name, value, filename) parts, written byte for byte."""
    body = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"'.encode()
        if filename is not None:
            disposition += b'; filename="' + filename + b'"'
        body += b"--" + boundary.encode() + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + value + b"\r\n"
    return body + b"--" + boundary.encode() + b"--\r\n", f"multipart/form-data; boundary={boundary}"


def upload(client: httpx.Client, content: bytes, filename: str = "data.txt", fmt: str | None = None,
           purpose: str = "fine-tune") -> httpx.Response:
    data = {"purpose": purpose, **({"format": fmt} if fmt else {})}
    return client.post("/files", data=data, files={"file": (filename, content, "application/octet-stream")})


def checked(client: httpx.Client, file_id: str, timeout: float = 60) -> dict[str, Any]:
    """The file once the validator decided on it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = client.get(f"/files/{file_id}").json()
        if found["status"] != "uploaded":
            return found
        time.sleep(0.2)
    raise AssertionError(f"{file_id} was not checked within {timeout} s")


def error_of(r: httpx.Response, status: int, code: str, field: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if field is not None:
        assert err["field"] == field, err
    return err


@pytest.fixture(scope="module")
def env(stack_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **stack_env}


def owner_client(stack: Stack, env: dict[str, str], scopes: str = "jobs:write") -> Iterator[tuple[str, httpx.Client]]:
    owner = "files-" + uuid.uuid4().hex[:8]
    key = create_key(env, owner, scopes)
    with httpx.Client(base_url=stack.api_url, headers=auth(key), timeout=30) as client:
        yield owner, client


@pytest.fixture
def mine(stack: Stack, env: dict[str, str]) -> Iterator[tuple[str, httpx.Client]]:
    """A client of an owner of the test's own, who has no file yet."""
    yield from owner_client(stack, env)


@pytest.fixture(scope="module")
def bucket(stack_env: dict[str, str]) -> Any:
    """An S3 client of the stack's store, to see what the service left there."""
    return boto3.client("s3", endpoint_url=stack_env["FT_S3_ENDPOINT_URL"],
                        aws_access_key_id=stack_env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=stack_env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def bucket_and_prefix(stack_env: dict[str, str]) -> tuple[str, str]:
    bucket, _, prefix = stack_env["FT_STORE_URL"].removeprefix("s3://").partition("/")
    return bucket, prefix


def stored_files(s3: Any, stack_env: dict[str, str]) -> set[str]:
    """Every object under files/ and every multipart upload still open there."""
    name, prefix = bucket_and_prefix(stack_env)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=name, Prefix=f"{prefix}/files/").get("Contents", [])}
    open_uploads = {u["Key"] for u in s3.list_multipart_uploads(Bucket=name).get("Uploads", [])}
    return keys | {f"open:{k}" for k in open_uploads}


def nothing_left(client: httpx.Client, s3: Any, stack_env: dict[str, str], before: set[str]) -> None:
    assert client.get("/files").json()["data"] == []
    # The API may answer before the store's abort of a multipart upload has landed; give it a moment.
    end = time.monotonic() + 10
    while stored_files(s3, stack_env) != before and time.monotonic() < end:
        time.sleep(0.2)
    assert stored_files(s3, stack_env) == before


# -- uploads and their checks --


def test_a_text_file_is_stored_hashed_and_checked(mine: tuple[str, httpx.Client], bucket: Any,
                                                  stack_env: dict[str, str]) -> None:
    owner, client = mine
    content = b"The first document.\nIts second line.\n\nThe second document.\n"
    r = upload(client, content, "notes.txt", "text")
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["owner"] == owner and created["filename"] == "notes.txt" and created["bytes"] == len(content)
    assert created["sha256"] == hashlib.sha256(content).hexdigest()
    assert created["purpose"] == "fine-tune" and created["format"] == "text"
    assert created["id"].startswith("file_") and created["status"] in ("uploaded", "processed")
    done = checked(client, created["id"])
    assert done["status"] == "processed" and done["errors"] is None
    assert done["stats"] == {"lines": 4, "examples": 2, "characters": len("The first document.\nIts second line.")
                             + len("The second document."), "messages": None}
    name, prefix = bucket_and_prefix(stack_env)
    assert bucket.get_object(Bucket=name, Key=f"{prefix}/files/{created['id']}")["Body"].read() == content


def test_jsonl_and_chat_files_are_processed_with_their_stats(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    jsonl = b'{"text": "one"}\n\n{"text": "three", "extra": 1}\r\n'
    done = checked(client, upload(client, jsonl, "a.jsonl", "jsonl").json()["id"])
    assert done["status"] == "processed" and done["stats"]["examples"] == 2 and done["stats"]["characters"] == 8
    chat = (json.dumps(CHAT_LINE) + "\n").encode() * 3
    done = checked(client, upload(client, chat, "c.jsonl", "chat").json()["id"])
    assert done["status"] == "processed", done
    assert done["stats"]["examples"] == 3
    assert done["stats"]["messages"] == {"assistant": 3, "system": 3, "user": 3}


@pytest.mark.parametrize(("content", "expected"), [
    ((json.dumps(CHAT_LINE) + "\n").encode(), "chat"),
    (b'{"text": "a"}\n{"text": "b"}\n', "jsonl"),
    (b"plain prose\n", "text"),
    (b'{"other": 1}\n', "text"),
])
def test_a_format_left_out_is_detected(mine: tuple[str, httpx.Client], content: bytes, expected: str) -> None:
    _, client = mine
    created = upload(client, content).json()
    assert created["format"] is None or created["format"] == expected
    done = checked(client, created["id"])
    assert (done["status"], done["format"]) == ("processed", expected), done


def test_a_bad_chat_file_is_in_error_with_its_first_twenty_problems_by_line(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    good = json.dumps(CHAT_LINE)
    lines = [good, '{"messages": [{"role": "robot", "content": "x"}]}', '{"messages": []}', "not json",
             '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}',
             '{"messages": [{"role": "user"}]}']
    lines += ["{broken"] * 30
    done = checked(client, upload(client, ("\n".join(lines) + "\n").encode(), "bad.jsonl", "chat").json()["id"])
    assert done["status"] == "error" and done["stats"] is None
    errors = done["errors"]
    assert len(errors) == 20
    assert [e["line"] for e in errors] == list(range(2, 22))
    assert "robot" in errors[0]["message"] and "messages" in errors[1]["message"]
    assert "not valid JSON" in errors[2]["message"] and "assistant" in errors[3]["message"]
    assert "role" in errors[4]["message"]


def test_a_file_that_is_not_jsonl_declared_jsonl_is_in_error(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    done = checked(client, upload(client, b"just some prose\nmore prose\n", "prose.jsonl", "jsonl").json()["id"])
    assert done["status"] == "error"
    assert done["errors"][:2] == [{"line": 1, "message": "not valid JSON (Expecting value)"},
                                  {"line": 2, "message": "not valid JSON (Expecting value)"}]


def test_an_empty_or_non_utf8_file_is_in_error(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    done = checked(client, upload(client, b"", "empty.txt").json()["id"])
    assert done["status"] == "error" and done["errors"] == [{"line": None, "message": "is empty"}]
    done = checked(client, upload(client, b"fine\n\xff\xfe broken\n", "latin.txt", "text").json()["id"])
    assert done["status"] == "error" and done["errors"][0]["line"] == 2 and "UTF-8" in done["errors"][0]["message"]


def test_a_file_whose_check_a_dead_control_plane_left_is_checked_again(stack: Stack, mine: tuple[str, httpx.Client],
                                                                       stack_env: dict[str, str]) -> None:
    _, client = mine
    stack.stop("controlplane")
    try:
        created = upload(client, b"left behind\n", "left.txt").json()
        # As a control plane that claimed it and died mid-check leaves it: uploaded, under a lease still running.
        with psycopg.connect(stack_env["FT_DATABASE_URL"].replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute("UPDATE files SET claimed_until = now() + interval '3 seconds' WHERE id = %s",
                         (created["id"],))
        time.sleep(1)
        assert client.get(f"/files/{created['id']}").json()["status"] == "uploaded"
    finally:
        stack.start_controlplane()
    done = checked(client, created["id"])
    assert done["status"] == "processed" and done["stats"]["examples"] == 1


# -- reading: pages, one file, its content --


def test_the_list_is_paged_newest_first(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    ids = [upload(client, f"doc {i}\n".encode(), f"f{i}.txt").json()["id"] for i in range(5)]
    seen, after = [], None
    while True:
        page = client.get("/files", params={"limit": 2, **({"after": after} if after else {})}).json()
        seen += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert seen == ids[::-1]
    # A well-formed id of no file names no place in the list (docs/api.md, "Pages").
    error_of(client.get("/files", params={"after": "file_" + "0" * 24}), 404, "not_found", "after")


def test_content_whole_and_by_range(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    content = bytes(range(256)) * 40
    created = upload(client, content, "bin.txt").json()
    whole = client.get(f"/files/{created['id']}/content")
    assert whole.status_code == 200 and whole.content == content
    assert whole.headers["X-Content-SHA256"] == created["sha256"] and whole.headers["Accept-Ranges"] == "bytes"
    assert "bin.txt" in whole.headers["Content-Disposition"]
    part = client.get(f"/files/{created['id']}/content", headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == content[100:200]
    assert part.headers["Content-Range"] == f"bytes 100-199/{len(content)}"
    tail = client.get(f"/files/{created['id']}/content", headers={"Range": "bytes=10000-"})
    assert tail.status_code == 206 and tail.content == content[10000:]
    outside = client.get(f"/files/{created['id']}/content", headers={"Range": f"bytes={len(content)}-"})
    assert outside.status_code == 416 and outside.headers["Content-Range"] == f"bytes */{len(content)}"


def test_delete_removes_the_row_and_the_object(mine: tuple[str, httpx.Client], bucket: Any,
                                               stack_env: dict[str, str]) -> None:
    _, client = mine
    created = upload(client, b"bye\n").json()
    gone = client.delete(f"/files/{created['id']}")
    assert gone.status_code == 200 and gone.json()["id"] == created["id"]
    error_of(client.get(f"/files/{created['id']}"), 404, "not_found")
    error_of(client.delete(f"/files/{created['id']}"), 404, "not_found")
    name, prefix = bucket_and_prefix(stack_env)
    assert bucket.list_objects_v2(Bucket=name, Prefix=f"{prefix}/files/{created['id']}").get("KeyCount", 0) == 0


def test_a_file_a_job_that_has_not_ended_names_cannot_be_deleted(api: httpx.Client, make_job: Any,
                                                                 stack_env: dict[str, str]) -> None:
    created = upload(api, b"in use\n").json()
    assert checked(api, created["id"])["status"] == "processed"
    job = api.post("/jobs", json=make_job(name="files-in-use", data={"train": created["id"], "validation": None},
                                          resources={"queue": "files-parked"})).json()
    assert job["request"]["data"]["train"] == created["id"], job
    err = error_of(api.delete(f"/files/{created['id']}"), 409, "file_in_use", "id")
    assert job["id"] in err["message"]
    assert api.post(f"/jobs/{job['id']}/cancel").status_code == 202
    assert api.delete(f"/files/{created['id']}").status_code == 200


def test_a_delete_racing_many_submits_never_leaves_a_job_on_a_deleted_file(
        stack: Stack, mine: tuple[str, httpx.Client], make_job: Any) -> None:
    """Submits on one file, sent a few milliseconds apart, and its delete among them, round after round with the
    delete later each time: a submit either made its job before the delete (which is then refused as in use) or is a
    422 after it; no job that has not ended ever names a deleted file, and nothing is a 500."""
    owner, client = mine
    submits, spread = 12, 0.06
    outcomes = []
    with ThreadPoolExecutor(submits + 1) as pool:
        for delay in [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.01, 0.02, 0.03, 0.04]:
            file_id = upload(client, b"raced\n").json()["id"]
            assert checked(client, file_id)["status"] == "processed"
            spec = make_job(name="files-race", data={"train": file_id, "validation": None},
                            resources={"queue": "files-parked"})
            start = threading.Barrier(submits + 1)

            def submit(after: float, spec: dict[str, Any] = spec, start: threading.Barrier = start) -> httpx.Response:
                start.wait()
                time.sleep(after)
                return client.post("/jobs", json=spec)

            def delete(file_id: str = file_id, start: threading.Barrier = start,
                       delay: float = delay) -> httpx.Response:
                start.wait()
                time.sleep(delay)
                return client.delete(f"/files/{file_id}")

            answers = [pool.submit(submit, i * spread / submits) for i in range(submits)]
            deleted = pool.submit(delete).result()
            made = [a.result() for a in answers]
            assert {r.status_code for r in made} <= {201, 422}, [(r.status_code, r.text) for r in made]
            assert deleted.status_code in (200, 409), deleted.text
            jobs = [r.json()["id"] for r in made if r.status_code == 201]
            if deleted.status_code == 200:
                # The file is gone: any job that was made must have ended, and none has (they wait on a parked
                # queue), so none may have been made.
                assert jobs == [], f"jobs {jobs} name file {file_id}, deleted under them"
                assert client.get(f"/files/{file_id}").status_code == 404
                for r in made:
                    assert r.json()["error"]["details"][0]["field"] == "data.train", r.text
            else:
                error_of(deleted, 409, "file_in_use", "id")
                assert jobs and client.get(f"/files/{file_id}").status_code == 200
                assert len(jobs) == submits, [r.text for r in made]  # the file outlived every submit
            assert {client.get(f"/jobs/{j}").json()["status"] for j in jobs} <= {"queued"}
            outcomes.append((delay, deleted.status_code, len(jobs)))
            for job in jobs:
                assert client.post(f"/jobs/{job}/cancel").status_code == 202
            if deleted.status_code == 409:
                assert client.delete(f"/files/{file_id}").status_code == 200
    print(f"{owner}: (delete delay, delete status, jobs made) per round: {outcomes}")


def test_another_owners_file_is_not_found_anywhere(stack: Stack, env: dict[str, str]) -> None:
    clients = owner_client(stack, env)
    _, mine = next(clients)
    others = owner_client(stack, env, "jobs:read")
    _, other = next(others)
    created = upload(mine, b"private\n").json()
    file_id = created["id"]
    for r in (other.get(f"/files/{file_id}"), other.get(f"/files/{file_id}/content")):
        error_of(r, 404, "not_found")
    assert other.get("/files").json()["data"] == []
    error_of(other.get("/files", params={"after": file_id}), 404, "not_found", "after")
    # jobs:read may not upload or delete at all.
    error_of(other.delete(f"/files/{file_id}"), 403, "forbidden")
    error_of(upload(other, b"x\n"), 403, "forbidden")
    writer = owner_client(stack, env)
    _, third = next(writer)
    error_of(third.delete(f"/files/{file_id}"), 404, "not_found")
    assert mine.get(f"/files/{file_id}").status_code == 200


# -- bad uploads: a 4xx naming the field, and nothing stored --


def test_purpose_and_format_are_checked(mine: tuple[str, httpx.Client], bucket: Any, stack_env: dict[str, str]) -> None:
    _, client = mine
    before = stored_files(bucket, stack_env)
    error_of(upload(client, b"x\n", purpose="training"), 422, "invalid_request", "purpose")
    error_of(upload(client, b"x\n", fmt="csv"), 422, "invalid_request", "format")
    error_of(client.post("/files", files={"file": ("a.txt", b"x\n")}), 422, "invalid_request", "purpose")
    error_of(client.post("/files", data={"purpose": "fine-tune"}, files={"other": ("a.txt", b"x\n")}), 422,
             "invalid_request", "other")
    error_of(client.post("/files", json={"purpose": "fine-tune"}), 415, "invalid_request", "Content-Type")
    # The purpose after the file: the file was stored first, and is removed again.
    body, ctype = form([("file", b"late purpose\n", b"a.txt"), ("purpose", b"nope", None)])
    error_of(client.post("/files", content=body, headers={"Content-Type": ctype}), 422, "invalid_request", "purpose")
    nothing_left(client, bucket, stack_env, before)


@pytest.mark.parametrize(("filename", "problem"), [(b"../../etc/passwd", "'..'"), (b"a\x00b.txt", "NUL"),
                                                   (b"a\x01b.txt", "control"), (b"dir/", "names no file")])
def test_a_filename_with_a_path_a_nul_or_a_control_character_is_refused(
        mine: tuple[str, httpx.Client], filename: bytes, problem: str, bucket: Any, stack_env: dict[str, str]) -> None:
    _, client = mine
    before = stored_files(bucket, stack_env)
    body, ctype = form([("purpose", b"fine-tune", None), ("file", b"data\n", filename)])
    err = error_of(client.post("/files", content=body, headers={"Content-Type": ctype}), 422, "invalid_request", "file")
    assert problem in err["message"]
    nothing_left(client, bucket, stack_env, before)


def test_a_path_in_the_filename_is_cut_to_its_last_part(mine: tuple[str, httpx.Client]) -> None:
    _, client = mine
    body, ctype = form([("purpose", b"fine-tune", None), ("file", b"data\n", b"some/dir/train.txt")])
    r = client.post("/files", content=body, headers={"Content-Type": ctype})
    assert r.status_code == 201 and r.json()["filename"] == "train.txt"


def test_a_multipart_body_cut_short_is_a_400_and_stores_nothing(mine: tuple[str, httpx.Client], bucket: Any,
                                                                stack_env: dict[str, str]) -> None:
    _, client = mine
    before = stored_files(bucket, stack_env)
    body, ctype = form([("purpose", b"fine-tune", None), ("file", b"x" * 100_000, b"cut.txt")])
    r = client.post("/files", content=body[:60_000], headers={"Content-Type": ctype})
    error_of(r, 400, "invalid_request", "file")
    # Cut inside the purpose field, before any file.
    r = client.post("/files", content=body[:100], headers={"Content-Type": ctype})
    error_of(r, 400, "invalid_request", "purpose")
    nothing_left(client, bucket, stack_env, before)


def raw_request(url: str, key: str, body: bytes, ctype: str, content_length: int, *, close_after: int | None = None,
                timeout: float = 30) -> tuple[int, bytes] | None:
    """POST /files on a socket of its own, with the Content-Length given; `close_after`: send that many bytes of the
    body and close the connection (None is then returned)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        head = (f"POST /files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {content_length}\r\n\r\n").encode()
        if close_after is not None:
            sock.sendall(head + body[:close_after])
            time.sleep(0.5)
            return None
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        headers, _, rest = answer.partition(b"\r\n\r\n")
        status = int(headers.split(b" ")[1])
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(rest) < length:
            rest += sock.recv(65536)
        return status, rest[:length]


@pytest.fixture
def mine_key(stack: Stack, env: dict[str, str]) -> Iterator[tuple[str, httpx.Client]]:
    owner = "files-" + uuid.uuid4().hex[:8]
    key = create_key(env, owner, "jobs:write")
    with httpx.Client(base_url=stack.api_url, headers=auth(key), timeout=30) as client:
        yield key, client


def test_a_lying_content_length_changes_nothing(stack: Stack, mine_key: tuple[str, httpx.Client], bucket: Any,
                                               stack_env: dict[str, str]) -> None:
    key, client = mine_key
    before = stored_files(bucket, stack_env)
    body, ctype = form([("purpose", b"fine-tune", None), ("file", b"y" * 50_000, b"lie.txt")])
    # Too small: the body ends where the length says, before its closing boundary (and the bytes after it are no
    # request either: the server may answer that first, and close the connection).
    answer = raw_request(stack.api_url, key, body, ctype, len(body) - 1000)
    assert answer is not None and answer[0] == 400, answer
    nothing_left(client, bucket, stack_env, before)
    # Too large: the closing boundary ends the form; what was stored is what was sent.
    answer = raw_request(stack.api_url, key, body, ctype, len(body) + 1000)
    assert answer is not None and answer[0] == 201, answer
    created = json.loads(answer[1])
    assert created["bytes"] == 50_000
    assert client.get(f"/files/{created['id']}/content").content == b"y" * 50_000


def test_an_upload_abandoned_half_way_leaves_nothing(stack: Stack, mine_key: tuple[str, httpx.Client], bucket: Any,
                                                     stack_env: dict[str, str]) -> None:
    key, client = mine_key
    before = stored_files(bucket, stack_env)
    # Larger than one part of the store's multipart upload, so a part was sent before the client left.
    body, ctype = form([("purpose", b"fine-tune", None), ("file", os.urandom(12 << 20), b"gone.bin")])
    raw_request(stack.api_url, key, body, ctype, len(body), close_after=len(body) * 3 // 4)
    nothing_left(client, bucket, stack_env, before)
    assert "unhandled error" not in (stack.log_dir / "api.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def small_api(stack: Stack, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ApiProcess]:
    """A second API on the stack's database and store, whose file limit is 1000 bytes."""
    proc = ApiProcess({**stack_env, "FT_MAX_FILE_BYTES": "1000"}, tmp_path_factory.mktemp("files") / "api.log")
    try:
        yield proc.start()
    finally:
        proc.stop()
    assert "unhandled error" not in proc.log(), proc.log()[-3000:]


def test_a_file_over_the_limit_is_a_413_whatever_its_declared_length(small_api: ApiProcess,
                                                                      mine_key: tuple[str, httpx.Client], bucket: Any,
                                                                      stack_env: dict[str, str]) -> None:
    key, client = mine_key
    before = stored_files(bucket, stack_env)
    with httpx.Client(base_url=small_api.url, headers=auth(key), timeout=30) as small:
        assert upload(small, b"z" * 1000).status_code == 201  # exactly the limit
        assert client.delete(f"/files/{client.get('/files').json()['data'][0]['id']}").status_code == 200
        error_of(upload(small, b"z" * 1001), 413, "payload_too_large", "file")
        # Streamed without a length (chunked), and with a length that claims a small body.
        body, ctype = form([("purpose", b"fine-tune", None), ("file", b"z" * 5000, b"big.txt")])
        chunks = iter([body[i:i + 700] for i in range(0, len(body), 700)])
        error_of(small.post("/files", content=chunks, headers={"Content-Type": ctype}), 413, "payload_too_large")
    answer = raw_request(small_api.url, key, body, ctype, 400)
    assert answer is not None and answer[0] == 400  # the body ends where it says: cut short
    answer = raw_request(small_api.url, key, body, ctype, len(body))
    assert answer is not None and answer[0] == 413
    nothing_left(client, bucket, stack_env, before)


def test_a_store_that_refuses_the_write_is_a_503_to_retry_and_keeps_nothing(
        stack_env: dict[str, str], mine_key: tuple[str, httpx.Client], tmp_path: Path) -> None:
    """An API whose bucket is not on the store's server (deleted, or misnamed): the store refuses the write, and the
    upload is a 503 with Retry-After naming no endpoint, no file row, and no unhandled error in the log."""
    key, client = mine_key
    missing = "s3://no-such-bucket-" + uuid.uuid4().hex[:8] + "/service"
    proc = ApiProcess({**stack_env, "FT_STORE_URL": missing}, tmp_path / "api.log").start()
    try:
        with httpx.Client(base_url=proc.url, headers=auth(key), timeout=60) as other:
            for size in (1000, 12 << 20):  # one request, and a multipart upload
                r = upload(other, b"w" * size)
                err = error_of(r, 503, "unavailable")
                assert r.headers["Retry-After"].isdigit() and "could not be written" in err["message"], r.text
                assert "127.0.0.1" not in r.text and "no-such-bucket" not in r.text, r.text
        assert client.get("/files").json()["data"] == []
    finally:
        proc.stop()
    assert "unhandled error" not in proc.log(), proc.log()[-3000:]


def test_the_quota_of_stored_bytes(api: httpx.Client, mine: tuple[str, httpx.Client], bucket: Any,
                                   stack_env: dict[str, str]) -> None:
    owner, client = mine
    quota = api.put(f"/owners/{owner}/quota", json={"max_stored_bytes": 3000})
    assert quota.status_code == 200 and quota.json()["max_stored_bytes"] == 3000
    first = upload(client, b"a" * 2000)
    assert first.status_code == 201
    assert api.get(f"/owners/{owner}/quota").json()["usage"]["stored_bytes"] == 2000
    before = stored_files(bucket, stack_env)
    err = error_of(upload(client, b"b" * 1500), 429, "quota_exceeded", "max_stored_bytes")
    assert "3000" in err["message"] and "2000" in err["message"]
    assert [f["id"] for f in client.get("/files").json()["data"]] == [first.json()["id"]]
    assert stored_files(bucket, stack_env) == before
    assert upload(client, b"c" * 1000).status_code == 201  # what fits still does
    client.delete(f"/files/{first.json()['id']}")
    assert upload(client, b"d" * 1500).status_code == 201


# -- the command line --


def test_ft_upload_and_ft_files(stack: Stack, mine_key: tuple[str, httpx.Client], tmp_path: Path) -> None:
    key, client = mine_key
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(CHAT_LINE) + "\n") * 50)
    env = {k: v for k, v in os.environ.items() if k not in ("FT_API_KEY", "FT_API_TOKEN")}
    env.update({"FT_API_URL": stack.api_url, "FT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"})

    def ft(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ftcli.main", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    done = ft("upload", str(data), "--format", "chat")
    assert done.returncode == 0, done.stderr
    file_id = done.stdout.strip()
    found = checked(client, file_id)
    assert found["status"] == "processed" and found["bytes"] == data.stat().st_size
    assert found["filename"] == "chat.jsonl" and found["stats"]["examples"] == 50
    listed = ft("files", "--json")
    assert [f["id"] for f in json.loads(listed.stdout)["data"]] == [file_id]
    assert file_id in ft("files").stdout
    refused = ft("upload", str(data), "--format", "csv")
    assert refused.returncode == 3 and "format" in refused.stderr
