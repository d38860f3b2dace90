"""Real DeepSpeed configs from other projects, each run through job resolution and through DeepSpeed's own parser.

tests/fixtures/deepspeed_configs/ holds the files unchanged, with their repository, commit and path in
SOURCES.json. Each is resolved as `POST /jobs` resolves it (JobSpec validation, then `resolve`) at 1, 2 and 8
processes. A refusal must be for a true reason, checked against DeepSpeed: a field it does not know, a
dangerous or unrun feature, a key DeepSpeed itself removed, or a batch or value DeepSpeed also refuses at that
world size. An accepted config must render to a JSON that DeepSpeed's `DeepSpeedConfig` parses inside a real
process group of that size, and everything DeepSpeed reads differently from the pasted file must be in the
job's notes. Three of them also train end to end under the real launcher.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from contract.deepspeed import DANGEROUS_KEYS, fields, resolve
from contract.problems import SpecError
from contract.spec import JobSpec, ResolvedJob

pytest.register_assert_rewrite("tests.trainer_support")

from tests.trainer_support import REPO, launch, make_job, of, write_run_spec  # noqa: E402

pytest_plugins = ["tests.trainer_support"]

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_configs"
SOURCES: dict[str, dict[str, str]] = json.loads((FIXTURES / "SOURCES.json").read_text())
NAMES = sorted(SOURCES)
WORLDS = (1, 2, 8)
ALLOWED_REFUSALS = {"unknown", "dangerous", "unrun", "removed", "batch", "value"}
# DeepSpeed's own periodic log lines: the job reports progress through its events instead.
LOG_ONLY = {"steps_per_print", "wall_clock_breakdown"}
# The words a note must contain to explain a difference in one of DeepSpeedConfig's attributes.
KEYWORDS: dict[str, tuple[str, ...]] = {
    "train_batch_size": ("batch",), "train_micro_batch_size_per_gpu": ("batch", "micro"),
    "gradient_accumulation_steps": ("batch", "accumulation"),
    "optimizer_name": ("optimizer",), "optimizer_params": ("optimizer",),
    "scheduler_name": ("scheduler",), "scheduler_params": ("scheduler",),
    "activation_checkpointing_config": ("activation_checkpointing",),
    "float16_config": ("fp16", "precision"), "bfloat16_config": ("bf16", "precision"),
}


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def _spec(config: dict[str, Any], world: int) -> JobSpec:
    # What a client sends: the pasted config and nothing else the config could contradict.
    return JobSpec.model_validate({"model": "org/model", "data": {"train": "train.txt"},
                                   "resources": {"num_gpus": world}, "deepspeed": {"config": config}})


def _fill_autos(original: Any, rendered: Any) -> Any:
    """The pasted config as its Hugging Face integration would hand it to DeepSpeed: each "auto" replaced by the
    job's value where the render has one, dropped (DeepSpeed's default) where it has none."""
    if not isinstance(original, dict):
        return original
    out: dict[str, Any] = {}
    for key, value in original.items():
        there = rendered.get(key) if isinstance(rendered, dict) else None
        if isinstance(value, str) and value.lower() == "auto":
            if there is not None and not isinstance(there, dict):
                out[key] = there
        else:
            out[key] = _fill_autos(value, there)
    return out


def _known(field: str) -> bool:
    """Whether DeepSpeed knows the field an error names (deepspeed.config.<path>)."""
    parts = field.removeprefix("deepspeed.config.").split(".")
    key, section = parts[-1], ".".join(parts[:-1])
    t = fields.table()
    if not section:
        return key in fields.top_level_keys() or key in t["inert_top_level"] or key in t["removed"][""]
    if fields.has_section(section):
        return fields.lookup(section, key) is not None or fields.removed(section, key) is not None
    if section == "optimizer.params":
        return key in t["adam_defaults"] or key in t["adam_extra_params"] or key == "max_grad_norm"
    if section == "scheduler.params":
        return any(key in params or key == "total_num_steps" for params in t["schedulers"].values())
    return key in fields.dict_section_keys(section) or key == "params"


@dataclass
class Crash:
    """Neither a resolution nor a refusal: what `POST /jobs` would answer with a 500."""

    error: str


Outcome = ResolvedJob | SpecError | Crash


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, int], Outcome]:
    out: dict[tuple[str, int], Outcome] = {}
    for name in NAMES:
        for world in WORLDS:
            try:
                out[name, world] = resolve(_spec(_load(name), world))
            except SpecError as exc:
                out[name, world] = exc
            except Exception:  # noqa: BLE001 - kept per config, so each crash fails its own config's test
                out[name, world] = Crash(traceback.format_exc(limit=-3))
    return out


@pytest.fixture(scope="module")
def parsed(outcomes: dict[tuple[str, int], Outcome], tmp_path_factory: pytest.TempPathFactory,
           ) -> dict[int, dict[str, Any]]:
    """DeepSpeed's parse of every rendered config, of every pasted one as DeepSpeed would get it, and of the parts
    the service refused as DeepSpeed would, each at its world size, in one subprocess."""
    by_world: dict[int, dict[str, Any]] = {w: {} for w in WORLDS}
    for (name, world), outcome in outcomes.items():
        original = _load(name)
        if isinstance(outcome, Crash):
            continue
        if isinstance(outcome, ResolvedJob):
            by_world[world][f"rendered/{name}"] = outcome.deepspeed_config
            by_world[world][f"original/{name}"] = _fill_autos(original, outcome.deepspeed_config)
            continue
        batch = {k: original[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps")
                 if isinstance(original.get(k), int)}
        by_world[world][f"batch/{name}"] = batch
        for error in outcome.errors:
            top = error.field.removeprefix("deepspeed.config.").split(".")[0]
            if error.kind == "value" and top in original:
                by_world[world][f"value/{name}/{top}"] = {"train_batch_size": world, top: original[top]}
    tmp = tmp_path_factory.mktemp("parse")
    (tmp / "in.json").write_text(json.dumps(by_world))
    proc = subprocess.run([sys.executable, "-m", "tests.ds_parse", str(tmp / "in.json"), str(tmp / "out.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(w): r for w, r in json.loads((tmp / "out.json").read_text()).items()}


def test_corpus_is_at_least_40_real_configs_from_other_projects_with_their_sources() -> None:
    files = {p.name for p in FIXTURES.glob("*.json")} - {"SOURCES.json"}
    assert files == set(SOURCES) and len(files) >= 40
    repos = {s["repository"] for s in SOURCES.values()}
    assert len(repos) >= 8, repos
    for source in SOURCES.values():
        assert set(source) == {"repository", "commit", "path"} and len(source["commit"]) == 40


def _no_offload_is_none(zero: dict[str, Any]) -> dict[str, Any]:
    # DeepSpeed runs an offload block whose device is "none" exactly as no block.
    return {k: None if isinstance(v, dict) and v.get("device") == "none" else v for k, v in zero.items()}


def _silent_changes(original: dict[str, Any], rendered: dict[str, Any], notes: list[str]) -> list[str]:
    """Attributes DeepSpeed reads differently from the two configs with no note that names the difference."""
    def noted(*words: str) -> bool:
        return any(w in note for note in notes for w in words)

    unexplained: list[str] = []
    for attr in sorted(set(original) | set(rendered)):
        a, b = original.get(attr), rendered.get(attr)
        if attr in LOG_ONLY or a == b:
            continue
        if attr in ("float16_config", "bfloat16_config") and not (a or {}).get("enabled") \
                and not (b or {}).get("enabled"):
            continue  # neither side trains in that precision: its loss-scaling settings do nothing
        if attr == "optimizer_params":
            adam = {k: fields.table()["adam_defaults"][k] for k in ("lr", "betas", "eps", "weight_decay")}
            if a is not None and {**adam, **a} == b:
                continue  # the rendered config writes out DeepSpeed's own defaults
        if attr == "zero_config":
            a, b = _no_offload_is_none(a), _no_offload_is_none(b)
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key) and not noted(key):
                    unexplained.append(f"zero_optimization.{key}: {a.get(key)!r} -> {b.get(key)!r}")
            continue
        if not noted(*KEYWORDS.get(attr, (attr,))):
            unexplained.append(f"{attr}: {json.dumps(a)[:120]} -> {json.dumps(b)[:120]}")
    return unexplained


@pytest.mark.parametrize("name", NAMES)
def test_real_config_is_taken_as_deepspeed_reads_it_or_refused_for_a_true_reason(
        name: str, outcomes: dict[tuple[str, int], Outcome], parsed: dict[int, dict[str, Any]]) -> None:
    original = _load(name)
    for world in WORLDS:
        outcome = outcomes[name, world]
        assert not isinstance(outcome, Crash), f"{name} at {world}: a crash, not an answer\n{outcome.error}"
        if isinstance(outcome, SpecError):
            for error in outcome.errors:
                where = f"{name} at {world}: {error.field} ({error.kind}): {error.message}"
                assert error.kind in ALLOWED_REFUSALS, where
                if error.kind == "unknown":
                    assert not _known(error.field) and "accepted" in error.message, where
                elif error.kind in ("unrun", "removed"):
                    assert _known(error.field), where
                elif error.kind == "dangerous":
                    key = error.field.removeprefix("deepspeed.config.")
                    assert key in DANGEROUS_KEYS and original[key].get("enabled") is not False, where
                elif error.kind == "batch":
                    assert not parsed[world][f"batch/{name}"]["ok"], f"DeepSpeed takes this batch: {where}"
                else:
                    top = error.field.removeprefix("deepspeed.config.").split(".")[0]
                    assert not parsed[world][f"value/{name}/{top}"]["ok"], f"DeepSpeed takes this value: {where}"
            continue
        cfg = outcome.deepspeed_config
        assert "auto" not in json.dumps(cfg).lower().replace('"auto_cast"', ""), cfg
        ours = parsed[world][f"rendered/{name}"]
        assert ours["ok"], f"{name} at {world}: DeepSpeed refuses the rendered config: {ours['error']}"
        view = ours["view"]
        assert (view["train_batch_size"], view["train_micro_batch_size_per_gpu"],
                view["gradient_accumulation_steps"]) == (cfg["train_batch_size"], outcome.micro_batch_size,
                                                         outcome.gradient_accumulation_steps)
        theirs = parsed[world][f"original/{name}"]
        # The pasted file itself may fail in DeepSpeed (no batch size given): then every batch attribute is the
        # service's choice, which the notes must say.
        their_view = theirs["view"] if theirs["ok"] else {}
        assert theirs["ok"] or any("batch" in n for n in outcome.notes), theirs
        silent = _silent_changes(their_view, view, outcome.notes) if theirs["ok"] else []
        assert not silent, f"{name} at {world}: changed without a note: {silent}; notes: {outcome.notes}"


def test_most_of_the_corpus_is_accepted(outcomes: dict[tuple[str, int], Outcome]) -> None:
    # Guards against a policy that passes the checks above by refusing everything.
    accepted = {name for (name, world), o in outcomes.items() if world == 1 and isinstance(o, ResolvedJob)}
    assert len(accepted) >= 30, sorted(set(NAMES) - accepted)


def test_corpus_refusals_name_the_true_reason(outcomes: dict[tuple[str, int], Outcome]) -> None:
    def message(name: str) -> str:
        outcome = outcomes[name, 1]
        assert isinstance(outcome, SpecError), name
        return " | ".join(e.message for e in outcome.errors)

    assert "which this service does not run" in message(
        "axolotl-ai-cloud_axolotl__deepspeed_configs_zero1_torch_compile.json")
    assert "tensor parallelism" in message("hiyouga_LLaMA-Factory__examples_deepspeed_ds_z2_autotp_config.json")
    assert "refuses it" in message("microsoft_DeepSpeedExamples__training_MoQ_test.json")
    assert "launches extra training runs" in message(
        "microsoft_DeepSpeedExamples__training_autotuning_hf_dsconfigs_ds_config_tune.json")
    assert "not a field DeepSpeed" in message("microsoft_DeepSpeedExamples__training_imagenet_config_ds_config.json")


# -- three of them train end to end on the CPU, under the real launcher --

TRAINED = {
    "zero2-optimizer-offload": "hiyouga_LLaMA-Factory__examples_deepspeed_ds_z2_offload_config.json",
    "zero3-parameter-offload": "axolotl-ai-cloud_axolotl__deepspeed_configs_zero3_bf16_cpuoffload_params.json",
    "plain-bf16": "axolotl-ai-cloud_axolotl__deepspeed_configs_zero3_bf16.json",
}


@pytest.mark.parametrize("case", list(TRAINED))
def test_real_config_trains_end_to_end(case: str, tmp_path: Path, tiny_model: Path, corpus: str) -> None:
    train = tmp_path / "train.txt"
    train.write_text(corpus)
    config = _load(TRAINED[case])
    job = make_job(tiny_model, train, hyperparameters={"max_steps": 4, "warmup_steps": 1},
                   deepspeed={"config": copy.deepcopy(config)}, checkpointing={"every_steps": None})
    del job["deepspeed"]["zero_stage"], job["deepspeed"]["precision"]  # the pasted config decides them
    spec_path = write_run_spec(tmp_path, job)
    resolved = json.loads(spec_path.read_text())["job"]
    zero = resolved["deepspeed_config"]["zero_optimization"]
    assert zero["stage"] == config["zero_optimization"]["stage"]
    for key in ("offload_optimizer", "offload_param"):
        assert zero.get(key, {}).get("device") == config["zero_optimization"].get(key, {}).get("device"), key
    assert resolved["deepspeed_config"]["bf16"]["enabled"] is True
    rc, events, tail = launch(spec_path)
    assert rc == 0, tail
    (done,) = of(events, "completed")
    assert done["steps"] == 4
    losses = [p["loss"] for p in of(events, "progress")]
    assert len(losses) == 4 and all(0 < x < 100 for x in losses), losses
