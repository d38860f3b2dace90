"""Resolving jobs and raw DeepSpeed configs into the rendered DeepSpeed JSON: pure Python, no launcher.

Good configs must resolve with no "auto" left and the batch triple DeepSpeed will check; bad ones must raise
SpecError naming exactly the fields to fix.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from contract.deepspeed import DANGEROUS_KEYS, resolve
from contract.problems import SpecError
from contract.spec import MAX_BATCH, JobSpec


def _job(config: dict[str, Any] | None = None, *, num_gpus: int = 1, **sections: Any) -> JobSpec:
    job: dict[str, Any] = {"model": "org/model", "data": {"train": "train.txt"}, "resources": {"num_gpus": num_gpus},
                           **sections}
    if config is not None:
        job["deepspeed"] = {**job.get("deepspeed", {}), "config": config}
    return JobSpec.model_validate(job)


def _autos(value: Any, path: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _autos(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _autos(v, f"{path}[{i}]")]
    return [path] if isinstance(value, str) and value.lower() == "auto" else []


def _triple(cfg: dict[str, Any]) -> tuple[int, int, int]:
    return cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]


def _error_fields(spec: JobSpec) -> list[str]:
    with pytest.raises(SpecError) as info:
        resolve(spec)
    return [e.field for e in info.value.errors]


# The config of the seed document (a 1-GPU tutorial), minus its offload_param, which needs ZeRO-3.
SEED_CONFIG: dict[str, Any] = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0001, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.0001, "warmup_num_steps": 1000}},
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "reduce_scatter": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "allgather_partitions": True,
    },
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}

# What Hugging Face's Trainer integration documents: every value "auto", filled from the training arguments.
HF_AUTO_CONFIG: dict[str, Any] = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                             "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _deepspeed_accepts(cfg: dict[str, Any]) -> None:
    """DeepSpeed's own parser (world size 1 without a process group) must accept the rendered JSON."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(copy.deepcopy(cfg))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
            parsed.gradient_accumulation_steps) == _triple(cfg)
    assert parsed.zero_optimization_stage == cfg["zero_optimization"]["stage"]


def test_seed_document_config_resolves() -> None:
    resolved = resolve(_job(SEED_CONFIG))
    cfg, hp, ds = resolved.deepspeed_config, resolved.spec.hyperparameters, resolved.spec.deepspeed
    assert _autos(cfg) == [] and _triple(cfg) == (4, 1, 4)
    assert (resolved.micro_batch_size, resolved.gradient_accumulation_steps) == (1, 4)
    assert hp.learning_rate == 1e-4 and hp.weight_decay == 0.01 and hp.warmup_steps == 1000
    assert hp.lr_schedule == "constant"  # WarmupLR: warm up, then hold
    assert ds.zero_stage == 2 and ds.offload_optimizer == "cpu" and ds.precision == "bf16"  # fp16 "auto"
    assert cfg["optimizer"]["params"]["lr"] == 1e-4 and cfg["optimizer"]["params"]["weight_decay"] == 0.01
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 5e8 and cfg["steps_per_print"] == 2000
    assert "scheduler" not in cfg and "fp16" not in cfg and cfg["bf16"] == {"enabled": True}
    _deepspeed_accepts(cfg)


