"""An API process of a test's own (uvicorn, a fresh database, no worker), and a TCP proxy that can cut it off.

The hostile-input, fuzz and access tests start their own API: in production mode with keys required,
pointed at a dead port, or behind a proxy they cut, none of which the session's shared stack may be.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path

import httpx
import psycopg
import redis

from scripts.stack import ROOT, Stack, migrate
from tests.conftest import PG
from tests.helpers import free_port, wait_for


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new, migrated database, dropped afterwards."""
    name = f"ft_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        migrate({**os.environ, "FT_DATABASE_URL": url})
        yield url
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def admin_database(key: str, owner: str) -> Iterator[str]:
    """`fresh_database` with `key` stored as an admin key of `owner`."""
    with fresh_database() as url:
        add_key(url, key, owner=owner)
        yield url


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def parked() -> str:
    """A queue of the test's own that no worker serves: its jobs wait, counted, for as long as the test needs."""
    return "parked-" + uuid.uuid4().hex[:8]


def parked_job(name: str, queue: str | None = None, num_gpus: int = 1) -> dict[str, object]:
    """A tiny job's body for a queue no worker serves (`queue`, else a fresh one)."""
    return {"name": name, "model": "tiny", "data": {"train": "train.txt"},
            "hyperparameters": {"max_steps": 2, "global_batch_size": 2, "seq_len": 8},
            "resources": {"num_gpus": num_gpus, "queue": queue or parked()}}


@contextmanager
def controlplane_of(env: dict[str, str], logs: Path) -> Iterator[Stack]:
    """The control plane alone, for a test's own API processes, once its first pass wrote the marker that tells a
    Redis data loss: a submit counted before it could be re-driven as a first start's."""
    stack = Stack(env, logs)
    stack.start_controlplane()
    try:
        wait_for(lambda: redis.Redis.from_url(env["FT_REDIS_URL"]).exists("ft:controlplane:dataset"), 60,
                 "the control plane")
        yield stack
    finally:
        stack.stop()


def fixed_key(label: str) -> str:
    """A well-formed API key whose secret a test chooses (so it can name it at import time, in parameters)."""
    return "ftk_" + (label * 43)[:43]


def add_key(database_url: str, key: str, owner: str = "default", scopes: tuple[str, ...] = ("admin",),
            expires_at: datetime | None = None) -> str:
    """Stores `key` as the service does (its SHA-256 only); returns its id."""
    key_id = "key_" + secrets.token_hex(8)
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("INSERT INTO api_keys (id, secret_hash, prefix, owner, scopes, name, expires_at) "
                     "VALUES (%s, %s, %s, %s, %s, 'tests', %s)",
                     (key_id, hashlib.sha256(key.encode()).digest(), key[:12], owner, list(scopes), expires_at))
    return key_id


def make_roots(base: Path) -> dict[str, str]:
    """Model and data roots holding just enough for a job to pass the location checks."""
    (base / "models" / "tiny").mkdir(parents=True, exist_ok=True)
    (base / "data").mkdir(exist_ok=True)
    (base / "data" / "train.txt").write_text("some text\n\nmore text\n")
    (base / "artifacts").mkdir(exist_ok=True)
    return {"FT_MODEL_ROOT": str(base / "models"), "FT_DATA_ROOT": str(base / "data"),
            "FT_ARTIFACTS_ROOT": str(base / "artifacts"), "FT_NVME_ROOT": str(base / "nvme")}


class ApiProcess:
    """`uvicorn api.main:app` on a free port with the given FT_* environment."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "FT_ENV": "development", **env, "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> ApiProcess:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "warning"], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the API exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            with suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise TimeoutError(f"the API at {self.url} did not answer /healthz within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def api_processes(env: dict[str, str], logs: Path, count: int = 2) -> Iterator[list[ApiProcess]]:
    """`count` API processes on one database (`env`), each started before the block; their logs must show no
    unhandled error once they stop."""
    procs = [ApiProcess(env, logs / f"api{i}.log") for i in range(count)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()
    for p in procs:
        assert "unhandled error" not in p.log(), p.log()[-3000:]


@contextmanager
def api_client(database: str, key: str, base: Path, **env: str) -> Iterator[httpx.Client]:
    """A production-mode API process of its own (keys required) on `database`, with the job roots under `base`
    (make_roots), and a client that sends `key`. Its log must show no unhandled error when it stops."""
    api = ApiProcess({"FT_DATABASE_URL": database, "FT_ENV": "production", **make_roots(base), **env},
                     base / "api.log").start()
    try:
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            yield c
    finally:
        api.stop()
    assert "unhandled error" not in api.log(), api.log()[-3000:]


class TcpProxy:
    """Forwards a local port to an upstream port. `cut()` drops every connection and refuses new ones, as a
    restarting Postgres does; `restore()` listens again on the same port."""

    def __init__(self, upstream_port: int) -> None:
        self.port = free_port()
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)  # lets the accept loop notice a cut
        self._listening.set()
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._listening.clear()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for s in self._sockets:
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while self._listening.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                except OSError:
                    client.close()
                    continue
                with self._lock:
                    self._sockets |= {client, upstream}
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
