"""Prometheus metrics against the real stack: the API's counters summed over its worker processes and labelled by
route template, jobs by state and queue read from Postgres at scrape time, the control plane's ingest, dispatch
and per-running-job figures (gone once the job ended); the dashboard and the compose profile that load them."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for, wait_status

ROOT = Path(__file__).parent.parent


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a fresh connection's scrape (so any API process may answer it)."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_api_requests_per_route_template_summed_over_processes(stack: Any, api: httpx.Client) -> None:
    url = stack.api_url + "/metrics"
    missing = {"method": "GET", "route": "/jobs/{job_id}", "status": "404"}
    before = sample(scrape(url), "ft_api_requests_total", **missing)
    headers = dict(api.headers)
    for i in range(40):  # a new connection each: the API's processes share the port, each takes some
        assert httpx.get(f"{stack.api_url}/jobs/job_nope{i}", headers=headers).status_code == 404
    after = scrape(url)
    # Exactly 40 whichever process answered the scrape: each process's counters are in the sum.
    assert sample(after, "ft_api_requests_total", **missing) - before == 40
    assert not any("job_nope" in str(key) for key in after)  # the template, never the raw path
    assert sample(after, "ft_api_request_duration_seconds_count", method="GET", route="/jobs/{job_id}") >= 40
    # Refused before routing: counted, with the status saying why.
    httpx.get(stack.api_url + "/jobs", headers={"Authorization": "Bearer ftk_" + "z" * 43})
    assert sample(scrape(url), "ft_api_requests_total", method="GET", route="unrouted", status="401") >= 1


def test_api_garbage_collection_pauses_are_measured(stack: Any) -> None:
    url = stack.api_url + "/metrics"
    # Each scrape builds the whole exposition (thousands of objects): young collections happen meanwhile.
    seen = wait_for(lambda: (s := scrape(url)) and sample(s, "ft_api_gc_pause_seconds_count", generation="0") > 0
                    and s, 30, "a young collection's pause in the API's metrics", interval=0.2)
    assert sample(seen, "ft_api_gc_pause_seconds_sum", generation="0") > 0
    assert ("ft_api_gc_pause_seconds_count", (("generation", "2"),)) in seen  # the series exists before any pause


def test_jobs_by_state_and_queue_from_postgres(stack: Any, api: httpx.Client, make_job: Any) -> None:
    queue = "parked-" + uuid.uuid4().hex[:8]
    ids = [api.post("/jobs", json=make_job(resources={"queue": queue})).json()["id"] for _ in range(3)]
    api.post(f"/jobs/{ids[0]}/cancel").raise_for_status()
    samples = scrape(stack.api_url + "/metrics")
    assert sample(samples, "ft_jobs", status="queued", queue=queue) == 2
    assert sample(samples, "ft_jobs", status="cancelled", queue=queue) == 1
    assert sample(samples, "ft_queue_oldest_wait_seconds", queue=queue) > 0
    assert sample(samples, "ft_jobs_scrape_ok") == 1
    for job_id in ids[1:]:
        api.post(f"/jobs/{job_id}/cancel")


def test_controlplane_metrics_follow_a_running_job(stack: Any, api: httpx.Client, make_job: Any,
                                                   stack_env: dict[str, str]) -> None:
    url = f"http://127.0.0.1:{stack_env['FT_CONTROLPLANE_METRICS_PORT']}/metrics"
    job_id = api.post("/jobs", json=make_job(hyperparameters={"max_steps": 16})).json()["id"]
    labels = {"job_id": job_id, "owner": "default", "queue": "default"}
    seen = wait_for(lambda: (s := scrape(url)) and sample(s, "ft_job_step", **labels) > 0 and s, 300,
                    f"job {job_id}'s step in the control plane's metrics", interval=0.5)
    assert sample(seen, "ft_job_total_steps", **labels) == 16
    assert sample(seen, "ft_job_loss", **labels) > 0 and sample(seen, "ft_job_tokens_per_second", **labels) > 0
    wait_status(api, job_id, {"succeeded"}, 300)
    done = scrape(url)
    # An ended job leaves every per-job gauge: no series outlives its job.
    assert not any(dict(key[1]).get("job_id") == job_id for key in done)
    assert sample(done, "ft_ingest_events_total") > 0 and sample(done, "ft_dispatched_total") >= 1
    assert sample(done, "ft_ingest_lag_seconds_count") == sample(done, "ft_ingest_events_total")
    assert 0 <= sample(done, "ft_ingest_last_lag_seconds") < 60
    assert ("ft_reaper_actions_total", ()) in done and sample(done, "ft_running_jobs_scrape_ok") == 1


def test_the_dashboard_and_the_monitoring_profile() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    port = services["controlplane"]["environment"]["FT_CONTROLPLANE_METRICS_PORT"]
    prometheus = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"api:8000", f"controlplane:{port}"}
    for mount in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (ROOT / source).exists(), source
    # Every metric the dashboard queries is one the service exports.
    exported = set(re.findall(r'"(ft_[a-z_]+)"', (ROOT / "api" / "metrics.py").read_text()
                              + (ROOT / "controlplane" / "metrics.py").read_text()))
    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "dashboards" / "finetune.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p["targets"]
               for name in re.findall(r"\b(ft_[a-z_]+?)(?:_bucket|_count|_sum)?\b", t["expr"])}
    assert queried and queried <= exported, queried - exported
