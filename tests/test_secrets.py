"""Webhook secrets encrypted at rest with FT_SECRETS_KEY: what Postgres holds, the migration of plain-text rows,
key rotation, a key that opens nothing, and a production start without a usable key.

The deliveries here run on a fresh database of their own, by an API process (which seals the secret) and the
control plane's real deliverer started in this process with the keys each step needs; the shared stack's
control plane, which has other keys, never sees these rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from api.settings import ApiSettings
from controlplane.deliverer import Deliverer
from controlplane.settings import ControlPlaneSettings
from core import secretbox, webhooks
from scripts.stack import ROOT
from tests.apiproc import ApiProcess, fresh_database, make_roots
from tests.conftest import PG
from tests.helpers import free_port, wait_for
from tests.test_webhooks import Receiver, start_receiver

OLD, NEW, OTHER = secretbox.new_key(), secretbox.new_key(), secretbox.new_key()


def pg_url(database: str) -> str:
    return database.replace("+psycopg", "")


def without_key(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != secretbox.SETTING}
    return {**env, **extra}


@pytest.fixture(scope="module")
def rx() -> Iterator[Receiver]:
    receiver = start_receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def site(redis_url: str, rx: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A fresh database, an API on it sealing with OLD, and owner `default`'s secret made there (URL: rx)."""
    base = tmp_path_factory.mktemp("secrets")
    with fresh_database() as database:
        api = ApiProcess({"FT_DATABASE_URL": database, "FT_REDIS_URL": redis_url, "FT_SECRETS_KEY": OLD,
                          "FT_ALLOW_ANONYMOUS": "true", "FT_WEBHOOK_ALLOW_NETS": "127.0.0.1/32",
                          **make_roots(base)}, base / "api.log").start()
        try:
            with httpx.Client(base_url=api.url, timeout=30) as client:
                made = client.put("/owners/default/webhook", json={"url": f"{rx.url}/ok"})
                assert made.status_code == 200 and made.json()["secret"].startswith("whsec_"), made.text
                yield {"database": database, "client": client, "secret": made.json()["secret"]}
        finally:
            api.stop()


def stored(database: str) -> str:
    with psycopg.connect(pg_url(database), autocommit=True) as conn:
        row = conn.execute("SELECT secret FROM webhook_owners WHERE owner = 'default'").fetchone()
    assert row is not None
    return str(row[0])


def announce(client: httpx.Client) -> str:
    """A job parked on a queue nobody serves, cancelled: its one delivery (job.cancelled) is pending."""
    job = {"name": "secrets", "model": "tiny", "data": {"train": "train.txt"},
           "hyperparameters": {"max_steps": 2, "global_batch_size": 2, "seq_len": 8},
           "resources": {"num_gpus": 1, "queue": "parked-" + uuid.uuid4().hex[:8]}}
    made = client.post("/jobs", json=job)
    assert made.status_code == 201, made.text
    job_id = str(made.json()["id"])
    assert client.post(f"/jobs/{job_id}/cancel").status_code == 202
    return job_id


def settled(database: str, job_id: str) -> tuple[Any, ...] | None:
    with psycopg.connect(pg_url(database), autocommit=True) as conn:
        row = conn.execute("SELECT id, status, attempts, last_error FROM webhook_deliveries WHERE job_id = %s",
                           (job_id,)).fetchone()
    return tuple(row) if row and row[1] != "pending" else None


@contextmanager
def deliverer(database: str, keys: str) -> Iterator[Deliverer]:
    d = Deliverer(ControlPlaneSettings(database_url=database, secrets_key=keys, webhook_allow_nets="127.0.0.1/32",
                                       env="production"))
    d.start()
    try:
        yield d
    finally:
        d.stop()


def delivered_to(rx: Receiver, delivery_id: str) -> list[Any]:
    return [g for g in rx.at("/ok") if g.headers["X-FT-Delivery"] == delivery_id]


def test_postgres_holds_the_secret_encrypted(site: dict[str, Any]) -> None:
    with psycopg.connect(pg_url(site["database"]), autocommit=True) as conn:
        whole = conn.execute("SELECT row_to_json(w)::text FROM webhook_owners AS w").fetchall()
    assert len(whole) == 1 and site["secret"][6:] not in whole[0][0], whole
    value = stored(site["database"])
    assert value.startswith(f"v1:{secretbox.key_id(secretbox.parse_keys(OLD)[0])}:"), value
    shown = site["client"].get("/owners/default/webhook").json()
    assert shown["secret"] is None and shown["secret_prefix"] == site["secret"][:10], shown


