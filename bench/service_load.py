"""The service under load: the figures of "The control plane at dashboard scale".

`python -m bench.service_load [--quick] [--out FILE] [--tool auto|wrk|python] [--only get post list sse]`
starts the stack as `make up` does (API, control plane, one Celery worker) on a fresh database of its own, a
Redis database number of its own and model/data/artifacts roots in a temporary folder (the tiny model and
corpus built as the tests build them), loads it from this machine, prints one JSON line per figure and
removes everything it made.
It prints figures and never judges them: each line carries its target for the reader.

1. `GET /jobs/{id}` at 16 and 64 concurrent clients: req/s, p50, p99.
2. `POST /jobs` (the demo job, on a queue no worker serves) at 16 clients: req/s, p99, rows vs 201s; then the
   same owner's submits with a quota in force that they never reach (`post_job_quota_*`), in the same run.
3. `GET /jobs?limit=20` over ~100,000 jobs seeded in SQL: newest page, `status=queued`, a deep cursor.
4. 100 and 1,000 SSE followers of one running job: who got every event, errors, delivery delay, the
   probes' p99 from a separate light client meanwhile, and the API's RSS.

HTTP load comes from `wrk` when it is on PATH (one thread, so the other core stays with the server),
else from an asyncio client in this process; each line says which.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from contract.codes import TERMINAL_STATUSES, JobStatus
from scripts.corpus import write_corpus
from scripts.stack import ROOT, Stack, migrate

PG_ADMIN = os.environ.get("FT_BENCH_PG", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")
REDIS_BASE = "redis://127.0.0.1:6379"
# Candidate Redis databases, tried from the top: 9 is the test suite's default, 0 the service's.
REDIS_DBS = range(15, 9, -1)
UNSERVED_QUEUE = "bench-unserved"  # no worker serves it: submitted jobs stay queued and nothing trains
SEED_ROWS = 100_000
QUEUED_EVERY = 100  # 1 seeded job in 100 is queued: a page of status=queued exists, as on a busy dashboard
DEMO_JOB = ROOT / "examples" / "demo-job.json"
WRK_TIMEOUT = "10s"  # a slow answer is a latency to report, not a socket error


@dataclass(frozen=True)
class Plan:
    """How long each part runs: --quick is a smoke check, the default gives stable figures."""

    load_s: int  # each HTTP load figure
    warmup_s: int  # the same load before it, unreported: pools filled, caches warm
    window_s: float  # SSE followers connected and measured
    # After the window, how long followers may take to receive the last stored event: long, so that "got
    # every event" counts losses; lateness is the delay figure.
    drain_s: float
    connect_s: float  # how long all followers may take to get their response headers

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(load_s=3, warmup_s=1, window_s=4.0, drain_s=10.0, connect_s=30.0)
        return cls(load_s=15, warmup_s=2, window_s=15.0, drain_s=30.0, connect_s=60.0)


# ---------------------------------------------------------------------------------------------- output

class Figures:
    """Prints each figure as one JSON line (and keeps them for --out)."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.lines: list[str] = []

    def emit(self, name: str, value: float | int | None, unit: str, target: str, **params: Any) -> None:
        if isinstance(value, float):
            value = round(value, 1) if abs(value) >= 10 else round(value, 2)
        line = json.dumps({"name": name, "value": value, "unit": unit, "target": target, **params})
        self.lines.append(line)
        print(line, flush=True)
        if self.out:
            self.out.write_text("\n".join(self.lines) + "\n")


KEY_ENV = "FT_BENCH_KEY"


def bench_key() -> str:
    return os.environ[KEY_ENV]


def auth_line() -> str:
    return f"Authorization: Bearer {bench_key()}\r\n"


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {bench_key()}"}


