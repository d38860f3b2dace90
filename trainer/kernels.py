"""Kernels chosen per device for the training step, and the loss call that feeds them.

On CUDA, for Llama-family models (full fine-tunes):
- attention over packed documents runs FlashAttention's variable-length kernel (torch.nn.attention.varlen),
  one causal segment per document, instead of sdpa with a dense block-diagonal mask, which computes every
  query against every key of its row and masks most of the result away;
- RMSNorm, rotary embedding and SwiGLU run Liger's fused Triton kernels, and the LM head is fused with the
  cross entropy (Liger's linear+cross-entropy), so the vocabulary-wide logits never exist in memory;
- a preference (dpo) job, on any device, applies the LM head to the answer tokens alone, fused with their
  log-probabilities chunk by chunk (trainer/preference.py's `head_logps`), for the same reason;
- where liger-kernel is not installed (or `model.kernels` is "torch"), the same three elementwise pieces are
  compiled with torch.compile as small functions of tensors, called from inside the modules: DeepSpeed's
  ZeRO-3 hooks, which sit on every submodule's call, then stay outside every compiled graph.
A CPU node needs none of this: every import of a new kernel is guarded, and the plan there is the stock model.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

from contract.codes import Method
from contract.spec import ResolvedJob
from trainer.data import IGNORE
from trainer.preference import head_logps, scored_positions, sequence_logps, sum_by_sequence

# Model types whose modules have the Llama layout the patches below rely on: RMSNorm with `variance_epsilon`,
# an MLP of gate/up/down projections, and a module-level `apply_rotary_pos_emb(q, k, cos, sin)`.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})
# The name the attention function is registered under in transformers' AttentionInterface. It must not
# contain "flash": transformers treats such names as requests for its own flash-attn integration.
VARLEN_ATTENTION = "ft_varlen"
PLAN_ATTR = "_ft_kernel_plan"
HEAD_ATTR = "_ft_head_routed"  # on the causal LM whose forward and head `_patch_head` routed


@dataclass(frozen=True)
class KernelPlan:
    """What one process runs. `notes` go into the `started` event's adjustments."""

    attention: str = "stock"  # "varlen": FlashAttention over each packed document
    elementwise: str = "stock"  # "liger" | "compiled" | "stock": RMSNorm, rotary, SwiGLU
    fused_loss: bool = False  # Liger's linear+cross-entropy
    compile_blocks: bool = False  # torch.compile whole blocks (models outside the Llama family)
    notes: tuple[str, ...] = field(default=())


STOCK = KernelPlan()


@functools.cache
def liger() -> tuple[Any, str]:
    """(liger's functional modules, version) or (None, why not). Imported only when a plan asks for it."""
    try:
        from importlib.metadata import version

        import liger_kernel.transformers.functional as functional
        import liger_kernel.transformers.rope as rope
    except Exception as exc:  # ImportError, or a Triton too old or missing for liger's kernels
        return None, f"{type(exc).__name__}: {exc}"
    return (functional, rope), version("liger-kernel")


@functools.cache
def varlen_call() -> tuple[Callable[..., torch.Tensor] | None, dict[str, Any], str]:
    """torch's FlashAttention variable-length entry point and the causal keyword its version takes."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return None, {}, f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"
    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 took is_causal=True; later versions express causality as the window (-1, 0).
    causal: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        causal["enable_gqa"] = True
    return varlen_attn, causal, ""


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _window_inactive(config: Any, seq_len: int) -> bool:
    """Mistral and Qwen2 configs may carry a sliding window; it changes nothing when no row is longer."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or window is None:
        return True
    return int(window) >= seq_len