def test_hf_all_auto_config_resolves_from_the_job() -> None:
    spec = _job(HF_AUTO_CONFIG, hyperparameters={"learning_rate": 2e-4, "global_batch_size": 16, "seq_len": 1024,
                                                 "gradient_clipping": 0.5, "warmup_steps": 10})
    resolved = resolve(spec)
    cfg, hp, ds = resolved.deepspeed_config, resolved.spec.hyperparameters, resolved.spec.deepspeed
    assert _autos(cfg) == [], _autos(cfg)
    # micro auto: the largest divisor of 16 with micro x 1024 tokens within the 16384-token budget.
    assert _triple(cfg) == (16, 16, 1)
    assert cfg["optimizer"]["params"]["lr"] == 2e-4 and cfg["gradient_clipping"] == 0.5
    assert hp.warmup_steps == 10 and hp.lr_schedule == "linear"  # WarmupDecayLR
    assert ds.zero_stage == 3 and ds.offload_optimizer == "cpu" and ds.offload_param == "cpu"
    zero = cfg["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True and zero["sub_group_size"] == 1e9
    assert "reduce_bucket_size" not in zero and "stage3_prefetch_bucket_size" not in zero
    assert "scheduler" not in cfg
    _deepspeed_accepts(cfg)


def test_plain_job_resolves_with_defaults() -> None:
    resolved = resolve(_job(num_gpus=2, hyperparameters={"global_batch_size": 32, "seq_len": 2048}))
    cfg = resolved.deepspeed_config
    assert _autos(cfg) == [] and "scheduler" not in cfg
    # 16 rows per process; 8 x 2048 tokens fill the 16384-token budget.
    assert _triple(cfg) == (32, 8, 2)
    assert resolved.world_size == 2 and resolved.spec.hyperparameters.micro_batch_size == 8
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"] == {"enabled": True}
    single = resolve(_job()).deepspeed_config
    _deepspeed_accepts(single)


BAD_CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    # -- contradictions --
    "batch triple does not multiply out": (
        {"num_gpus": 2, "config": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                   "gradient_accumulation_steps": 2}},
        ["deepspeed.config.train_batch_size"]),
    "raw batch vs explicit global batch": (
        {"hyperparameters": {"global_batch_size": 8}, "config": {"train_batch_size": 16}},
        ["deepspeed.config.train_batch_size"]),
    "raw lr vs explicit learning_rate": (
        {"hyperparameters": {"learning_rate": 1e-4}, "config": {"optimizer": {"type": "AdamW",
                                                                              "params": {"lr": 3e-4}}}},
        ["deepspeed.config.optimizer.params.lr"]),
    "raw stage 2 with offload_param": (
        {"config": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}},
        ["deepspeed.config.zero_optimization.offload_param"]),
    "raw stage vs explicit zero_stage": (
        {"deepspeed": {"zero_stage": 3}, "config": {"zero_optimization": {"stage": 1}}},
        ["deepspeed.config.zero_optimization.stage"]),
    "micro does not divide the per-rank batch": (
        {"num_gpus": 2, "hyperparameters": {"global_batch_size": 8, "micro_batch_size": 3}},
        ["hyperparameters.micro_batch_size"]),
    "raw micro does not divide the per-rank batch": (
        {"num_gpus": 2, "hyperparameters": {"global_batch_size": 8},
         "config": {"train_micro_batch_size_per_gpu": 3}},
        ["deepspeed.config.train_micro_batch_size_per_gpu"]),
    "global batch not divisible by processes": (
        {"num_gpus": 2, "hyperparameters": {"global_batch_size": 9}},
        ["hyperparameters.global_batch_size"]),
    "raw global batch not divisible by processes": (
        {"num_gpus": 2, "config": {"train_batch_size": 9}},
        ["deepspeed.config.train_batch_size"]),
    "warmup longer than the run": (
        {"hyperparameters": {"max_steps": 10},
         "config": {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}},
        ["hyperparameters.warmup_steps"]),
    # -- dangerous or unknown --
    **{f"dangerous {key}": ({"config": {key: {"enabled": True}}}, [f"deepspeed.config.{key}"])
       for key in ("flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "autotuning")},
    "nvme optimizer offload without nvme_path": (
        {"config": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}},
        ["deepspeed.config.zero_optimization.offload_optimizer.nvme_path"]),
    "nvme param offload without nvme_path": (
        {"config": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}},
        ["deepspeed.config.zero_optimization.offload_param.nvme_path"]),
    "partial optimizer offload below stage 3": (
        {"config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}},
        ["deepspeed.config.zero_optimization.offload_optimizer.ratio"]),
    "partial optimizer offload ratio out of range": (
        {"config": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}}},
        ["deepspeed.config.zero_optimization.offload_optimizer.ratio"]),
    "misspelt top-level key": (
        {"config": {"trian_batch_size": 8}},
        ["deepspeed.config.trian_batch_size"]),
    "unknown zero key": (
        {"config": {"zero_optimization": {"stage": 2, "stage3_prefech_bucket_size": 10}}},
        ["deepspeed.config.zero_optimization.stage3_prefech_bucket_size"]),
    "unknown offload key": (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}}},
        ["deepspeed.config.zero_optimization.offload_optimizer.pin_memroy"]),
    "unknown optimizer type": (
        {"config": {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}},
        ["deepspeed.config.optimizer.type"]),
    "unknown optimizer param": (
        {"config": {"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}},
        ["deepspeed.config.optimizer.params.momentum"]),
    # -- wrong types anywhere in the raw config: named, never a crash --
    "scheduler params as a list": (
        {"config": {"scheduler": {"type": "WarmupLR", "params": [1000]}}},
        ["deepspeed.config.scheduler.params"]),
    "betas as strings": (
        {"config": {"optimizer": {"type": "AdamW", "params": {"betas": ["0.9", "0.95"]}}}},
        ["deepspeed.config.optimizer.params.betas"]),
    "betas out of range": (
        {"config": {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}},
        ["deepspeed.config.optimizer.params.betas"]),
    "optimizer type not a string": (
        {"config": {"optimizer": {"type": {"name": "AdamW"}}}},
        ["deepspeed.config.optimizer.type"]),
    "stage true": (
        {"config": {"zero_optimization": {"stage": True}}},
        ["deepspeed.config.zero_optimization.stage"]),
    "tuning knobs of the wrong type": (
        {"config": {"zero_optimization": {"overlap_comm": "yes", "reduce_bucket_size": 1.5}}},
        ["deepspeed.config.zero_optimization.overlap_comm", "deepspeed.config.zero_optimization.reduce_bucket_size"]),
    "offload flag as a string": (
        {"config": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": "true"}}}},
        ["deepspeed.config.zero_optimization.offload_optimizer.pin_memory"]),
    "loss scaling as a string": (
        {"config": {"fp16": {"enabled": True, "initial_scale_power": "16"}}},
        ["deepspeed.config.fp16.initial_scale_power"]),
    "top-level knob of the wrong type": (
        {"config": {"steps_per_print": [10]}},
        ["deepspeed.config.steps_per_print"]),
    "learning rate above the job's bound": (
        {"config": {"optimizer": {"type": "AdamW", "params": {"lr": 5}}}},
        ["deepspeed.config.optimizer.params.lr"]),
    "warmup beyond the step bound": (
        {"config": {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10**20}}}},
        ["deepspeed.config.scheduler.params.warmup_num_steps"]),
    "raw micro x accumulation x processes above the global batch bound": (
        {"num_gpus": 64, "config": {"train_micro_batch_size_per_gpu": 1_000_000, "gradient_accumulation_steps": 1000}},
        ["deepspeed.config.gradient_accumulation_steps"]),
    "several errors at once": (
        {"config": {"wandb": {}, "trian_batch_size": 8, "zero_optimization": {"stage": 5}}},
        ["deepspeed.config.wandb", "deepspeed.config.trian_batch_size", "deepspeed.config.zero_optimization.stage"]),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_config_raises_with_exact_fields(case: str) -> None:
    sections, expected = BAD_CASES[case]
    sections = dict(sections)
    num_gpus = sections.pop("num_gpus", 1)
    config = sections.pop("config", None)
    assert _error_fields(_job(config, num_gpus=num_gpus, **sections)) == expected


def test_every_dangerous_key_is_refused() -> None:
    for key in DANGEROUS_KEYS:
        assert _error_fields(_job({key: {}})) == [f"deepspeed.config.{key}"], key


def test_a_disabled_dangerous_block_is_accepted_and_not_rendered() -> None:
    # "enabled": false does nothing in DeepSpeed; the block's other keys must still be DeepSpeed's.
    for key in DANGEROUS_KEYS:
        assert key not in resolve(_job({key: {"enabled": False}})).deepspeed_config, key
    assert _error_fields(_job({"wandb": {"enabled": False, "projekt": "x"}})) == ["deepspeed.config.wandb.projekt"]


def test_resolve_does_not_modify_the_callers_spec() -> None:
    spec = _job(copy.deepcopy(SEED_CONFIG))
    before = spec.model_dump()
    resolve(spec)
    assert spec.model_dump() == before


# -- rendering: what DeepSpeed gets for each option --


def _render(**deepspeed: Any) -> dict[str, Any]:
    return resolve(_job(deepspeed=deepspeed)).deepspeed_config


def test_stage3_gathers_16bit_weights_on_save() -> None:
    assert _render(zero_stage=3)["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    for stage in (0, 1, 2):
        assert "stage3_gather_16bit_weights_on_model_save" not in _render(zero_stage=stage)["zero_optimization"]


def test_partial_optimizer_offload_reaches_deepspeed_on_stage3() -> None:
    zero = resolve(_job({"zero_optimization": {"stage": 3, "sub_group_size": 500_000_000,
                                               "offload_optimizer": {"device": "cpu", "ratio": 0.6}}})
                   ).deepspeed_config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.6}
    assert zero["sub_group_size"] == 500_000_000


def test_offload_blocks_for_cpu_and_nvme() -> None:
    zero = _render(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    zero = _render(zero_stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/nvme/job-1")[
        "zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme/job-1"}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme/job-1"}
    zero = _render(zero_stage=1)["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero


def test_resolve_writes_the_jobs_nvme_path_into_every_nvme_offload_block() -> None:
    """A raw config's nvme_path becomes deepspeed.nvme_path, and the rendered blocks carry that one folder."""
    resolved = resolve(_job({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme/raw", "buffer_count": 4},
        "offload_param": {"device": "nvme"}}}))
    zero = resolved.deepspeed_config["zero_optimization"]
    assert resolved.spec.deepspeed.nvme_path == "/nvme/raw"
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "buffer_count": 4,
                                         "nvme_path": "/nvme/raw"}
    assert zero["offload_param"]["nvme_path"] == "/nvme/raw"


def test_precision_blocks() -> None:
    fp16 = _render(precision="fp16")
    assert fp16["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                            "hysteresis": 2, "min_loss_scale": 1}
    assert "bf16" not in fp16
    # Loss-scaling settings from a raw config reach the rendered block.
    raw = resolve(_job({"fp16": {"enabled": True, "initial_scale_power": 12}})).deepspeed_config
    assert raw["fp16"]["enabled"] is True and raw["fp16"]["initial_scale_power"] == 12
    assert _render(precision="bf16")["bf16"] == {"enabled": True}
    fp32 = _render(precision="fp32")
    assert "fp16" not in fp32 and "bf16" not in fp32


def test_no_scheduler_block_is_rendered() -> None:
    # The trainer owns the schedule (it spans the steps the data yields), even when a raw config names one.
    assert "scheduler" not in _render()
    raw = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 100}}}
    resolved = resolve(_job(raw))
    assert "scheduler" not in resolved.deepspeed_config
    assert resolved.spec.hyperparameters.lr_schedule == "cosine" and resolved.spec.hyperparameters.warmup_steps == 5
    assert any("total_num_steps" in note for note in resolved.notes)