def note(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the figures."""
    print(f"[service_load {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


# ------------------------------------------------------------------------------------------ processes

def proc_tree(pid: int) -> list[int]:
    """pid and all its descendants, from /proc (the API may run workers of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def rss_bytes(pid: int, tree: list[int] | None = None) -> int:
    """RSS of pid and its descendants (`tree`, when the caller found them already)."""
    total = 0
    for p in tree if tree is not None else proc_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * resource.getpagesize()
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of pid and its live descendants."""
    total = 0.0
    for p in proc_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


NOT_OTHERS = ("postgres", "redis-server")  # shared services: they serve this run too


def others_cpu(ours: set[int]) -> dict[int, float]:
    """CPU seconds of every process that is not this run's (nor Postgres or Redis), by pid."""
    found: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            if stat[stat.index("(") + 1:stat.rindex(")")] in NOT_OTHERS:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            found[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


class CpuMeter:
    """Share of one core each process tree used over a measurement (100 = one core): who was the bottleneck.

    For SSE the client is this process, so it is measured too (its lag is part of the delays it reports): by
    process_time, since the stack's processes are its children and a tree would count them. So is the
    worker with the job it trains under it (launcher and ranks), which shares the same two cores.
    others_cpu_pct is what processes outside this run took meanwhile (another test run, a build): on two
    cores it says whether a figure was taken on a quiet machine. It misses processes that ended meanwhile.
    """

    def __init__(self, pids: dict[str, int], client: bool = False) -> None:
        self.pids = pids
        self.client = client
        self.start = time.monotonic()
        self.cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self.client_cpu = time.process_time()
        self.others = others_cpu(set(proc_tree(os.getpid())))

    def read(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.start, 1e-9)
        shares = {f"{name}_cpu_pct": round(100 * (cpu_seconds(pid) - self.cpu[name]) / wall, 1)
                  for name, pid in self.pids.items()}
        if self.client:
            shares["client_cpu_pct"] = round(100 * (time.process_time() - self.client_cpu) / wall, 1)
        others = others_cpu(set(proc_tree(os.getpid())))
        shares["others_cpu_pct"] = round(100 * sum(max(0.0, cpu - self.others.get(pid, 0.0))
                                                   for pid, cpu in others.items()) / wall, 1)
        return shares


def raise_open_file_limit() -> int:
    """1,000 followers need 1,000 sockets here and in the API, which inherits this limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ------------------------------------------------------------------------------------------ the stack

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pick_redis_db() -> int:
    """An empty Redis database of its own (FT_BENCH_REDIS_DB forces one), flushed when the run ends."""
    forced = os.environ.get("FT_BENCH_REDIS_DB")
    for db in [int(forced)] if forced else REDIS_DBS:
        if redis.Redis.from_url(f"{REDIS_BASE}/{db}").dbsize() == 0:
            return db
    raise RuntimeError(f"no empty Redis database among {list(REDIS_DBS)}; set FT_BENCH_REDIS_DB")


def build_assets(roots: dict[str, Path]) -> None:
    """The tests' corpus and tiny model, at the paths examples/demo-job.json names (demo/…, tiny-llama).

    The model is built in a child process: this one stays free of torch, as lean as a load generator should be.
    """
    train, _ = write_corpus(roots["data"] / "demo", limit_chars=200_000)
    subprocess.run([sys.executable, "-m", "trainer.tiny", "--out", str(roots["models"] / "tiny-llama"),
                    "--corpus", str(train)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


@dataclass
class Service:
    stack: Stack
    database: str  # its Postgres database's name
    dsn: str  # psycopg connection string to it

    @property
    def url(self) -> str:
        return self.stack.api_url

    def pid(self, name: str) -> int:
        return self.stack.procs[name].pid


@contextlib.contextmanager
def service() -> Iterator[Service]:
    """The stack as `make up` runs it, on a database, Redis database and roots of its own; all removed after.

    Every address, path and credential is set here; other FT_* settings this shell exported (FT_API_WORKERS,
    FT_LOOP_INTERVAL_SECONDS, …) pass through, and are named on stderr, since they change the figures.
    """
    inherited = sorted(k for k in os.environ if k.startswith("FT_") and not k.startswith("FT_BENCH_"))
    if inherited:
        note(f"FT_* settings from this shell in effect: {', '.join(inherited)}")
    with contextlib.ExitStack() as cleanup:
        base = Path(tempfile.mkdtemp(prefix="ft-service-load-"))
        cleanup.callback(shutil.rmtree, base, ignore_errors=True)
        roots = {name: base / name for name in ("models", "data", "artifacts", "logs")}
        for p in roots.values():
            p.mkdir()
        note(f"building the tiny model and corpus under {base}")
        build_assets(roots)

        name = f"ft_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        cleanup.callback(drop_database, name)
        db = pick_redis_db()
        redis_url = f"{REDIS_BASE}/{db}"
        cleanup.callback(lambda: redis.Redis.from_url(redis_url).flushdb())

        pg = conninfo_to_dict(PG_ADMIN)
        server = f"{pg.get('user', 'postgres')}@{pg.get('host', '127.0.0.1')}:{pg.get('port', 5432)}"
        # No default quota: the submit figures create thousands of jobs for one owner; the second one sets a quota row.
        env = {"FT_ENV": "development", "FT_QUEUES": "default", "FT_QUOTA_MAX_ACTIVE_JOBS": "",
               "FT_DATABASE_URL": f"postgresql+psycopg://{server}/{name}",
               "FT_REDIS_URL": redis_url, "FT_BROKER_URL": redis_url, "FT_HOST": "127.0.0.1",
               "FT_PORT": str(free_port()),
               "FT_ARTIFACTS_ROOT": str(roots["artifacts"]), "FT_MODEL_ROOT": str(roots["models"]),
               "FT_DATA_ROOT": str(roots["data"]), "FT_NVME_ROOT": str(roots["artifacts"] / "nvme")}
        migrate({**os.environ, **env})
        # An admin key of its own, as an operator makes one; the load carries it as any client would. In the
        # environment, so the probe's and the followers' processes have it too.
        os.environ[KEY_ENV] = subprocess.run(
            [sys.executable, "-m", "api.admin.keys", "create", "--owner", "bench", "--scopes", "admin",
             "--name", "bench"],
            env={**os.environ, **env}, check=True, capture_output=True, text=True).stdout.strip()
        stack = Stack(env, roots["logs"])
        cleanup.callback(stack.stop)
        stack.start_api()
        stack.start_controlplane()
        stack.start_worker("worker1")
        stack.wait_ready()
        note(f"stack up at {stack.api_url} (database {name}, Redis db {db}, logs in {roots['logs']})")
        yield Service(stack=stack, database=name, dsn=make_conninfo(PG_ADMIN, dbname=name))


def drop_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ------------------------------------------------------------------------------------------ HTTP load

@dataclass
class LoadResult:
    responses: int
    seconds: float
    p50_s: float | None
    p99_s: float | None
    statuses: Counter[int]
    socket_errors: int
    tool: str

    @property
    def ok(self) -> int:
        return sum(n for code, n in self.statuses.items() if 200 <= code < 300)

    @property
    def ok_rps(self) -> float:
        return self.ok / self.seconds

    def params(self) -> dict[str, Any]:
        return {"responses": self.responses, "non_2xx": self.responses - self.ok,
                "socket_errors": self.socket_errors, "statuses": {str(k): v for k, v in sorted(self.statuses.items())}}


@dataclass(frozen=True)
class Load:
    """One closed-loop load: `concurrency` clients each sending the next request when the last one answered."""

    url: str
    concurrency: int
    seconds: int
    # POST bodies: the text around a per-request marker, so rows can be matched to requests afterwards.
    body: tuple[str, str] | None = None


WRK_LUA_COMMON = r"""
-- Written by bench/service_load.py: counts statuses per thread and prints one JSON line at the end.
local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  statuses = {}
  counter = 0
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    for code, n in pairs(t:get("statuses")) do total[code] = (total[code] or 0) + n end
  end
  local parts = {}
  for code, n in pairs(total) do table.insert(parts, string.format('"%d": %d', code, n)) end
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"responses": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "socket_errors": %d, '
    .. '"timeouts": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration, math.floor(latency:percentile(50)), math.floor(latency:percentile(99)),
    e.connect + e.read + e.write, e.timeout, table.concat(parts, ", ")))
end
"""

WRK_LUA_POST = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local head = [==[%s]==]
local tail = [==[%s]==]

function request()
  counter = counter + 1
  return wrk.format(nil, nil, nil, head .. "w" .. tid .. "-" .. counter .. tail)
end
"""


def wrk_version() -> str | None:
    path = shutil.which("wrk")
    if not path:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return out.split(" [")[0].strip() or "wrk"


def run_wrk(load: Load, version: str) -> LoadResult:
    script = WRK_LUA_COMMON + (WRK_LUA_POST % load.body if load.body else "")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        proc = subprocess.run(["wrk", "-t1", f"-c{load.concurrency}", f"-d{load.seconds}s", "--timeout",
                               WRK_TIMEOUT, "--latency", "-H", f"Authorization: Bearer {bench_key()}",
                               "-s", f.name, load.url],
                              capture_output=True, text=True, timeout=load.seconds + 60)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result (exit {proc.returncode}): {proc.stderr or proc.stdout}")
    r = json.loads(line.removeprefix("BENCH_JSON "))
    return LoadResult(responses=r["responses"], seconds=r["duration_us"] / 1e6,
                      p50_s=r["p50_us"] / 1e6, p99_s=r["p99_us"] / 1e6,
                      statuses=Counter({int(k): v for k, v in r["statuses"].items()}),
                      socket_errors=r["socket_errors"] + r["timeouts"], tool=f"{version} -t1 -c{load.concurrency}")


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Reads one response with a Content-Length body; returns its status and whether the server keeps the
    connection."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    status = int(head.split(" ", 2)[1])
    length = 0
    for header in head.split("\r\n")[1:]:
        if header.startswith("content-length:"):
            length = int(header.split(":", 1)[1])
    await reader.readexactly(length)
    return status, "connection: close" not in head


async def python_client(load: Load, host: str, port: int, path: str, client: int, deadline: float,
                        latencies: list[float], statuses: Counter[int], errors: list[str]) -> None:
    count = 0
    writer: asyncio.StreamWriter | None = None
    while time.monotonic() < deadline:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            count += 1
            if load.body:
                body = f"{load.body[0]}p{client}-{count}{load.body[1]}".encode()
                request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth_line()}Content-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            else:
                request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth_line()}\r\n".encode()
            t0 = time.perf_counter()
            writer.write(request)
            status, keep = await asyncio.wait_for(read_response(reader), timeout=10)
            latencies.append(time.perf_counter() - t0)
            statuses[status] += 1
            if not keep:
                writer.close()
                writer = None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ValueError) as exc:
            errors.append(type(exc).__name__)
            if writer is not None:
                writer.close()
            writer = None
    if writer is not None:
        writer.close()


