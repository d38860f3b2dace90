"""The worker's plain pieces: event parsing, rank log tailing, failure classification, build locks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

from contract.codes import FailureCode
from tests.helpers import wait_for
from trainer import swap
from worker import prebuild
from worker.logpump import RankLogTail, parse_trainer_event
from worker.ops import extensions_dir, release_stale_build_locks
from worker.outcome import classify_failure, read_completion
from worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[1]


def test_only_json_objects_with_an_event_are_trainer_events() -> None:
    assert parse_trainer_event('{"event": "progress", "step": 3}') == {"event": "progress", "step": 3}
    assert parse_trainer_event('{"step": 3}') is None
    assert parse_trainer_event("{not json") is None
    assert parse_trainer_event("[rank0] hello") is None


def test_rank_logs_are_read_in_complete_lines_with_their_rank(tmp_path: Path) -> None:
    tail = RankLogTail(tmp_path)
    (tmp_path / "20260101_rank1.log").write_bytes(b"first\nsecond par")
    assert tail.poll() == [(1, "first")]
    with (tmp_path / "20260101_rank1.log").open("ab") as f:
        f.write(b"t\n")
    (tmp_path / "20260101_rank0.log").write_bytes(b"zero\n")
    assert sorted(tail.poll()) == [(0, "zero"), (1, "second part")]
    assert tail.close() == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, whose writes find the disk full")
def test_a_full_disk_is_named_as_such_not_as_a_trainer_error() -> None:
    # The traceback a rank prints when a save finds its filesystem full, made by a real write that fails so.
    try:
        with open("/dev/full", "w") as full:
            full.write("x" * 65536)
            full.flush()
    except OSError:
        tail = traceback.format_exc().splitlines()
    else:
        raise AssertionError("a write to /dev/full succeeded")
    error = classify_failure(1, None, ["[rank0] saving checkpoint 40", *tail])
    assert error["code"] == FailureCode.DISK_FULL and "No space left on device" in error["log_tail"]


def test_failures_are_classified_from_the_trainer_error_first_then_the_log() -> None:
    assert classify_failure(1, {"code": "data_error", "message": "bad line 3"}, [])["code"] == "data_error"
    oom = classify_failure(1, None, ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"])
    assert oom["code"] == "out_of_memory" and "Tried to allocate" in oom["log_tail"]
    assert classify_failure(-9, None, ["nothing useful"])["code"] == "killed"
    # How the DeepSpeed launcher reports a rank the kernel's OOM killer ended: its own exit status is 247.
    launcher_tail = ["[ERROR] [launch.py:259:sigkill_handler] ['python3', '-u', '-m', 'trainer', '--spec', "
                     "'spec.json'] exits with return code = -9"]
    killed = classify_failure(247, None, launcher_tail)
    assert killed["code"] == "killed" and "host memory" in killed["message"]
    assert classify_failure(1, None, launcher_tail)["code"] == "killed"
    assert classify_failure(1, None, ["Traceback ..."])["code"] == "trainer_error"
    # A rank killed by a signal is the cause even when the surviving rank reported its broken connection.
    gloo = {"code": "trainer_error", "message": "Connection closed by peer [127.0.0.1]:29500"}
    rank1 = classify_failure(247, gloo, launcher_tail, first_dead_rank=1)
    assert rank1["code"] == "killed" and rank1["rank"] == "1" and rank1["signal"] == "SIGKILL"
    assert rank1["message"].startswith("rank 1 was killed by SIGKILL")
    segv = classify_failure(1, gloo, [launcher_tail[0].replace("-9", "-11")], first_dead_rank=0)
    assert segv["code"] == "killed" and "rank 0 was killed by SIGSEGV" in segv["message"]
    # An NCCL watchdog aborts its rank: the log names the real cause, the signal is its consequence.
    nccl = classify_failure(1, None, ["Watchdog caught collective operation timeout",
                                      launcher_tail[0].replace("-9", "-6")])
    assert nccl["code"] == "nccl_timeout"
    assert classify_failure(1, None, [launcher_tail[0].replace("-9", "1")])["code"] == "trainer_error"


def test_completion_needs_the_marker_and_the_exported_model(tmp_path: Path) -> None:
    assert read_completion(tmp_path) is None
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 7, "final_loss": 1.5}))
    assert read_completion(tmp_path) is None, "a marker without weights is not a finished export"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    done = read_completion(tmp_path)
    assert done is not None and done["step"] == 7 and "model.safetensors" in done["files"]


def test_build_locks_left_by_a_killed_attempt_are_released(tmp_path: Path) -> None:
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").write_text("")
    (tmp_path / "cpu_adam").mkdir()
    assert release_stale_build_locks(tmp_path) == [tmp_path / "deepspeed_shm_comm" / "lock"]
    assert not (tmp_path / "deepspeed_shm_comm" / "lock").exists()


HOLD_A_BUILD_LOCK = """
import sys
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes it
baton.release()  # raises FileNotFoundError where someone removed the lock of this live build
"""


def _hold_build_lock(lock: Path) -> subprocess.Popen[str]:
    """A process building an op, as a rank or a prebuild does: it holds torch's build lock open."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_BUILD_LOCK, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def _ops_copy(tmp_path: Path) -> Path:
    """This install's built ops in a folder of the test's own: what a test builds, locks or releases there,
    no other process (another pytest worker's launches, a worker's jobs) loads from. Built first where needed,
    so a copy's prebuild only loads what is there."""
    real = extensions_dir(WorkerSettings())
    prebuild.ensure(real)
    copy = tmp_path / "torch_extensions"
    shutil.copytree(real, copy, ignore=shutil.ignore_patterns("lock", prebuild.PREBUILD_LOCK))
    return copy


