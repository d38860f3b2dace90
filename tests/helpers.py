"""Helpers the tests share: polling, reading a job's events, finding a job's processes."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def async_io_buildable() -> bool:
    """Whether DeepSpeed's async I/O op (NVMe offload) can be built here: it needs libaio-dev."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and bool(builder.is_compatible(verbose=False))


NO_ASYNC_IO = ("NVMe offload needs DeepSpeed's async I/O op, which needs libaio-dev (apt-get install libaio-dev); "
               "CI installs it")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_no_processes(marker: str, timeout: float, what: str) -> None:
    """Waits until no live process mentions `marker`; on a timeout the message names those still there."""
    left: list[str] = []

    def gone() -> bool:
        left[:] = job_processes(marker)
        return not left

    try:
        wait_for(gone, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running: {[p[:300] for p in left[:5]]}") from None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group `pgid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(int(proc.name))
    return found


def job_processes(marker: str) -> list[str]:
    """Command lines of live (non-zombie) processes that mention marker (a job id or a spec path)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # it ended while we looked
        if marker in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline}")
    return found


def events_of(api: httpx.Client, job_id: str, types: list[str] | None = None) -> list[dict[str, Any]]:
    out, after = [], 0
    while True:
        page = api.get(f"/jobs/{job_id}/events", params={"after": after, "limit": 1000, "type": types or []}).json()
        out += page["data"]
        after = page["next_after"]
        if not page["has_more"]:
            return out


def wait_status(api: httpx.Client, job_id: str, statuses: set[str], timeout: float) -> dict[str, Any]:
    try:
        return wait_for(lambda: (j := api.get(f"/jobs/{job_id}").json())["status"] in statuses and j,
                        timeout, f"job {job_id} to reach {statuses}")
    except AssertionError as exc:
        # A job that never got there says why in its own state and log: put both in the failure.
        job = api.get(f"/jobs/{job_id}").json()
        logs = api.get(f"/jobs/{job_id}/logs").text[-3000:]
        raise AssertionError(f"{exc}; it is {job['status']} (attempt {job['attempt']}, progress "
                             f"{job['progress']}, error {job['error']}); log tail:\n{logs}") from None