async def run_python_load(load: Load) -> LoadResult:
    url = httpx.URL(load.url)
    path = url.raw_path.decode()
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    start = time.monotonic()
    deadline = start + load.seconds
    await asyncio.gather(*(python_client(load, url.host, url.port or 80, path, i, deadline, latencies, statuses,
                                         errors) for i in range(load.concurrency)))
    return LoadResult(responses=len(latencies), seconds=time.monotonic() - start,
                      p50_s=percentile(latencies, 50), p99_s=percentile(latencies, 99), statuses=statuses,
                      socket_errors=len(errors), tool=f"python-asyncio -c{load.concurrency}")


class LoadTool:
    """wrk when it is installed (and not refused with --tool python), else the asyncio client."""

    def __init__(self, choice: str = "auto") -> None:
        self.wrk = wrk_version() if choice != "python" else None
        if choice == "wrk" and not self.wrk:
            raise SystemExit("--tool wrk: wrk is not on PATH (apt-get install wrk)")

    def run(self, load: Load) -> LoadResult:
        if self.wrk:
            return run_wrk(load, self.wrk)
        return asyncio.run(run_python_load(load))

    def measure(self, load: Load, warmup_s: int, warmup_body: tuple[str, str] | None = None) -> LoadResult:
        """The load after an unreported warm-up of the same shape (its own body, so its rows are not counted)."""
        if warmup_s:
            self.run(Load(url=load.url, concurrency=load.concurrency, seconds=warmup_s, body=warmup_body))
        return self.run(load)