def choose(job: ResolvedJob, on_gpu: bool, model: torch.nn.Module) -> KernelPlan:
    """The plan for this process's device; a CPU node gets the stock model (and block compilation only
    where the job asks for it explicitly)."""
    spec = job.spec
    config = getattr(_causal_lm(model), "config", None)
    family = getattr(config, "model_type", None) in LLAMA_FAMILY and spec.lora is None
    mode = spec.deepspeed.compile
    # Today's measured default: compile on CUDA, never with LoRA's wrapped modules.
    want_compile = mode == "on" or (mode == "auto" and on_gpu and spec.lora is None)
    notes: list[str] = []
    preference = spec.method.type == Method.DPO
    if preference:
        notes.append("loss: the LM head applied to the answer tokens alone, fused with their log-probabilities "
                     "chunk by chunk (the vocabulary-wide logits are never materialised)")
    if spec.lora is not None and on_gpu:
        notes.append("kernels: stock modules with LoRA (the fused kernels are measured on full fine-tunes only)")

    attention = "stock"
    if spec.model.attn_implementation == "auto" and on_gpu and family:
        fn, _, why = varlen_call()
        capable = torch.cuda.get_device_capability()[0] >= 8
        if (fn is not None and capable and spec.deepspeed.precision in ("bf16", "fp16")
                and _window_inactive(config, spec.hyperparameters.seq_len)
                and not getattr(config, "attention_dropout", 0.0)):
            attention = "varlen"
            notes.append("attention: FlashAttention variable-length kernel, one causal segment per packed "
                         "document (torch.nn.attention.varlen)")
        else:
            notes.append("attention: sdpa (" + (why or "FlashAttention varlen needs CUDA capability 8.0+, "
                                                "bf16 or fp16, no sliding window and no attention dropout") + ")")

    elementwise, fused_loss = "stock", False
    if family and on_gpu and spec.model.kernels == "auto":
        mods, detail = liger()
        if mods is not None:
            elementwise = "liger"
            fused_loss = not preference
            notes.append(f"kernels: Liger {detail} fused RMSNorm, rotary, SwiGLU"
                         + ("" if preference else " and linear+cross-entropy (the vocabulary-wide logits are never "
                                                  "materialised)"))
        else:
            notes.append(f"kernels: liger-kernel unavailable ({detail}); install the `gpu` extra")
    if elementwise == "stock" and family and want_compile:
        elementwise = "compiled"
    compile_blocks = (not family and want_compile
                      and (spec.deepspeed.zero_stage < 3 or mode == "on"))
    if not family and want_compile and not compile_blocks:
        notes.append("torch.compile off: whole-block compilation would trace DeepSpeed's ZeRO-3 module hooks")
    return KernelPlan(attention=attention, elementwise=elementwise, fused_loss=fused_loss,
                      compile_blocks=compile_blocks, notes=tuple(notes))


# --- attention -------------------------------------------------------------------------------------------

def segments(position_ids: torch.Tensor | None, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """Cumulative document offsets over the flattened (rows × seq) batch, int32, and the longest document.

    A document starts at every row start and wherever a position does not continue the previous token's
    (positions restart at 0 per packed document; the packer's padding continues the last one, so it stays in
    that document's segment, after its real tokens, where causal attention hides it). Host tensors in, so
    the device never waits for this."""
    rows, seq = shape
    if position_ids is None:
        return torch.arange(0, rows * seq + 1, seq, dtype=torch.int32), seq
    pos = position_ids.reshape(-1)
    start = torch.ones(pos.numel(), dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    start[::seq] = True
    offsets = torch.cat([start.nonzero().flatten(), torch.tensor([pos.numel()])]).to(torch.int32)
    return offsets, int((offsets[1:] - offsets[:-1]).max())


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, longest: int,
                  scale: float | None) -> torch.Tensor:
    fn, causal, why = varlen_call()
    if fn is None:
        raise RuntimeError(why)
    # Versions without `enable_gqa` hand fewer KV heads to FlashAttention as they are: it shares each KV
    # head among its query heads itself.
    kwargs = dict(causal)
    if scale is not None:
        kwargs["scale"] = scale
    return fn(q, k, v, offsets, offsets, longest, longest, **kwargs)


def _segmentwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
    """The same function one document at a time through sdpa: devices without FlashAttention's kernel."""
    bounds = offsets.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        parts.append(o.transpose(0, 1))
    return torch.cat(parts)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             ft_segments: tuple[torch.Tensor, int] | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, Hq, S, D), key and value (B, Hkv, S, D) in; (B, S, Hq, D)
    out. Documents come from `ft_segments` (see `segments`); without them every row is one document."""
    if dropout:
        raise ValueError("the varlen attention path runs without attention dropout")
    b, hq, s, d = query.shape
    # (B, H, S, D) views of (B, S, H, D) projections: flattening them to (tokens, H, D) is free.
    q = query.transpose(1, 2).reshape(b * s, hq, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
    if ft_segments is None:
        ft_segments = (torch.arange(0, b * s + 1, s, dtype=torch.int32, device=q.device), s)
    offsets, longest = ft_segments
    if q.is_cuda:
        out = _flash_varlen(q, k, v, offsets, longest, scaling)
    else:
        out = _segmentwise(q, k, v, offsets, scaling)
    return out.view(b, s, hq, d), None


def _use_varlen_attention(model: torch.nn.Module) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    # No mask function is registered under this name on purpose: transformers then builds no mask at all
    # (the block-diagonal mask of packed rows is what the segments replace).
    _causal_lm(model).set_attn_implementation(VARLEN_ATTENTION)


# --- elementwise: RMSNorm, rotary, SwiGLU ----------------------------------------------------------------

# The modeling module's own rotary function, per module, so a patch can be undone (tests share a process).
_ORIGINAL_ROPE: dict[str, Callable[..., Any]] = {}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Llama's RMSNorm: statistics in fp32, the scale applied in the input's dtype.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")]


def _mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    config = getattr(_causal_lm(model), "config", None)
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return []
    return [m for m in model.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))]


def _modeling_module(model: torch.nn.Module) -> Any:
    return sys.modules[type(_causal_lm(model)).__module__]


def _patch_elementwise(model: torch.nn.Module, rms: Callable[..., torch.Tensor],
                       silu_mul: Callable[..., torch.Tensor], rope: Callable[..., Any]) -> int:
    def norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.variance_epsilon)

    def mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    norms, mlps = _norms(model), _mlps(model)
    for m in norms:
        m.forward = MethodType(norm_forward, m)
    for m in mlps:
        m.forward = MethodType(mlp_forward, m)
    modeling = _modeling_module(model)
    _ORIGINAL_ROPE.setdefault(modeling.__name__, modeling.apply_rotary_pos_emb)
    # Module-level, as the attention modules look it up at call time; this process trains one model.
    modeling.apply_rotary_pos_emb = rope
    return len(norms) + len(mlps)


def restore_rotary() -> None:
    """Put every patched modeling module's own rotary function back (for processes that build more models)."""
    for name, fn in _ORIGINAL_ROPE.items():
        sys.modules[name].apply_rotary_pos_emb = fn
    _ORIGINAL_ROPE.clear()


