"""The DeepSpeed config one try of an attempt hands to DeepSpeed.

contract/deepspeed renders the job's config; this attempt then changes what only it can know, all here: where
NVMe offload swaps (trainer/swap.py), torch Adam where FusedAdam cannot run, the micro batch and accumulation
that the probe or the on_oom ladder chose, the ladder's optimizer offload, and whether a checkpoint of another
world size loads through DeepSpeed's universal format (trainer/elastic.py). Rank 0 writes the result to
`attempts/N/ds_config.json` in the job's folder, beside the worker's `spec.json`, so an operator can read what
DeepSpeed got.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from contract.spec import RunSpec
from trainer import elastic, swap
from trainer.oom import MemorySetting

FILE_NAME = "ds_config.json"


def for_try(run: RunSpec, setting: MemorySetting, *, swap_folder: Path | None, committed: list[Path], world: int,
            device_name: str) -> tuple[dict[str, Any], list[str]]:
    """The rendered config with every change of this try, plus what had to change for this machine (reported
    in `started`)."""
    cfg = copy.deepcopy(run.job.deepspeed_config)
    adjustments: list[str] = []
    if swap_folder is not None:
        cfg = swap.point_at(cfg, swap_folder)
        adjustments.append(f"NVMe swap files in {swap_folder}, removed when the attempt ends")
    zero_cfg = cfg.setdefault("zero_optimization", {})
    offload = zero_cfg.get("offload_optimizer", {}).get("device", "none")
    if device_name != "cuda" and offload == "none" and "optimizer" in cfg:
        # FusedAdam is CUDA-only; the offload path already uses DeepSpeed's CPU Adam.
        cfg["optimizer"].setdefault("params", {})["torch_adam"] = True
        adjustments.append(f"optimizer.params.torch_adam=true: FusedAdam needs CUDA, this accelerator is "
                           f"{device_name}")
    cfg["train_micro_batch_size_per_gpu"] = setting.micro_batch_size
    cfg["gradient_accumulation_steps"] = setting.gradient_accumulation_steps
    if setting.offload_optimizer != "none" and "offload_optimizer" not in zero_cfg:
        # The ladder's last rung; DeepSpeed's CPU Adam steps the offloaded state (torch_adam would replace it).
        zero_cfg["offload_optimizer"] = {"device": setting.offload_optimizer, "pin_memory": True}
        cfg.get("optimizer", {}).get("params", {}).pop("torch_adam", None)
        adjustments.append("optimizer offloaded to the CPU by the on_oom ladder")
    # The engine reads `checkpoint.load_universal` when it is built.
    elastic.configure(cfg, committed, world)
    return cfg, adjustments


def path(job_dir: Path, attempt: int) -> Path:
    return job_dir / "attempts" / str(attempt) / FILE_NAME


def write(cfg: dict[str, Any], job_dir: Path, attempt: int) -> Path:
    """Record the config DeepSpeed gets (rank 0 only: every rank holds the same one). A later try of the
    on_oom ladder overwrites it: the file is what the engine that ran last was built from."""
    target = path(job_dir, attempt)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tmp.replace(target)
    return target