# ------------------------------------------------------------------------------------------ jobs

def demo_job(name: str, queue: str) -> dict[str, Any]:
    job: dict[str, Any] = json.loads(DEMO_JOB.read_text())
    job["name"] = name
    job["resources"]["queue"] = queue
    return job


def follow_job() -> dict[str, Any]:
    """A job that trains through the whole SSE measurement: tests/conftest.py's make_job, many more steps.

    No checkpoint is written (nothing but events reach the followers), and the time limit ends it even if
    this run were killed before it could cancel it.
    """
    return {
        "name": "bench-followed",
        "model": "tiny-llama",
        "data": {"train": "demo/train.txt", "validation": "demo/validation.txt"},
        "hyperparameters": {"max_steps": 1_000_000, "learning_rate": 0.003, "warmup_steps": 2,
                            "global_batch_size": 8, "seq_len": 64},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
        "resources": {"num_gpus": 2, "time_limit_seconds": 1200},
    }


def post_body(name: str) -> tuple[str, str]:
    """The demo job as text around a marker slot in its metadata: every request's row can be told apart."""
    job = demo_job(name, UNSERVED_QUEUE)
    job["metadata"] = {**job.get("metadata", {}), "bench_req": "MARKER"}
    head, tail = json.dumps(job).split("MARKER")
    return head, tail


def wait_running(api: httpx.Client, job_id: str, timeout: float = 240) -> dict[str, Any]:
    """Until the job trains (its first progress event is in): followers then see live events."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        job = api.get(f"/jobs/{job_id}").json()
        if job["status"] == JobStatus.RUNNING and (job["progress"].get("step") or 0) >= 1:
            return job
        if job["status"] in TERMINAL_STATUSES:
            raise RuntimeError(f"the followed job ended before it was followed: {job['status']} {job['error']}")
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} was not training within {timeout} s")


def stop_job(api: httpx.Client, job_id: str, timeout: float = 90) -> str:
    api.post(f"/jobs/{job_id}/cancel")
    end = time.monotonic() + timeout
    status = "?"
    while time.monotonic() < end:
        status = api.get(f"/jobs/{job_id}").json()["status"]
        if status in TERMINAL_STATUSES:
            break
        time.sleep(0.5)
    return status


# ------------------------------------------------------------------------------------------ figure 1, 2

def figure_get(svc: Service, tool: LoadTool, plan: Plan, figures: Figures, job_id: str) -> None:
    for conc in (16, 64):
        cpu = CpuMeter({"api": svc.pid("api"), "controlplane": svc.pid("controlplane")})
        r = tool.measure(Load(url=f"{svc.url}/jobs/{job_id}", concurrency=conc, seconds=plan.load_s),
                         plan.warmup_s)
        common = {"concurrency": conc, "duration_s": round(r.seconds, 1), "tool": r.tool, **cpu.read(),
                  **r.params()}
        figures.emit(f"get_job_c{conc}_rps", r.ok_rps, "req/s", ">= 3000", **common)
        figures.emit(f"get_job_c{conc}_p50", ms(r.p50_s), "ms", "-", **common)
        figures.emit(f"get_job_c{conc}_p99", ms(r.p99_s), "ms", "< 10" if conc == 64 else "< 50", **common)


# A quota in force that the figure never reaches: what the submit pays is the counting, not a refusal.
BENCH_QUOTA = {"max_active_jobs": 1_000_000}


def figure_post(svc: Service, tool: LoadTool, plan: Plan, figures: Figures) -> None:
    """The submit without a quota, then the same one owner's submits with a quota in force: both in one run."""
    post_figure(svc, tool, plan, figures, quota=False)
    with httpx.Client(base_url=svc.url, timeout=30, headers=auth_headers()) as api:
        api.put("/owners/bench/quota", json=BENCH_QUOTA).raise_for_status()
    try:
        post_figure(svc, tool, plan, figures, quota=True)
    finally:
        with httpx.Client(base_url=svc.url, timeout=30, headers=auth_headers()) as api:
            api.put("/owners/bench/quota", json={}).raise_for_status()


