"""The CPU priority a job's launcher and ranks run at (worker/priority.py), applied the way the supervisor
applies it, inherited by what they start, and the defaults: `low` for a worker, `idle` for a one-host stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from scripts.stack import Stack
from worker import priority
from worker.settings import WorkerSettings

# What a rank would report about itself and about a process it starts (a data loader, a compile job).
PROBE = """
import json, os, subprocess, sys
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0), os.nice(0))"],
                       capture_output=True, text=True, check=True).stdout.split()
print(json.dumps({"policy": os.sched_getscheduler(0), "nice": os.nice(0), "child": [int(x) for x in child]}))
"""


def probe(argv: list[str]) -> dict[str, object]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


BASE_NICE = os.nice(0)


@pytest.mark.parametrize(("level", "policy", "nice"), [
    ("normal", os.SCHED_OTHER, BASE_NICE),
    ("low", os.SCHED_OTHER, min(19, BASE_NICE + priority.LOW_NICE)),
    ("idle", os.SCHED_IDLE, BASE_NICE),
])
def test_each_priority_applies_to_the_command_and_what_it_starts(level: priority.Priority, policy: int,
                                                                  nice: int) -> None:
    found = probe(priority.command([sys.executable, "-c", PROBE], level))
    assert found == {"policy": policy, "nice": nice, "child": [policy, nice]}


def test_idle_without_chrt_falls_back_to_the_lowest_nice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority.shutil, "which", lambda _: None)
    argv = priority.command([sys.executable, "-c", PROBE], "idle")
    assert argv[:3] == ["nice", "-n", "19"]
    assert probe(argv) == {"policy": os.SCHED_OTHER, "nice": 19, "child": [os.SCHED_OTHER, 19]}


def test_defaults_low_on_a_worker_idle_on_a_one_host_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FT_TRAINER_PRIORITY", raising=False)
    assert WorkerSettings().trainer_priority == "low"
    assert Stack({}, tmp_path).env["FT_TRAINER_PRIORITY"] == "idle"
    # The operator's choice wins, from the shell or from the caller.
    monkeypatch.setenv("FT_TRAINER_PRIORITY", "normal")
    assert Stack({}, tmp_path).env["FT_TRAINER_PRIORITY"] == "normal"
    assert Stack({"FT_TRAINER_PRIORITY": "low"}, tmp_path).env["FT_TRAINER_PRIORITY"] == "low"


def test_an_unknown_priority_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_TRAINER_PRIORITY", "realtime")
    with pytest.raises(ValidationError) as caught:
        WorkerSettings()
    assert "trainer_priority" in str(caught.value) and "'idle'" in str(caught.value)
