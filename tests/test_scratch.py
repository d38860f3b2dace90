"""A node's idle job folders are swept (worker/scratch.py): those unused past FT_SCRATCH_RETENTION_SECONDS, and, while
the disk is short of room, idle ones oldest first until it has room again; never one that an attempt of any process
holds, never where the store is a folder over the jobs root.

Real folders, real locks held by other processes, a real small disk (a tmpfs, where this user may mount one), and a
real job on a real worker whose folder the sweep passes over while it runs and takes once it ended, its results still
served from the store.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chaos_support import rank_pids
from tests.helpers import events_of, wait_for, wait_status
from worker.scratch import LOCKS, Sweeper, in_use, lock_file
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
HUGE = 1 << 62  # more free bytes than any disk has: a node with this minimum reads as full
DAY = 24 * 3600.0
END = {"succeeded", "failed", "cancelled"}

# Another worker process's supervisor: the job's folder in use (worker/attempt.py `supervise`) until it is killed.
HOLD = """
import sys, time
from pathlib import Path
from worker.scratch import in_use
with in_use(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""
# A sweep of another process as worker/scratch.py makes one: the exclusive lock taken, a while spent under it (the
# folder's removal), the lock file unlinked before the lock is let go.
SWEEPING = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
os.unlink(sys.argv[1])
os.close(fd)
"""


def settings_of(artifacts: Path, **more: Any) -> WorkerSettings:
    return WorkerSettings(artifacts_root=str(artifacts), **more)


def job_folder(jobs_root: Path, name: str, *, nbytes: int = 0, age: float = 0.0) -> Path:
    """A finished job's folder as an attempt leaves it, last used `age` seconds ago."""
    folder = jobs_root / name
    (folder / "attempts" / "1" / "logs").mkdir(parents=True)
    (folder / "FENCE").write_text("1")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "shard.bin").write_bytes(os.urandom(nbytes))
    then = time.time() - age
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (then, then), follow_symlinks=False)
    return folder