def post_figure(svc: Service, tool: LoadTool, plan: Plan, figures: Figures, quota: bool) -> None:
    conc = 16
    name = "post_job_quota" if quota else "post_job"
    job_name = "bench-post-quota" if quota else "bench-post-load"
    cpu = CpuMeter({"api": svc.pid("api"), "controlplane": svc.pid("controlplane")})
    r = tool.measure(Load(url=f"{svc.url}/jobs", concurrency=conc, seconds=plan.load_s,
                          body=post_body(job_name)), plan.warmup_s, post_body(f"{job_name}-warmup"))
    common = {"concurrency": conc, "duration_s": round(r.seconds, 1), "tool": r.tool, **cpu.read(), **r.params(),
              "quota": BENCH_QUOTA if quota else None}
    figures.emit(f"{name}_rps", r.ok_rps, "req/s", ">= 500", **common)
    figures.emit(f"{name}_p99", ms(r.p99_s), "ms", "-", **common)
    time.sleep(2)  # requests the load generator abandoned at its deadline may still be committing
    with psycopg.connect(svc.dsn, autocommit=True) as conn:
        # The control plane's scheduler looks at each committed job (these wait on a queue no node serves,
        # so it gives each its queued_reason rather than a placement): how long it took to catch up with the
        # submits once they stopped, and whether every row was looked at.
        waited = time.monotonic()
        while True:
            unsent = conn.execute("SELECT count(*) FROM jobs WHERE name = %s "
                                  "AND dispatched_at IS NULL AND queued_reason IS NULL", (job_name,)).fetchone()[0]
            if unsent == 0 or time.monotonic() - waited > 120:
                break
            time.sleep(0.2)
        figures.emit(f"{name}_unsent_after_load", unsent, "rows", "0", catch_up_s=round(time.monotonic() - waited, 1),
                     concurrency=conc, tool=r.tool)
        rows, distinct = conn.execute("SELECT count(*), count(DISTINCT metadata->>'bench_req') FROM jobs "
                                      "WHERE name = %s", (job_name,)).fetchone() or (0, 0)
        # The POSTed jobs wait forever on a queue nobody serves; ended here, the control plane's per-pass
        # scan of queued jobs sees the seeded share only, not however many this figure happened to create.
        conn.execute("UPDATE jobs SET status = 'cancelled', finished_at = now() "
                     "WHERE status = 'queued' AND queue = %s", (UNSERVED_QUEUE,))
    created = r.statuses.get(201, 0)
    figures.emit(f"{name}_rows_minus_201s", rows - created, "rows",
                 f"0 (up to {conc} more: requests in flight when the load stopped, answered to no one)",
                 concurrency=conc, duration_s=round(r.seconds, 1), tool=r.tool, rows=rows,
                 responses_201=created, duplicate_rows=rows - distinct)


# ------------------------------------------------------------------------------------------ figure 3

SEED_SQL = """
INSERT INTO jobs (id, name, status, attempt, queue, request, resolved, progress, error, checkpoints,
                  output, metadata, event_seq, created_at, updated_at, dispatched_at, started_at, finished_at)
SELECT s.id, 'bench-seed', s.status, 1, t.queue, t.request, t.resolved, t.progress,
       CASE WHEN s.status = 'failed' THEN '{"code": "trainer_error", "message": "seeded"}'::jsonb END,
       '[]'::jsonb, NULL, t.metadata, 1, s.at, s.at,
       s.at, -- dispatched: the control plane must not send the seeded queued jobs
       CASE WHEN s.status <> 'queued' THEN s.at + interval '20 seconds' END,
       CASE WHEN s.status <> 'queued' THEN s.at + interval '10 minutes' END
FROM (SELECT * FROM jobs WHERE id = %(template)s) t
CROSS JOIN LATERAL (
    SELECT g, 'job_' || substr(md5('bench-seed-' || g), 1, 20) AS id,
           CASE WHEN g %% %(queued_every)s = 0 THEN 'queued'
                WHEN g %% 10 = 3 THEN 'failed'
                WHEN g %% 10 = 7 THEN 'cancelled'
                ELSE 'succeeded' END AS status,
           now() - make_interval(secs => (%(n)s - g) * 30) AS at  -- one every 30 s, ~35 days back
    FROM generate_series(1, %(n)s) g
) s
ORDER BY s.g  -- seq follows created order, as it does for jobs the API creates
"""

SEED_EVENTS_SQL = """
INSERT INTO job_events (job_id, seq, attempt, type, data, created_at)
SELECT id, 1, 1, 'state', '{"status": "queued"}'::jsonb, created_at FROM jobs WHERE name = 'bench-seed'
"""


def seed_jobs(svc: Service, template_id: str) -> tuple[int, str]:
    """~100,000 jobs copied from one real job in SQL, with their first event; returns the table's size and
    the id ~90% of the way down the newest-first list."""
    with psycopg.connect(svc.dsn) as conn:
        conn.execute(SEED_SQL, {"template": template_id, "n": SEED_ROWS, "queued_every": QUEUED_EVERY})
        conn.execute(SEED_EVENTS_SQL)
        conn.commit()
        conn.autocommit = True
        # A table that grew over months has its statistics; one filled in a second gets them now.
        conn.execute("ANALYZE jobs")
        conn.execute("ANALYZE job_events")
        total = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]  # type: ignore[index]
        deep = conn.execute("SELECT id FROM jobs ORDER BY seq DESC OFFSET %s LIMIT 1",
                            (int(total * 0.9),)).fetchone()[0]  # type: ignore[index]
    return int(total), str(deep)


