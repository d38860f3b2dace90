"""Private Postgres and Redis servers that a test may stop, kill and restart, and what the outage tests compare.

The machine's shared Postgres and Redis serve other people's tests at the same time, so the outage tests
never touch them: they run their own cluster (initdb into a temporary folder, as the `postgres` OS
user) and their own `redis-server` that keeps nothing on disk, as production's Redis may.

`python -m tests.outage_support commit-without-ack` is the control plane dying between its Postgres
commit and its Redis acknowledgement, made deterministic: it reads what the ingester would read,
stores and commits it, and exits without acknowledging (run it while the control plane is stopped).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
import redis

from core.serverpaths import ServerPaths, host_directories, python_directories
from tests.helpers import free_port
from worker.logpump import parse_trainer_event

PG_BIN = Path(os.environ.get("FT_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "postgres"


def _as_postgres(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """initdb and the server refuse to run as root; the `postgres` OS user runs them."""
    if os.geteuid() == 0:
        argv = ["runuser", "-u", PG_USER, "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


class PrivatePostgres:
    """A throwaway cluster on its own port: stop it and start it again without disturbing anyone."""

    def __init__(self) -> None:
        missing = [p for p in (PG_BIN / "initdb", PG_BIN / "pg_ctl") if not p.exists()]
        if missing:
            raise RuntimeError(f"PostgreSQL server binaries are needed for the outage tests: {missing} not found "
                               "(set FT_TEST_PG_BIN to their folder)")
        if os.geteuid() == 0 and shutil.which("runuser") is None:
            raise RuntimeError("running as root, runuser is needed to start PostgreSQL as the postgres user")
        self.base = Path(tempfile.mkdtemp(prefix="ft-outage-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.base, PG_USER, PG_USER)
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self.port = free_port()
        done = _as_postgres([str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                             "--no-sync", "-E", "UTF8"], timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stdout}\n{done.stderr}")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/finetune"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=finetune"

    def _ctl(self, *args: str) -> None:
        # fsync off: this cluster only ever stops cleanly (fast shutdown), and the machine is shared and slow.
        options = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        done = _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.log),
                             "-w", "-t", "60", *args], timeout=90)
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl {' '.join(args)} failed: {done.stdout}\n{done.stderr}\n"
                               f"{self.log.read_text()[-2000:] if self.log.exists() else ''}")

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, as when the server restarts under the service."""
        self._ctl("stop", "-m", "fast")

    def ready(self) -> bool:
        try:
            with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                                 connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def destroy(self) -> None:
        try:
            self._ctl("stop", "-m", "immediate")
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(self.base, ignore_errors=True)


class PrivateRedis:
    """A redis-server that keeps nothing on disk: killing it and starting it again loses every key."""

    def __init__(self, log_dir: Path, host: str = "127.0.0.1") -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server must be on PATH for the outage tests")
        self.host = host
        self.port = free_port()
        self.log = log_dir / f"redis-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> None:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", self.host, "--protected-mode", "no", "--save", "",
             "--appendonly", "no",
             "--dir", str(self.log.parent)], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.log}")
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within 20 s")

    def kill(self) -> None:
        """SIGKILL: everything in memory (task messages, the event stream, every key) is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def rank0_events(job_dir: Path, attempt: int) -> list[tuple[str, dict[str, Any]]]:
    """What the worker must have published from rank 0's log, in order: each JSON line with an "event"
    member is a trainer event (the rest of the object is its data), every other line a `log` event."""
    files = sorted((job_dir / "attempts" / str(attempt) / "logs").glob("*_rank0.log"))
    assert len(files) == 1, f"one rank-0 log expected for attempt {attempt}, found {files}"
    raw = files[0].read_bytes()
    *lines, rest = raw.split(b"\n")
    if rest:
        lines.append(rest)  # the worker sends an unterminated last line too, when the attempt ends
    out: list[tuple[str, dict[str, Any]]] = []
    for blob in lines:
        line = blob.decode("utf-8", "replace").rstrip("\r")
        event = parse_trainer_event(line)
        if event is None:
            out.append(("log", {"rank": 0, "line": line}))
        else:
            kind = str(event.pop("event"))
            out.append((kind, event))
    return out


def trainer_event_count(job_dir: Path, attempt: int) -> int:
    files = list((job_dir / "attempts" / str(attempt) / "logs").glob("*_rank0.log"))
    if not files:
        return 0
    return sum(1 for line in files[0].read_text(errors="replace").splitlines()
               if parse_trainer_event(line) is not None)


def stored_events(dsn: str, job_id: str) -> list[dict[str, Any]]:
    """The job's durable log as Postgres holds it (data exactly as stored, with its source ids)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT seq, attempt, type, data, source_id FROM job_events WHERE job_id = %s "
                            "ORDER BY seq", (job_id,)).fetchall()
    return [{"seq": r[0], "attempt": r[1], "type": r[2], "data": r[3], "source_id": r[4]} for r in rows]


