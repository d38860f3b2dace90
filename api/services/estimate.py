"""Will it fit, and how long will it take: a resolved job's memory per GPU and per node, checked against the
node kinds the service knows, with the settings that would make it fit, and a duration where a throughput was
measured. Answers `POST /jobs?dry_run=true`; imports neither torch nor DeepSpeed (the API never does).

The figures are the trainer's measured ones (bench/RESULTS.md, memory sections; trainer/memory.py for the host):
a full fine-tune with `adamw` holds 20 bytes per parameter of state (16-bit weights and gradients, fp32 master
weights, fp32 gradient partition, two fp32 moments: 6.3 B took 128.8 GiB on one H200), `adamw_bf16` 10 (14.1 B
took 136.6 GiB, 15.0 B ran out); ZeRO stage 1 shards the optimizer's share over the ranks, 2 the gradients too,
3 the weights too. The optimizer offloaded to the CPU costs the node 18 bytes per trainable parameter (20 with
ZeRO-3) and leaves the GPU the 16-bit weights and gradients (7.2 B: 21.6 GiB). These are estimates of the
steady state: the trainer's own probe picks the micro batch on the device, and `resources.on_oom: adapt` backs
off if the estimate was short.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from api.services.lengths import Survey
from contract.protocol import NodeState
from contract.spec import ResolvedJob
from core import placement as rule

GiB = 2**30
# CUDA context, NCCL and DeepSpeed's communication buckets: what a rank holds beyond its tensors.
GPU_OVERHEAD_BYTES = 2 * GiB
# A rank's own host memory (Python, torch, the tokenizer, the data): the 7.2 B offload run's process held 4.2 GiB.
HOST_BYTES_PER_RANK = 4 * GiB
# Activation bytes per token and layer per hidden unit, bf16 with FlashAttention (Korthikanti et al.: 34·s·b·h);
# with activation checkpointing a layer keeps only its 16-bit input (2·h per token) and one layer is recomputed.
ACT_BYTES_PER_HIDDEN = 34
CKPT_BYTES_PER_HIDDEN = 2


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    family: str = "llama"  # llama (Llama, Mistral, Qwen2: gated MLP) or gpt2
    positions: int = 0

    def parameters(self) -> int:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        if self.family == "gpt2":
            per_layer = 4 * h * h + 4 * h + 2 * h * self.ffn + self.ffn + h + 4 * h
            return self.vocab * h + self.positions * h + self.layers * per_layer + 2 * h
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * per_layer + h

    def lora_parameters(self, rank: int, targets: list[str] | str) -> int:
        """LoRA's A and B matrices: rank × (in + out) for each targeted linear layer of each block."""
        h, kv, f = self.hidden, self.hidden // self.heads * self.kv_heads, self.ffn
        linears = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, f),
                   "up_proj": (h, f), "down_proj": (f, h)}
        if self.family == "gpt2":
            linears = {"c_attn": (h, 3 * h), "c_proj": (h, h), "c_fc": (h, f), "mlp.c_proj": (f, h)}
        names = list(linears) if targets == "all-linear" else [t for t in targets if t in linears] or list(linears)
        return self.layers * sum(rank * sum(linears[n]) for n in names)


def _llama(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool) -> Shape:
    return Shape(hidden, layers, heads, kv, ffn, vocab, tied)


# Published shapes of models people fine-tune, for hub ids (nothing is downloaded to learn them). Keys are
# lower case without an -instruct/-chat suffix, which does not change the shape.
KNOWN_SHAPES: dict[str, Shape] = {
    "gpt2": Shape(768, 12, 12, 12, 3072, 50257, True, "gpt2", 1024),
    "meta-llama/llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, 128256, True),
    "meta-llama/llama-3.2-3b": _llama(3072, 28, 24, 8, 8192, 128256, True),
    "meta-llama/llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, 128256, False),
    "meta-llama/meta-llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, 128256, False),
    "meta-llama/meta-llama-3-8b": _llama(4096, 32, 32, 8, 14336, 128256, False),
    "meta-llama/llama-3.1-70b": _llama(8192, 80, 64, 8, 28672, 128256, False),
    "meta-llama/llama-3.3-70b": _llama(8192, 80, 64, 8, 28672, 128256, False),
    "mistralai/mistral-7b-v0.1": _llama(4096, 32, 32, 8, 14336, 32000, False),
    "mistralai/mistral-7b-v0.3": _llama(4096, 32, 32, 8, 14336, 32768, False),
    "qwen/qwen2.5-0.5b": _llama(896, 24, 14, 2, 4864, 151936, True),
    "qwen/qwen2.5-1.5b": _llama(1536, 28, 12, 2, 8960, 151936, True),
    "qwen/qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, 152064, False),
    "tinyllama/tinyllama-1.1b-chat-v1.0": _llama(2048, 22, 32, 4, 5632, 32000, False),
}


