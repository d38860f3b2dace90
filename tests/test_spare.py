"""The warm trainer (worker/spare.py, worker/warm.py): a rank it forks starts as the launcher's would, two attempts
share nothing, killing the group leaves no process, and a spare that crashed or cannot serve is bypassed.

Real processes: the spare imports the real trainer before it forks; the ranks are tests/spare_probe.py, run the
same way the launcher runs a module (the trainer itself runs through the spare in every job test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from contract.protocol import WarmTrainer
from tests.helpers import free_port, group_members, wait_for
from worker import warm
from worker.attempt import trainer_env
from worker.priority import command
from worker.process import kill_group, wait_group_gone
from worker.spare import RANK_VARIABLES, TAKEN, Request


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return trainer_env(tmp_path / "ext")


@pytest.fixture
def spares(tmp_path: Path) -> Any:
    s = warm.Spares(sys.executable, tmp_path / "jobs")
    yield s
    s.close()


def request(tmp_path: Path, env: dict[str, str], out: Path, *args: str, world: int = 2,
            priority: str = "normal") -> Request:
    job_dir = tmp_path / "jobs" / out.name
    job_dir.mkdir(parents=True, exist_ok=True)
    return Request(guard=[], worker_pid=os.getpid(), env=env, cwd=str(job_dir), umask=warm.current_umask(),
                   rlimits=warm.process_limits(), log_dir=str(job_dir / "logs"), priority=priority, world=world,
                   master_port=free_port(), devices=[str(i) for i in range(world)],
                   trainer_args=["--out", str(out), *args], entry="tests.spare_probe")


def run_warm(spares: warm.Spares, env: dict[str, str], req: Request) -> subprocess.Popen[bytes]:
    spares.start(env)
    spare = spares.take(env)
    assert spare is not None
    answer, _ = warm.hand_over(spare, req)
    assert answer == TAKEN
    return spare


def seen(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_a_forked_rank_starts_with_what_the_launcher_gives_its_rank(tmp_path: Path, env: dict[str, str],
                                                                    spares: warm.Spares) -> None:
    launched, forked = tmp_path / "launched", tmp_path / "forked"
    job_dir = tmp_path / "jobs" / "launched"
    job_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
            "--enable_each_rank_log", str(job_dir / "logs"), "--module", "tests.spare_probe", "--out", str(launched)]
    assert subprocess.run(command(argv, "normal"), cwd=job_dir, env=env, timeout=600).returncode == 0
    spare = run_warm(spares, env, request(tmp_path, env, forked))
    assert spare.wait(timeout=300) == 0
    for rank in (0, 1):
        a, b = seen(launched, rank), seen(forked, rank)
        # The port is each start's own; the rest of the environment is the launcher's exactly.
        differ = {k for k in set(a["env"]) | set(b["env"]) if a["env"].get(k) != b["env"].get(k)}
        assert differ == {"MASTER_PORT"}, {k: (a["env"].get(k), b["env"].get(k)) for k in differ}
        assert RANK_VARIABLES <= set(b["env"])
        assert a["argv"] == [f"--local_rank={rank}", "--out", str(launched)]
        assert b["argv"] == [f"--local_rank={rank}", "--out", str(forked)]
        for key in ("local_rank", "umask", "nofile", "sched", "nice"):
            assert a[key] == b[key], key
        assert Path(a["cwd"]).name == "launched" and Path(b["cwd"]).name == "forked"
        assert Path(b["sys_path0"]) == Path(b["cwd"]) and Path(a["sys_path0"]) == Path(a["cwd"])
        # The ranks are in the spare's session, which is the attempt's group.
        assert b["pgid"] == spare.pid and b["ppid"] == spare.pid
    logs = sorted(p.name for p in (tmp_path / "jobs" / "forked" / "logs").iterdir())
    assert [name.rsplit("_", 1)[1] for name in logs] == ["rank0.log", "rank1.log"]


def test_two_attempts_in_a_row_share_no_state(tmp_path: Path, env: dict[str, str], spares: warm.Spares) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    # At a lower priority than the worker's (worker/priority.py), which a forked rank takes as the launcher's would.
    one = run_warm(spares, env, request(tmp_path, env, first, world=1, priority="low"))
    assert one.wait(timeout=300) == 0
    # What the worker does when an attempt ends: the next spare is a new process, never the last one's.
    two = run_warm(spares, env, request(tmp_path, env, second, world=1))
    assert two.wait(timeout=300) == 0
    a, b = seen(first, 0), seen(second, 0)
    assert a["nice"] == os.getpriority(os.PRIO_PROCESS, 0) + 10
    assert a["mark"] is None and b["mark"] is None  # the module global rank 0 of the first attempt set
    assert "SPARE_PROBE_LEAK" not in b["env"]  # and the variable it set
    assert one.pid != two.pid and a["ppid"] == one.pid and b["ppid"] == two.pid


def test_killing_the_group_kills_the_spare_and_every_rank_and_their_children(tmp_path: Path, env: dict[str, str],
                                                                             spares: warm.Spares) -> None:
    out = tmp_path / "cancelled"
    spare = run_warm(spares, env, request(tmp_path, env, out, "--sleep", "300"))
    wait_for(lambda: all((out / f"child{r}.pid").is_file() for r in (0, 1)), 300, "both ranks' children")
    members = group_members(spare.pid)
    assert len(members) == 5, members  # the spare, two ranks, a child of each
    # Each process names its attempt in its command line, as the launcher's did: ps and job_processes find it.
    lines = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in members]
    assert sum(f"--local_rank={r} --out {out}" in line for line in lines for r in (0, 1)) == 2, lines
    assert sum(f"warm trainer of --out {out}" in line for line in lines) == 1, lines
    kill_group(spare.pid, signal.SIGKILL)  # what cancel does (worker/attempt.py `obey`)
    spare.wait(timeout=10)
    assert wait_group_gone(spare.pid, 10)
    assert not any(alive(pid) for pid in members)


def test_a_failed_rank_ends_the_others_and_its_code_is_the_attempts(tmp_path: Path, env: dict[str, str],
                                                                    spares: warm.Spares) -> None:
    out = tmp_path / "failed"
    req = request(tmp_path, env, out, "--exit", "7", world=1)
    spare = run_warm(spares, env, req)
    assert spare.wait(timeout=300) == 7
    assert wait_group_gone(spare.pid, 10)


def test_the_group_dies_with_its_worker_even_by_sigkill(tmp_path: Path, env: dict[str, str]) -> None:
    """The spare, as the attempt's guard, kills the group when the worker that handed it the attempt is gone."""
    out = tmp_path / "orphaned"
    req = request(tmp_path, env, out, "--sleep", "300")
    script = ("import json, sys, time\nfrom pathlib import Path\nfrom worker import warm\nfrom worker.spare import "
              "Request\nreq = Request(**json.loads(sys.argv[1]))\nreq.worker_pid = __import__('os').getpid()\n"
              f"s = warm.Spares(sys.executable, Path({str(tmp_path / 'jobs')!r}))\ns.start(req.env)\n"
              "spare = s.take(req.env)\nprint(warm.hand_over(spare, req)[0], spare.pid, flush=True)\ntime.sleep(300)\n")
    from dataclasses import asdict

    worker = subprocess.Popen([sys.executable, "-c", script, json.dumps(asdict(req))], env=env,
                              stdout=subprocess.PIPE)
    assert worker.stdout is not None
    answer, pid = worker.stdout.readline().decode().split()
    assert answer == TAKEN
    wait_for(lambda: all((out / f"child{r}.pid").is_file() for r in (0, 1)), 300, "both ranks' children")
    members = group_members(int(pid))
    worker.kill()
    worker.wait()
    assert wait_group_gone(int(pid), 10)
    assert not any(alive(p) for p in members)


