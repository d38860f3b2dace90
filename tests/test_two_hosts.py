"""Two hosts that share no disk: each worker has its own scratch folder (FT_ARTIFACTS_ROOT) and cache, runs in a
network namespace of its own, and reaches Redis, the artifact store (a real S3 server) and the other host's ranks
only over the network. A two-node job checkpoints, loses a node (its worker killed, its scratch folder deleted), is
requeued on another pair, resumes from the store's checkpoint, succeeds and exports into the store.

The API and the control plane run on this machine's side of the bridge with a database of their own; the model
is read from the model root, as a node's provisioned base model is (the same path on every host).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from scripts.stack import Stack, migrate
from store.objects import Store
from tests import netns_support
from tests.conftest import PG, create_key
from tests.helpers import events_of, free_port, wait_for, wait_no_processes, wait_status
from tests.outage_support import PrivateRedis
from tests.s3_support import S3Server, store_config

WHY_NOT = netns_support.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
END = {"succeeded", "failed", "cancelled"}


@pytest.fixture
def network() -> Iterator[netns_support.Network]:
    net = netns_support.Network(int(os.environ.get("FT_TEST_REDIS_DB", "9")))
    yield net
    net.close()


@pytest.fixture
def cluster(network: netns_support.Network, roots: dict[str, Path],
            tmp_path: Path) -> Iterator[tuple[Stack, httpx.Client, Store, dict[str, str]]]:
    name = f"ft_hosts_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    redis_server = PrivateRedis(roots["logs"], host=network.gateway)
    redis_server.start()
    s3 = S3Server(roots["logs"], host=network.gateway)
    env = {**s3.env(s3.bucket()), "FT_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}",
           "FT_REDIS_URL": redis_server.url, "FT_PORT": str(free_port()), "FT_ENV": "development",
           "FT_ARTIFACTS_ROOT": str(tmp_path / "api-host"), "FT_MODEL_ROOT": str(roots["models"]),
           "FT_DATA_ROOT": str(tmp_path / "no-data"), "FT_HEARTBEAT_SECONDS": "1", "FT_LEASE_TTL_SECONDS": "3",
           "FT_LEASE_GRACE_SECONDS": "2", "FT_LOOP_INTERVAL_SECONDS": "0.2", "FT_QUOTA_MAX_ACTIVE_JOBS": "",
           "FT_CONTROLPLANE_METRICS_PORT": str(free_port()), "FT_TRAINER_PRIORITY": "normal",
           # The ranks of two hosts meet over the namespaces' own interface, not a loopback.
           "GLOO_SOCKET_IFNAME": "eth0"}
    full = {**os.environ, **env}
    migrate(full)
    stack = Stack(env, roots["logs"] / f"hosts-{name}")
    stack.start_api()
    stack.start_controlplane()
    stack.wait_ready()
    key = create_key(full, "default", "admin")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        os.environ.setdefault(var, env[var])
    store = Store(store_config(env))
    try:
        with httpx.Client(base_url=stack.api_url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as api:
            yield stack, api, store, env
    finally:
        stack.stop()
        s3.stop()
        redis_server.kill()
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_host_worker(stack: Stack, host: netns_support.Host, name: str, scratch: Path) -> None:
    stack.start_worker(name, queues="hosts", slots=1, prefix=host.prefix(), env={
        "FT_NODE_ADDR": host.addr, "FT_ARTIFACTS_ROOT": str(scratch / "artifacts"),
        "FT_CACHE_ROOT": str(scratch / "cache")})


def test_a_two_host_job_without_a_shared_disk_loses_a_node_resumes_from_the_store_and_exports(
        network: netns_support.Network, cluster: tuple[Stack, httpx.Client, Store, dict[str, str]],
        roots: dict[str, Path], tmp_path: Path) -> None:
    stack, api, store, _ = cluster
    corpus = (roots["data"] / "corpus" / "train.txt").read_bytes()
    uploaded = api.post("/files", files={"file": ("train.txt", corpus, "text/plain")},
                        data={"purpose": "fine-tune", "format": "text"})
    assert uploaded.status_code == 201, uploaded.text
    file_id = uploaded.json()["id"]
    wait_for(lambda: api.get(f"/files/{file_id}").json()["status"] == "processed", 60, "the file processed")

    hosts = {name: network.host() for name in ("host-a", "host-b", "host-c")}
    scratch = {name: tmp_path / name for name in hosts}
    for name in ("host-a", "host-b"):
        start_host_worker(stack, hosts[name], name, scratch[name])
    for name in ("host-a", "host-b"):
        wait_for(lambda n=name: any(x["name"] == n and x["state"] == "up" for x in api.get("/nodes").json()["data"]),
                 60, f"node {name} up")
    spec: dict[str, Any] = {
        "name": "two-hosts", "model": "tiny-llama", "data": {"train": file_id},
        "hyperparameters": {"max_steps": 24, "learning_rate": 0.003, "warmup_steps": 2, "global_batch_size": 8,
                            "seq_len": 64},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
        "resources": {"num_gpus": 1, "num_nodes": 2, "queue": "hosts", "time_limit_seconds": 900},
        "checkpointing": {"every_steps": 6, "keep_last": 2}}
    job = api.post("/jobs", json=spec)
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    ckpt = wait_for(lambda: [c for c in events_of(api, job_id, ["checkpoint"]) if c.get("committed")], 400,
                    "a checkpoint committed to the store")[0]
    first = ckpt["attempt"]
    parts = api.get(f"/jobs/{job_id}").json()["placement"]
    assert sorted(p["node"] for p in parts) == ["host-a", "host-b"]

    # Host b is gone, and its disk with it.
    doomed = stack.procs.pop("host-b")
    doomed.kill()
    doomed.wait()
    wait_no_processes(f"{scratch['host-b']}/", 30, "host b's ranks ended by their guard")
    shutil.rmtree(scratch["host-b"])
    start_host_worker(stack, hosts["host-c"], "host-c", scratch["host-c"])

    final = wait_status(api, job_id, END, 600)
    assert final["status"] == "succeeded", final["error"]
    assert final["attempt"] > first
    assert sorted(p["node"] for p in final["placement"]) == ["host-a", "host-c"]
    evs = events_of(api, job_id)
    resumed = [e for e in evs if e["type"] == "started" and e["attempt"] == final["attempt"]]
    assert resumed and resumed[0]["resumed_from_step"] >= ckpt["step"] > 0, resumed
    # Host c had never seen the job: its ranks' part of the checkpoint came from the store.
    assert list((scratch["host-c"] / "artifacts" / "jobs" / job_id / "checkpoints").glob("step-*"))
    # The export is in the store and downloads through the API.
    listed = api.get(f"/jobs/{job_id}/output")
    assert listed.status_code == 200, listed.text
    files = {f["path"]: f for f in listed.json()["files"]}
    assert "model.safetensors" in files and "config.json" in files
    config = api.get(f"/jobs/{job_id}/output/config.json")
    assert hashlib.sha256(config.content).hexdigest() == files["config.json"]["sha256"]
    assert any(item.key.endswith("/output/model.safetensors") for item in store.list(f"jobs/{job_id}/"))
    wait_no_processes(job_id, 30, "no process of the job left on any host")