@dataclass(frozen=True)
class NodeKind:
    name: str
    gpus: int  # 0: a CPU node, whose ranks hold everything in host memory
    gpu_bytes: int  # what torch can allocate on one device
    host_bytes: int  # available host memory of the node
    description: str


NODE_KINDS = (
    # 143,771 MiB per card, 139.8 GiB of it allocatable; the benchmark host had 128 GiB, 123.5 available.
    NodeKind("h200", 1, int(139.8 * GiB), int(123.5 * GiB), "one H200 (141 GB) with 128 GiB of host memory"),
    NodeKind("h200x8", 8, int(139.8 * GiB), 540 * GiB, "eight H200 (141 GB each) with 560 GiB of host memory"),
    # The CPU workers the service runs its own tests on (2 cores, 24 GB).
    NodeKind("cpu", 0, 0, 20 * GiB, "a CPU node with 24 GB of memory"),
)

# Measured real tokens/s per H200 (bench/RESULTS.md): (parameters, LoRA, optimizer offloaded, tokens/s, run).
MEASURED_THROUGHPUT = (
    (124_000_000, False, False, 157_209, "GPT-2 124M, defaults (call 3)"),
    (1_236_000_000, False, False, 68_767, "Llama-3.2-1B shape, defaults, ZeRO-2 (call 14)"),
    (8_030_000_000, False, False, 10_558, "Llama-3.1-8B shape, adamw_bf16, ZeRO-2 (call 16)"),
    (8_030_000_000, False, True, 181, "Llama-3.1-8B shape, ZeRO-3, optimizer on the CPU (call 9)"),
    (13_260_000_000, False, False, 805, "13.3 B, adamw_bf16, ZeRO-3, activation checkpointing, micro 1 (call 17)"),
    (14_140_000_000, False, False, 786, "14.1 B, adamw_bf16, ZeRO-3, activation checkpointing, micro 1 (call 17)"),
)


class Fit(BaseModel):
    kind: str
    description: str
    fits: bool
    reasons: list[str] = Field(description="What does not fit, with both numbers; empty where it fits")


class Suggestion(BaseModel):
    change: str = Field(description="The setting(s) to change, as job fields")
    gpu_bytes_per_device: int
    host_bytes_per_node: int
    fits_on: list[str]


class Estimate(BaseModel):
    parameters: int | None
    trainable_parameters: int | None
    parameters_source: str | None = Field(description="Where the parameter count came from, or null: unknown")
    gpu_bytes_per_device: int | None
    host_bytes_per_node: int | None
    breakdown: dict[str, int] = Field(description="GPU bytes per device by what holds them")
    fits: list[Fit]
    suggestions: list[Suggestion]
    duration_seconds: float | None
    duration_basis: str | None = Field(description="The measured throughput the duration is from, or why none")
    notes: list[str]


class NodeFit(BaseModel):
    node: str
    kind: str
    state: str = Field(description="up, draining, disk_full or lost, as GET /nodes shows it")
    slots_total: int
    slots_free: int
    fits: bool = Field(description="Whether this node could ever run its share: its queue, slots and device memory")
    free_now: bool = Field(description="Whether it has the share's slots free now")
    reasons: list[str] = Field(description="Why it cannot run the share; empty where it can")


class Placement(BaseModel):
    queue: str
    num_nodes: int
    slots_per_node: int
    nodes: list[NodeFit] = Field(description="Every node the cluster knows, live from the nodes table")
    placeable_now: bool = Field(description="Whether enough nodes have the slots free now (the scheduler then "
                                            "still orders the job behind others by priority, owner and age)")
    summary: str


class DryRun(BaseModel):
    dry_run: bool = True
    owner: str
    job: dict[str, Any] = Field(description="The job as a submit would store it: name, queue, request, resolved")
    estimate: Estimate
    placement: Placement = Field(description="The job against the nodes the cluster has now")
    pairs: Survey | None = Field(default=None, description=(
        "A dpo job's training pairs under its seq_len, counted with its tokenizer as the trainer will: kept, cut "
        "and dropped, with tokens per side; null for a supervised job or where the API cannot read the tokenizer"))


