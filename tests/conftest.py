"""Shared fixtures: a real stack (Postgres, Redis, uvicorn, control plane, Celery worker) per session.

Each session gets its own database and Redis database; each test owns its jobs. Nothing is mocked:
the worker runs the real DeepSpeed launcher with two CPU processes on a tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis

from scripts.corpus import write_corpus
from scripts.stack import ROOT, Stack, migrate
from tests.helpers import free_port
from tests.outage_support import PrivateRedis
from tests.s3_support import S3Server

PG = os.environ.get("FT_TEST_PG", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")
# Under pytest-xdist each worker process is a session of its own: its own database, stack and Redis database.
_XDIST = os.environ.get("PYTEST_XDIST_WORKER", "")
REDIS_DB = int(os.environ.get("FT_TEST_REDIS_DB", "9")) + (int(_XDIST.removeprefix("gw")) if _XDIST else 0)
# Outside development the service refuses to start without it; every process a test starts inherits it.
os.environ.setdefault("FT_SECRETS_KEY", "dGVzdHMtb25seS13ZWJob29rLXNlY3JldHMta2V5LTA=")


@pytest.fixture(scope="session")
def database() -> Iterator[str]:
    name = f"ft_test_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is needed at {PG!r} and is not reachable: {exc}")
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = f"redis://127.0.0.1:6379/{REDIS_DB}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    except redis.ConnectionError as exc:
        pytest.fail(f"Redis is needed at {url} and is not reachable: {exc}")
    return url


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of the module's own, for a module that runs a control plane on a database of its own. On the
    session's Redis the two control planes would share one event stream, and each ingester drops the events
    of jobs its database lacks: the other's."""
    server = PrivateRedis(tmp_path_factory.mktemp("own-redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture(scope="session")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from trainer.tiny import build_tiny_model

    base = tmp_path_factory.mktemp("ft")
    r = {name: base / name for name in ("models", "data", "artifacts", "logs", "cache")}
    for p in r.values():
        p.mkdir()
    train, _ = write_corpus(r["data"] / "corpus", limit_chars=200_000)
    build_tiny_model(r["models"] / "tiny-llama", train.read_text())
    return r


@pytest.fixture(scope="session")
def s3(roots: dict[str, Path]) -> Iterator[S3Server]:
    """A real S3-protocol server on this machine: the session stack's artifact store."""
    server = S3Server(roots["logs"])
    yield server
    server.stop()


# What a /v1 job takes from the deployment: job_spec()'s small job, without its step count (epochs decide).
OPENAI_JOB_DEFAULTS = {
    "hyperparameters": {"learning_rate": 0.003, "warmup_steps": 1, "seq_len": 64},
    "deepspeed": {"zero_stage": 2, "precision": "bf16"},
    "resources": {"num_gpus": 2, "time_limit_seconds": 600},
    "checkpointing": {"every_steps": 2, "keep_last": 2},
}


@pytest.fixture(scope="session")
def stack_env(database: str, redis_url: str, roots: dict[str, Path], s3: S3Server) -> dict[str, str]:
    return {
        # The session's store is S3, as a cluster's is; tests/test_store.py runs both kinds of store.
        **s3.env(s3.bucket()),
        "FT_DATABASE_URL": database, "FT_REDIS_URL": redis_url, "FT_PORT": str(free_port()),
        "FT_ARTIFACTS_ROOT": str(roots["artifacts"]), "FT_MODEL_ROOT": str(roots["models"]),
        "FT_CACHE_ROOT": str(roots["cache"]),
        "FT_DATA_ROOT": str(roots["data"]), "FT_NVME_ROOT": str(roots["artifacts"] / "nvme"),
        # Short leases so a killed worker is noticed within seconds.
        "FT_HEARTBEAT_SECONDS": "1", "FT_LEASE_TTL_SECONDS": "3", "FT_LEASE_GRACE_SECONDS": "2",
        "FT_LOOP_INTERVAL_SECONDS": "0.2", "FT_ENV": "development",
        "FT_CONTROLPLANE_METRICS_PORT": str(free_port()),  # read by tests/test_metrics.py
        # Clients that speak raw HTTP (the followers' SSE readers) send no key: they act as `default`'s admin.
        # The `api` client sends a real key; tests/test_access.py runs its own APIs with keys required.
        "FT_ALLOW_ANONYMOUS": "true",
        # Tests leave parked jobs queued all session long; quotas are tested on APIs of their own.
        "FT_QUOTA_MAX_ACTIVE_JOBS": "",
        # tests/test_webhooks.py's receivers listen on loopback, which the SSRF rules refuse unless allowed.
        "FT_WEBHOOK_ALLOW_NETS": "127.0.0.1/32",
        # The suite also runs trainers outside any worker (tests/test_trainer*.py), at normal priority, beside
        # the stack's jobs on two cores: jobs in SCHED_IDLE would wait out each of those runs. The priorities
        # themselves are tested in tests/test_priority.py and tests/test_chaos.py.
        "FT_TRAINER_PRIORITY": "normal",
        # The OpenAI-compatible face (tests/test_openai_jobs.py): the tiny model is the deployment's base model, and
        # what an OpenAI body cannot say is a small job on this machine's CPUs.
        "FT_BASE_MODELS": "tiny-llama",
        "FT_OPENAI_JOB_DEFAULTS": json.dumps(OPENAI_JOB_DEFAULTS),
    }


def create_key(env: dict[str, str], owner: str, scopes: str, name: str = "tests") -> str:
    """A key made the way an operator makes the first one: the CLI, straight into Postgres."""
    done = subprocess.run([sys.executable, "-m", "api.admin.keys", "create", "--owner", owner, "--scopes", scopes,
                           "--name", name], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="session")
def stack(stack_env: dict[str, str], roots: dict[str, Path]) -> Iterator[Stack]:
    env = {**os.environ, **stack_env}
    migrate(env)
    s = Stack(stack_env, roots["logs"])
    s.start_api()
    s.start_controlplane()
    s.start_worker("worker1")
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def admin_key(stack: Stack, stack_env: dict[str, str]) -> str:
    """An admin key of the `default` owner (the owner anonymous raw-HTTP clients act as, so both see the
    same jobs)."""
    return create_key({**os.environ, **stack_env}, "default", "admin")


@pytest.fixture(scope="session")
def api(stack: Stack, admin_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.api_url, timeout=30, headers={"Authorization": f"Bearer {admin_key}"}) as client:
        yield client


def job_spec(**overrides: Any) -> dict[str, Any]:
    """A small job of the tiny model on the session's corpus, with `overrides` merged in (a dict into a dict)."""
    job: dict[str, Any] = {
        "name": "test",
        "model": "tiny-llama",
        "data": {"train": "corpus/train.txt", "validation": "corpus/validation.txt"},
        "hyperparameters": {"max_steps": 24, "learning_rate": 0.003, "warmup_steps": 2,
                            "global_batch_size": 8, "seq_len": 64},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
        "resources": {"num_gpus": 2, "time_limit_seconds": 600},
        "checkpointing": {"every_steps": 8, "keep_last": 2},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    return job


@pytest.fixture
def make_job() -> Callable[..., dict[str, Any]]:
    return job_spec
