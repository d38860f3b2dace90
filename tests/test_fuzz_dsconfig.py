"""Fuzzing of raw DeepSpeed configs, generated from DeepSpeed's own field table
(contract/deepspeed/deepspeed_fields.json).

The schema fuzzer (tests/test_fuzz_api.py) never writes a DeepSpeed config: the API's schema says only "an
object" there. Here every field DeepSpeed reads (the top-level keys, every field of its config models, the keys of
the sections it reads as plain dicts, the optimizer's and each scheduler's params) gets values at and beyond its
bounds (DeepSpeed's and the service's own), huge and tiny numbers, integers beyond 64 bits, NaN and infinities,
and every wrong JSON type. Each config goes through what `POST /jobs` runs in process (JobSpec validation,
`resolve`, then the JSON a submit stores and the estimate a dry run answers), and a fixed-seed sample of them,
with every real config of tests/fixtures/deepspeed_configs/, through a real API process (dry run and submit) on
a database of its own. The property: an answer, never a crash; a refusal names a field; the API agrees with the
in-process path; no 5xx; and what the service accepts, DeepSpeed's own parser accepts too (a sample).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from api.services.estimate import estimate
from contract.deepspeed import fields, policy, resolve
from contract.problems import SpecError
from contract.spec import JobSpec
from db import jsonw
from tests.apiproc import add_key, api_client, fixed_key, fresh_database

KEY = fixed_key("dsfuzz")
QUEUE = "dsfuzz-parked"  # no worker serves it: submitted jobs stay queued
FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_configs"
# Reproducible by default; FT_FUZZ_SEED=<n> explores other samples.
SEED = int(os.environ.get("FT_FUZZ_SEED", "0"))
API_SAMPLE = 150  # generated configs sent to the real API, each as a dry run and as a submit
JOB_FIELDS = set(JobSpec.model_fields)
REPO = Path(__file__).resolve().parents[1]

# Numbers at the edges of what JSON, Python, a 64-bit float and a 64-bit integer hold.
EXTREMES: list[Any] = [
    0, -1, 1, 0.5, -0.5, 1e-300, -1e-300, 1e300, -1e300, 1e14, 5e8, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
    -(2**63), -(2**63) - 1, 2**64, 9.3e18, 10**400, -(10**400), float(2**63), math.nan, math.inf, -math.inf,
]
WRONG_TYPES: list[Any] = ["", "x", "auto", "AUTO", "16", "true", "1e14", [], [1, "a"], [[[]]], {}, {"enabled": True},
                          {"x": None}, True, False, None]
POOL = EXTREMES + WRONG_TYPES

# The service's own bound on a raw field, by where the field sits (contract/deepspeed/policy.py).
SERVICE_KINDS: dict[str, dict[str, policy.Kind]] = {
    "": policy.PASSTHROUGH_KINDS, "zero_optimization": policy.ZERO_KINDS,
    "zero_optimization.offload_optimizer": policy.OFFLOAD_KINDS,
    "zero_optimization.offload_param": policy.OFFLOAD_KINDS, "fp16": policy.FP16_KINDS,
    "activation_checkpointing": policy.ACTIVATION_CKPT_KINDS, "aio": policy.AIO_KINDS,
    "optimizer.params": policy.OPTIMIZER_KINDS, "scheduler.params": policy.SCHEDULER_KINDS,
}
# What a field's section needs around it to be read at all: an enabled dangerous block is refused before its
# fields are looked at, an offload block is read for its device, parameter offload needs stage 3.
CONTEXT: dict[str, dict[str, Any]] = {
    "zero_optimization.offload_optimizer": {"device": "cpu"},
    "zero_optimization.offload_param": {"device": "cpu"},
    **{s: {"enabled": False} for s in policy.DANGEROUS_KEYS},
}

Slot = tuple[tuple[str, ...], dict[str, Any], list[float]]  # the field's path, its context, its bounds


def _edges(bounds: list[float]) -> list[Any]:
    """Values at each bound and just beyond it on both sides, as integers and as floats."""
    out: list[Any] = []
    for b in bounds:
        out += [b, b - 1, b + 1, float(b), float(b) * 2, -b]
        if isinstance(b, float) or abs(b) < 2**53:
            out += [b - 1e-9, b + 1e-9, b + 0.5]
    return out


def _bounds(spec: dict[str, Any] | None, kind: policy.Kind | None) -> list[float]:
    found = [spec[b] for b in ("ge", "gt", "le", "lt") if spec and b in spec]
    if kind is not None and kind.type in ("int", "number", "size"):
        found += [kind.lo, kind.hi]
    return found


def _wrap(section: str, key: str, value: Any, context: dict[str, Any]) -> dict[str, Any]:
    """A raw config that holds `value` at `section.key` (sections nest by dots), inside its context."""
    parts = section.split(".") if section else []
    block: dict[str, Any] = {**context, key: value}
    if len(parts) == 2 and parts[0] == "zero_optimization":
        return {"zero_optimization": {"stage": 3, parts[1]: block}}  # every ZeRO sub-block is read at stage 3
    for part in reversed(parts):
        block = {part: block}
    return block


def slots() -> list[tuple[str, str, dict[str, Any], list[float]]]:
    """Every field DeepSpeed reads, as (section, key, context, bounds)."""
    t = fields.table()
    out: list[tuple[str, str, dict[str, Any], list[float]]] = []
    tops = set(t["top_level"]) | set(t["top_level_aliases"]) | set(t["inert_top_level"]) | set(t["removed"][""])
    for key in sorted(tops):
        out.append(("", key, {}, _bounds(None, policy.PASSTHROUGH_KINDS.get(key))))
    for section, section_fields in t["models"].items():
        kinds = SERVICE_KINDS.get(section, {})
        for name, spec in section_fields.items():
            for alias in spec["names"]:
                out.append((section, alias, CONTEXT.get(section, {}), _bounds(spec, kinds.get(spec["field"])
                                                                              or kinds.get(name))))
    for key in t["removed"]["zero_optimization"]:
        out.append(("zero_optimization", key, {}, []))
    for section, keys in t["dict_sections"].items():
        kinds = SERVICE_KINDS.get(section, {})
        for key in keys:
            out.append((section, key, CONTEXT.get(section, {}), _bounds(None, kinds.get(key))))
    for key in [*t["adam_defaults"], *t["adam_extra_params"]]:
        out.append(("optimizer.params", key, {}, _bounds(None, policy.OPTIMIZER_KINDS.get(key))))
    for scheduler, params in t["schedulers"].items():
        for key in [*params, "total_num_steps"]:
            out.append((f"scheduler.params.{scheduler}", key, {}, _bounds(None, policy.SCHEDULER_KINDS.get(key))))
    return out


def _config(section: str, key: str, value: Any, context: dict[str, Any]) -> dict[str, Any]:
    if section.startswith("scheduler.params."):
        return {"scheduler": {"type": section.rsplit(".", 1)[1], "params": {key: value}}}
    if section == "optimizer.params":
        return {"optimizer": {"type": "AdamW", "params": {key: value}}}
    return _wrap(section, key, value, context)


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,)
            yield from _leaves(v, path + (k,))


def _mutated(config: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A real config with one of its values replaced by one from the pool."""
    out = json.loads(json.dumps(config))
    path = rng.choice(list(_leaves(out)))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = rng.choice(POOL)
    return out


