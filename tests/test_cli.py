"""The `ft` command line, the installed entry point run as a subprocess against the real stack: submit and
wait for a real fine-tune, watch it through a proxy that drops the stream mid-job (the watch resumes with
Last-Event-ID and sees every event once, in order), list, read, logs, cancel, exit codes, and the service's
errors printed with their field and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.apiproc import TcpProxy

FT = str(Path(sys.executable).with_name("ft"))


def ft_env(url: str, key: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FT_API_KEY", "FT_API_TOKEN")}
    env.update({"FT_API_URL": url, "COLUMNS": "200", "NO_COLOR": "1"})
    if key is not None:
        env["FT_API_KEY"] = key
    return env


def ft(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([FT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def env(stack: Any, admin_key: str) -> dict[str, str]:
    return ft_env(stack.api_url, admin_key)


@pytest.fixture
def job_file(tmp_path: Path, make_job: Any) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(make_job(name="cli")))
    return path


def lines_json(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rest_of(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The rest of a process's stdout and stderr, read through its own file objects: communicate() reads the
    pipes beneath them and would lose what an earlier readline() had already buffered."""
    got: dict[str, str] = {}
    readers = [threading.Thread(target=lambda name=name, f=f: got.__setitem__(name, f.read()), daemon=True)
               for name, f in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    proc.wait(timeout=timeout)
    for reader in readers:
        reader.join(timeout=30)
    return got["out"], got["err"]


def test_submit_wait_and_a_watch_that_resumes_after_the_stream_is_cut(env: dict[str, str], job_file: Path,
                                                                      stack_env: dict[str, str], tmp_path: Path
                                                                      ) -> None:
    name = "cli-" + uuid.uuid4().hex[:8]
    submit = subprocess.Popen([FT, "submit", str(job_file), "--set", f"name={name}", "--set",
                               "hyperparameters.max_steps=16", "--set", "checkpointing.every_steps=8", "--wait"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert submit.stdout is not None
    job_id = submit.stdout.readline().strip()
    assert job_id.startswith("job_"), (job_id, submit.stderr.read() if submit.stderr else "")

    # A proxy in front of the API that the test cuts while the job trains: every connection through it is
    # dropped mid-stream and new ones are refused for two seconds, as a restarting load balancer does.
    proxy = TcpProxy(int(stack_env["FT_PORT"]))
    proxy.restore()
    watch = subprocess.Popen([FT, "watch", job_id, "--json"], env={**env, "FT_API_URL": f"http://127.0.0.1:{proxy.port}"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watch.stdout is not None and watch.stderr is not None
    seen = [json.loads(watch.stdout.readline()) for _ in range(3)]
    proxy.cut()
    time.sleep(2)
    proxy.restore()
    try:
        rest, errors = rest_of(watch, timeout=300)
        submit_out, submit_err = rest_of(submit, timeout=300)
    finally:
        proxy.cut()
        for p in (watch, submit):
            if p.poll() is None:
                p.kill()
    events = seen + lines_json(rest)
    assert "resuming after event" in errors, errors
    # Every event exactly once and in order across the cut: the ids are the job's gap-free sequence numbers.
    assert [e["id"] for e in events] == list(range(1, len(events) + 1)), [e["id"] for e in events]
    assert events[-1]["type"] == "state" and events[-1]["status"] == "succeeded", events[-3:]
    assert any(e["type"] == "progress" for e in events)
    assert watch.returncode == 0, errors
    assert submit.returncode == 0, submit_err
    assert "succeeded" in submit_out and "Traceback" not in submit_err

    # The ended job through every reading command.
    assert ft(env, "wait", job_id).returncode == 0
    got = ft(env, "get", job_id, "--json")
    job = json.loads(got.stdout)
    assert got.returncode == 0 and job["id"] == job_id and job["status"] == "succeeded" and job["name"] == name
    assert job["progress"]["step"] == 16
    table = ft(env, "get", job_id).stdout
    assert job_id in table and "succeeded" in table and "16/16" in table
    listed = json.loads(ft(env, "ls", "--status", "succeeded", "--json", "--limit", "200").stdout)
    assert job_id in [j["id"] for j in listed["data"]]
    assert job_id not in [j["id"] for j in json.loads(ft(env, "ls", "--queue", "nowhere", "--json").stdout)["data"]]
    assert job_id in ft(env, "ls", "--owner", "default").stdout
    log = ft(env, "logs", job_id)
    assert log.returncode == 0 and "[attempt 1][rank 0]" in log.stdout
    log_events = lines_json(ft(env, "logs", job_id, "--json").stdout)
    assert log_events and {e["type"] for e in log_events} == {"log"}
    # Following an ended job's log prints it and returns.
    assert ft(env, "logs", job_id, "-f").stdout == log.stdout
    replay = ft(env, "watch", job_id)
    assert replay.returncode == 0 and "succeeded" in replay.stdout


def test_cancel_and_wait_exit_codes(env: dict[str, str], job_file: Path) -> None:
    parked = "parked-" + uuid.uuid4().hex[:8]  # a queue no worker serves: the job stays queued
    created = ft(env, "submit", str(job_file), "--set", f"resources.queue={parked}", "--json")
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]
    assert job_id in ft(env, "ls", "--queue", parked).stdout
    cancelled = ft(env, "cancel", job_id, "--json")
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["status"] == "cancelled"
    waited = ft(env, "wait", job_id, "--json")
    assert waited.returncode == 1 and json.loads(waited.stdout)["status"] == "cancelled"
    again = ft(env, "cancel", job_id)
    assert again.returncode == 3 and "conflict" in again.stderr and "(field: status)" in again.stderr


def test_errors_name_the_field_without_a_traceback(env: dict[str, str], job_file: Path, stack: Any) -> None:
    bad = ft(env, "submit", str(job_file), "--set", "hyperparameters.seq_len=3")
    assert bad.returncode == 3 and "invalid_request" in bad.stderr
    assert "(field: hyperparameters.seq_len)" in bad.stderr and "Traceback" not in bad.stderr
    as_json = ft(env, "submit", str(job_file), "--set", "deepspeed.zero_stage=7", "--json")
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["error"]["field"] == "deepspeed.zero_stage"
    missing = ft(env, "get", "job_nope")
    assert missing.returncode == 3 and "not_found" in missing.stderr and "(field: id)" in missing.stderr
    wrong_key = ft(ft_env(stack.api_url, "ftk_" + "x" * 43), "ls")
    assert wrong_key.returncode == 3 and "unauthorized" in wrong_key.stderr and "authorization" in wrong_key.stderr
    nowhere = ft(ft_env("http://127.0.0.1:9", "k"), "ls")
    assert nowhere.returncode == 3 and "cannot reach the API" in nowhere.stderr
    malformed = ft(env, "submit", str(job_file), "--set", "no-equals-sign")
    assert malformed.returncode == 3 and "(field: --set)" in malformed.stderr
    for result in (bad, missing, wrong_key, nowhere, malformed):
        assert "Traceback" not in result.stderr + result.stdout


def test_nodes(env: dict[str, str]) -> None:
    """The stack's one worker announced its node."""
    listed = ft(env, "nodes", "--json")
    assert listed.returncode == 0, listed.stderr
    node = json.loads(listed.stdout)["data"][0]
    table = ft(env, "nodes").stdout
    assert node["name"] in table and node["state"] in table


def test_the_dev_key_file_when_no_key_is_set(stack: Any, admin_key: str, tmp_path: Path) -> None:
    (tmp_path / "var").mkdir()
    # The stack lets header-less requests in (FT_ALLOW_ANONYMOUS): a bad key in the file shows it is sent.
    (tmp_path / "var" / "dev-key").write_text("ftk_" + "y" * 43 + "\n")
    assert "unauthorized" in ft(ft_env(stack.api_url, None), "ls", cwd=tmp_path).stderr
    (tmp_path / "var" / "dev-key").write_text(admin_key + "\n")
    listed = ft(ft_env(stack.api_url, None), "ls", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "data" in json.loads(listed.stdout)