@pytest.fixture
def holder() -> Iterator[Callable[[Path, str], subprocess.Popen[str]]]:
    """Starts processes that hold a job's folder in use, as a supervisor of another worker process does."""
    procs: list[subprocess.Popen[str]] = []

    def hold(jobs_root: Path, job_id: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(jobs_root), job_id], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB filesystem of its own, whose room the test decides exactly."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"needs a tmpfs of its own (mount as root): {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- retention --------------------------------------------------------------------------------------------
def test_an_idle_folder_past_the_retention_goes_and_a_recent_or_held_one_stays(
        tmp_path: Path, holder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_SCRATCH_RETENTION_SECONDS", "3600")
    settings = settings_of(tmp_path)
    assert settings.scratch_retention_seconds == 3600
    assert WorkerSettings.model_fields["scratch_retention_seconds"].default == DAY
    root = settings.jobs_root
    old = job_folder(root, "job_old", age=2 * 3600)
    recent = job_folder(root, "job_recent", age=60)
    held = job_folder(root, "job_held", age=3 * 3600)
    # Beside the job folders: the warm trainer's marker (worker/warm.py) and anything else of a dot-name.
    (root / ".warm-0123").write_text("")
    (root / ".hidden").mkdir()
    holder(root, "job_held")

    assert Sweeper(settings, 0).sweep() == ["job_old"]
    assert not old.exists() and not lock_file(root, "job_old").exists()
    assert recent.is_dir() and held.is_dir() and (root / ".warm-0123").is_file() and (root / ".hidden").is_dir()
    assert (root / LOCKS).is_dir()

    # The newest of its direct entries counts: an attempt writing under an old folder keeps it.
    job_folder(root, "job_written", age=2 * 3600)
    (root / "job_written" / "attempts").touch()
    assert Sweeper(settings, 0).sweep() == []
    assert (root / "job_written").is_dir()


def test_the_heartbeats_sweep_takes_what_an_earlier_run_left_at_its_first_beat_and_reads_the_disk_after(
        tmp_path: Path) -> None:
    settings = settings_of(tmp_path, scratch_retention_seconds=3600)
    root = settings.jobs_root
    job_folder(root, "job_left", age=2 * 3600)
    (root / LOCKS).mkdir()
    (root / LOCKS / "job_never_made.lock").write_text("")  # a supervisor that ended before it made the folder
    sweeper = Sweeper(settings, 0)
    state = sweeper.disk()
    assert state["disk_full"] is False and state["disk_free_bytes"] > 0
    assert not (root / "job_left").exists() and not (root / LOCKS / "job_never_made.lock").exists()
    # The next retention sweep comes minutes later: a folder that expires meanwhile waits for it, absent pressure.
    job_folder(root, "job_next", age=2 * 3600)
    sweeper.disk()
    assert (root / "job_next").is_dir()


# -- the disk short of room ---------------------------------------------------------------------------------
def test_a_disk_short_of_room_has_idle_folders_removed_oldest_first_until_the_room_is_back(
        small_disk: Path, holder: Any) -> None:
    settings = settings_of(small_disk)
    root = settings.jobs_root
    # The oldest of all is in use: kept, whatever the room.
    job_folder(root, "job_held", nbytes=3 * MiB // 2, age=500)
    for i, name in enumerate(["job_a", "job_b", "job_c", "job_d"]):
        job_folder(root, name, nbytes=3 * MiB // 2, age=400 - 100 * i)
    holder(root, "job_held")
    sweeper = Sweeper(settings, 2 * MiB)
    assert sweeper.pressed()

    # A beat: nothing is past the retention, but below twice the minimum the oldest idle folders go.
    state = sweeper.disk()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["job_d", "job_held"]
    assert state["disk_full"] is False and state["disk_free_bytes"] >= 4 * MiB, state
    assert not sweeper.pressed()
    assert sweeper.sweep() == [], "room enough: nothing more goes"


def test_a_node_that_reads_as_full_has_every_idle_folder_removed_oldest_first_and_keeps_the_held_one(
        tmp_path: Path, holder: Any) -> None:
    # Where no tmpfs can be mounted this still runs: a minimum above the disk's room makes the node read as full.
    settings = settings_of(tmp_path)
    root = settings.jobs_root
    job_folder(root, "job_held", age=900)
    for i, name in enumerate(["job_a", "job_b", "job_c"]):
        job_folder(root, name, age=600 - 100 * i)
    holder(root, "job_held")
    sweeper = Sweeper(settings, HUGE)
    assert sweeper.sweep() == ["job_a", "job_b", "job_c"]
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == ["job_held"]
    assert sweeper.disk()["disk_full"] is True  # nothing idle left to free


# -- a supervisor and a sweep meeting on one job ---------------------------------------------------------
def test_a_supervisor_waits_for_a_sweep_under_way_and_then_holds_the_folder_it_makes_anew(tmp_path: Path) -> None:
    settings = settings_of(tmp_path)
    root = settings.jobs_root
    job_folder(root, "job_x")
    lock = lock_file(root, "job_x")
    lock.parent.mkdir()
    sweeping = subprocess.Popen([sys.executable, "-c", SWEEPING, str(lock), "1.0"], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert sweeping.stdout is not None and sweeping.stdout.readline().strip() == "locked"
        waits: list[float] = []
        started = time.monotonic()
        with in_use(root, "job_x", waiting=lambda: waits.append(time.monotonic())):
            assert time.monotonic() - started >= 0.5 and waits, "it waited for the sweep, keeping its lease"
            # Its lock is on the file the next sweep finds, not on the one the sweep unlinked.
            (root / "job_x").mkdir(exist_ok=True)
            assert Sweeper(settings, HUGE).sweep(0) == []
            assert (root / "job_x").is_dir()
        assert Sweeper(settings, HUGE).sweep(0) == ["job_x"]
    finally:
        sweeping.kill()
        sweeping.wait()


# -- what the sweep never does ------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["artifacts", "artifacts/jobs", "artifacts/jobs/store"])
def test_a_folder_store_over_the_jobs_root_turns_the_sweep_off(tmp_path: Path, store: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    settings = settings_of(tmp_path / "artifacts", store_url=f"file://{tmp_path / store}")
    root = settings.jobs_root
    job_folder(root, "job_stored", age=2 * DAY)
    sweeper = Sweeper(settings, HUGE)
    with caplog.at_level(logging.WARNING, logger="worker.scratch"):
        assert sweeper.sweep(0) == [] and sweeper.disk()["disk_full"] is True
        assert sweeper.sweep(0) == []
    assert (root / "job_stored").is_dir()
    said = [r.getMessage() for r in caplog.records if r.name == "worker.scratch"]
    assert len(said) == 1 and "not swept" in said[0], said

    # A folder store beside the jobs root is no reason to keep anything.
    beside = settings_of(tmp_path / "artifacts", store_url=f"file://{tmp_path / 'store'}")
    assert Sweeper(beside, HUGE).sweep(0) == ["job_stored"]


def test_a_folder_that_cannot_be_removed_is_said_and_passed_over(
        small_disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A filesystem mounted inside it: its removal fails (the mount point is busy), as a foreign owner's files would.
    settings = settings_of(tmp_path / "artifacts")
    root = settings.jobs_root
    stuck = job_folder(root, "job_stuck", age=2 * DAY)
    job_folder(root, "job_next", age=DAY + 60)
    (stuck / "mounted").mkdir()
    subprocess.run(["mount", "--bind", str(small_disk), str(stuck / "mounted")], check=True)
    try:
        sweeper = Sweeper(settings, 0)
        with caplog.at_level(logging.WARNING, logger="worker.scratch"):
            assert sweeper.sweep(0) == ["job_next"]
            sweeper.disk()  # a beat too: never raised into the heartbeat
        assert (stuck / "mounted").is_dir()
        said = [r.getMessage() for r in caplog.records if r.name == "worker.scratch"]
        assert len(said) == 1 and "cannot remove the idle job folder" in said[0], said
    finally:
        subprocess.run(["umount", "-l", str(stuck / "mounted")], check=False)


# -- the real stack -----------------------------------------------------------------------------------------
def test_a_running_jobs_folder_is_kept_and_once_the_job_ended_swept_with_its_results_still_served(
        api: httpx.Client, stack: Any, stack_env: dict[str, str], make_job: Any, tmp_path: Path) -> None:
    queue, name = f"scratch-{uuid.uuid4().hex[:6]}", f"scratch-{uuid.uuid4().hex[:4]}"
    artifacts = tmp_path / "artifacts"
    # A node of its own with an artifacts root of its own: the sweeps below take every idle folder there, and none
    # of what the session's other tests read.
    stack.start_worker(name, queues=queue, env={"FT_ARTIFACTS_ROOT": str(artifacts)})
    try:
        spec = make_job(name="scratch", hyperparameters={"max_steps": 40}, resources={"queue": queue},
                        checkpointing={"every_steps": 40, "keep_last": 1})
        job = api.post("/jobs", json=spec).json()
        sweeper = Sweeper(settings_of(artifacts, store_url=stack_env["FT_STORE_URL"]), HUGE)
        job_dir = sweeper.root / job["id"]
        attempt = int(wait_for(lambda: events_of(api, job["id"], ["started"]), 240, "the trainer to start")[-1][
            "attempt"])
        ranks = wait_for(lambda: rank_pids(job["id"], attempt), 30, "the attempt's ranks")
        # Frozen while the sweep runs, so that the attempt is surely still running when it does.
        for pid in ranks.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            assert job["id"] not in sweeper.sweep(0)
            assert (job_dir / "attempts" / str(attempt)).is_dir() and (job_dir / "FENCE").is_file()
            assert rank_pids(job["id"], attempt) == ranks
        finally:
            for pid in ranks.values():
                os.kill(pid, signal.SIGCONT)

        final = wait_status(api, job["id"], END, 300)
        assert final["status"] == "succeeded", final["error"]
        # The supervisor lets go once it has reported the end, just before the API can show it.
        wait_for(lambda: job["id"] in sweeper.sweep(0), 10, "the ended job's folder to be swept")
        assert not job_dir.exists() and not lock_file(sweeper.root, job["id"]).exists()

        # What outlives the node is in the store: the export is served whole.
        files = api.get(f"/jobs/{job['id']}/output").json()["files"]
        model = next(f for f in files if f["path"] == "model.safetensors")
        got = api.get(f"/jobs/{job['id']}/output/model.safetensors")
        assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == model["sha256"]
        assert api.get(f"/jobs/{job['id']}").json()["status"] == "succeeded"
    finally:
        stack.stop(name)