def placement(nodes: list[dict[str, Any]], queue: str, num_nodes: int, slots: int,
              gpu_per_device: int | None) -> Placement:
    """The job's share (`slots` devices on each of `num_nodes` nodes) against each node of GET /nodes, by the rule
    the scheduler places by (core/placement.py): a node at its job limit has no slot free now."""
    kinds = {k.name: k for k in NODE_KINDS if k.gpus}
    out, available = [], {}
    for n in nodes:
        reasons = []
        if n["state"] == NodeState.LOST:
            reasons.append("the node stopped heartbeating (lost): it receives nothing")
        reasons += rule.why_never(queues=n["queues"], slots=n["slots_total"], queue=queue, need=slots)
        known = kinds.get(n["kind"])
        if known is not None and gpu_per_device is not None and gpu_per_device > known.gpu_bytes:
            reasons.append(f"GPU memory: needs {gpu_per_device / GiB:.1f} GiB per device, a {n['kind']} has "
                           f"{known.gpu_bytes / GiB:.1f}")
        fits = not reasons
        jobs, jobs_max = len(n.get("jobs") or []), n["jobs_max"]
        available[n["name"]] = rule.free_now(free=n["slots_free"], jobs=jobs, jobs_max=jobs_max)
        out.append(NodeFit(node=n["name"], kind=n["kind"], state=n["state"], slots_total=n["slots_total"],
                           slots_free=n["slots_free"], fits=fits, reasons=reasons,
                           free_now=fits and rule.fits_now(usable=n["state"] == NodeState.UP, free=n["slots_free"],
                                                           jobs=jobs, jobs_max=jobs_max, need=slots)))
    able, free = sum(f.fits for f in out), sum(f.free_now for f in out)
    if able < num_nodes:
        summary = (f"no placement: {able} node(s) of queue {queue!r} can take {slots} slot(s) each, the job needs "
                   f"{num_nodes}; it would wait in queued until such nodes join")
    elif free < num_nodes:
        largest = max((available[f.node] for f in out if f.fits), default=0)
        summary = (f"would wait for {slots} free slot(s) on {num_nodes} node(s) of queue {queue!r}; "
                   f"largest free now: {largest}")
    else:
        summary = f"{free} node(s) of queue {queue!r} have {slots} slot(s) free now"
    return Placement(queue=queue, num_nodes=num_nodes, slots_per_node=slots, nodes=out,
                     placeable_now=free >= num_nodes and able >= num_nodes, summary=summary)


@dataclass(frozen=True)
class Setting:
    """What memory depends on, taken from the resolved job (and changed one field at a time for suggestions)."""

    world: int
    local_ranks: int
    zero_stage: int
    precision: str
    optimizer: str
    offload_optimizer: str
    offload_param: str
    checkpointing: bool
    micro_batch: int
    seq_len: int
    lora_rank: int | None
    lora_targets: list[str] | str
    torch_kernels: bool


def setting_of(resolved: ResolvedJob) -> Setting:
    spec = resolved.spec
    ds, hp, cfg = spec.deepspeed, spec.hyperparameters, resolved.deepspeed_config
    zero = cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", ds.zero_stage))
    precision = "bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp16" if (cfg.get("fp16") or {}).get(
        "enabled") else "fp32"
    offload_opt = ((zero.get("offload_optimizer") or {}).get("device") or ds.offload_optimizer or "none")
    offload_par = ((zero.get("offload_param") or {}).get("device") or ds.offload_param or "none")
    return Setting(world=resolved.world_size, local_ranks=spec.resources.num_gpus, zero_stage=stage,
                   precision=precision, optimizer=hp.optimizer, offload_optimizer=offload_opt,
                   offload_param=offload_par, checkpointing=ds.activation_checkpointing,
                   micro_batch=resolved.micro_batch_size, seq_len=hp.seq_len,
                   lora_rank=spec.lora.rank if spec.lora else None,
                   lora_targets=spec.lora.target_modules if spec.lora else "all-linear",
                   torch_kernels=spec.model.kernels == "torch")


def shape_of(name_or_path: str) -> tuple[Shape | None, str | None]:
    """The model's shape from its config.json where the model is local, else from the known-shapes table."""
    path = Path(name_or_path)
    if path.is_absolute():
        try:
            return shape_from_config(json.loads((path / "config.json").read_text())), f"{path}/config.json"
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None, None
    key = name_or_path.lower()
    for suffix in ("-instruct", "-chat", "-it"):
        key = key.removesuffix(suffix)
    shape = KNOWN_SHAPES.get(key)
    return (shape, f"known shapes: {key}") if shape else (None, None)


