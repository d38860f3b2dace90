"""A Hugging Face model folder from a committed checkpoint, for a job that continues from it (`"model":
"job_…@step-N"`, contract/spec.py `checkpoint_ref`).

A checkpoint holds DeepSpeed's training state, not a model folder: the full weights are DeepSpeed's own
reconstruction (`zero_to_fp32`: the fp32 master weights of every ZeRO 1–3 shard), or, with ZeRO stage 0 and no
shards, the module's state dict that the model-states file holds whole. They are written as `model.safetensors`
in the parent's training precision (what its export would hold), one name per tensor where weights are tied (the
first name, the module's own, as `save_pretrained` keeps it; `from_pretrained` ties the others again from the
config), beside the config, tokenizer and generation config the trainer saved in the tag's `hf/` folder
(trainer/checkpoint.py `write_model_files`).

The worker runs it as a process of its own (`python -m worker.from_checkpoint TAG_DIR OUT_DIR`), so the worker
never imports torch and the memory of the conversion is given back when it ends.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from store.checkpoints import HF_FOLDER

WEIGHTS = "model.safetensors"
# What DeepSpeed names the module's state in a tag: one file (ZeRO 0–2), or one per rank (ZeRO-3).
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# torch.compile's wrapper adds this to the names of the modules it wraps.
COMPILED = "_orig_mod."


class NotConvertible(Exception):
    """The tag lacks what a model folder is made of."""


def _precision(ds_config: dict[str, Any]) -> Any:
    import torch

    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    return torch.float32


def _weights(tag_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full weights (by the module's names) and the DeepSpeed config they were trained under."""
    import torch

    states = next((tag_dir / name for name in MODEL_STATES if (tag_dir / name).is_file()), None)
    if states is None:
        raise NotConvertible(f"{tag_dir} holds no DeepSpeed model states ({' or '.join(MODEL_STATES)})")
    # Written by the job's own trainer and checked against the manifest's SHA-256 on the way here; DeepSpeed's
    # own loader reads them the same way.
    model_states = torch.load(states, map_location="cpu", weights_only=False, mmap=True)
    ds_config = model_states.get("ds_config") or {}
    if any(tag_dir.glob("*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        del model_states
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name), ds_config
    return dict(model_states["module"]), ds_config


def _untied(weights: dict[str, Any]) -> dict[str, Any]:
    """One name per tensor: tied weights are one tensor under two names (which safetensors refuses); the first
    name seen, in the module's order, is kept."""
    seen: set[tuple[int, tuple[int, ...], Any]] = set()
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        if tensor.numel():
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if key in seen:
                continue
            seen.add(key)
        out[name.replace(COMPILED, "")] = tensor
    return out


def convert(tag_dir: Path, out_dir: Path) -> list[str]:
    """Write the model folder of the checkpoint in `tag_dir` into `out_dir`; returns its files."""
    from safetensors.torch import save_file

    hf = tag_dir / HF_FOLDER
    if not (hf / "config.json").is_file():
        raise NotConvertible(f"{tag_dir} holds no {HF_FOLDER}/config.json: the checkpoint was saved without its "
                             "model's config and tokenizer")
    weights, ds_config = _weights(tag_dir)
    dtype = _precision(ds_config)
    tensors: dict[str, Any] = {}
    for name, tensor in _untied(weights).items():
        # A copy of its own each: DeepSpeed's weights are views of one flat buffer, which safetensors refuses.
        tensors[name] = tensor.to(dtype=dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
    del weights
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    for f in hf.iterdir():
        if f.is_file():
            shutil.copyfile(f, out_dir / f.name)
    return sorted(p.name for p in out_dir.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Hugging Face model folder from a committed checkpoint's tag")
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        files = convert(args.tag_dir, args.out_dir)
    except NotConvertible as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(" ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