# -- hostile numbers: every validation step stays cheap and the answer stays right --


def test_divisor_search_matches_brute_force() -> None:
    from contract.deepspeed.batch import _divisors_desc

    for n in [*range(1, 400), 720_720, 999_983, 1_000_000]:
        assert _divisors_desc(n) == [d for d in range(n, 0, -1) if n % d == 0], n


def test_largest_numbers_resolve_in_milliseconds_with_the_right_answer() -> None:
    # A raw train_batch_size of 2e8 once cost seconds (a divisor search linear in the value).
    start = time.perf_counter()
    huge = _error_fields(_job({"train_batch_size": 200_000_000}))
    prime = resolve(_job(hyperparameters={"global_batch_size": 999_983, "seq_len": 8}))
    with pytest.raises(SpecError) as info:
        resolve(_job(hyperparameters={"global_batch_size": MAX_BATCH, "micro_batch_size": 3}))
    widest = resolve(_job(num_gpus=64, hyperparameters={"global_batch_size": 64 * 15_625, "seq_len": 8}))
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"{elapsed:.3f} s"
    assert huge == ["deepspeed.config.train_batch_size"]
    # 999983 is prime: the only micro batch within the 16384-token budget that divides it is 1.
    assert (prime.micro_batch_size, prime.gradient_accumulation_steps) == (1, 999_983)
    message = info.value.errors[0].message
    assert "3 does not divide the per-process batch 1000000" in message
    assert "accepted: 1000000, 500000, 250000, 200000" in message
    # 15625 rows per process = 5**6; the largest divisor within 16384 / 8 = 2048 tokens' worth is 625.
    assert (widest.micro_batch_size, widest.gradient_accumulation_steps) == (625, 25)