# The marks the worker adds to the `started` event's `startup` beside rank 0's own (worker/attempt.py).
WORKER_MARKS = ("picked_up", "spawned")


def _rank_part(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 printed of a stored event: the worker's own start-up marks taken out of `started`."""
    if kind != "started" or "startup" not in data:
        return data
    marks = {k: v for k, v in data["startup"].items() if k not in WORKER_MARKS}
    return {**data, "startup": marks}


def compare_with_rank0(dsn: str, job_id: str, job_dir: Path, attempt: int) -> dict[str, int]:
    """Every rank-0 line of the attempt is stored exactly once, in order, and the log is gap-free."""
    stored = stored_events(dsn, job_id)
    assert [e["seq"] for e in stored] == list(range(1, len(stored) + 1)), "seq is gap-free from 1"
    sources = [e["source_id"] for e in stored if e["source_id"] is not None]
    assert len(sources) == len(set(sources)), "no stream entry stored twice"
    # What the worker publishes is what rank 0 printed with this node's folders rewritten (worker/outcome.py
    # `server_paths`): the job's folder is under the artifacts root, the rest of its paths Python's or /tmp's.
    rewrite = ServerPaths([(job_dir.parent.parent, "<artifacts>"), *python_directories(), *host_directories()])
    expected = [(kind, rewrite.value(data)) for kind, data in rank0_events(job_dir, attempt)]
    got = [(e["type"], _rank_part(e["type"], e["data"])) for e in stored
           if e["attempt"] == attempt and e["type"] != "state" and e["data"].get("rank") == 0]
    if got != expected:
        missing = [e for e in expected if e not in got]
        extra = [e for e in got if e not in expected]
        dups = len(got) - len({json.dumps(g, sort_keys=True) for g in got})
        raise AssertionError(f"rank-0 events of attempt {attempt}: {len(expected)} in the log file, {len(got)} "
                             f"stored; missing {missing[:5]} ({len(missing)}), extra {extra[:5]} ({len(extra)}), "
                             f"{dups} duplicated")
    return {"stored": len(stored), "rank0": len(expected),
            "trainer": sum(1 for kind, _ in expected if kind != "log")}


def states(dsn: str, job_id: str) -> list[tuple[int, str]]:
    return [(e["attempt"], e["data"].get("status")) for e in stored_events(dsn, job_id) if e["type"] == "state"]


def commit_without_ack() -> int:
    """Read a batch as the control plane's ingester, commit it to Postgres, then die before acknowledging."""
    from controlplane.ingest import Ingester
    from controlplane.settings import ControlPlaneSettings
    from db.engine import session_scope
    from db.ingest import store

    client = redis.Redis.from_url(ControlPlaneSettings().redis_url)
    ingester = Ingester(client)
    time.sleep(1)  # let the trainer's events pile up: the batch left unacknowledged is then a real one
    end = time.monotonic() + 30
    entries: list[tuple[str, dict[str, str]]] = []
    while not entries and time.monotonic() < end:
        entries = ingester._read(block_ms=500)
    if not entries:
        print("nothing to read within 30 s", flush=True)
        return 1
    with session_scope() as session:
        store(session, entries)
    print(json.dumps({"committed": len(entries), "first": entries[0][0], "last": entries[-1][0]}), flush=True)
    os._exit(0)  # no ack, no cleanup: exactly what SIGKILL after the commit leaves behind


if __name__ == "__main__":
    if sys.argv[1:] != ["commit-without-ack"]:
        sys.exit("usage: python -m tests.outage_support commit-without-ack")
    sys.exit(commit_without_ack())
