"""Where NVMe offload writes its swap files: a folder per attempt under the job's `nvme_path`.

DeepSpeed names its swap files by rank and parameter id only, so two jobs given the same `nvme_path` would
overwrite each other's state, and the files (about 12 bytes per parameter for the optimizer) stay on the
disk after the run. Each attempt gets its own folder, and it is removed when the attempt ends: by the
trainer after a completed export, and by the worker after any ending, including a killed one.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from contract.spec import RunSpec

OFFLOAD_BLOCKS = ("offload_optimizer", "offload_param")


def swap_folder(nvme_path: str, job_dir: str, attempt: int) -> Path:
    return Path(nvme_path) / f"{Path(job_dir).name}-attempt-{attempt}"


def uses_nvme(ds_config: dict[str, Any]) -> bool:
    zero = ds_config.get("zero_optimization", {})
    return any(zero.get(k, {}).get("device") == "nvme" for k in OFFLOAD_BLOCKS)


def point_at(ds_config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The config with every NVMe offload block writing into `folder`."""
    cfg = copy.deepcopy(ds_config)
    for key in OFFLOAD_BLOCKS:
        block = cfg.get("zero_optimization", {}).get(key)
        if block and block.get("device") == "nvme":
            block["nvme_path"] = str(folder)
    return cfg


def remove(folder: Path) -> bool:
    """Delete an attempt's swap folder; True if there was one."""
    if not folder.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def attempt_folder(run_spec: RunSpec) -> Path | None:
    """The swap folder of a run spec, or None without NVMe offload."""
    nvme_path = run_spec.job.spec.deepspeed.nvme_path
    if not nvme_path or not uses_nvme(run_spec.job.deepspeed_config):
        return None
    return swap_folder(nvme_path, run_spec.paths.job_dir, run_spec.attempt)
