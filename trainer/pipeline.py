"""Pipeline parallelism (`resources.pipeline_stages` > 1): a Hugging Face decoder as DeepSpeed pipeline stages.

The model's own modules are reused as pipeline layers: the embedding, each decoder layer, the final norm and
the LM head. Between stages travel (hidden states, position ids[, attention mask]). The first decoder layer of
each stage builds the micro batch's causal mask(s) and rotary embedding from the position ids with the model's
own functions, as the model's forward does once per forward, and hands them to the stage's other decoder layers
(`Shared`), so a packed row's documents stay apart, the stages compute what the whole model computes, and the
host waits for the device once per micro batch and stage (building a mask reads back whether the rows pack
several documents), not once per layer. The loss of a micro
batch is the summed next-token cross entropy times a scale the trainer chooses, the same objective as
trainer/recipe.py's plain loop. Export maps each stage's layers back to their Hugging Face names.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from safetensors.torch import save_file
from torch import nn

from contract.stages import family_problem
from trainer.data import IGNORE, BatchOrder, Blocks
from trainer.errors import ModelLoadError

Inputs = tuple[Any, ...]  # tensors; inside a stage, a decoder layer's output also carries its Shared
TIED_KEY = "embed"


class EmbedPipe(nn.Module):
    """First layer: token ids -> hidden states; the position ids (and a padding mask) ride along."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, inputs: Inputs) -> Inputs:
        input_ids, *rest = inputs
        return (self.embed_tokens(input_ids), *rest)

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {f"model.embed_tokens.{k}": v for k, v in self.embed_tokens.state_dict().items()}