def test_a_crashed_spare_is_bypassed_and_the_next_one_serves(tmp_path: Path, env: dict[str, str],
                                                             spares: warm.Spares) -> None:
    spares.start(env)
    crashed = spares.take(env)
    assert crashed is not None
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait()
    spares._spare, spares._env = crashed, env  # a spare that died while the node held it
    assert spares.take(env) is None  # the attempt goes to the launcher
    out = tmp_path / "after"
    assert run_warm(spares, env, request(tmp_path, env, out, world=1)).wait(timeout=300) == 0
    assert seen(out, 0)["mark"] is None


def test_a_spare_refuses_an_attempt_of_another_environment_and_leaves_nothing(tmp_path: Path, env: dict[str, str],
                                                                              spares: warm.Spares) -> None:
    spares.start(env)
    spare = spares.take(env)
    assert spare is not None
    other = {**env, "HF_HOME": str(tmp_path / "elsewhere")}
    answer, _ = warm.hand_over(spare, request(tmp_path, other, tmp_path / "refused", world=1))
    assert answer.startswith("refused") and "HF_HOME" in answer
    assert spare.poll() is not None and wait_group_gone(spare.pid, 10)
    # A changed environment never takes the old spare: the worker starts the launcher and a spare of the new one.
    spares.start(env)
    assert spares.take(other) is None