def shape_from_config(c: dict[str, Any]) -> Shape:
    if "n_embd" in c:  # GPT-2 and its kind
        h = int(c["n_embd"])
        return Shape(h, int(c["n_layer"]), int(c["n_head"]), int(c["n_head"]), int(c.get("n_inner") or 4 * h),
                     int(c["vocab_size"]), True, "gpt2", int(c.get("n_positions", 1024)))
    heads = int(c["num_attention_heads"])
    return Shape(int(c["hidden_size"]), int(c["num_hidden_layers"]), heads,
                 int(c.get("num_key_value_heads") or heads), int(c["intermediate_size"]), int(c["vocab_size"]),
                 bool(c.get("tie_word_embeddings", False)))


def memory(shape: Shape, s: Setting) -> tuple[dict[str, int], int]:
    """(GPU bytes per device by part, host bytes per node)."""
    n = shape.parameters()
    t = shape.lora_parameters(s.lora_rank, s.lora_targets) if s.lora_rank else n
    half = s.precision in ("bf16", "fp16")
    word = 2 if half else 4
    w = max(1, s.world)
    if s.optimizer == "adamw_bf16":
        state = 6  # bf16 master weights and two bf16 moments
    else:
        state = 16 if half else 8  # fp32 master weights and gradient partition, two fp32 moments (fp32: moments)
    weights = n * word / (w if s.zero_stage == 3 else 1)
    if s.offload_param != "none":
        weights = 0
    grads = t * word / (w if s.zero_stage >= 2 else 1)
    optimizer = 0 if s.offload_optimizer != "none" else t * state / (w if s.zero_stage >= 1 else 1)
    tokens = s.micro_batch * s.seq_len
    per_hidden = CKPT_BYTES_PER_HIDDEN if s.checkpointing else ACT_BYTES_PER_HIDDEN
    act = per_hidden * shape.hidden * shape.layers * tokens * (1 if half else 2)
    if s.checkpointing:
        act += ACT_BYTES_PER_HIDDEN * shape.hidden * tokens * (1 if half else 2)
    if s.torch_kernels or shape.family == "gpt2":
        act += 10 * shape.vocab * tokens  # 16-bit logits, their fp32 copy for the loss, and its gradient
    gpu = {"weights": int(weights), "gradients": int(grads), "optimizer": int(optimizer), "activations": int(act),
           "overhead": GPU_OVERHEAD_BYTES}
    share = s.local_ranks / w  # ZeRO partitions offloaded state over all ranks; a node holds its ranks' share
    host = HOST_BYTES_PER_RANK * s.local_ranks
    if s.offload_optimizer != "none":
        host += t * (16 + (2 if half else 0) + (2 if s.zero_stage == 3 else 0)) * share
    if s.offload_param != "none":
        host += n * word * share
    return gpu, int(host)


def fits(gpu_per_device: int, host_per_node: int, s: Setting) -> list[Fit]:
    out = []
    for kind in NODE_KINDS:
        reasons = []
        if kind.gpus == 0:
            # A CPU node's ranks hold everything a GPU rank would, in host memory.
            need = host_per_node + gpu_per_device * s.local_ranks
            if need > kind.host_bytes:
                reasons.append(f"host memory: needs {need / GiB:.1f} GiB, the node has {kind.host_bytes / GiB:.1f}")
        else:
            if s.local_ranks > kind.gpus:
                reasons.append(f"resources.num_gpus is {s.local_ranks}; the node has {kind.gpus} GPU(s)")
            if gpu_per_device > kind.gpu_bytes:
                reasons.append(f"GPU memory: needs {gpu_per_device / GiB:.1f} GiB per device, the device has "
                               f"{kind.gpu_bytes / GiB:.1f}")
            if host_per_node > kind.host_bytes:
                reasons.append(f"host memory: needs {host_per_node / GiB:.1f} GiB, the node has "
                               f"{kind.host_bytes / GiB:.1f}")
        out.append(Fit(kind=kind.name, description=kind.description, fits=not reasons, reasons=reasons))
    return out


