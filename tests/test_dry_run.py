"""`POST /jobs?dry_run=true` against a real API process and database: it refuses exactly what a submit refuses
and creates nothing (no row, event, audit entry, idempotency record or quota use); it answers the resolved job,
memory per device and node from the model's own config.json (local) or the known shapes (hub ids), where that
fits, what would make it fit, and a duration where a throughput was measured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from api.services import estimate
from tests.apiproc import add_key, api_client, fixed_key, fresh_database, make_roots

KEY = fixed_key("dryrunadmin")
# The Llama-3.2-1B shape: 1,235,814,400 parameters with its tied embeddings.
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True}
TABLES = ("jobs", "job_events", "audit_log", "idempotency_keys")


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    with fresh_database() as url:
        add_key(url, KEY, owner="dry")
        yield url


@pytest.fixture(scope="module")
def client(database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    base = tmp_path_factory.mktemp("dryrun")
    make_roots(base)
    (base / "models" / "tiny" / "config.json").write_text(json.dumps(LLAMA_1B))
    with api_client(database, KEY, base) as c:
        yield c


def counts(database: str) -> dict[str, int]:
    with psycopg.connect(database.replace("+psycopg", "")) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}  # type: ignore[index]


def job(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "dry", "model": "tiny", "data": {"train": "train.txt"},
                            "hyperparameters": {"max_steps": 100, "global_batch_size": 32, "seq_len": 2048},
                            "resources": {"queue": "parked-dry"}}
    for key, value in overrides.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return body


def test_creates_nothing_and_resolves_as_a_submit_would(client: httpx.Client, database: str) -> None:
    client.put("/owners/dry/quota", json={"max_active_jobs": 1, "max_gpus": None}).raise_for_status()
    before = counts(database)
    for _ in range(3):  # beyond the quota of one: a dry run uses none of it
        r = client.post("/jobs", params={"dry_run": "true"}, json=job(), headers={"Idempotency-Key": "dry-1"})
        assert r.status_code == 200, r.text
    assert counts(database) == before
    assert client.get("/owners/dry/quota").json()["usage"]["active_jobs"] == 0
    answer = r.json()
    assert answer["dry_run"] is True and answer["owner"] == "dry"
    e = answer["estimate"]
    assert e["parameters"] == 1_235_814_400 and e["parameters_source"].endswith("tiny/config.json")
    assert e["trainable_parameters"] == e["parameters"]
    assert e["gpu_bytes_per_device"] == sum(e["breakdown"].values())
    assert {f["kind"] for f in e["fits"]} >= {"h200", "cpu"}
    assert next(f for f in e["fits"] if f["kind"] == "h200")["fits"] is True
    # The 1B shape was measured: 100 steps × 32 × 2048 tokens at 68,767 tokens/s.
    assert e["duration_seconds"] == pytest.approx(100 * 32 * 2048 / 68_767)
    # A real submit of the same body stores what the dry run showed.
    created = client.post("/jobs", json=job())
    assert created.status_code == 201, created.text
    assert created.json()["resolved"] == answer["job"]["resolved"]
    assert created.json()["request"] == answer["job"]["request"]
    assert counts(database)["jobs"] == before["jobs"] + 1


@pytest.mark.parametrize("bad", [
    {"hyperparameters": {"seq_len": 3}},
    {"model": "../etc"},
    {"deepspeed": {"zero_stage": 3, "config": {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}}},
    {"hyperparameters": {"optimizer": "adamw_bf16"}, "deepspeed": {"precision": "fp16"}},
])
def test_refuses_exactly_what_a_submit_refuses(client: httpx.Client, database: str, bad: dict[str, Any]) -> None:
    before = counts(database)
    dry = client.post("/jobs", params={"dry_run": "true"}, json=job(**bad))
    real = client.post("/jobs", json=job(**bad))
    assert dry.status_code == real.status_code == 422, (dry.text, real.text)
    assert dry.json() == real.json()
    assert counts(database) == before


def test_what_would_make_the_8b_fit(client: httpx.Client) -> None:
    """The Llama-3.1-8B shape, every parameter, adamw on one H200: the measured 20 bytes per parameter do not
    fit; adamw_bf16 does (it trained at 10,558 tokens/s), and so does LoRA."""
    r = client.post("/jobs", params={"dry_run": "true"}, json=job(
        model="meta-llama/Llama-3.1-8B", hyperparameters={"micro_batch_size": 4}))
    e = r.json()["estimate"]
    assert e["parameters"] == 8_030_261_248 and e["parameters_source"] == "known shapes: meta-llama/llama-3.1-8b"
    h200 = next(f for f in e["fits"] if f["kind"] == "h200")
    assert h200["fits"] is False and "GPU memory" in h200["reasons"][0]
    changes = {s["change"]: s for s in e["suggestions"]}
    assert "h200" in changes['hyperparameters.optimizer="adamw_bf16"']["fits_on"]
    assert "h200" in changes['lora={"rank": 16}']["fits_on"]
    # The optimizer on the CPU fits the GPU but not 128 GiB of host memory (18 bytes a parameter), as measured.
    offload = changes['deepspeed.offload_optimizer="cpu"']
    assert "h200" not in offload["fits_on"] and offload["host_bytes_per_node"] > 128 * 2**30
    fitted = client.post("/jobs", params={"dry_run": "true"}, json=job(
        model="meta-llama/Llama-3.1-8B", hyperparameters={"micro_batch_size": 4, "optimizer": "adamw_bf16"}))
    e = fitted.json()["estimate"]
    assert next(f for f in e["fits"] if f["kind"] == "h200")["fits"] and e["suggestions"] == []
    assert e["duration_seconds"] == pytest.approx(100 * 32 * 2048 / 10_558)


def test_placement_against_the_live_nodes(client: httpx.Client, database: str) -> None:
    """The nodes table as the control plane keeps it (copied from the workers' announcements): an 8-slot h200
    node, a 2-slot one that stopped heartbeating, a CPU node of another queue."""
    with psycopg.connect(database.replace("+psycopg", ""), autocommit=True) as conn:
        for name, kind, slots, queue, age in (("gpu-a", "h200", 8, "h200", 0), ("gpu-b", "h200", 2, "h200", 3600),
                                              ("cpu-1", "cpu", 2, "parked-dry", 0)):
            conn.execute("INSERT INTO nodes (name, kind, slots, devices, queues, jobs_max, last_seen) "
                         "VALUES (%s, %s, %s, %s, %s, %s, now() - make_interval(secs => %s))",
                         (name, kind, slots, json.dumps([str(d) for d in range(slots)]), [queue], slots, age))

    def placed(**resources: Any) -> dict[str, Any]:
        r = client.post("/jobs", params={"dry_run": "true"}, json=job(resources={"queue": "h200", **resources}))
        assert r.status_code == 200, r.text
        return r.json()["placement"]

    p = placed(num_gpus=4)
    by = {n["node"]: n for n in p["nodes"]}
    assert p["placeable_now"] is True and by["gpu-a"]["fits"] and by["gpu-a"]["free_now"], p
    assert not by["gpu-b"]["fits"] and any("lost" in r for r in by["gpu-b"]["reasons"])
    assert any("resources.num_gpus is 4; the node has 2 slots" in r for r in by["gpu-b"]["reasons"])
    assert not by["cpu-1"]["fits"] and "not resources.queue 'h200'" in by["cpu-1"]["reasons"][0]
    gang = placed(num_gpus=4, num_nodes=2)
    assert gang["placeable_now"] is False and gang["summary"].startswith("no placement: 1 node(s)"), gang
    # The 8B shape with adamw needs more than an H200 holds per device: no node of its kind fits it.
    r = client.post("/jobs", params={"dry_run": "true"}, json=job(
        model="meta-llama/Llama-3.1-8B", hyperparameters={"micro_batch_size": 4}, resources={"queue": "h200"}))
    big = {n["node"]: n for n in r.json()["placement"]["nodes"]}
    assert not big["gpu-a"]["fits"] and big["gpu-a"]["reasons"][0].startswith("GPU memory"), big["gpu-a"]


def test_a_node_at_its_job_limit_is_not_placeable_now() -> None:
    """The scheduler places nothing on a node that runs as many jobs as it may (jobs_max), whatever its free slots;
    the dry run says so too (core/placement.py is the one rule both apply). An 8-slot node, as GET /nodes shows it,
    with jobs_max 1 and one running 1-slot job has 7 slots free but none for a new job."""
    running = {"id": "job_x", "status": "running", "devices": ["0"]}
    node = {"name": "busy-1", "kind": "h200", "queues": ["limit-dry"], "slots_total": 8, "slots_free": 7,
            "jobs": [running], "jobs_max": 1, "state": "up"}
    p = estimate.placement([node], "limit-dry", 1, 1, None)
    [fit] = p.nodes
    assert fit.fits and fit.slots_free == 7 and not fit.free_now, fit
    assert p.placeable_now is False and p.summary.endswith("largest free now: 0"), p
    # Below its limit the same node takes the job now.
    p = estimate.placement([{**node, "jobs_max": 2}], "limit-dry", 1, 1, None)
    assert p.placeable_now is True and p.nodes[0].free_now, p


def test_an_unknown_model_is_valid_without_an_estimate(client: httpx.Client) -> None:
    r = client.post("/jobs", params={"dry_run": "true"}, json=job(model="someone/unknown-model"))
    assert r.status_code == 200, r.text
    e = r.json()["estimate"]
    assert e["parameters"] is None and e["fits"] == [] and "unknown" in e["notes"][0]


def test_the_cli_dry_run(client: httpx.Client, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    path = tmp_path / "job.json"
    path.write_text(json.dumps(job()))
    env = {**os.environ, "FT_API_URL": str(client.base_url), "FT_API_KEY": KEY, "COLUMNS": "200"}
    ft = str(Path(sys.executable).with_name("ft"))
    shown = subprocess.run([ft, "submit", str(path), "--dry-run"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "nothing was created" in shown.stdout and "1,235,814,400" in shown.stdout and "fits" in shown.stdout
    as_json = subprocess.run([ft, "submit", str(path), "--dry-run", "--json", "--set", "hyperparameters.seq_len=3"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["error"]["field"] == "hyperparameters.seq_len"
