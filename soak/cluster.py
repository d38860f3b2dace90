"""The stack the soak runs: a Postgres and a Redis of its own (so restarting them harms nobody else), the S3-protocol
store (moto's server), a fault proxy on every link the nemesis cuts, the API, the control plane and two or more
worker nodes with disks and caches of their own; all of it removed at the end.

Links through proxies: each worker's Redis (broker, stream, keys; its guards' too) and store (its ranks' uploads
too), the control plane's Postgres, and the API's and control plane's store. The API reaches Postgres directly, so
its 503s come from Postgres's own restarts, which the check of 5xx answers knows as a dependency down.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from scripts.corpus import write_corpus
from scripts.pairs import write_pairs
from scripts.stack import ROOT, Stack, database_exists_or_create
from soak.history import History
from soak.proxy import ProxyHub, free_port
from tests.outage_support import PrivatePostgres, PrivateRedis
from tests.s3_support import S3Server

NODE_DISK_BYTES = 384 * 2**20  # each node's disk (its jobs' folders and its cache): room for a few tiny jobs
STORE_SLOW_DELAY = 0.5  # seconds each chunk waits on a slow store link
NET_DELAY = 0.2  # seconds each chunk waits on a delayed link
# The leases are the product's defaults (2 s heartbeat, 10 s TTL, 3 s grace): on two busy cores shorter ones lose
# workers to scheduling delays alone, and the nemesis's pauses straddle the default TTL as they should.
SETTINGS = {"FT_ENV": "development", "FT_LOOP_INTERVAL_SECONDS": "0.3", "FT_QUOTA_MAX_ACTIVE_JOBS": "",
            "FT_API_WORKERS": "1", "FT_TRAINER_PRIORITY": "low", "FT_WEBHOOK_ALLOW_NETS": "127.0.0.1/32",
            "FT_WEBHOOK_BACKOFF_SECONDS": "0.5", "FT_WEBHOOK_BACKOFF_MAX_SECONDS": "4",
            "FT_STORE_RETRY_SECONDS": "120", "FT_REPORT_RETRY_SECONDS": "120"}


@dataclass
class Node:
    name: str
    disk: Path  # its own file system where mounts work: jobs' folders and the cache
    mounted: bool
    env: dict[str, str] = field(default_factory=dict)


class SoakStack(Stack):
    def start_process(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self._start(name, argv, env)


class Cluster:
    def __init__(self, base: Path, history: History, workers: int) -> None:
        self.base = base
        self.history = history
        self.logs = base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.hub = ProxyHub()
        self.postgres: PrivatePostgres | None = None
        self.shared_database: str | None = None
        self.redis = PrivateRedis(self.logs)
        self.s3: S3Server | None = None
        self.nodes = [Node(f"node{i + 1}", base / f"node{i + 1}", False) for i in range(workers)]
        self.stopped: set[str] = set()  # processes the nemesis stopped or killed on purpose, not to be restarted
        self.key = ""
        self.env: dict[str, str] = {}
        self.stack: SoakStack | None = None
        self.roots = {name: base / name for name in ("models", "data")}

    # ------------------------------------------------------------------------------------------ up
    @property
    def private_postgres(self) -> bool:
        return self.postgres is not None

    def up(self) -> None:
        for p in self.roots.values():
            p.mkdir(parents=True, exist_ok=True)
        self._assets()
        self.redis.start()
        self._postgres()
        self.s3 = S3Server(self.logs)
        bucket = self.s3.bucket()
        store_env = self.s3.env(bucket)
        os.environ.update({k: v for k, v in store_env.items() if k.startswith("AWS_")})
        s3_port = int(store_env["FT_S3_ENDPOINT_URL"].rsplit(":", 1)[1])
        self.hub.add("store", s3_port)
        pg_url = self.database_url
        self.hub.add("controlplane->postgres", int(pg_url.rsplit(":", 1)[1].split("/", 1)[0]))
        self.env = {**SETTINGS, **store_env, "FT_DATABASE_URL": pg_url, "FT_REDIS_URL": self.redis.url,
                    "FT_BROKER_URL": self.redis.url, "FT_PORT": str(free_port()), "FT_HOST": "127.0.0.1",
                    "FT_MODEL_ROOT": str(self.roots["models"]), "FT_DATA_ROOT": str(self.roots["data"]),
                    "FT_ARTIFACTS_ROOT": str(self.base / "api-artifacts"),
                    "FT_S3_ENDPOINT_URL": self.endpoint("store"),
                    "FT_CONTROLPLANE_METRICS_PORT": str(free_port())}
        full = {**os.environ, **self.env}
        database_exists_or_create(pg_url)
        migrated = subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=ROOT, env=full,
                                  capture_output=True, text=True)
        if migrated.returncode != 0:
            raise RuntimeError(f"migrations failed: {migrated.stderr[-2000:]}")
        self.key = subprocess.run([sys.executable, "-m", "api.admin.keys", "create", "--owner", "soak", "--scopes",
                                   "admin", "--name", "soak"], cwd=ROOT, env=full, check=True, capture_output=True,
                                  text=True).stdout.strip()
        for node in self.nodes:
            self._node(node, s3_port)
        self.stack = SoakStack(self.env, self.logs)
        for name in ("api", "controlplane", *(n.name for n in self.nodes)):
            self.start(name)
        self.stack.wait_ready(120)

    def _assets(self) -> None:
        """The tests' corpus, preference pairs and tiny model, at the paths the soak's jobs name."""
        train, _ = write_corpus(self.roots["data"] / "demo", limit_chars=200_000)
        write_pairs(self.roots["data"] / "demo" / "pairs.jsonl", 64, seed=7)
        subprocess.run([sys.executable, "-m", "trainer.tiny", "--out", str(self.roots["models"] / "tiny-llama"),
                        "--corpus", str(train)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)

    def _postgres(self) -> None:
        try:
            self.postgres = PrivatePostgres()
            self.postgres.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            self.postgres = None
            self.history.add("cluster", f"no private Postgres ({exc}); the shared one, no Postgres restarts")
            import psycopg

            self.shared_database = f"ft_soak_{os.getpid()}_{int(time.time())}"
            with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{self.shared_database}"')

    @property
    def database_url(self) -> str:
        if self.postgres is not None:
            return self.postgres.url
        return f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.shared_database}"

    @property
    def dsn(self) -> str:
        if self.postgres is not None:
            return self.postgres.dsn
        return f"host=127.0.0.1 port=5432 user=postgres dbname={self.shared_database}"

    def endpoint(self, proxy: str) -> str:
        return f"http://127.0.0.1:{self.hub.proxies[proxy].port}"

    def _node(self, node: Node, s3_port: int) -> None:
        node.disk.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={NODE_DISK_BYTES}", "tmpfs", str(node.disk)],
                                 capture_output=True, text=True)
        node.mounted = mounted.returncode == 0
        if not node.mounted:
            self.history.add("cluster", f"{node.name}: no tmpfs ({mounted.stderr.strip()}); no disk_full faults")
        redis = self.hub.add(f"{node.name}->redis", self.redis.port)
        self.hub.add(f"{node.name}->store", s3_port)
        url = f"redis://127.0.0.1:{redis.port}/0"
        node.env = {"FT_NODE_NAME": node.name, "FT_NODE_SLOTS": "2", "FT_QUEUES": "default",
                    "FT_NODE_ADDR": "127.0.0.1", "FT_REDIS_URL": url, "FT_BROKER_URL": url,
                    "FT_S3_ENDPOINT_URL": self.endpoint(f"{node.name}->store"),
                    "FT_ARTIFACTS_ROOT": str(node.disk / "artifacts"), "FT_CACHE_ROOT": str(node.disk / "cache"),
                    "FT_NVME_ROOT": str(node.disk / "nvme")}

    # ---------------------------------------------------------------------------------- processes
    def start(self, name: str) -> None:
        assert self.stack is not None
        python = sys.executable
        if name == "api":
            self.stack.start_api()
        elif name == "controlplane":
            self.stack.start_process(name, [python, "-m", "controlplane"], {
                "FT_DATABASE_URL": self.database_url.replace(
                    f":{self.database_url.rsplit(':', 1)[1].split('/', 1)[0]}/",
                    f":{self.hub.proxies['controlplane->postgres'].port}/")})
        else:
            node = next(n for n in self.nodes if n.name == name)
            self.stack.start_process(name, [python, "-m", "worker"], node.env)
        self.stopped.discard(name)
        self.history.add("cluster", f"started {name} (pid {self.stack.procs[name].pid})")

    def pid(self, name: str) -> int | None:
        assert self.stack is not None
        proc = self.stack.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def signal(self, name: str, sig: int) -> int | None:
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pid

    def kill_and_restart(self, name: str) -> None:
        assert self.stack is not None
        self.stopped.add(name)
        self.signal(name, signal.SIGKILL)
        proc = self.stack.procs.get(name)
        if proc is not None:
            proc.wait(30)
        self.start_until_up(name)

    def stop_and_restart(self, name: str, grace: float) -> bool:
        """SIGTERM, as an operator's restart sends it, then a start again; SIGKILL where it has not ended within
        `grace` seconds (as a deploy's own timeout does). True when it ended by itself."""
        assert self.stack is not None
        self.stopped.add(name)
        self.signal(name, signal.SIGTERM)
        proc = self.stack.procs.get(name)
        by_itself = True
        if proc is not None:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                by_itself = False
                self.signal(name, signal.SIGKILL)
                proc.wait(30)
        self.start_until_up(name)
        return by_itself

    def start_until_up(self, name: str, timeout: float = 90.0) -> None:
        """Start it again; a worker may refuse while its killed self's node claim is still live, so retry."""
        end = time.monotonic() + timeout
        while True:
            self.start(name)
            self.stopped.add(name)  # a refusal at start is this loop's to retry, not the monitor's to count
            time.sleep(3)
            if self.pid(name) is not None or time.monotonic() > end:
                self.stopped.discard(name)
                return
            self.history.add("cluster", f"{name} exited at start; starting it again")

    def revive_crashed(self) -> list[str]:
        """Processes that ended without the nemesis's doing: recorded, and started again."""
        assert self.stack is not None
        crashed = [n for n, p in self.stack.procs.items() if p.poll() is not None and n not in self.stopped]
        for name in crashed:
            self.history.add("cluster", f"{name} exited by itself with {self.stack.procs[name].returncode}")
            self.start(name)
        return crashed

    # ------------------------------------------------------------------------------ services
    def restart_redis(self) -> None:
        self.redis.kill()
        self.redis.start()

    def restart_postgres(self) -> None:
        assert self.postgres is not None
        self.postgres.stop()
        self.postgres.start()

    def set_store(self, mode: str, delay: float = 0.0) -> None:
        for name in self.hub.proxies:
            if name == "store" or name.endswith("->store"):
                self.hub.set(name, mode, delay)

    def fill_disk(self, node: str) -> Path | None:
        """Fill the node's disk to the last byte; the file to remove to heal it."""
        n = next(x for x in self.nodes if x.name == node)
        if not n.mounted:
            return None
        filler = n.disk / "soak-filler"
        chunk = b"\0" * 2**20
        with filler.open("ab") as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        return filler

    def api(self, timeout: float = 30) -> httpx.Client:
        assert self.stack is not None
        return httpx.Client(base_url=self.stack.api_url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.key}"})

    # ---------------------------------------------------------------------------------- down
    def down(self) -> None:
        if self.stack is not None:
            for proc in list(self.stack.procs.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            with contextlib.suppress(Exception):
                self.stack.stop(timeout=30)
        self.hub.close()
        if self.s3 is not None:
            self.s3.stop()
        self.redis.kill()
        if self.postgres is not None:
            self.postgres.destroy()
        if self.shared_database:
            import psycopg

            with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{self.shared_database}" WITH (FORCE)')
        for node in self.nodes:
            if node.mounted:
                subprocess.run(["umount", "-l", str(node.disk)], capture_output=True)


def make_base() -> Path:
    return Path(tempfile.mkdtemp(prefix="ft-soak-"))


def remove_base(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)


def spec(kind: str, name: str) -> dict[str, object]:
    """A job small enough for two shared cores: a few steps of the tiny model, a checkpoint every two."""
    with (ROOT / "examples" / ("dpo-job.json" if kind == "dpo" else "demo-job.json")).open() as f:
        body = json.load(f)
    body["name"] = name
    body["hyperparameters"].update({"max_steps": 6, "global_batch_size": 4, "seq_len": 32, "warmup_steps": 1})
    body["hyperparameters"].pop("eval_every_steps", None)
    body["hyperparameters"].pop("micro_batch_size", None)
    body["resources"] = {"num_gpus": 1 if kind == "dpo" else 2, "time_limit_seconds": 600}
    body["checkpointing"] = {"every_steps": 2, "keep_last": 2}
    body["metadata"] = {"purpose": "soak"}
    return body