def test_raw_batch_fields_above_the_bound_are_refused_with_it() -> None:
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        with pytest.raises(SpecError) as info:
            resolve(_job({key: MAX_BATCH + 1}))
        err = info.value.errors[0]
        assert err.field == f"deepspeed.config.{key}" and f"from 1 to {MAX_BATCH}" in err.message


# -- DeepSpeed's own knowledge: the table, aliases, deprecated names, unrun features, notes --


def test_field_table_matches_the_installed_deepspeed() -> None:
    # The API reads the checked-in table; rebuilding it from DeepSpeed's models must give the same table, so an
    # upgrade of DeepSpeed fails here until `python -m contract.deepspeed.fields_gen` is run and the policies reviewed.
    from contract.deepspeed import fields
    from contract.deepspeed.fields_gen import build, render_table

    assert render_table(build()) == fields.TABLE_PATH.read_text()


def test_every_top_level_key_deepspeed_reads_has_a_policy() -> None:
    from contract.deepspeed import fields, policy

    policies = (set(policy.DANGEROUS_KEYS) | set(policy.UNRUN_TOP) | policy.MERGED_TOP
                | set(policy.PASSTHROUGH_KINDS) | policy.PASSTHROUGH_SECTIONS | set(policy.IGNORED_TOP)
                | set(fields.table()["top_level_aliases"]))
    assert fields.top_level_keys() - policies == set()