def figure_list(svc: Service, tool: LoadTool, plan: Plan, figures: Figures, template_id: str) -> None:
    t0 = time.monotonic()
    total, deep = seed_jobs(svc, template_id)
    note(f"seeded {SEED_ROWS} jobs in {time.monotonic() - t0:.1f} s; table has {total}")
    conc = 16
    pages = {"newest": "/jobs?limit=20", "status_queued": "/jobs?limit=20&status=queued",
             "deep_cursor": f"/jobs?limit=20&after={deep}"}
    for label, path in pages.items():
        cpu = CpuMeter({"api": svc.pid("api"), "controlplane": svc.pid("controlplane")})
        r = tool.measure(Load(url=svc.url + path, concurrency=conc, seconds=plan.load_s), plan.warmup_s)
        common = {"concurrency": conc, "duration_s": round(r.seconds, 1), "tool": r.tool, "jobs_in_table": total,
                  "path": path, **cpu.read(), **r.params()}
        figures.emit(f"list_{label}_rps", r.ok_rps, "req/s", "-", **common)
        figures.emit(f"list_{label}_p99", ms(r.p99_s), "ms", "< 50", **common)


# ------------------------------------------------------------------------------------------ figure 4

@dataclass
class Follower:
    """One SSE reader; it keeps raw events with their arrival time and parses them only afterwards, so
    reading 1,000 streams costs this process as little as possible while it is being timed."""

    status: int | None = None
    error: str | None = None
    ended: bool = False  # the server ended the stream (the job is running: it should not)
    connected_at: float | None = None  # wall clock (time.time(), as the database's created_at) at its headers
    last_id: int = 0
    blocks: list[tuple[float, bytes]] = field(default_factory=list)


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body; b"" at its end."""
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    if size == 0:
        await reader.readuntil(b"\r\n")
        return b""
    return (await reader.readexactly(size + 2))[:-2]


async def follow(host: str, port: int, job_id: str, f: Follower) -> None:
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /jobs/{job_id}/events HTTP/1.1\r\nHost: {host}\r\n{auth_line()}"
                     "Accept: text/event-stream\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        f.connected_at = time.time()
        f.status = int(head.split(b" ", 2)[1])
        if f.status != 200:
            return
        chunked = b"transfer-encoding: chunked" in head.lower()
        buf = b""
        while True:
            data = await read_chunk(reader) if chunked else await reader.read(65536)
            if not data:
                f.ended = True
                return
            now = time.time()
            buf += data
            while (cut := buf.find(b"\n\n")) >= 0:
                block, buf = buf[:cut], buf[cut + 2:]
                if block.startswith(b"id: "):  # not a keep-alive comment
                    f.blocks.append((now, block))
                    f.last_id = int(block[4:block.index(b"\n")])
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        f.error = type(exc).__name__
    finally:
        if writer is not None:
            writer.close()


def parse_block(block: bytes) -> tuple[int, float]:
    """An SSE event's id and its created_at (epoch seconds)."""
    event_id, created = 0, 0.0
    for line in block.decode().split("\n"):
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            created = datetime.fromisoformat(json.loads(line[6:])["created_at"]).timestamp()
    return event_id, created


async def stored_ids(client: httpx.AsyncClient, job_id: str) -> list[int]:
    """Every stored event's id, through the JSON pages."""
    ids: list[int] = []
    after = 0
    while True:
        page = (await client.get(f"/jobs/{job_id}/events", params={"after": after, "limit": 1000})).json()
        ids += [e["id"] for e in page["data"]]
        after = page["next_after"]
        if not page["has_more"]:
            return ids


def probe(base_url: str, job_id: str, seconds: float, interval: float = 0.1) -> dict[str, dict[str, Any]]:
    """The light client: one connection, /healthz then GET /jobs/{id}, every `interval` s. Runs in a
    process of its own, so the followers' event loop cannot delay it."""
    paths = {"healthz": "/healthz", "get_job": f"/jobs/{job_id}"}
    latencies: dict[str, list[float]] = {k: [] for k in paths}
    errors: Counter[str] = Counter()
    with httpx.Client(base_url=base_url, timeout=30, headers=auth_headers()) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for key, path in paths.items():
                t0 = time.perf_counter()
                try:
                    ok = client.get(path).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies[key].append(time.perf_counter() - t0)
                else:
                    errors[key] += 1
            time.sleep(interval)
    return {k: {"p50_ms": ms(percentile(v, 50)), "p99_ms": ms(percentile(v, 99)), "n": len(v),
                "errors": errors[k]} for k, v in latencies.items()}


async def sample_rss(pid: int, until: float, samples: list[int]) -> None:
    # The API's processes are found once: walking /proc takes ~15 ms of this loop, which reads the followers.
    tree = proc_tree(pid)
    while time.monotonic() < until:
        samples.append(rss_bytes(pid, tree))
        await asyncio.sleep(1.0)


@dataclass
class FollowRun:
    followers: list[Follower]
    expected: list[int]  # stored event ids at the end of the window
    probe: dict[str, dict[str, Any]]
    rss_max: int
    connect_s: float
    cpu: dict[str, float]
    window: tuple[float, float]  # wall clock: all followers connected, the probe running
    drained_s: float  # from reading the stored events until every follower had the last one (or drain_s)


