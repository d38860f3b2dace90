"""`hyperparameters.optimizer: "adamw_bf16"`: the update itself, in process, and the config it renders. The trainer
with it under the real launcher (DeepSpeed's ZeRO with bf16 master weights and this optimizer as its client
optimizer) is in tests/test_trainer_matrix.py: matrix rows at ZeRO-2 and 3 that train, checkpoint and export, resume
exactly, and track adamw's loss curve."""

from __future__ import annotations

import pytest
import torch

from contract.deepspeed import resolve
from contract.problems import SpecError
from contract.spec import JobSpec
from trainer import optim


def test_stochastic_rounding_keeps_bf16_values_and_is_unbiased_between_them() -> None:
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(10_000).to(torch.bfloat16).float()
    assert torch.equal(optim.stochastic_round_to_bf16(exact, gen).float(), exact)
    # 1 + 0.3 ulp (bf16's ulp at 1 is 2**-7): rounds to 1 + ulp 30% of the time, else to 1, never elsewhere.
    ulp = 2.0**-7
    for sign in (1.0, -1.0):
        x = torch.full((200_000,), sign * (1.0 + 0.3 * ulp))
        r = optim.stochastic_round_to_bf16(x, gen).float()
        assert set(r.unique().tolist()) == {sign * 1.0, sign * (1.0 + ulp)}
        # The mean of 200,000 Bernoulli(0.3) draws is within 0.3 ± 0.005 (about 5 standard deviations).
        assert (r.mean().item() - sign * 1.0) / (sign * ulp) == pytest.approx(0.3, abs=0.005)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    r = optim.stochastic_round_to_bf16(special, gen).float()
    assert r[0] == float("inf") and r[1] == float("-inf") and r[2].isnan()


def test_update_is_adamw_on_fp32_parameters_chunked_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 parameters are updated exactly (no rounding), so the arithmetic must equal torch's AdamW, and the
    chunking that bounds its temporaries must not change a value."""
    torch.manual_seed(0)
    init = [torch.randn(1000), torch.randn(7, 13)]
    grads = [[torch.randn_like(p) for p in init] for _ in range(20)]
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    def train(make: type[torch.optim.Optimizer], **extra: object) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = make(params, **kwargs, **extra)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    reference = train(torch.optim.AdamW)
    whole = train(optim.AdamWBF16, seed=1)
    monkeypatch.setattr(optim, "CHUNK", 64)
    chunked = train(optim.AdamWBF16, seed=1)
    for r, w, c in zip(reference, whole, chunked, strict=True):
        torch.testing.assert_close(w, r, rtol=1e-5, atol=1e-6)
        assert torch.equal(w, c)


def test_small_updates_accumulate_in_bf16_where_round_to_nearest_would_lose_them() -> None:
    """The reason for stochastic rounding. Weights of 1.0 (bf16's half-ulp there is 0.0039) with lr 1e-4 and a
    constant gradient move by ~1e-4 per step: an fp32 master reaches ~0.98 after 200 steps; bf16 with round-to-
    nearest would stay at 1.0 for ever. With stochastic rounding each weight is within a few ulps of the fp32
    path and their mean within 0.1% of it."""
    n, steps = 4096, 200
    kwargs = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    ref = torch.nn.Parameter(torch.ones(n))
    bf = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt_ref, opt_bf = torch.optim.AdamW([ref], **kwargs), optim.AdamWBF16([bf], **kwargs, seed=3)
    for _ in range(steps):
        ref.grad = torch.full_like(ref, 0.5)
        bf.grad = torch.full_like(bf, 0.5)
        opt_ref.step()
        opt_bf.step()
    moved = 1.0 - ref.detach().mean().item()
    assert moved == pytest.approx(0.02, rel=0.01)
    assert bf.dtype == torch.bfloat16 and opt_bf.state[bf]["exp_avg"].dtype == torch.bfloat16
    assert bf.detach().float().mean().item() == pytest.approx(ref.detach().mean().item(), abs=1e-3)
    # Each weight's rounding errors are a zero-mean random walk of at most half an ulp (2**-8 below 1.0) in
    # standard deviation per step, so the spread around the fp32 path is bounded by sqrt(steps) of them.
    assert (bf.detach().float() - ref.detach()).std().item() <= steps**0.5 * 2.0**-8 / 2
    # What round-to-nearest would have done with the first step's update.
    assert torch.tensor(1.0 - 1e-4).to(torch.bfloat16).item() == 1.0


def test_compiled_update_is_the_op_by_op_update_bit_for_bit() -> None:
    """A CUDA job runs the update compiled into one kernel; inductor must lower the bit tricks of the rounding
    exactly. Compiled here for the CPU (the same graph, C++ instead of Triton), on fresh random values."""
    n = 100_003  # not a multiple of any vector width

    def state() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(5)
        w, g, m = (torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(3))
        return [w, g, m, torch.rand(n, generator=gen).to(torch.bfloat16)]

    noise = torch.randint(0, 1 << 16, (3, n), dtype=torch.int32, generator=torch.Generator().manual_seed(6))
    hyper = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 1 - 0.9**3, 1 - 0.95**3])
    eager, compiled = state(), state()
    optim._bf16_step(*eager, noise, hyper)
    torch.compile(optim._bf16_step, dynamic=None, fullgraph=True)(*compiled, noise, hyper)
    assert not torch.equal(eager[0], state()[0])
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("deepspeed", "expected"), [
    ({"precision": "fp16"}, 'needs deepspeed.precision "bf16" (got "fp16")'),
    ({"zero_stage": 0}, "needs ZeRO stage 1, 2 or 3 (got stage 0)"),
    ({"offload_optimizer": "cpu"}, '(accepted with offload: "adamw")'),
])
def test_combinations_that_cannot_run_are_refused_naming_the_field(deepspeed: dict[str, object],
                                                                   expected: str) -> None:
    job = {"model": "m", "data": {"train": "t"}, "hyperparameters": {"optimizer": "adamw_bf16"},
           "deepspeed": deepspeed}
    with pytest.raises(SpecError) as err:
        resolve(JobSpec.model_validate(job))
    (problem,) = err.value.errors
    assert problem.field == "hyperparameters.optimizer" and expected in problem.message, problem.message


def test_rendered_config_hands_the_optimizer_to_zero_with_bf16_master_weights() -> None:
    job = {"model": "m", "data": {"train": "t"}, "hyperparameters": {"optimizer": "adamw_bf16"}}
    cfg = resolve(JobSpec.model_validate(job)).deepspeed_config
    assert "optimizer" not in cfg and cfg["zero_allow_untested_optimizer"] is True
    assert cfg["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    default = resolve(JobSpec.model_validate({**job, "hyperparameters": {}})).deepspeed_config
    assert default["optimizer"]["type"] == "AdamW" and "bf16_master_weights_and_grads" not in default["bf16"]