def _liger_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    functional = liger()[0][0]
    return functional.liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=True)


def _liger_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return liger()[0][0].liger_swiglu(gate, up)


def _liger_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return liger()[0][1].liger_rotary_pos_emb(q, k, cos, sin)


# --- the loss --------------------------------------------------------------------------------------------

def _head_forward(self: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor | None = None, *,
                  logps: bool = False) -> torch.Tensor:
    """The LM head's own call, so ZeRO-3 gathers its weight around it. With targets: the summed cross entropy
    computed chunk by chunk without the logits (Liger's, where the plan fuses the loss), or with `logps` each row's
    log-probability of its target (trainer/preference.py's fused head)."""
    if targets is None:
        return F.linear(hidden, self.weight, self.bias)
    if logps:
        return head_logps(hidden, self.weight, self.bias, targets)
    functional = liger()[0][0]
    # fp32 accumulation of the head's gradient across chunks: the vocabulary is summed over thousands of tokens.
    return functional.liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), self.weight, targets.reshape(-1), bias=self.bias,
        ignore_index=IGNORE, reduction="sum", accum_dtype=torch.float32)


def _loss_forward(self: torch.nn.Module, *args: Any, ft_targets: torch.Tensor | None = None,
                  ft_scored: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> Any:
    """The causal LM's forward. Given `ft_targets` (labels already shifted left by one): the summed loss. Given
    `ft_scored` (flat positions and the token each predicts): those positions' log-probabilities, the head applied
    to them alone."""
    if ft_targets is None and ft_scored is None:
        return type(self).forward(self, *args, **kwargs)
    body = getattr(self, self.base_model_prefix)
    hidden = body(*args, **kwargs).last_hidden_state
    head = self.get_output_embeddings()
    if ft_scored is None:
        return head(hidden, ft_targets)
    index, targets = ft_scored
    return head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, index), targets, logps=True)