async def follow_run(svc: Service, job_id: str, n: int, plan: Plan, pool: ProcessPoolExecutor) -> FollowRun:
    """n followers from the first event; once all are connected, a window with the probe beside them,
    then every stored event is read and they get `drain_s` to receive the last one."""
    url = httpx.URL(svc.url)
    followers = [Follower() for _ in range(n)]
    t0 = time.monotonic()
    tasks = [asyncio.create_task(follow(url.host, url.port or 80, job_id, f)) for f in followers]
    deadline = t0 + plan.connect_s
    while time.monotonic() < deadline and any(f.status is None and f.error is None for f in followers):
        await asyncio.sleep(0.05)
    connect_s = time.monotonic() - t0
    loop = asyncio.get_running_loop()
    cpu = CpuMeter({"api": svc.pid("api"), "controlplane": svc.pid("controlplane"), "worker": svc.pid("worker1")},
                   client=True)
    window = (time.time(), time.time() + plan.window_s)
    probed = loop.run_in_executor(pool, probe, svc.url, job_id, plan.window_s)
    rss: list[int] = []
    await sample_rss(svc.pid("api"), time.monotonic() + plan.window_s, rss)
    cpu_read = cpu.read()
    async with httpx.AsyncClient(base_url=svc.url, timeout=60, headers=auth_headers()) as client:
        expected = await stored_ids(client, job_id)
    last = expected[-1] if expected else 0
    read_at = time.monotonic()
    while time.monotonic() < read_at + plan.drain_s and any(
            f.last_id < last and f.status == 200 and not f.error and not f.ended for f in followers):
        await asyncio.sleep(0.05)
    drained_s = time.monotonic() - read_at
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # Its last request may still be waiting on a swamped API: awaited only now, it cannot stretch the window.
    probe_result = await probed
    return FollowRun(followers=followers, expected=expected, probe=probe_result, rss_max=max(rss, default=0),
                     connect_s=connect_s, cpu=cpu_read, window=window, drained_s=drained_s)


def follow_figures(run: FollowRun) -> dict[str, Any]:
    """Who got every stored event (exactly, in order), the errors, and the live events' delay.

    The delay figures are of events created in the window, when every follower is connected and reading
    live; while 1,000 connect, each first reads the job's backlog, and the live events' delay then is
    reported beside them (connecting_delay_*), not mixed in.
    """
    expected = run.expected
    last = expected[-1] if expected else 0
    complete = 0
    delays: list[float] = []
    connecting: list[float] = []
    start, end = run.window
    per_event: dict[int, list[float]] = {}  # event id -> each follower's delay: upstream vs fan-out
    for f in run.followers:
        events = [(t, *parse_block(b)) for t, b in f.blocks]
        got = [i for _, i, _ in events if i <= last]
        complete += int(f.status == 200 and got == expected)
        for t, event_id, created in events:
            if start <= created <= end:
                delays.append(t - created)
                per_event.setdefault(event_id, []).append(t - created)
            elif f.connected_at and f.connected_at <= created < start:
                # Live for this follower, though others were still connecting.
                connecting.append(t - created)
    statuses = Counter(f.status for f in run.followers if f.status is not None)
    return {
        "complete": complete,
        "error_status": sum(n for code, n in statuses.items() if code != 200),
        "socket_errors": sum(1 for f in run.followers if f.error),
        "never_answered": sum(1 for f in run.followers if f.status is None and f.error is None),
        "ended_early": sum(1 for f in run.followers if f.ended),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "error_kinds": dict(Counter(f.error for f in run.followers if f.error)),
        "events_expected": len(expected),
        "delay_p50": percentile(delays, 50), "delay_p99": percentile(delays, 99), "delay_samples": len(delays),
        # Per event: when its first follower had it (the path up to the fan-out: ingest, notify, the feed's
        # read) and when its last one did (plus writing it to every follower and this client reading them all).
        "first_follower_delay_max_ms": ms(max((min(d) for d in per_event.values()), default=None)),
        "first_follower_delay_p50_ms": ms(percentile([min(d) for d in per_event.values()], 50)),
        "last_follower_delay_max_ms": ms(max((max(d) for d in per_event.values()), default=None)),
        "last_follower_delay_p50_ms": ms(percentile([max(d) for d in per_event.values()], 50)),
        "connecting_delay_p50_ms": ms(percentile(connecting, 50)),
        "connecting_delay_p99_ms": ms(percentile(connecting, 99)), "connecting_delay_samples": len(connecting),
    }


def emit_probe(figures: Figures, followers: int, result: dict[str, dict[str, Any]], window_s: float,
               baseline: dict[str, dict[str, Any]] | None, cpu: dict[str, float]) -> None:
    for key, route in (("healthz", "/healthz"), ("get_job", "GET /jobs/{id}")):
        r = result[key]
        target = "-" if baseline is None else f"unchanged from 0 followers ({baseline[key]['p99_ms']} ms)"
        figures.emit(f"sse{followers}_probe_{key}_p99", r["p99_ms"], "ms", target, followers=followers,
                     concurrency=1, duration_s=window_s, tool="httpx, 1 connection, ~10 req/s per route",
                     route=route, p50_ms=r["p50_ms"], samples=r["n"], errors=r["errors"], **cpu)


