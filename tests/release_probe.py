"""One DeepSpeed engine in one process (world size 1, CPU): take two steps, release the optimizer's state
and print what is left, as JSON. Run by tests/test_memory.py in a subprocess so the process group stays
out of pytest."""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.memory import release_optimizer_state
from trainer.recipe import _skip_shared_memory_collectives


def full_weights(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """The module's whole weights (ZeRO-3 gathers its partitions), as the export reads them."""
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            out[name] = p.detach().clone()
    return out


def main(stage: int, offload: str, precision: str, ratio: float) -> None:
    _skip_shared_memory_collectives()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = {"type": "AdamW", "params": {"lr": 1e-2}}
    if offload == "none":
        optimizer["params"]["torch_adam"] = True
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "optimizer": optimizer,
           "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": offload, "ratio": ratio},
                                                     "sub_group_size": 4096} if offload != "none" else {})},
           "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    before = full_weights(engine)
    released = release_optimizer_state(engine)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    backup = getattr(engine.optimizer, "backup_optimizer", None)
    after = dict(engine.module.named_parameters())
    weights = full_weights(engine)
    print(json.dumps({
        "n_params": n_params, "released": released,
        "inner_state_entries": len(inner.state) + (len(backup.state) if backup else 0),
        "inner_param_numel": sum(p.numel() for g in inner.param_groups for p in g["params"]
                                 if all(p is not q for q in after.values()))
        + sum(p.numel() for p in getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])),
        "module_unchanged": all(torch.equal(before[n], weights[n]) for n in before),
        "module_numel": sum(w.numel() for w in weights.values())}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]))