def _patch_head(model: torch.nn.Module) -> bool:
    """Route the causal LM's forward and its head through the functions above (each falls back to the stock
    call); False where the head is not a plain linear layer (a LoRA-wrapped head, say), which keeps the stock
    forward."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    prefix = getattr(lm, "base_model_prefix", None)
    if type(head) is not torch.nn.Linear or not prefix or not hasattr(lm, prefix):
        return False
    if not getattr(lm, HEAD_ATTR, False):
        head.forward = MethodType(_head_forward, head)
        lm.forward = MethodType(_loss_forward, lm)
        setattr(lm, HEAD_ATTR, True)
    return True


MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


def _model_inputs(plan: KernelPlan, batch: dict[str, torch.Tensor],
                  device: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What the model's forward takes of a host batch, on the device, and the varlen plan's document offsets."""
    extra: dict[str, Any] = {}
    names = [k for k in MODEL_INPUTS if k in batch]
    if plan.attention == "varlen":
        # Padding sits after the real tokens of its row or document, and causal attention already hides it.
        names = [k for k in names if k != "attention_mask"]
        pos = batch.get("position_ids")
        offsets, longest = segments(None if pos is None else pos.cpu(), tuple(batch["input_ids"].shape))
        extra["ft_segments"] = (offsets.to(device, non_blocking=True), longest)
    return {k: batch[k].to(device, non_blocking=True) for k in names}, extra


def label_logps(engine: Any, batch: dict[str, torch.Tensor], device: str, segment_ids: torch.Tensor | None,
                num_segments: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of a host batch: the summed log-probability of its labelled tokens and their count (the
    contract of trainer/preference.py's `sequence_logps`), through the attention this process chose. The LM head
    runs on the scored positions alone, chunk by chunk (`preference.head_logps`); a model whose head could not be
    routed so takes the stock logits of every position."""
    model = getattr(engine, "module", engine)
    plan: KernelPlan = getattr(model, PLAN_ATTR, STOCK)
    scored = scored_positions(batch["labels"], segment_ids, num_segments=num_segments).to(device)
    inputs, extra = _model_inputs(plan, batch, device)
    if getattr(_causal_lm(model), HEAD_ATTR, False):
        per_token = engine(**inputs, ft_scored=(scored.index, scored.targets), use_cache=False, **extra)
        return sum_by_sequence(per_token, scored)
    logits = engine(**inputs, use_cache=False, **extra).logits
    return sequence_logps(logits, batch["labels"].to(device, non_blocking=True),
                          None if segment_ids is None else segment_ids.to(device, non_blocking=True),
                          num_segments=num_segments)


def token_loss_sum(engine: Any, batch: dict[str, torch.Tensor], device: str) -> torch.Tensor:
    """Summed next-token cross entropy over labelled tokens (the caller divides by the global count).

    `batch` holds host tensors (a probe's may already be on the device); document offsets are read from its
    position ids before anything moves."""
    plan: KernelPlan = getattr(getattr(engine, "module", engine), PLAN_ATTR, STOCK)
    labels = batch.pop("labels")
    inputs, extra = _model_inputs(plan, batch, device)
    if plan.fused_loss:
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)
        return engine(**inputs, ft_targets=targets.to(device, non_blocking=True), use_cache=False, **extra)
    out = engine(**inputs, use_cache=False, **extra)
    logits = out.logits[:, :-1, :]
    targets = labels[:, 1:].to(device, non_blocking=True)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


# --- applying a plan -------------------------------------------------------------------------------------

def apply(model: torch.nn.Module, plan: KernelPlan) -> list[str]:
    """What changes the model's memory use: attention, Liger's kernels and the fused loss. Before the micro
    batch probe, so the probe measures what training will run."""
    setattr(model, PLAN_ATTR, plan)
    if plan.attention == "varlen":
        _use_varlen_attention(model)
    if plan.elementwise == "liger":
        _patch_elementwise(model, _liger_rms, _liger_silu_mul, _liger_rope)
    _patch_head(model)
    return list(plan.notes)


def compile_for(model: torch.nn.Module, plan: KernelPlan, backend: str = "inductor") -> list[str]:
    """torch.compile where the plan says, after the probe (which then runs eagerly, a conservative peak)."""
    if plan.elementwise == "compiled":
        # Small functions of tensors: the same code for every layer, so one graph per input shape and grad
        # mode; the micro batch may become a dynamic dimension after the probe's sizes.
        compiled = functools.partial(torch.compile, backend=backend, dynamic=None)
        modeling = _modeling_module(model)
        rope = compiled(_ORIGINAL_ROPE.get(modeling.__name__, modeling.apply_rotary_pos_emb))
        n = _patch_elementwise(model, compiled(_rms), compiled(_silu_mul), rope)
        return [f"torch.compile on RMSNorm, rotary and SwiGLU ({n} modules) as tensor functions, outside "
                "DeepSpeed's module hooks"]
    if plan.compile_blocks:
        from trainer.tuning import compile_blocks

        return [f"torch.compile on {compile_blocks(model)} transformer blocks"]
    return []
