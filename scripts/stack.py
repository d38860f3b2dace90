"""Starts the service's processes (API, control plane, Celery workers) and stops them all together.

`python -m scripts.stack` runs the whole stack in the foreground (what `make up` does); the demo and
the tests use the Stack class to do the same from Python. Every address and path comes from the
FT_* environment, as in production.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.settings import ApiSettings

ROOT = Path(__file__).resolve().parent.parent


class StackSettings(BaseSettings):
    """What a stack of this host's processes reads of its FT_ environment: where its API listens (the API's own
    settings and defaults) and what its processes are started with."""

    model_config = SettingsConfigDict(env_prefix="FT_", extra="ignore", hide_input_in_errors=True)

    host: str = ApiSettings.model_fields["host"].default
    port: int = ApiSettings.model_fields["port"].default
    api_workers: int | None = None  # uvicorn processes; unset: one per core
    queues: str = "default"  # what a worker of the stack serves, unless it is started with its own
    node_name: str | None = None  # the worker's node; unset: the host's name (make up) or the worker's name
    node_addr: str = "127.0.0.1"  # the stack's nodes are processes of this one host
    key: SecretStr | None = None  # an admin key for scripts/demo.py outside development (`make up` prints it)

    @classmethod
    def of(cls, env: dict[str, str]) -> StackSettings:
        """The settings in `env` (the stack's environment, which may differ from this process's), empty values
        counting as unset."""
        given = {name: env[f"FT_{name.upper()}"] for name in cls.model_fields if env.get(f"FT_{name.upper()}")}
        return cls.model_validate(given)


def database_exists_or_create(url: str) -> None:
    """Create the service's database on first use (a fresh machine has only the default ones)."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    admin = f"host={u.host or '127.0.0.1'} port={u.port or 5432} user={u.username or 'postgres'} dbname=postgres"
    if u.password:
        admin += f" password={u.password}"
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (u.database,)).fetchone():
            conn.execute(f'CREATE DATABASE "{u.database}"')


def migrate(env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=ROOT, env=env, check=True)


DEV_KEY = ROOT / "var" / "dev-key"


def ensure_dev_key(path: Path = DEV_KEY) -> str:
    """The development stack's admin key (owner `default`), kept in var/dev-key (mode 600): reused while it
    still works in this database, made anew otherwise. This is how `make up` and `make demo` work without a
    manual step while the API requires a key like production does."""
    import asyncio

    from api import access
    from api.settings import ApiSettings
    from db import keys
    from db import pool as pg

    async def working_or_new() -> tuple[str, bool]:
        pg.configure(database_url=ApiSettings().database_url, pool_size=1)
        try:
            if path.is_file():
                key = path.read_text().strip()
                found = await keys.lookup(access.digest(key.encode()))
                if found is not None and (found["expires_at"] is None
                                          or found["expires_at"] > datetime.now(timezone.utc)):
                    return key, False
            _, key = await access.create_key(owner="default", scopes=["admin"],
                                             name="development (make up, make demo)", actor=None)
            return key, True
        finally:
            await pg.close()

    key, made = asyncio.run(working_or_new())
    if not made:
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(key + "\n")
    return key


class Stack:
    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        # Every process of this stack shares one host: the ranks take only CPU time the API, the control plane
        # and the worker's lease renewals leave (worker/priority.py), unless the operator chose otherwise.
        self.env.setdefault("FT_TRAINER_PRIORITY", "idle")
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def api_url(self) -> str:
        settings = StackSettings.of(self.env)
        return f"http://{settings.host}:{settings.port}"

    def _start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None,
               prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        out = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen([*(prefix or []), *argv], cwd=ROOT, env={**self.env, **(extra_env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def start_api(self) -> None:
        # One process per core: a request is mostly Python work, so a single event loop tops out at one
        # core; the processes share the port and nothing else (each has its own pool and feeds).
        settings = StackSettings.of(self.env)
        workers = settings.api_workers or os.cpu_count() or 1
        self._start("api", [sys.executable, "-m", "uvicorn", "api.main:app", "--host", settings.host,
                            "--port", str(settings.port), "--workers", str(workers), "--log-level", "warning",
                            "--no-access-log"])

    def start_controlplane(self) -> None:
        self._start("controlplane", [sys.executable, "-m", "controlplane"])

    def start_worker(self, name: str = "worker1", queues: str | None = None, *, node: str | None = None,
                     slots: int | None = None, env: dict[str, str] | None = None,
                     prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
        """One node's worker (`python -m worker`: a threads pool, one thread per slot, consuming only the
        node's own queue). Its node is `node`, else FT_NODE_NAME, else `name`: the tests' workers are
        nodes of their own on one host. `prefix` runs it elsewhere (`ip netns exec HOST`: another host's
        network); it must exec the worker, so the process started is the worker itself."""
        settings = StackSettings.of(self.env)
        extra = {"FT_QUEUES": queues or settings.queues, "FT_NODE_NAME": node or settings.node_name or name,
                 # The stack's nodes are processes of this one host: a multi-node job meets on the loopback.
                 "FT_NODE_ADDR": settings.node_addr}
        if slots is not None:
            extra["FT_NODE_SLOTS"] = str(slots)
        extra.update(env or {})
        return self._start(name, [sys.executable, "-m", "worker"], extra, prefix)

    def wait_ready(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.log_dir / (name + '.log')}")
            try:
                if httpx.get(self.api_url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the API at {self.api_url} was not ready within {timeout} s")

    def stop(self, name: str | None = None, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        names = [name] if name else list(self.procs)
        for n in names:
            if self.procs[n].poll() is None:
                self.procs[n].send_signal(sig)
        for n in names:
            try:
                self.procs[n].wait(timeout)
            except subprocess.TimeoutExpired:
                self.procs[n].kill()
                self.procs[n].wait()
            del self.procs[n]


def main() -> int:
    env = dict(os.environ)
    from api.settings import get_settings

    settings = get_settings()
    database_exists_or_create(settings.database_url)
    migrate(env)
    if settings.development:
        ensure_dev_key()
    stack = Stack(env, ROOT / "var" / "logs")
    stack.start_api()
    stack.start_controlplane()
    stack.start_worker(node=StackSettings.of(env).node_name or socket.gethostname())
    try:
        stack.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        # e.g. the worker refused a node name another live worker on this host holds (its log says which)
        print(exc, file=sys.stderr)
        stack.stop()
        return 1
    print(f"API on {stack.api_url} (docs at {stack.api_url}/docs); logs in {stack.log_dir}; Ctrl-C stops all.",
          flush=True)
    if settings.development:
        print(f"admin key of owner 'default' in {DEV_KEY.relative_to(ROOT)}: export FT_KEY=$(cat {DEV_KEY})",
              flush=True)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping:
            for name, proc in stack.procs.items():
                if proc.poll() is not None:
                    print(f"{name} exited with {proc.returncode}; stopping the stack", file=sys.stderr)
                    stopping = True
            time.sleep(0.5)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