def changes(s: Setting) -> list[tuple[str, Setting]]:
    """Single changes that save memory, in the order worth trying: those that cost no speed first."""
    out: list[tuple[str, Setting]] = []
    if s.zero_stage < 3 and s.world > 1:
        out.append(("deepspeed.zero_stage=3", replace(s, zero_stage=3)))
    if s.optimizer == "adamw" and s.precision == "bf16" and s.offload_optimizer == "none" and s.zero_stage >= 1:
        out.append(('hyperparameters.optimizer="adamw_bf16"', replace(s, optimizer="adamw_bf16")))
    if not s.checkpointing:
        out.append(("deepspeed.activation_checkpointing=true", replace(s, checkpointing=True)))
    if s.micro_batch > 1:
        out.append(("hyperparameters.micro_batch_size=1", replace(s, micro_batch=1)))
    if s.seq_len > 512:
        out.append((f"hyperparameters.seq_len={s.seq_len // 2}", replace(s, seq_len=s.seq_len // 2)))
    if s.offload_optimizer == "none" and s.optimizer == "adamw":
        out.append(('deepspeed.offload_optimizer="cpu"', replace(s, offload_optimizer="cpu")))
    if s.lora_rank is None:
        out.append(("lora={\"rank\": 16}", replace(s, lora_rank=16, lora_targets="all-linear")))
    return out


def suggestions(shape: Shape, s: Setting) -> list[Suggestion]:
    """Each single change that makes the job fit a GPU kind; where none does alone, the changes together."""
    def tried(change: str, setting: Setting) -> Suggestion:
        gpu, host = memory(shape, setting)
        per_device = sum(gpu.values())
        where = [f.kind for f in fits(per_device, host, setting) if f.fits and f.kind != "cpu"]
        return Suggestion(change=change, gpu_bytes_per_device=per_device, host_bytes_per_node=host, fits_on=where)

    single = [tried(c, setting) for c, setting in changes(s)]
    found = [x for x in single if x.fits_on]
    if found:
        return found
    combined, names = s, []
    for change, _ in changes(s):
        if "offload_optimizer" in change and combined.optimizer == "adamw_bf16":
            continue  # DeepSpeed steps offloaded state only with its own CPU Adam
        names.append(change)
        combined = {c: st for c, st in changes(combined)}.get(change, combined)
        attempt = tried(", ".join(names), combined)
        if attempt.fits_on:
            return [attempt]
    return []


def duration(n: int, s: Setting, resolved: ResolvedJob) -> tuple[float | None, str]:
    lora = s.lora_rank is not None
    offload = s.offload_optimizer != "none"
    match = [m for m in MEASURED_THROUGHPUT if abs(m[0] - n) <= 0.05 * m[0] and m[1] == lora and m[2] == offload]
    if not match:
        return None, "no throughput was measured for a model of this size and setting"
    steps = resolved.spec.hyperparameters.max_steps
    if steps is None:
        return None, "the job trains for epochs (no max_steps): its length depends on the data"
    _, _, _, per_gpu, run = match[0]
    tokens = steps * resolved.spec.hyperparameters.global_batch_size * s.seq_len
    return tokens / (per_gpu * max(1, s.world)), (f"{per_gpu:,} tokens/s per H200 measured for {run}, times "
                                                  f"{s.world} ranks; training only")


def estimate(resolved: ResolvedJob) -> Estimate:
    s = setting_of(resolved)
    shape, source = shape_of(resolved.spec.model.name_or_path)
    notes = []
    if shape is None:
        return Estimate(parameters=None, trainable_parameters=None, parameters_source=None, gpu_bytes_per_device=None,
                        host_bytes_per_node=None, breakdown={}, fits=[], suggestions=[], duration_seconds=None,
                        duration_basis=None, notes=["the model's shape is unknown (not a local model with a "
                                                    "config.json, nor a known hub id): no memory estimate"])
    n = shape.parameters()
    trainable = shape.lora_parameters(s.lora_rank, s.lora_targets) if s.lora_rank else n
    gpu, host = memory(shape, s)
    per_device = sum(gpu.values())
    found = fits(per_device, host, s)
    if "nvme" in (s.offload_optimizer, s.offload_param):
        notes.append("NVMe offload: the offloaded state is on disk, counted in neither memory")
    if resolved.micro_batch_auto:
        notes.append(f"micro batch {s.micro_batch} is the API's estimate; on a GPU the trainer measures the largest "
                     "that fits, so activations may grow to fill the device")
    seconds, basis = duration(n, s, resolved)
    return Estimate(parameters=n, trainable_parameters=trainable, parameters_source=source,
                    gpu_bytes_per_device=per_device, host_bytes_per_node=host, breakdown=gpu, fits=found,
                    suggestions=[] if any(f.fits for f in found if f.kind != "cpu") else suggestions(shape, s),
                    duration_seconds=seconds, duration_basis=basis, notes=notes)
