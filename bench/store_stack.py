"""The stack the store benchmarks start: a database and Redis database of their own, the artifact store a folder in
a temporary directory or a moto S3 server on this machine, an admin key; all removed when `cleanup` closes. The
caller starts the processes it measures."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench.service_load import PG_ADMIN, drop_database, pick_redis_db
from scripts.stack import Stack, migrate
from tests.helpers import free_port
from tests.s3_support import S3Server


@dataclass
class StoreStack:
    base: Path  # the temporary directory: the model and data roots, the folder store, the jobs' folders, the logs
    env: dict[str, str]
    key: str  # an admin key of owner `bench`
    stack: Stack


def store_stack(cleanup: contextlib.ExitStack, *, prefix: str, store: str, env: dict[str, str]) -> StoreStack:
    """`store`: `file` or `s3`; `env`: the benchmark's own FT_* settings, over these."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    cleanup.callback(shutil.rmtree, base, ignore_errors=True)
    name = f"ft_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    cleanup.callback(drop_database, name)
    settings = {"FT_ENV": "development", "FT_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}",
                "FT_REDIS_URL": f"redis://127.0.0.1:6379/{pick_redis_db()}", "FT_PORT": str(free_port()),
                "FT_ARTIFACTS_ROOT": str(base / "artifacts"), "FT_MODEL_ROOT": str(base), "FT_DATA_ROOT": str(base),
                "FT_STORE_URL": f"file://{base / 'store'}", **env}
    if store == "s3":
        s3 = S3Server(base)
        cleanup.callback(s3.stop)
        settings.update(s3.env(s3.bucket()))
        # This process writes into the store too (the download benchmark's export).
        os.environ.update({k: v for k, v in settings.items() if k.startswith("AWS_")})
    full = {**os.environ, **settings}
    migrate(full)
    key = subprocess.run([sys.executable, "-m", "api.admin.keys", "create", "--owner", "bench", "--scopes", "admin",
                          "--name", "bench"], env=full, check=True, capture_output=True, text=True).stdout.strip()
    stack = Stack(settings, base / "logs")
    cleanup.callback(stack.stop)
    return StoreStack(base, settings, key, stack)