def test_rotation_a_new_key_first_then_rotate_then_drop_the_old(site: dict[str, Any], rx: Receiver) -> None:
    database, secret = site["database"], site["secret"]
    # 1. The new key goes first, the old one stays: rows sealed with the old key still sign.
    job_id = announce(site["client"])
    with deliverer(database, f"{NEW},{OLD}"):
        delivery, status, _, error = wait_for(lambda: settled(database, job_id), 20, "the delivery")
    assert (status, error) == ("delivered", None)
    [got] = delivered_to(rx, delivery)
    assert webhooks.verify(secret, got.headers["X-FT-Signature"], got.body)
    # 2. The re-encryption: every row is sealed with the first key.
    env = without_key({"FT_DATABASE_URL": database, "FT_SECRETS_KEY": f"{NEW},{OLD}", "FT_ENV": "production"})
    done = subprocess.run([sys.executable, "-m", "api.admin.secrets", "rotate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 of 1" in done.stdout, done.stdout + done.stderr
    assert stored(database).startswith(f"v1:{secretbox.key_id(secretbox.parse_keys(NEW)[0])}:")
    # 3. The old key is dropped: the same secret still signs.
    job_id = announce(site["client"])
    with deliverer(database, NEW):
        delivery, status, _, error = wait_for(lambda: settled(database, job_id), 20, "the delivery")
    assert (status, error) == ("delivered", None)
    [got] = delivered_to(rx, delivery)
    assert webhooks.verify(secret, got.headers["X-FT-Signature"], got.body)


def test_a_secret_no_configured_key_opens_fails_its_delivery_with_the_reason(site: dict[str, Any],
                                                                             rx: Receiver) -> None:
    database = site["database"]
    job_id = announce(site["client"])
    with deliverer(database, OTHER) as d:
        delivery, status, attempts, error = wait_for(lambda: settled(database, job_id), 20, "the failed delivery")
        # Failed at once and not retried; the deliverer goes on serving.
        assert d._thread is not None and d._thread.is_alive()
    assert status == "failed" and attempts == 1, (status, attempts, error)
    assert "cannot be decrypted" in error and secretbox.SETTING in error and "does not hold" in error, error
    assert delivered_to(rx, delivery) == []


def test_the_migration_encrypts_plain_rows_and_its_downgrade_decrypts_them() -> None:
    name = f"ft_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    database = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    env = without_key({"FT_DATABASE_URL": database, "FT_SECRETS_KEY": NEW, "FT_ENV": "production"})

    def alembic(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "alembic", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]

    plain = webhooks.new_secret()
    try:
        alembic("upgrade", "0008")
        with psycopg.connect(pg_url(database), autocommit=True) as conn:
            conn.execute("INSERT INTO webhook_owners (owner, secret) VALUES ('before', %s)", (plain,))
        alembic("upgrade", "head")
        with psycopg.connect(pg_url(database), autocommit=True) as conn:
            value, prefix = conn.execute("SELECT secret, secret_prefix FROM webhook_owners").fetchone() or ("", "")
        assert plain[6:] not in value and prefix == plain[:10], value
        ring = secretbox.Keyring(secretbox.parse_keys(NEW))
        assert ring.open(value, context=secretbox.webhook_context("before")) == plain
        alembic("downgrade", "0008")
        with psycopg.connect(pg_url(database), autocommit=True) as conn:
            assert conn.execute("SELECT secret FROM webhook_owners").fetchone() == (plain,)
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_briefly(argv: list[str], env: dict[str, str], seconds: float = 60) -> tuple[int | None, str]:
    """(exit status, output); None where it was still running after `seconds` (it started), then stopped."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=seconds)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out


@pytest.mark.parametrize("value", [None, "not-a-key", f"{secretbox.new_key()},too-short", secretbox.DEVELOPMENT_KEY],
                         ids=["unset", "malformed", "one-malformed-of-two", "the-public-development-key"])
@pytest.mark.parametrize("program", ["api", "controlplane"])
def test_production_without_a_usable_key_refuses_to_start(program: str, value: str | None, tmp_path: Path) -> None:
    # Nothing listens on the database's port: what refuses must be the settings, before any connection.
    extra = {"FT_ENV": "production", "FT_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x",
             "FT_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
             "FT_CONTROLPLANE_METRICS_PORT": str(free_port())}
    env = without_key({**extra, **({secretbox.SETTING: value} if value is not None else {})})
    argv = ([sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(free_port())]
            if program == "api" else [sys.executable, "-m", "controlplane"])
    started = time.monotonic()
    code, out = run_briefly(argv, env, seconds=30)
    assert code is not None and code != 0, f"{program} started ({time.monotonic() - started:.0f} s):\n{out[-2000:]}"
    assert secretbox.SETTING in out and "api.admin.secrets new-key" in out, out[-2000:]
    # One line per problem, not a traceback an operator has to read through.
    assert "cannot start" in out and "Traceback" not in out, out[-2000:]
    assert value is None or value.split(",")[-1] not in out  # the key itself is never printed


def test_development_without_a_key_seals_with_the_development_key() -> None:
    ring = secretbox.keyring(ApiSettings(env="development", secrets_key=""))
    assert ring.ids == [secretbox.key_id(secretbox.parse_keys(secretbox.DEVELOPMENT_KEY)[0])]
    assert ring.open(ring.seal("whsec_x", context="c"), context="c") == "whsec_x"
    with pytest.raises(ValueError, match=secretbox.SETTING):
        ApiSettings(env="staging", secrets_key="")