def test_the_api_side_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, contract.deepspeed; assert not {'torch', 'deepspeed'} & set(sys.modules), 'imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _notes(config: dict[str, Any], **sections: Any) -> list[str]:
    return resolve(_job(config, **sections)).notes


ACCEPTED_NAMES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # the pasted config -> what the rendered config must hold (one canonical name each)
    "bfloat16 is bf16": ({"bfloat16": {"enabled": True}}, {"bf16": {"enabled": True}}),
    "unprefixed ZeRO-3 names": (
        {"zero_optimization": {"stage": 3, "max_live_parameters": 1e9, "max_reuse_distance": 5e8}},
        {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 5e8}}),
    "deprecated fp16 weights on save": (
        {"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
        {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}),
    "unprefixed 16-bit weights on save": (
        {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}},
        {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}),
    "deprecated cpu_offload": (
        {"zero_optimization": {"stage": 2, "cpu_offload": True}},
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}),
    "zero_force_ds_cpu_optimizer": ({"zero_force_ds_cpu_optimizer": False}, {"zero_force_ds_cpu_optimizer": False}),
    "comments and names DeepSpeed ignores": (
        {"_comment": "from a blog post", "comms_config": {"verbose": False}, "monitor_config": {"enabled": True}},
        {}),
    "disabled monitors": ({"wandb": {"enabled": False}, "tensorboard": {"enabled": False, "output_path": "x"}}, {}),
}