def _as_before_an_op_became_buildable(folder: Path, op: str = "CPUAdamBuilder") -> None:
    """Rewrite the folder's manifest as a prebuild on this machine before `op` could be built there wrote it
    (as AsyncIOBuilder before libaio-dev was installed): the op unbuilt, the system since changed."""
    manifest = json.loads((folder / prebuild.MANIFEST).read_text())
    manifest["ops"][op] = "cannot be built here"
    manifest["fingerprint"]["system"] = "before-a-package-was-installed"
    (folder / prebuild.MANIFEST).write_text(json.dumps(manifest))


def _env(folder: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}


def _prebuild(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.prebuild", *args], cwd=REPO, env=_env(folder),
                          capture_output=True, text=True, timeout=600)


def _built(folder: Path) -> set[str]:
    manifest = json.loads((folder / prebuild.MANIFEST).read_text())
    return {name for name, state in manifest["ops"].items() if state == "built"}


def test_a_build_lock_a_live_process_holds_is_kept(tmp_path: Path) -> None:
    live, dead = tmp_path / "async_io" / "lock", tmp_path / "cpu_adam" / "lock"
    holder = _hold_build_lock(live)
    killed = _hold_build_lock(dead)
    killed.kill()
    killed.wait()
    try:
        assert release_stale_build_locks(tmp_path) == [dead]
        assert live.exists() and not dead.exists()
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0, "the live build lost its lock"
    assert not live.exists() and release_stale_build_locks(tmp_path) == []


