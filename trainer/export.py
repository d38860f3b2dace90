"""Write the trained model in Hugging Face format and mark the output COMPLETE."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from contract.codes import EventKind
from contract.spec import JobSpec
from trainer.events import emit_rank0
from trainer.fence import Fence

COMPLETE = "COMPLETE"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _gather_stage3_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Full weights on rank 0, one parameter at a time so no rank ever holds two whole copies of the model.

    Collective: every rank walks the same parameters in the same order.
    """
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                state[name] = param.detach().cpu().clone()
    if rank == 0:
        for name, buf in module.named_buffers():
            state.setdefault(name, buf.detach().cpu().clone())
    return state


def _list_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != COMPLETE)


def export(engine: Any, tokenizer: PreTrainedTokenizerBase, spec: JobSpec, model_location: str,
           output_dir: Path, rank: int, step: int, final_loss: float | None, fence: Fence) -> list[str]:
    """Collective: every rank must call it. The files are written into the attempt's staging folder and
    moved to `output_dir` only while the attempt is current, then marked COMPLETE."""
    from trainer import pipeline

    module = engine.module
    pipelined = pipeline.is_pipeline(engine)
    stage3 = spec.deepspeed.zero_stage == 3
    state = _gather_stage3_state_dict(module, rank) if stage3 else None
    staged = fence.staging(output_dir.parent, "output")
    if rank == 0:
        if staged.exists():
            shutil.rmtree(staged)
        staged.mkdir(parents=True)
        if pipelined:
            # The weights come from every stage below; the config says what model they make.
            module.config.save_pretrained(staged)
        else:
            # With LoRA, peft's save_pretrained writes only the adapter (it filters the state dict itself).
            module.save_pretrained(staged, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        gen = getattr(module, "generation_config", None)
        if gen is not None and not (staged / "generation_config.json").exists():
            gen.save_pretrained(staged)
        if spec.lora is not None and spec.lora.merge_on_export:
            _write_merged(spec, model_location, staged, tokenizer)
    _barrier()
    if pipelined:
        pipeline.write_weights(engine, staged)
    files: list[str] = []
    if rank == 0:
        files = _list_files(staged)
        fence.check("its export")
        if output_dir.exists():
            # An earlier attempt's export (or half of one): the marker below vouches for these files only.
            shutil.rmtree(output_dir)
        os.rename(staged, output_dir)
        marker = {"step": step, "files": files, "final_loss": final_loss, "attempt": fence.attempt}
        (output_dir / COMPLETE).write_text(json.dumps(marker))
        emit_rank0(EventKind.COMPLETED, output_dir=str(output_dir), files=files, steps=step, final_loss=final_loss)
    _barrier()
    return files


def _write_merged(spec: JobSpec, model_location: str, output_dir: Path,
                  tokenizer: PreTrainedTokenizerBase) -> None:
    """Base + saved adapter, merged on the host. Works the same for every ZeRO stage because it starts
    from the files just written instead of from the (possibly partitioned) training module."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.modeling import DTYPES

    base = AutoModelForCausalLM.from_pretrained(model_location, revision=spec.model.revision,
                                                trust_remote_code=spec.model.trust_remote_code,
                                                dtype=DTYPES[spec.deepspeed.precision])
    merged = PeftModel.from_pretrained(base, str(output_dir)).merge_and_unload()
    merged_dir = output_dir / "merged"
    merged.save_pretrained(merged_dir, safe_serialization=True)
    tokenizer.save_pretrained(merged_dir)
