"""Times the pieces the kernel plan replaces, at the Llama-3.2-1B benchmark shape, on packed benchmark rows.

Attention (one layer, forward + backward; 32 query heads, 8 KV heads, head dim 64, seq 2048):
  varlen       FlashAttention's variable-length kernel, one causal segment per document (the plan)
  sdpa_mask    sdpa with the dense block-diagonal causal mask transformers builds from packed position ids
  sdpa_causal  sdpa causal over whole rows, documents attending to each other (the HF Trainer reference)
Loss (LM head + cross entropy over 128,256 tokens of vocabulary, forward + backward):
  torch        bf16 logits, upcast to fp32, F.cross_entropy (the stock loss)
  liger_flce   Liger's fused linear+cross-entropy (the plan)

  python3 -m bench.kernel_bench --micro 16
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from bench.synthetic import line_lengths
from trainer import kernels


def packed_positions(rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Position ids of rows packed from the benchmark's document lengths, as trainer.data packs them."""
    lens = [int(n) + 1 for n in line_lengths(rows * seq, seed) if n > 0]  # +1: each document ends with eos
    pos: list[int] = []
    for n in lens:
        while n and len(pos) < rows * seq:
            take = min(seq - len(pos) % seq, n)
            pos += list(range(take))
            n -= take
        if len(pos) >= rows * seq:
            break
    return torch.tensor(pos[: rows * seq]).view(rows, seq)


def timed(fn: Callable[[], None], reps: int = 10) -> float:
    """Median milliseconds of `fn` on the device, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def attention(rows: int, seq: int) -> dict[str, float]:
    hq, hkv, d = 32, 8, 64
    pos = packed_positions(rows, seq)
    offsets, longest = kernels.segments(pos, (rows, seq))
    n_docs = offsets.numel() - 1
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, seq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(rows, seq, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(rows, seq, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(rows, seq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    dev_offsets = offsets.cuda()

    def varlen() -> None:
        out = kernels._flash_varlen(q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d), dev_offsets,
                                    longest, d ** -0.5)
        out.backward(grad.view(-1, hq, d))

    doc = torch.zeros_like(pos)
    doc.view(-1)[offsets[1:-1].long()] = 1
    doc = doc.cumsum(-1).cuda()
    causal = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal  # (rows, seq, seq), True = attend

    def sdpa(attn_mask: torch.Tensor | None) -> Callable[[], None]:
        # As transformers calls it: with a mask, KV heads repeated to the query heads; without, enable_gqa.
        def run() -> None:
            key, value = k.transpose(1, 2), v.transpose(1, 2)
            if attn_mask is not None:
                key, value = key.repeat_interleave(hq // hkv, 1), value.repeat_interleave(hq // hkv, 1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), key, value, attn_mask=attn_mask,
                                                 is_causal=attn_mask is None, enable_gqa=attn_mask is None)
            out.transpose(1, 2).backward(grad)
        return run

    out = {"docs": n_docs, "longest": longest, "varlen_ms": timed(varlen),
           "sdpa_mask_ms": timed(sdpa(mask[:, None])), "sdpa_causal_ms": timed(sdpa(None))}
    # Useful work of the varlen kernel: causal attention within each document only.
    lengths = (offsets[1:] - offsets[:-1]).double()
    out["varlen_TFLOPs"] = float(3.5 * 2 * 2 * hq * d * (lengths * (lengths + 1) / 2).sum()) / out["varlen_ms"] / 1e9
    return out


def loss(tokens: int, hidden: int = 2048, vocab: int = 128256) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    functional = kernels.liger()[0][0]

    def stock() -> None:
        logits = x @ w.t()
        F.cross_entropy(logits.float(), y, reduction="sum").backward()

    def fused() -> None:
        functional.liger_fused_linear_cross_entropy(x, w, y, reduction="sum", accum_dtype=torch.float32).backward()

    out: dict[str, float] = {}
    for name, fn in (("torch", stock), ("liger_flce", fused)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out[f"{name}_ms"] = timed(fn)
        out[f"{name}_peak_extra_GiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        x.grad = w.grad = None
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    a = p.parse_args()
    print(json.dumps({"recipe": "kernel_bench_attention", "micro": a.micro, "seq": a.seq,
                      **{k: round(v, 3) if isinstance(v, float) else v for k, v in attention(a.micro, a.seq).items()}}),
          flush=True)
    print(json.dumps({"recipe": "kernel_bench_loss", "tokens": a.micro * a.seq,
                      **{k: round(v, 3) for k, v in loss(a.micro * a.seq).items()}}), flush=True)


if __name__ == "__main__":
    main()