async def figure_sse(svc: Service, plan: Plan, figures: Figures) -> None:
    with httpx.Client(base_url=svc.url, timeout=60, headers=auth_headers()) as api:
        created = api.post("/jobs", json=follow_job())
        if created.status_code != 201:
            raise RuntimeError(f"the followed job was refused: {created.status_code} {created.text}")
        job_id = created.json()["id"]
        note(f"followed job {job_id} submitted; waiting for it to train")
        await asyncio.to_thread(wait_running, api, job_id)
        ctx = get_context("spawn")  # no fork of a process with an event loop and sockets
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                pool.submit(percentile, [1.0], 50).result()  # started before any window is timed
                cpu = CpuMeter({"api": svc.pid("api"), "worker": svc.pid("worker1")})
                baseline = (await asyncio.get_running_loop().run_in_executor(
                    pool, probe, svc.url, job_id, plan.window_s))
                emit_probe(figures, 0, baseline, plan.window_s, None, cpu.read())
                figures.emit("sse0_api_rss", round(rss_bytes(svc.pid("api")) / 2**20, 1), "MiB", "-", followers=0,
                             tool="/proc statm, uvicorn and its children")
                for n in (100, 1000):
                    note(f"{n} followers")
                    await asyncio.sleep(2)  # the previous group's streams are closed on the server side too
                    run = await follow_run(svc, job_id, n, plan, pool)
                    emit_follow(figures, n, run, plan, baseline)
        finally:
            note(f"cancelling the followed job: {stop_job(api, job_id)}")


def emit_follow(figures: Figures, n: int, run: FollowRun, plan: Plan, baseline: dict[str, dict[str, Any]]) -> None:
    f = follow_figures(run)
    common = {"followers": n, "concurrency": n, "duration_s": plan.window_s, "drain_s": plan.drain_s,
              "tool": "python-asyncio raw streams, one process", "connect_s": round(run.connect_s, 2),
              "drained_s": round(run.drained_s, 2),
              "events_expected": f["events_expected"], **run.cpu}
    figures.emit(f"sse{n}_followers_complete", f["complete"], "followers", f"= {n} (every event delivered)",
                 **common)
    figures.emit(f"sse{n}_followers_errors", f["error_status"] + f["socket_errors"] + f["never_answered"],
                 "followers", "0", statuses=f["statuses"], error_kinds=f["error_kinds"],
                 never_answered=f["never_answered"], ended_early=f["ended_early"], **common)
    target = "< 250" if n == 1000 else "-"
    delay = {"samples": f["delay_samples"], "connecting_delay_p50_ms": f["connecting_delay_p50_ms"],
             **{k: f[k] for k in ("first_follower_delay_p50_ms", "first_follower_delay_max_ms",
                                  "last_follower_delay_p50_ms", "last_follower_delay_max_ms")},
             "connecting_delay_p99_ms": f["connecting_delay_p99_ms"],
             "connecting_delay_samples": f["connecting_delay_samples"]}
    figures.emit(f"sse{n}_delay_p50", ms(f["delay_p50"]), "ms", "-", **delay, **common)
    figures.emit(f"sse{n}_delay_p99", ms(f["delay_p99"]), "ms", target, **delay, **common)
    emit_probe(figures, n, run.probe, plan.window_s, baseline, run.cpu)
    figures.emit(f"sse{n}_api_rss", round(run.rss_max / 2**20, 1), "MiB", "-", followers=n,
                 tool="/proc statm, uvicorn and its children, peak of 1 s samples", duration_s=plan.window_s)


# ------------------------------------------------------------------------------------------ main

FIGURES = ("get", "post", "list", "sse")


def run_all(plan: Plan, figures: Figures, tool: LoadTool, only: tuple[str, ...] = FIGURES) -> None:
    note(f"HTTP load tool: {tool.wrk or 'python-asyncio (wrk not on PATH)'}")
    with service() as svc:
        with httpx.Client(base_url=svc.url, timeout=30, headers=auth_headers()) as api:
            created = api.post("/jobs", json=demo_job("bench-template", UNSERVED_QUEUE))
            if created.status_code != 201:
                raise RuntimeError(f"the demo job was refused: {created.status_code} {created.text}")
            template = created.json()["id"]
        if "get" in only:
            note("figure 1: GET /jobs/{id}")
            figure_get(svc, tool, plan, figures, template)
        if "post" in only:
            note("figure 2: POST /jobs")
            figure_post(svc, tool, plan, figures)
        if "list" in only:
            note("figure 3: GET /jobs over 100k jobs")
            figure_list(svc, tool, plan, figures, template)
        if "sse" in only:
            note("figure 4: SSE followers")
            asyncio.run(figure_sse(svc, plan, figures))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds per figure: a smoke check")
    p.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    p.add_argument("--tool", choices=("auto", "wrk", "python"), default="auto",
                   help="HTTP load generator: wrk if on PATH (auto), or the asyncio client")
    p.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES),
                   help="run only these figures (all by default)")
    a = p.parse_args()
    # SIGTERM ends the run like Ctrl-C: the stack is stopped and the database dropped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    limit = raise_open_file_limit()
    if limit < 1100:
        note(f"open-file limit is {limit}: 1,000 followers will see socket errors")
    t0 = time.monotonic()
    run_all(Plan.of(a.quick), Figures(a.out), LoadTool(a.tool), tuple(a.only))
    note(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