def _mask_function(config: Any, index: int) -> Callable[..., Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # The same choice each family's own forward makes: Mistral by its sliding_window, Qwen per layer type.
    if config.model_type == "mistral":
        sliding = getattr(config, "sliding_window", None) is not None
    else:
        types = getattr(config, "layer_types", None)
        sliding = bool(types) and types[index] == "sliding_attention"
    return create_sliding_window_causal_mask if sliding else create_causal_mask


class Shared:
    """What every decoder layer needs for one micro batch apart from its own weights: the attention masks (one per
    mask function the stage's layers use) and the rotary embedding, each made once, by the first layer that asks.

    The model's forward builds them once per forward; a layer building its own would wait for the device once per
    layer, since transformers' mask functions read back to the host whether the rows pack several documents. It
    travels inside a stage only: the stage's last decoder layer leaves it out of the tuple sent to the next stage
    (only tensors cross), which builds its own from the position ids that cross.
    """

    def __init__(self, config: Any, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        self.config = config
        self.position_ids = position_ids
        self.attention_mask = attention_mask
        self.masks: dict[Callable[..., Any], Any] = {}
        self.position_embeddings: Any = None

    def mask(self, function: Callable[..., Any], hidden: torch.Tensor) -> Any:
        # The mask depends on `hidden` only through its batch size, length, dtype and device: the same for every
        # decoder layer of the micro batch.
        if function not in self.masks:
            self.masks[function] = function(self.config, hidden, self.attention_mask, None,
                                            position_ids=self.position_ids)
        return self.masks[function]

    def rotary(self, rotary: nn.Module, hidden: torch.Tensor) -> Any:
        if self.position_embeddings is None:
            self.position_embeddings = rotary(hidden, self.position_ids)
        return self.position_embeddings


class DecoderPipe(nn.Module):
    """One decoder layer of the model, with the mask and rotary embedding its model's forward would give it."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # no parameters; its inv_freq buffer is not persistent, so no checkpoint holds it
        self.config = config
        self.index = index
        self.mask_function = _mask_function(config, index)
        # Whether this is its stage's last decoder layer (`build` sets it): that one sends only tensors on. True is
        # always correct, only slower: each layer would then build the masks again.
        self.last_in_stage = True

    def forward(self, inputs: Inputs) -> Inputs:
        hidden, position_ids, *rest = inputs
        shared = rest.pop() if rest and isinstance(rest[-1], Shared) else None
        attention_mask = rest[0] if rest else None
        if shared is None:  # the stage's first decoder layer: a new micro batch
            shared = Shared(self.config, position_ids, attention_mask)
        out = self.layer(hidden, attention_mask=shared.mask(self.mask_function, hidden), position_ids=position_ids,
                         position_embeddings=shared.rotary(self.rotary, hidden), use_cache=False)
        if isinstance(out, tuple):  # older decoder layers return (hidden, ...)
            out = out[0]
        return (out, position_ids, *rest) if self.last_in_stage else (out, position_ids, *rest, shared)

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {f"model.layers.{self.index}.{k}": v for k, v in self.layer.state_dict().items()}


class NormPipe(nn.Module):
    """The final norm; from here on only the hidden states are needed."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, inputs: Inputs | torch.Tensor) -> torch.Tensor:
        hidden = inputs[0] if isinstance(inputs, tuple) else inputs
        return self.norm(hidden)

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {f"model.norm.{k}": v for k, v in self.norm.state_dict().items()}


class HeadPipe(nn.Module):
    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def hf_state(self) -> dict[str, torch.Tensor]:
        return {f"lm_head.{k}": v for k, v in self.lm_head.state_dict().items()}


def _tied_head(embed: EmbedPipe, hidden: torch.Tensor) -> torch.Tensor:
    # The last stage's copy of the embedding, kept equal to the first stage's by DeepSpeed's tied-weight sync.
    return F.linear(hidden, embed.embed_tokens.weight)


class TokenLoss:
    """The pipeline's loss_fn. Labels arrive as (labels, scale, row weights): the returned loss, the one
    backpropagated, is the row-weighted summed cross entropy times `scale`; the unscaled sum is kept for the
    trainer's report (only a last stage computes any)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: Inputs) -> torch.Tensor:
        targets, scale, weights = labels
        shifted = logits[:, :-1, :].float()
        per_token = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), targets[:, 1:].reshape(-1),
                                    ignore_index=IGNORE, reduction="none")
        summed = (per_token.view(targets.shape[0], -1).sum(dim=1) * weights).sum()
        self.total = summed.detach() if self.total is None else self.total + summed.detach()
        return summed * scale

    def take(self) -> float:
        value = 0.0 if self.total is None else float(self.total)
        self.total = None
        return value


def build(model: nn.Module, stages: int, partition: str) -> PipelineModule:
    """The model's modules as `stages` pipeline stages; every rank keeps only the layers of its own stage."""
    config = model.config
    problem = family_problem(config.to_dict(), stages)
    if problem is None and not all(hasattr(model, "model") and hasattr(model.model, n)
                                   for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        problem = f"{type(model).__name__} does not have the modules model.embed_tokens/layers/norm/rotary_emb"
    if problem is None and not hasattr(model, "lm_head"):
        problem = f"{type(model).__name__} has no lm_head"
    if problem:
        raise ModelLoadError(f"resources.pipeline_stages {stages}: cannot split this model: {problem}")
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    first: Any = (TiedLayerSpec(TIED_KEY, EmbedPipe, inner.embed_tokens, tied_weight_attr=["embed_tokens.weight"])
                  if tied else LayerSpec(EmbedPipe, inner.embed_tokens))
    specs: list[Any] = [first]
    specs += [LayerSpec(DecoderPipe, layer, inner.rotary_emb, config, i) for i, layer in enumerate(inner.layers)]
    specs.append(LayerSpec(NormPipe, inner.norm))
    specs.append(TiedLayerSpec(TIED_KEY, EmbedPipe, inner.embed_tokens, forward_fn=_tied_head,
                               tied_weight_attr=["embed_tokens.weight"])
                 if tied else LayerSpec(HeadPipe, model.lm_head))
    pipe = PipelineModule(layers=specs, num_stages=stages, loss_fn=TokenLoss(), partition_method=partition)
    # This stage's decoder layers (a contiguous run) share one Shared per micro batch; the last one ends it.
    decoders = [layer for layer in pipe.forward_funcs if isinstance(layer, DecoderPipe)]
    for layer in decoders[:-1]:
        layer.last_in_stage = False
    # The specs hold the whole model; only this stage's layers are needed from here on (host memory).
    for spec in pipe._layer_specs:
        spec.module_args = ()
    pipe.config = config
    pipe.generation_config = getattr(model, "generation_config", None)
    gc.collect()
    return pipe


def is_pipeline(engine: Any) -> bool:
    return isinstance(getattr(engine, "module", None), PipelineModule)


def micro_batch(batch: dict[str, torch.Tensor], scale: float, weights: torch.Tensor) -> tuple[Inputs, Inputs]:
    inputs = [batch["input_ids"], batch["position_ids"]]
    if "attention_mask" in batch:
        inputs.append(batch["attention_mask"])
    return tuple(inputs), (batch["labels"], torch.tensor(scale, dtype=torch.float32), weights)


def train_step(engine: Any, blocks: Blocks, order: BatchOrder, epoch: int, index: int, scale: float) -> float:
    """One optimizer step through the pipeline: the data-parallel group's micro batches of global batch
    `index` of `epoch`; returns the summed cross entropy this rank computed (0 unless a last stage)."""
    ones = torch.ones(order.micro, dtype=torch.float32)
    rows = order.micro_rows(epoch, index, engine.grid.get_data_parallel_rank())
    batches: Iterator[Any] = iter([micro_batch(blocks.batch(r), scale, ones) for r in rows])
    engine.train_batch(batches)
    return engine.module.loss_fn.take()


def evaluate(engine: Any, blocks: Blocks, micro: int, device: str) -> tuple[float, float]:
    """Token-weighted loss over all validation rows. Every micro batch has `micro` rows (the pipeline's buffers
    have one shape); rows beyond a rank's share repeat row 0 with weight 0."""
    dp_rank, dp = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    rows = list(range(dp_rank, len(blocks), dp))
    n_micro = math.ceil(math.ceil(len(blocks) / dp) / micro)
    batches = []
    for i in range(n_micro):
        chunk = rows[i * micro:(i + 1) * micro]
        weights = torch.tensor([1.0] * len(chunk) + [0.0] * (micro - len(chunk)))
        batches.append(micro_batch(blocks.batch(chunk + [0] * (micro - len(chunk))), 1.0, weights))
    engine.eval_batch(iter(batches), num_micro_batches=n_micro)
    engine.module.train()
    count = float((blocks.labels[:, 1:] != IGNORE).sum())
    total = torch.tensor([engine.module.loss_fn.take()], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    loss = float(total) / max(count, 1.0)
    return loss, math.exp(min(loss, 50.0))


def write_weights(engine: Any, folder: Path) -> None:
    """Collective. Data-parallel rank 0 of each stage writes its layers under their Hugging Face names as one
    safetensors shard; rank 0 writes the index that `from_pretrained` reads. The head of a tied model is the
    embedding's weight, so it is written once, by the first stage."""
    pipe: PipelineModule = engine.module
    stage, stages = engine.grid.get_stage_id(), engine.grid.get_pipe_parallel_world_size()
    shard = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    names: dict[str, int] = {}
    if engine.grid.get_data_parallel_rank() == 0:
        state: dict[str, torch.Tensor] = {}
        for layer in pipe.forward_funcs:
            if isinstance(layer, (EmbedPipe, DecoderPipe, NormPipe, HeadPipe)):
                state.update({k: v.detach().cpu().contiguous() for k, v in layer.hf_state().items()})
        save_file(state, str(folder / shard), metadata={"format": "pt"})
        names = {k: v.numel() * v.element_size() for k, v in state.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (shard, names))
    if dist.get_rank() == 0:
        weight_map = {name: file for file, part in gathered for name in part}
        total = sum(size for _, part in gathered for size in part.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    dist.barrier()


def kernel_plan(plan: Any) -> Any:
    """The kernels of `plan` that work inside pipeline layers: the per-module ones (RMSNorm, rotary, SwiGLU).
    Variable-length attention and the fused linear+loss hook the whole model's forward, which stages do not run."""
    if plan.attention == "stock" and not plan.fused_loss:
        return plan
    note = ("pipeline stages: the model's own attention (its mask keeps packed documents apart) and the stage's "
            "LM head with a separate cross entropy, instead of variable-length attention and the fused loss")
    return replace(plan, attention="stock", fused_loss=False, notes=(*plan.notes, note))
