"""The HTTP contract against the live API: validation errors, paging, cancel, health, the error shape."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

SEED_CONFIG = {  # as printed in the seed document, for 2 GPUs
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0001, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.0001,
                                                 "warmup_num_steps": 1000}},
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_scatter": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e8, "allgather_partitions": True},
    "gradient_clipping": 1.0, "steps_per_print": 2000, "wall_clock_breakdown": False,
}
HF_AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto"},
    "gradient_clipping": "auto",
}
PARKED = {"queue": "parked"}  # no worker serves it: these jobs stay queued


def raw_config_job(make_job: Any, config: dict[str, Any], num_gpus: int, **hyper: Any) -> dict[str, Any]:
    """A job that leaves batch, optimizer and schedule to the raw config (anything else would contradict it)."""
    job = make_job(deepspeed={"config": config}, resources={"num_gpus": num_gpus, **PARKED})
    job["hyperparameters"] = {"max_steps": 5, "seq_len": 64, **hyper}
    return job


def job_count(api: httpx.Client) -> int:
    n, after = 0, None
    while True:
        page = api.get("/jobs", params={"limit": 200, **({"after": after} if after else {})}).json()
        n += len(page["data"])
        if not page["has_more"]:
            return n
        after = page["data"][-1]["id"]


def assert_error(r: httpx.Response, status: int, field: str | None, *fragments: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"code", "message", "field"}
    fields = [d["field"] for d in err.get("details", [])] or [err["field"]]
    if field is not None:
        assert field in fields, err
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])
    return err


def test_raw_config_contradicting_the_job_names_both_fields(api: httpx.Client, make_job: Any) -> None:
    job = make_job(deepspeed={"config": SEED_CONFIG}, resources={"num_gpus": 1, **PARKED})
    assert job["hyperparameters"]["global_batch_size"] == 8
    assert_error(api.post("/jobs", json=job), 422, "deepspeed.config.train_batch_size",
                 "hyperparameters.global_batch_size is 8")


def test_seed_config_for_two_gpus_is_refused_with_the_numbers_and_the_fix(api: httpx.Client, make_job: Any) -> None:
    before = job_count(api)
    r = api.post("/jobs", json=raw_config_job(make_job, SEED_CONFIG, 2))
    assert_error(r, 422, "deepspeed.config.train_batch_size", "train_batch_size (4)",
                 "train_micro_batch_size_per_gpu (1)", "gradient_accumulation_steps (4)", "processes (2)", "= 8",
                 "set train_batch_size to 8", "gradient_accumulation_steps to 2")
    assert job_count(api) == before, "a refused job leaves no row"


def test_seed_config_with_param_offload_names_the_stage_rule(api: httpx.Client, make_job: Any) -> None:
    cfg = copy.deepcopy(SEED_CONFIG)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    r = api.post("/jobs", json=raw_config_job(make_job, cfg, 1))
    assert_error(r, 422, "deepspeed.config.zero_optimization.offload_param", "stage 3")


def test_seed_config_that_adds_up_is_merged_and_resolved(api: httpx.Client, make_job: Any) -> None:
    r = api.post("/jobs", json=raw_config_job(make_job, SEED_CONFIG, 1, max_steps=2000))
    assert r.status_code == 201, r.text
    res = r.json()["resolved"]
    ds = res["deepspeed_config"]
    batch = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert batch == (4, 1, 4)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert res["spec"]["hyperparameters"]["weight_decay"] == 0.01
    assert res["spec"]["hyperparameters"]["warmup_steps"] == 1000
    assert res["spec"]["hyperparameters"]["lr_schedule"] == "constant"
    assert "auto" not in json.dumps(ds)
    api.post(f"/jobs/{r.json()['id']}/cancel")


def test_hf_style_auto_values_are_resolved_not_passed_through(api: httpx.Client, make_job: Any) -> None:
    r = api.post("/jobs", json=raw_config_job(make_job, HF_AUTO_CONFIG, 2, global_batch_size=32, seq_len=1024,
                                              learning_rate=2e-5))
    assert r.status_code == 201, r.text
    job = r.json()
    ds = job["resolved"]["deepspeed_config"]
    assert "auto" not in json.dumps(ds)
    m, a = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    assert ds["train_batch_size"] == 32 == m * a * 2
    assert ds["bf16"] == {"enabled": True} and ds["optimizer"]["params"]["lr"] == 2e-5
    assert any("micro batch auto" in n for n in job["resolved"]["notes"])
    assert api.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelled"


@pytest.mark.parametrize(("patch", "field", "fragment"), [
    ({"model": "/etc"}, "model.name_or_path", "outside the model root"),
    ({"model": "./no-such-model"}, "model.name_or_path", "does not exist"),
    ({"model": "a/b/c"}, "model.name_or_path", "neither"),
    ({"data": {"train": "../../../etc/passwd"}}, "data.train", "outside the data root"),
    ({"data": {"train": "corpus/missing.txt"}}, "data.train", "does not exist"),
    ({"data": {"train": "corpus/train.txt", "format": "csv"}}, "data.format",
     "'text', 'jsonl', 'chat', 'completion' or 'preference'"),
    ({"hyperparameters": {"micro_batch_size": 3, "global_batch_size": 8}}, "hyperparameters.micro_batch_size",
     "does not divide"),
    ({"hyperparameters": {"global_batch_size": 7}}, "hyperparameters.global_batch_size", "not divisible"),
    ({"deepspeed": {"zero_stage": 5}}, "deepspeed.zero_stage", "0, 1, 2 or 3"),
    ({"deepspeed": {"zero_stage": 0, "offload_param": "cpu"}}, "deepspeed.offload_param", "needs zero_stage 3"),
    ({"deepspeed": {"zero_stage": 3, "offload_optimizer": "nvme"}}, "deepspeed.nvme_path", "needs nvme_path"),
    ({"deepspeed": {"config": {"wandb": {"enabled": True}}}}, "deepspeed.config.wandb", "network"),
    ({"deepspeed": {"config": {"flops_profiler": {"output_file": "/tmp/x"}}}}, "deepspeed.config.flops_profiler",
     "files"),
    ({"deepspeed": {"config": {"trian_batch_size": 8}}}, "deepspeed.config.trian_batch_size", "accepted"),
    ({"model": {"name_or_path": "tiny-llama", "trust_remote_code": True}}, "model.trust_remote_code", "operator"),
    ({"colour": "blue"}, "colour", "not a known field"),
    ({"hyperparameters": {"optimizer": "adamw_bf16"}, "deepspeed": {"offload_optimizer": "cpu"}},
     "hyperparameters.optimizer", '(accepted with offload: "adamw")'),
    ({"hyperparameters": {"optimizer": "adam8bit"}}, "hyperparameters.optimizer", "'adamw' or 'adamw_bf16'"),
])
def test_invalid_requests_name_the_field(api: httpx.Client, make_job: Any, patch: dict[str, Any], field: str,
                                         fragment: str) -> None:
    before = job_count(api)
    r = api.post("/jobs", json=make_job(resources=PARKED, **patch))
    err = assert_error(r, 422, field)
    assert any(fragment in d["message"] for d in err.get("details", [err])), err
    assert job_count(api) == before


def test_paging_is_newest_first_with_a_cursor_and_a_status_filter(api: httpx.Client, make_job: Any) -> None:
    ids = [api.post("/jobs", json=make_job(name=f"page-{i}", resources=PARKED)).json()["id"] for i in range(3)]
    first = api.get("/jobs", params={"limit": 2, "status": "queued"}).json()
    assert [j["id"] for j in first["data"]] == ids[::-1][:2] and first["has_more"]
    second = api.get("/jobs", params={"limit": 2, "status": "queued", "after": first["data"][-1]["id"]}).json()
    assert second["data"][0]["id"] == ids[0]
    assert_error(api.get("/jobs", params={"status": "sleeping"}), 422, "status", "accepted")
    assert_error(api.get("/jobs", params={"after": "job_nope"}), 422, "after")
    # Lists are summaries: the request and its resolution are read one job at a time.
    assert "resolved" not in first["data"][0] and "request" not in first["data"][0]
    assert "resolved" in api.get(f"/jobs/{ids[0]}").json()
    # The queue filter pages the same way, on its own index.
    other = [api.post("/jobs", json=make_job(name=f"q-{i}", resources={**PARKED, "queue": "parked-other"})).json()["id"]
             for i in range(3)]
    by_queue = api.get("/jobs", params={"queue": "parked-other", "limit": 2}).json()
    assert [j["id"] for j in by_queue["data"]] == other[::-1][:2] and by_queue["has_more"]
    rest = api.get("/jobs", params={"queue": "parked-other", "limit": 2, "after": other[1]}).json()
    assert [j["id"] for j in rest["data"]] == [other[0]] and not rest["has_more"]
    assert_error(api.get("/jobs", params={"queue": "no spaces"}), 422, "queue")
    for job_id in ids:
        r = api.post(f"/jobs/{job_id}/cancel")
        assert r.status_code == 202 and r.json()["status"] == "cancelled"
    evs = api.get(f"/jobs/{ids[0]}/events").json()["data"]
    assert [e["status"] for e in evs] == ["queued", "cancelled"]


def test_unknown_job_and_health(api: httpx.Client) -> None:
    assert_error(api.get("/jobs/job_missing"), 404, "id")
    assert_error(api.post("/jobs/job_missing/cancel"), 404, "id")
    assert api.get("/healthz").json()["status"] == "ok"
    ready = api.get("/readyz").json()
    assert ready == {"status": "ok", "checks": {"postgres": "ok", "redis": "ok"}}
    assert "/jobs" in api.get("/openapi.json").json()["paths"]
    assert api.get("/docs").status_code == 200


def test_example_job_file_is_accepted(api: httpx.Client, roots: dict[str, Path]) -> None:
    job = json.loads((Path(__file__).parent.parent / "examples" / "demo-job.json").read_text())
    job["data"] = {"train": "corpus/train.txt", "validation": "corpus/validation.txt"}
    job["resources"]["queue"] = "parked"
    r = api.post("/jobs", json=job)
    assert r.status_code == 201, r.text
    api.post(f"/jobs/{r.json()['id']}/cancel")


def test_a_description_is_shown_with_the_job_in_reads_and_lists(api: httpx.Client, make_job: Any) -> None:
    about = "Continued pre-training on the support corpus — try 2, longer warm-up"
    made = api.post("/jobs", json=make_job(name="described", description=about, resources=PARKED))
    assert made.status_code == 201 and made.json()["description"] == about
    plain = api.post("/jobs", json=make_job(name="plain", resources=PARKED)).json()
    assert plain["description"] is None
    listed = {j["id"]: j for j in api.get("/jobs", params={"queue": "parked", "limit": 200}).json()["data"]}
    assert listed[made.json()["id"]]["description"] == about and listed[plain["id"]]["description"] is None
    assert api.get(f"/jobs/{made.json()['id']}").json()["description"] == about
    assert_error(api.post("/jobs", json=make_job(description="x" * 2001, resources=PARKED)), 422, "description")
    assert_error(api.post("/jobs", json=make_job(description=7, resources=PARKED)), 422, "description")
    for job_id in (made.json()["id"], plain["id"]):
        api.post(f"/jobs/{job_id}/cancel")
