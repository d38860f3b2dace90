"""Load the tokenizer and model a job names (hub id or local directory), and apply LoRA if asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from contract.spec import JobSpec, RunPaths
from trainer.errors import ModelLoadError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model_location(spec: JobSpec, paths: RunPaths) -> str:
    """A relative path that exists under the model root is a local model; anything else is a hub id."""
    name = spec.model.name_or_path
    if paths.model_root and not Path(name).is_absolute():
        candidate = Path(paths.model_root) / name
        if candidate.exists():
            return str(candidate)
    return name


def load_tokenizer(spec: JobSpec, location: str) -> PreTrainedTokenizerBase:
    try:
        tok = AutoTokenizer.from_pretrained(location, revision=spec.model.revision,
                                            trust_remote_code=spec.model.trust_remote_code)
    except Exception as exc:  # any failure here means the model is unusable
        raise ModelLoadError(f"cannot load tokenizer from {location!r}: {exc}") from exc
    if tok.pad_token is None:
        # Padding only ever sits under label -100 / attention 0, so reusing eos is safe.
        if tok.eos_token is None:
            raise ModelLoadError(f"tokenizer of {location!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: JobSpec, location: str, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    # Loading in the training precision halves host memory for bf16 jobs; DeepSpeed keeps fp32 masters anyway.
    dtype = DTYPES[spec.deepspeed.precision]
    m = spec.model
    attn = "sdpa" if m.attn_implementation == "auto" else m.attn_implementation
    try:
        if m.init == "random":
            config = AutoConfig.from_pretrained(location, revision=m.revision, trust_remote_code=m.trust_remote_code)
            # Initialised on the GPU when there is one: random init of billions of weights on the host is slow.
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                         trust_remote_code=m.trust_remote_code)
        else:
            # safetensors only: pickled weight files from elsewhere could run code when loaded.
            model = AutoModelForCausalLM.from_pretrained(
                location, revision=m.revision, trust_remote_code=m.trust_remote_code, dtype=dtype,
                attn_implementation=attn, use_safetensors=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {location!r}: {exc}") from exc
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    # The KV cache is useless in training and wastes memory.
    model.config.use_cache = False
    if spec.deepspeed.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora is not None:
        model = apply_lora(spec, model)
    return model


def apply_lora(spec: JobSpec, model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = spec.lora
    assert lora is not None
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise ModelLoadError(f"cannot apply LoRA (target_modules={lora.target_modules!r}): {exc}") from exc
