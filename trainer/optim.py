"""The optimizer a job names (`hyperparameters.optimizer`), for the ones DeepSpeed does not build itself.

"adamw" is DeepSpeed's own (FusedAdam on the GPU, CPU Adam for offload): fp32 master weights and two fp32
moments, 16 bytes of optimizer state per trained parameter on top of the 16-bit weights and gradients.

"adamw_bf16" is `AdamWBF16` below, handed to `deepspeed.initialize` as a client optimizer with
`bf16.bf16_master_weights_and_grads` and `bf16.bf16_optimizer_states` in the rendered config, so ZeRO keeps its
master partitions, gradients and this optimizer's moments in bf16: 6 bytes of state per parameter instead of 16.
A bf16 master weight alone would stall: bf16 has 8 bits of mantissa, so an update smaller than half a unit in the
last place (a weight of 0.02 has a step of 1.2e-4; lr 1e-5 × an Adam step of ~1 is far below it) rounds back to
the old value every time. Stochastic rounding rounds up with probability equal to the discarded fraction, so the
expected stored value is the exact fp32 result and small updates accumulate on average (Zamirai et al. 2020,
"Revisiting BFloat16 Training"; the same scheme as torchao's `bf16_stochastic_round`). The moments are rounded
the same way: exp_avg_sq moves by (1 - beta2) × g² per step, far below its own half-ulp.

How it meets ZeRO (DeepSpeed 0.19.8's `runtime/zero/stage_1_and_2.py`, `stage3.py`, `base_optimizer.py`): ZeRO
replaces the optimizer's parameters with its flat master partitions (one per parameter group at stages 1-2, one
per sub-group at stage 3) and calls `step()` on them; their dtype is bf16 when the config asks for bf16 master
weights. A partition holds up to every parameter of the model (8 B elements for an 8B model on one GPU), so the
update runs over chunks of CHUNK elements: fp32 temporaries of a whole partition would need more memory than the
state saved. With optimizer offload DeepSpeed insists on its own CPU Adam (`zero_force_ds_cpu_optimizer`), so
the job schema refuses that combination (contract.deepspeed.optimizer_problems).

Why no 8-bit AdamW (torchao, bitsandbytes): with bf16 master weights its block-quantised moments would save 2 more
bytes per parameter (4 -> 2 of ~10 on the GPU), for a dependency on every node and state that ZeRO's checkpoints
and partitioning do not know. bf16 state already trains the Llama-3.1-8B shape without offload at ~59% MFU
(attention counted over the whole row; ~56% counting 6N alone: trainer/flops.py) and fits 14.1 B on one H200
(bench/RESULTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from contract.spec import ResolvedJob

# Elements per chunk of the update: 64 Mi elements keep the fp32 temporaries near 1.5 GiB.
CHUNK = 1 << 26
ADAM_EPS = 1e-8  # DeepSpeed's Adam default, which "adamw" renders too
# GPU bytes per trained parameter that the optimizer adds once training starts, beyond the 16-bit weight and
# gradient the micro-batch probe measures: "adamw_bf16" keeps a bf16 master copy (2) and two bf16 moments (4), and
# ZeRO-2 flattens the gradient partition into one more bf16 buffer at each step (2).
STATE_BYTES = {"adamw_bf16": 8.0}


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the dropped fraction of the last place."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return _round_with(x, noise)


def _round_with(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """bf16 is the top half of an fp32: adding a uniform 16-bit integer to the bits and cutting the low half rounds
    the magnitude up exactly when the noise carries into bit 16. Sign-magnitude bits make it symmetric for
    negative values. Inf and NaN are left as they are (a carry could turn a NaN's all-ones bits into -0)."""
    rounded = (x.view(torch.int32) + noise).bitwise_and(-65536).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def _bf16_step(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, noise: torch.Tensor,
               hyper: torch.Tensor) -> None:
    """One chunk's AdamW update of bf16 weights and moments, in fp32, written back stochastically rounded. The
    scalars come as one tensor so that a learning rate that changes every step never recompiles the CUDA
    version (`_fused_bf16_step`), which inductor makes one kernel: ~26 bytes moved per element against ~250
    for the op-by-op version."""
    lr, beta1, beta2, eps, weight_decay, bc1, bc2 = hyper.unbind()
    g32 = g.float()
    m32 = m.float() * beta1 + g32 * (1.0 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1.0 - beta2)
    w32 = w.float() * (1.0 - lr * weight_decay) - (lr / bc1) * m32 / ((v32 / bc2).sqrt() + eps)
    w.copy_(_round_with(w32, noise[0]))
    m.copy_(_round_with(m32, noise[1]))
    v.copy_(_round_with(v32, noise[2]))


@functools.cache
def _fused_bf16_step() -> Any:
    return torch.compile(_bf16_step, dynamic=None, fullgraph=True)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on bf16 parameters with bf16 moments; the arithmetic is fp32, every stored
    value is written back with stochastic rounding. fp32 parameters are updated exactly (no rounding needed).

    The rounding noise is a pure function of (seed, step, the parameter's index, chunk), so a run resumed from
    a checkpoint (which holds `step` and `index` in each parameter's state) rounds exactly as the uninterrupted
    run did, with no generator state to save.
    """

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float = ADAM_EPS,
                 weight_decay: float = 0.0, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # Moments in the parameter's own dtype: bf16 under bf16 master weights.
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["index"] = sum(len(s) > 0 for s in self.state.values()) - 1
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                gen = self._generator(p.device, (self.seed * 1_000_003 + step * 7_919 + int(state["index"])) % 2**63)
                _update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], gen, lr=group["lr"], beta1=beta1,
                        beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step)
        return loss


def _update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            gen: torch.Generator, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
            step: int) -> None:
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    if not all(t.dtype == torch.bfloat16 for t in (p, exp_avg, exp_avg_sq)):
        _update_exact(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, bc1=bc1, bc2=bc2)
        return
    hyper = torch.tensor([lr, beta1, beta2, eps, weight_decay, bc1, bc2], dtype=torch.float32, device=p.device)
    # The CPU (the test suite) runs it op by op: compiling there needs a C++ toolchain and buys nothing measured.
    step_fn = _fused_bf16_step() if p.is_cuda else _bf16_step
    for w_s, g_s, m_s, v_s in _chunks(p, grad, exp_avg, exp_avg_sq):
        noise = torch.randint(0, 1 << 16, (3, *w_s.shape), dtype=torch.int32, device=p.device, generator=gen)
        step_fn(w_s, g_s, m_s, v_s, noise, hyper)


def _chunks(*tensors: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    # ZeRO's partitions are contiguous; anything else is updated whole (it is a small tensor then).
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    for start in range(0, n, CHUNK):
        yield tuple(t[start:start + CHUNK] for t in flat)


def _update_exact(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, bc1: float,
                  bc2: float) -> None:
    """fp32 weights and moments (a job outside bf16 master weights): plain AdamW, nothing to round."""
    for w, g, m, v in _chunks(p, grad, exp_avg, exp_avg_sq):
        g32 = g.float()
        m.mul_(beta1).add_(g32, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
        if weight_decay:
            w.mul_(1.0 - lr * weight_decay)
        w.addcdiv_(m, (v / bc2).sqrt_().add_(eps), value=-lr / bc1)


def client_optimizer(job: ResolvedJob, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """The optimizer object to hand `deepspeed.initialize`, or None where DeepSpeed builds its own ("adamw")."""
    hp = job.spec.hyperparameters
    if hp.optimizer == "adamw":
        return None
    return AdamWBF16(params, lr=hp.learning_rate, betas=tuple(hp.adam_betas), eps=ADAM_EPS,
                     weight_decay=hp.weight_decay, seed=hp.seed)