def test_prebuild_leaves_the_cpu_ops_where_the_ranks_load_them(tmp_path: Path) -> None:
    """`make install` ran `python -m worker.prebuild`: the ops lie in the folder the supervisor gives the ranks
    (TORCH_EXTENSIONS_DIR), so no job compiles them. A lock a killed build left is released by the next
    prebuild, on a copy: the real folder is shared with every other process of this install."""
    folder = extensions_dir(WorkerSettings())
    prebuild.ensure(folder)
    check = subprocess.run([sys.executable, "-m", "worker.prebuild", "--check"], cwd=REPO, capture_output=True,
                           text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-2000:]
    assert f"DeepSpeed ops ready in {folder}: " in check.stderr and "CPUAdamBuilder" in check.stderr, check.stderr
    assert list((folder / "cpu_adam").glob("*.so")), sorted(p.name for p in (folder / "cpu_adam").iterdir())
    printed = subprocess.run([sys.executable, "-m", "worker.prebuild", "--print-dir"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert printed.stdout.strip() == str(folder)

    copy = _ops_copy(tmp_path)
    (copy / "cpu_adam" / "lock").touch()  # as a build killed half-way leaves it: no process holds it
    r = _prebuild(copy)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"removed a build lock a killed build left: {copy / 'cpu_adam' / 'lock'}" in r.stderr, r.stderr
    assert not (copy / "cpu_adam" / "lock").exists()
    # Every built op was loaded, so ninja checked its objects against the headers installed now.
    manifest = json.loads((copy / prebuild.MANIFEST).read_text())
    assert set(manifest["built_in_seconds"]) == _built(copy), manifest


def test_packages_installed_anew_make_the_prebuilt_ops_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A venv made anew with the same versions (a fresh clone's `make install` in the same place): the manifest's
    versions match, but every header is newer than the objects built from it. The prebuild must notice, or the
    first job's ranks recompile the op inside its time limit."""
    monkeypatch.setattr(prebuild, "_package_path", lambda package, inner: str(tmp_path / package / inner))
    include = tmp_path / "torch" / "include"
    include.mkdir(parents=True)
    folder = tmp_path / "ops"
    folder.mkdir()
    prebuild.write_manifest(folder, {"fingerprint": prebuild.fingerprint(), "ops": {}, "libraries": []})
    assert prebuild.stale_reason(folder) is None
    shutil.rmtree(tmp_path / "torch")  # as pip does on a reinstall: the package's files are written anew
    include.mkdir(parents=True)
    later = include.stat().st_mtime_ns + 10**9
    os.utime(include, ns=(later, later))
    assert prebuild.stale_reason(folder) == "packages changed since the ops were prebuilt"


def test_make_install_builds_an_op_that_became_buildable_after_the_first_install(tmp_path: Path) -> None:
    """`make install`, a system package installed (libaio-dev), `make install` again: the stamp of the first
    install is up to date, yet the op the package made buildable is built now, not by a job's ranks."""
    copy = _ops_copy(tmp_path)
    _as_before_an_op_became_buildable(copy)
    assert "system changed" in str(prebuild.stale_reason(copy))
    check = _prebuild(copy, "--check")
    assert check.returncode == 1 and "can build but has not built" in check.stderr, check.stderr[-2000:]
    assert "CPUAdamBuilder" in check.stderr.split("has not built")[1]
    # -o: the installed packages count as installed, so no pip runs; what is left is what every install does.
    make = subprocess.run(["make", "-o", ".venv/.installed", "install"], cwd=REPO, env=_env(copy),
                          capture_output=True, text=True, timeout=600)
    assert make.returncode == 0, (make.stdout + make.stderr)[-2000:]
    assert "CPUAdamBuilder" in _built(copy), (make.stdout + make.stderr)[-2000:]
    assert prebuild.stale_reason(copy) is None
    assert _prebuild(copy, "--check").returncode == 0


def test_a_worker_builds_what_became_buildable_before_it_takes_a_job(tmp_path: Path) -> None:
    copy = _ops_copy(tmp_path)
    _as_before_an_op_became_buildable(copy)
    # Celery's --help exits before connecting anywhere: what runs before it is all a worker's start does first.
    started = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=REPO, env=_env(copy),
                             capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr[-2000:]
    assert "checking DeepSpeed's ops before any job runs: system changed" in started.stderr, started.stderr[-2000:]
    assert "CPUAdamBuilder" in _built(copy) and prebuild.stale_reason(copy) is None
    assert "--concurrency" in started.stdout  # then the worker itself started

    # Where the ops cannot be built, the worker refuses to start rather than leave the build to a job.
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    refused = subprocess.run([sys.executable, "-m", "worker", "--help"], cwd=REPO, env=_env(not_a_folder / "ops"),
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "worker: refusing to start" in refused.stderr, refused.stderr[-2000:]
    assert "--concurrency" not in refused.stdout


def test_two_prebuilds_at_once_build_each_op_once_and_keep_a_live_build_lock(tmp_path: Path) -> None:
    """Two processes prebuilding one folder (two workers starting, two pytest workers' launches) while a rank
    holds an op's build lock: neither removes the live lock, one waits for the other, both succeed."""
    copy = _ops_copy(tmp_path)
    _as_before_an_op_became_buildable(copy)
    rank = _hold_build_lock(copy / "cpu_adam" / "lock")
    builds = [subprocess.Popen([sys.executable, "-m", "worker.prebuild"], cwd=REPO, env=_env(copy),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs: list[list[str]] = [[], []]

    def read(i: int) -> None:
        stream = builds[i].stderr
        assert stream is not None
        logs[i].extend(stream)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    try:
        # The first holds the prebuild lock and waits on the rank's build lock, so the second waits for it.
        wait_for(lambda: any("another prebuild of" in line for log in logs for line in log), 120,
                 "one prebuild to wait for the other")
    finally:
        rank.communicate("", timeout=60)
        for p in builds:
            p.wait(timeout=600)
        for t in readers:
            t.join(timeout=60)
    text = ["".join(log) for log in logs]
    assert rank.returncode == 0, "a prebuild removed the lock of a live build"
    assert [p.returncode for p in builds] == [0, 0], text
    assert not any("removed a build lock" in log for log in text), text
    assert sum("another prebuild of" in log for log in text) == 1, text
    assert "CPUAdamBuilder" in _built(copy)


def test_the_swap_folder_is_per_attempt_and_removed_only_for_nvme_jobs(tmp_path: Path) -> None:
    from contract.deepspeed import resolve
    from contract.spec import JobSpec, RunPaths, RunSpec

    def run(device: str, attempt: int) -> RunSpec:
        job = resolve(JobSpec.model_validate({"model": "m", "data": {"train": "t"}}))
        ds = job.spec.deepspeed.model_copy(update={"nvme_path": str(tmp_path / "nvme")})
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"deepspeed": ds}), "deepspeed_config": {
            "zero_optimization": {"offload_optimizer": {"device": device}}}})
        job_dir = tmp_path / "jobs" / "j-42"
        return RunSpec(job=job, attempt=attempt, paths=RunPaths(
            job_dir=str(job_dir), checkpoint_dir=str(job_dir / "c"), output_dir=str(job_dir / "o")))

    folder = swap.attempt_folder(run("nvme", 2))
    assert folder == tmp_path / "nvme" / "j-42-attempt-2"
    assert swap.attempt_folder(run("cpu", 2)) is None
    assert swap.point_at(run("nvme", 2).job.deepspeed_config, folder)["zero_optimization"][
        "offload_optimizer"] == {"device": "nvme", "nvme_path": str(folder)}
    (folder / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    (folder / "zero_stage_3" / "optimizer" / "rank0" / "0_1.tensor.swp").write_bytes(b"x")
    other = tmp_path / "nvme" / "j-43-attempt-1"
    other.mkdir()
    assert swap.remove(folder) and not folder.exists()
    assert other.is_dir() and not swap.remove(folder)


def test_the_warm_trainers_word_on_the_rank_that_failed_first_beats_what_proc_showed() -> None:
    from worker.logpump import RankWatch

    watch = RankWatch()
    watch.see("process 4242 spawned with command: [warm trainer, --local_rank=0, x]")
    watch.see("process 4243 spawned with command: [warm trainer, --local_rank=1, x]")
    watch.first_dead = 0  # /proc looked after the reaper had stopped both: the first in its order
    watch.see("process 4243 (local rank 1) failed first with exit code -9")
    assert watch.first_dead == 1
