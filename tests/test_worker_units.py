"""The worker's plain pieces: event parsing, rank log tailing, failure classification, build locks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainer import swap
from worker.logpump import RankLogTail, parse_trainer_event
from worker.outcome import classify_failure, read_completion
from worker.settings import WorkerSettings
from worker.supervisor import extensions_dir, release_stale_build_locks


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


def test_prebuild_leaves_the_cpu_ops_where_the_ranks_load_them(tmp_path: Path) -> None:
    """`make install` ran `python -m worker.prebuild`; running it again finds the ops built, and they lie in
    the folder the supervisor gives the ranks (TORCH_EXTENSIONS_DIR), so no job compiles them."""
    folder = extensions_dir(WorkerSettings())
    (folder / "cpu_adam").mkdir(parents=True, exist_ok=True)
    (folder / "cpu_adam" / "lock").touch()  # as a build killed half-way leaves it
    r = subprocess.run([sys.executable, "-m", "worker.prebuild"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"DeepSpeed ops ready in {folder}: CPUAdamBuilder" in r.stderr, r.stderr[-2000:]
    assert not (folder / "cpu_adam" / "lock").exists()
    assert list((folder / "cpu_adam").glob("*.so")), sorted(p.name for p in (folder / "cpu_adam").iterdir())
    printed = subprocess.run([sys.executable, "-m", "worker.prebuild", "--print-dir"], capture_output=True,
                             text=True, timeout=120)
    assert printed.stdout.strip() == str(folder)


def test_the_swap_folder_is_per_attempt_and_removed_only_for_nvme_jobs(tmp_path: Path) -> None:
    def run(device: str, attempt: int) -> dict[str, Any]:
        return {"attempt": attempt, "paths": {"job_dir": str(tmp_path / "jobs" / "j-42")},
                "job": {"spec": {"deepspeed": {"nvme_path": str(tmp_path / "nvme")}},
                        "deepspeed_config": {"zero_optimization": {"offload_optimizer": {"device": device}}}}}

    folder = swap.attempt_folder(run("nvme", 2))
    assert folder == tmp_path / "nvme" / "j-42-attempt-2"
    assert swap.attempt_folder(run("cpu", 2)) is None
    assert swap.point_at(run("nvme", 2)["job"]["deepspeed_config"], folder)["zero_optimization"][
        "offload_optimizer"] == {"device": "nvme", "nvme_path": str(folder)}
    (folder / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    (folder / "zero_stage_3" / "optimizer" / "rank0" / "0_1.tensor.swp").write_bytes(b"x")
    other = tmp_path / "nvme" / "j-43-attempt-1"
    other.mkdir()
    assert swap.remove(folder) and not folder.exists()
    assert other.is_dir() and not swap.remove(folder)