@pytest.mark.parametrize("case", list(ACCEPTED_NAMES))
def test_names_deepspeed_accepts_are_merged_under_one_name(case: str) -> None:
    config, expected = ACCEPTED_NAMES[case]
    cfg = resolve(_job(config)).deepspeed_config
    for key, value in expected.items():
        assert cfg[key] == value, (key, cfg[key])
    for key in ("_comment", "comms_config", "monitor_config", "bfloat16", "wandb", "tensorboard"):
        assert key not in cfg
    zero = cfg["zero_optimization"]
    for alias in ("max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                  "stage3_gather_fp16_weights_on_model_save", "cpu_offload"):
        assert alias not in zero
    _deepspeed_accepts(cfg)


def test_ignored_names_are_said_in_the_notes() -> None:
    notes = _notes({"comms_config": {"verbose": False}, "bfloat16": {"enabled": True}})
    assert any(n.startswith("comms_config is not rendered") for n in notes), notes
    assert any("bfloat16 is DeepSpeed" in n and "rendered as bf16" in n for n in notes), notes


REFUSED_FOR_A_REASON: dict[str, tuple[dict[str, Any], str, str, str]] = {
    # config -> (field, kind, words of the reason)
    "two names of one field": (
        {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True,
                               "stage3_gather_16bit_weights_on_model_save": True}},
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "conflict", "two names of one field"),
    "deprecated name with its replacement": (
        {"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                               "stage3_gather_16bit_weights_on_model_save": True}},
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "conflict", "two names of one field"),
    "fractional min_loss_scale": (
        {"fp16": {"enabled": True, "min_loss_scale": 1e-10}}, "fp16.min_loss_scale", "value", "must be an integer"),
    "compile": ({"compile": {"deepcompile": True}}, "compile", "unrun", "which this service does not run"),
    "tensor parallelism": ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel", "unrun",
                           "tensor parallelism, which this service does not run"),
    "removed by DeepSpeed": ({"elasticity": {"enabled": True}}, "elasticity", "removed", "refuses it"),
    "unknown, with the closest name": ({"gradient_cliping": 1.0}, "gradient_cliping", "unknown",
                                       "did you mean 'gradient_clipping'"),
    "unknown ZeRO key, with the closest name": (
        {"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com", "unknown",
        "did you mean 'overlap_comm'"),
    "Lamb": ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type", "unrun", "does not run"),
}


@pytest.mark.parametrize("case", list(REFUSED_FOR_A_REASON))
def test_refusals_give_the_true_reason(case: str) -> None:
    config, field, kind, words = REFUSED_FOR_A_REASON[case]
    with pytest.raises(SpecError) as info:
        resolve(_job(config))
    (error,) = info.value.errors
    assert (error.field, error.kind) == (f"deepspeed.config.{field}", kind) and words in error.message, error


def test_deepspeed_refuses_what_the_service_refuses_as_deepspeed_would() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    for case in ("two names of one field", "deprecated name with its replacement", "fractional min_loss_scale"):
        config = {"train_batch_size": 1, **REFUSED_FOR_A_REASON[case][0]}
        with pytest.raises(Exception):  # noqa: B017 - DeepSpeed raises pydantic's and its own assertion errors
            DeepSpeedConfig(copy.deepcopy(config))


def test_unset_fields_take_deepspeeds_defaults_and_job_choices_are_noted() -> None:
    # Only a micro batch: DeepSpeed derives the global batch as micro × processes, with no accumulation.
    resolved = resolve(_job({"train_micro_batch_size_per_gpu": 4}, num_gpus=2))
    assert _triple(resolved.deepspeed_config) == (8, 4, 1)
    # No fp16/bf16 block enabled: DeepSpeed trains in fp32, and so does the job.
    assert resolved.spec.deepspeed.precision == "fp32" and "bf16" not in resolved.deepspeed_config
    assert any("neither fp16 nor bf16" in n for n in resolved.notes)
    # No ZeRO block: DeepSpeed's stage 0.
    assert resolved.deepspeed_config["zero_optimization"] == {"stage": 0}
    # The job's own choices for what DeepSpeed would leave to the client: optimizer and schedule.
    assert any(n.startswith("optimizer is unset") for n in resolved.notes)
    assert any(n.startswith("scheduler is unset") for n in resolved.notes)
    # fp16 "auto" takes the job's precision, and says so.
    assert any('fp16.enabled "auto": the job\'s precision bf16' in n for n in _notes({"fp16": {"enabled": "auto"}}))
    # An optimizer block without betas: DeepSpeed's Adam defaults, not the job's.
    hp = resolve(_job({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})).spec.hyperparameters
    assert hp.adam_betas == (0.9, 0.999)
    # The warm-up shape differs from DeepSpeed's WarmupLR: said in one sentence.
    notes = _notes({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    assert any("linear warm-up over 10 steps" in n and "logarithmically" in n for n in notes), notes
    # With a raw config the render adds none of the service's own ZeRO tuning.
    zero = resolve(_job({"zero_optimization": {"stage": 2}})).deepspeed_config["zero_optimization"]
    assert zero == {"stage": 2}


RENDERED_PROBLEMS: list[dict[str, Any]] = [
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
    {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 3, "max_live_parameters": 1, "stage3_max_live_parameters": 1}},
    {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
     "fp16": {"enabled": True}, "bf16": {"enabled": True}},
    {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
    {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 1, "reduce_bucket_size": 0}},
]


@pytest.mark.parametrize("index", range(len(RENDERED_PROBLEMS)))
def test_submit_time_check_refuses_what_deepspeeds_parser_refuses(index: int) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    from contract.deepspeed.fields import check_rendered

    cfg = RENDERED_PROBLEMS[index]
    assert check_rendered(cfg, 1), cfg
    with pytest.raises(Exception):  # noqa: B017 - DeepSpeed's assertion, value and validation errors alike
        DeepSpeedConfig(copy.deepcopy(cfg))
    fixed = {**cfg, "train_batch_size": 4, "zero_optimization": {"stage": 2}}
    fixed.pop("fp16", None)
    assert check_rendered(fixed, 1) == []
    DeepSpeedConfig(copy.deepcopy(fixed))
