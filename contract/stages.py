"""Which models `resources.pipeline_stages` > 1 can split, judged from a config.json alone.

Importable without torch: the API refuses an unsplittable local model at submit with the same reason the
trainer would give when it loads the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Decoders whose forward is embed -> identical decoder layers (rotary positions, a causal mask built from the
# position ids) -> final norm -> LM head, with the module names model.embed_tokens / model.layers / model.norm /
# lm_head: the pipeline stages rebuild exactly that forward from the model's own layers (trainer/pipeline.py).
SPLITTABLE = ("llama", "mistral", "qwen2", "qwen3")


def family_problem(config: dict[str, Any], stages: int) -> str | None:
    """Why a model with this config.json cannot run in `stages` pipeline stages, or None."""
    kind = config.get("model_type")
    if kind not in SPLITTABLE:
        return (f"splits only the decoder families {', '.join(SPLITTABLE)} into pipeline stages; this model's "
                f"model_type is {kind!r}; set resources.pipeline_stages to 1")
    layers = config.get("num_hidden_layers")
    # Every stage holds at least one decoder layer; the embedding and the head ride on the first and last.
    if isinstance(layers, int) and layers < stages:
        return (f"{stages} stages need at least {stages} decoder layers, and this model has {layers}; set "
                f"resources.pipeline_stages to at most {layers}")
    return None


def local_family_problem(model_dir: str | Path, stages: int) -> str | None:
    """family_problem for a model directory; None when there is no config.json to read (a hub id is checked
    by the trainer when it loads the model's config)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        # Named relative to the model: a client never sees where the model root is (core/serverpaths.py).
        return f"cannot read the model's config.json to check that it can be split: {exc.strerror or exc}"
    except ValueError as exc:
        return f"cannot read the model's config.json to check that it can be split: {exc}"
    if not isinstance(config, dict):
        return "the model's config.json is not a JSON object"
    return family_problem(config, stages)


def spec_problems(stages: int, world: int, zero_stage: int, lora: bool, on_oom: str,
                  trust_remote_code: bool) -> list[str]:
    """What in a job's own fields rules out `stages` pipeline stages; each message names the field."""
    if stages == 1:
        return []
    field = f"resources.pipeline_stages {stages}"
    problems: list[str] = []
    if zero_stage >= 2:
        # DeepSpeed's pipeline engine asserts this itself; refusing at submit says it before the job queues.
        problems.append(f"{field} needs deepspeed.zero_stage 0 or 1 (got {zero_stage}): ZeRO stages 2 and 3 "
                        "partition gradients and parameters across ranks, which DeepSpeed's pipeline engine does "
                        "not support; set zero_stage to 1 or pipeline_stages to 1")
    if world % stages:
        problems.append(f"{field} must divide the world size resources.num_gpus × resources.num_nodes = {world} "
                        "(world = stages × data-parallel degree)")
    if lora:
        problems.append(f"{field} does not run with lora: the pipeline stages hold the plain model's layers; "
                        "remove lora or set pipeline_stages to 1")
    if on_oom == "adapt":
        problems.append(f'{field} needs resources.on_oom "fail": the on_oom ladder does not adapt a pipeline')
    if trust_remote_code:
        problems.append(f"{field} does not split models with their own code (model.trust_remote_code); only "
                        f"the built-in families {', '.join(SPLITTABLE)} split")
    return problems