def generated() -> list[dict[str, Any]]:
    """Every field with the values at and beyond its bounds and a fixed-seed share of the pool; then the real
    configs, each with values replaced."""
    rng = random.Random(SEED)
    configs: list[dict[str, Any]] = []
    for section, key, context, bounds in slots():
        values = _edges(bounds) + rng.sample(POOL, 24)
        configs += [_config(section, key, v, context) for v in values]
    corpus = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json")) if p.name != "SOURCES.json"]
    for config in corpus:
        configs += [_mutated(config, rng) for _ in range(12)]
    return configs


def job_body(config: Any) -> dict[str, Any]:
    return {"name": "dsfuzz", "model": "tiny", "data": {"train": "train.txt"}, "resources": {"queue": QUEUE},
            "deepspeed": {"config": config}}


def _names_a_field(field: Any) -> bool:
    return isinstance(field, str) and (field == "body" or field.split(".")[0].split("[")[0] in JOB_FIELDS)


def _numbers(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            yield from _numbers(item)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield node


def in_process(config: Any) -> bool:
    """Whether a submit of this config would be accepted, by the path `POST /jobs` runs; raises on a crash, and
    fails on a refusal that names no field or on a render holding a number DeepSpeed's consumers cannot."""
    try:
        spec = JobSpec.model_validate(job_body(config))
    except ValidationError as exc:
        assert all(e["loc"] for e in exc.errors()), exc
        return False
    try:
        resolved = resolve(spec)
    except SpecError as exc:
        assert exc.errors, exc
        for e in exc.errors:
            assert _names_a_field(e.field) and e.message, e
        return False
    # What an accepted submit does next: store the request and the resolution as JSON, and a dry run estimates.
    jsonw.dumps(spec.model_dump(mode="json", exclude_unset=True))
    json.loads(jsonw.dumps(resolved.model_dump(mode="json")))
    estimate(resolved)
    for n in _numbers(resolved.deepspeed_config):
        assert -(2**63) <= n < 2**63 and math.isfinite(n), f"{n!r} rendered"
    return True


def _crashes(configs: list[dict[str, Any]]) -> tuple[list[str], dict[bool, int]]:
    crashes: list[str] = []
    answers = {True: 0, False: 0}
    for config in configs:
        try:
            answers[in_process(config)] += 1
        except Exception as exc:  # noqa: BLE001 - every crash is collected, then reported together
            crashes.append(f"{type(exc).__name__}: {str(exc)[:200]} <- {json.dumps(config)[:300]}")
    return crashes, answers


def test_every_field_of_deepspeeds_table_gets_an_answer_in_process() -> None:
    configs = generated()
    start = time.monotonic()
    crashes, answers = _crashes(configs)
    elapsed = time.monotonic() - start
    print(f"\n{len(configs)} configs in {elapsed:.1f} s: {answers[True]} accepted, {answers[False]} refused")
    assert not crashes, f"{len(crashes)} crashes, first ones:\n" + "\n".join(crashes[:15])
    # The generator must reach past the refusals, or it fuzzed only the 422 path.
    assert len(configs) >= 5000 and answers[True] >= 500 and answers[False] >= 2000, answers


def test_every_extreme_number_on_every_field_gets_an_answer() -> None:
    """Not a sample: every field with every number of EXTREMES."""
    crashes: list[str] = []
    for section, key, context, _ in slots():
        configs = [_config(section, key, v, context) for v in EXTREMES]
        crashes += _crashes(configs)[0]
    assert not crashes, f"{len(crashes)} crashes, first ones:\n" + "\n".join(crashes[:15])


def test_deepspeed_parses_what_the_service_accepted(tmp_path: Path) -> None:
    """The other half of the property: an accepted config renders to one DeepSpeed's own parser takes (at the
    job's one process), for a fixed-seed sample of the accepted ones."""
    rng = random.Random(SEED)
    accepted: dict[str, Any] = {}
    for i, config in enumerate(generated()):
        if _safe_in_process(config):
            accepted[str(i)] = (config, resolve(JobSpec.model_validate(job_body(config))))
    sample = dict(rng.sample(sorted(accepted.items()), 300))
    assert all(r.world_size == 1 for _, r in sample.values())
    (tmp_path / "in.json").write_text(json.dumps({1: {k: r.deepspeed_config for k, (_, r) in sample.items()}}))
    proc = subprocess.run([sys.executable, "-m", "tests.ds_parse", str(tmp_path / "in.json"),
                           str(tmp_path / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads((tmp_path / "out.json").read_text())["1"]
    refused = [f"{parsed[k]['error'][:200]} <- {json.dumps(sample[k][0])[:300]}" for k in sample if not parsed[k]["ok"]]
    assert not refused, f"{len(refused)} accepted configs DeepSpeed refuses:\n" + "\n".join(refused[:10])


# -- the real API --


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    base = tmp_path_factory.mktemp("dsfuzz")
    with fresh_database() as database:
        add_key(database, KEY, owner="dsfuzz-owner")
        with api_client(database, KEY, base, FT_QUOTA_MAX_ACTIVE_JOBS="") as c:
            yield c


def _post(client: httpx.Client, config: Any, *, dry_run: bool) -> httpx.Response:
    # Python's json writes NaN and Infinity as bare words, as a careless client would: the API must refuse them.
    body = json.dumps(job_body(config))
    return client.post("/jobs", params={"dry_run": "true"} if dry_run else None, content=body,
                       headers={"Content-Type": "application/json"})


def _check_answer(r: httpx.Response, accepted: bool, config: Any) -> None:
    where = f"{r.status_code} {r.text[:500]} <- {json.dumps(config)[:300]}"
    assert r.status_code < 500, where
    if 200 <= r.status_code < 300:
        assert accepted, f"the API took what the in-process path refuses: {where}"
        return
    assert 400 <= r.status_code < 500 and not accepted, f"the API refused what the in-process path takes: {where}"
    error = r.json()["error"]
    assert {"code", "message", "field"} <= set(error) and error["message"], where
    assert _names_a_field(error["field"]), where


def test_a_sample_of_generated_configs_gets_an_answer_from_the_api(client: httpx.Client) -> None:
    rng = random.Random(SEED)
    configs = generated()
    # Both outcomes in the sample: accepted configs are the rarer ones.
    verdicts = [_safe_in_process(c) for c in configs]
    accepted = [(c, True) for c, ok in zip(configs, verdicts, strict=True) if ok]
    refused = [(c, False) for c, ok in zip(configs, verdicts, strict=True) if not ok]
    sample = rng.sample(accepted, API_SAMPLE // 3) + rng.sample(refused, API_SAMPLE - API_SAMPLE // 3)
    statuses: dict[int, int] = {}
    for config, expected in sample:
        for dry_run in (True, False):
            r = _post(client, config, dry_run=dry_run)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            _check_answer(r, expected, config)
    print(f"\nAPI statuses: {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) >= 40 and statuses.get(201, 0) >= 40 and statuses.get(422, 0) >= 150, statuses


def _safe_in_process(config: Any) -> bool:
    try:
        return in_process(config)
    except Exception:  # noqa: BLE001 - a crash is the in-process test's failure; here it counts as a refusal
        return False


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json") if p.name != "SOURCES.json"))
def test_every_real_config_gets_an_answer_from_the_api(client: httpx.Client, name: str) -> None:
    config = json.loads((FIXTURES / name).read_text())
    accepted = in_process(config)
    for dry_run in (True, False):
        _check_answer(_post(client, config, dry_run=dry_run), accepted, config)


TRANSFORMERS_ZERO3 = "huggingface_transformers__tests_deepspeed_ds_config_zero3.json"


def test_transformers_zero3_config_is_submitted_with_its_sub_group_size(client: httpx.Client) -> None:
    """Its sub_group_size of 1e14 is a threshold DeepSpeed compares parameter counts against: DeepSpeed takes it,
    and so does the service, unchanged."""
    config = json.loads((FIXTURES / TRANSFORMERS_ZERO3).read_text())
    assert config["zero_optimization"]["sub_group_size"] == 1e14
    dry = _post(client, config, dry_run=True)
    assert dry.status_code == 200, dry.text
    zero = dry.json()["job"]["resolved"]["deepspeed_config"]["zero_optimization"]
    assert zero["sub_group_size"] == 1e14 and zero["stage"] == 3, zero
    created = _post(client, config, dry_run=False)
    assert created.status_code == 201, created.text
    assert created.json()["resolved"]["deepspeed_config"]["zero_optimization"] == zero


@pytest.mark.parametrize(("zero", "field", "words"), [
    # The service's own bounds: a buffer DeepSpeed allocates, and the int64 ceiling of a threshold.
    ({"reduce_bucket_size": 1e14}, "reduce_bucket_size", "from 0 to 1000000000000"),
    ({"stage3_model_persistence_threshold": 2**63}, "stage3_model_persistence_threshold",
     "from 0 to 9223372036854775807"),
    ({"sub_group_size": 10**400}, "sub_group_size", "from 0 to 9223372036854775807"),
    # DeepSpeed's own: pydantic reads a float into an integer field only inside the int64 range.
    ({"sub_group_size": 1e300}, "sub_group_size", "below 9223372036854775808"),
    ({"stage3_max_live_parameters": -1}, "stage3_max_live_parameters", "at least 0"),
])
def test_a_number_beyond_a_bound_is_a_422_naming_the_field_and_the_bound(
        client: httpx.Client, zero: dict[str, Any], field: str, words: str) -> None:
    for dry_run in (True, False):
        r = _post(client, {"zero_optimization": {"stage": 3, **zero}}, dry_run=dry_run)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == f"deepspeed.config.zero_optimization.{field}" and words in error["message"], error


def test_deepspeeds_own_largest_default_is_accepted(client: httpx.Client) -> None:
    # stage3_model_persistence_threshold's default is sys.maxsize: written out, it must pass.
    r = _post(client, {"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 2**63 - 1}},
              dry_run=True)
    assert r.status_code == 200, r.text