def test_an_idle_spare_ends_with_its_worker(tmp_path: Path, env: dict[str, str]) -> None:
    script = (f"import sys, time\nfrom pathlib import Path\nfrom worker import warm\ns = warm.Spares(sys.executable, "
              f"Path({str(tmp_path)!r}))\ns.start(dict(__import__('os').environ))\nprint(s._spare.pid, flush=True)\n"
              "time.sleep(300)\n")
    worker = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE)
    assert worker.stdout is not None
    pid = int(worker.stdout.readline())
    time.sleep(0.5)  # mid-import
    worker.kill()
    worker.wait()
    wait_for(lambda: not alive(pid), 10, "the idle spare gone with its worker")


def test_a_spare_started_before_the_worker_execs_into_celery_is_adopted(tmp_path: Path, env: dict[str, str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m worker` starts the spare, then execs: the process it becomes (here a second Spares of this same
    process, as after an exec) takes it over through the variable, the pid and the pipes' descriptors."""
    monkeypatch.delenv(warm.HANDED_DOWN, raising=False)
    before = warm.Spares(sys.executable, tmp_path / "jobs")
    before.start(env)
    before.hand_down()
    before._spare = before._env = None  # as an exec forgets it: the descriptors are the adopter's alone now
    assert warm.HANDED_DOWN in os.environ
    after = warm.Spares(sys.executable, tmp_path / "jobs")
    try:
        after.adopt(env)
        assert warm.HANDED_DOWN not in os.environ
        spare = after.take(env)
        assert isinstance(spare, warm.Adopted)
        out = tmp_path / "adopted"
        answer, _ = warm.hand_over(spare, request(tmp_path, env, out, world=1))  # type: ignore[arg-type]
        assert answer == TAKEN and spare.wait(timeout=300) == 0
        assert seen(out, 0)["ppid"] == spare.pid
    finally:
        after.close()
    # One handed down with another environment than the node's now is ended, not served.
    before.start(env)
    pid = before._spare.pid if before._spare is not None else 0
    before.hand_down()
    before._spare = before._env = None
    after.adopt({**env, "HF_HOME": str(tmp_path)})
    assert after.take(env) is None
    wait_for(lambda: not alive(pid), 10, "the spare of another environment ended")


def test_the_node_knows_when_its_spare_is_imported_and_when_it_has_none(tmp_path: Path, env: dict[str, str],
                                                                        spares: warm.Spares) -> None:
    """What the node announces (worker/node.py, GET /nodes `warm_trainer`): importing until the spare's imports are
    done, ready then, none once an attempt took it; the ready file is the spare's to remove when it is taken, the
    node's when it ends one."""
    assert spares.state() == WarmTrainer.NONE
    spares.start(env)
    ready = spares._ready
    assert ready is not None and spares.state() == WarmTrainer.IMPORTING  # torch is not imported in a blink
    wait_for(lambda: spares.state() == WarmTrainer.READY, 300, "the spare's imports done")
    assert ready.exists()
    spare = spares.take(env)
    assert spare is not None and spares.state() == WarmTrainer.NONE
    answer, _ = warm.hand_over(spare, request(tmp_path, env, tmp_path / "taken", world=1))
    assert answer == TAKEN and spare.wait(timeout=300) == 0
    assert not ready.exists(), "a spare serving an attempt is ready no more"
    # One ended unused (a changed environment, the worker's shutdown) leaves no ready file either.
    spares.start(env)
    wait_for(lambda: spares.state() == WarmTrainer.READY, 300, "the second spare's imports done")
    second = spares._ready
    spares.close()
    assert second is not None and not second.exists() and spares.state() == WarmTrainer.NONE
    assert not list((tmp_path / "jobs").glob(".warm-*"))
