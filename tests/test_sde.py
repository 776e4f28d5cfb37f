"""SDE step, log-probs and schedules (docs/conventions.md)."""

from __future__ import annotations

import math

import pytest
import torch

from jagg.engine.sde import (
    diffusers_sigmas,
    diffusion_coefficient,
    sde_step_with_logprob,
    shift_sigmas,
    shifted_linear_sigmas,
)

F64 = torch.float64


def _xv(b=3, shape=(2, 4, 4)):
    return torch.randn(b, *shape, dtype=F64), torch.randn(b, *shape, dtype=F64)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance"])
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.1, 0.0)])
def test_log_prob_equals_torch_normal(kind, sigma, sigma_next):
    x, v = _xv()
    step = sde_step_with_logprob(x, v, sigma, sigma_next, kind=kind, noise_level=0.7)
    ref = torch.distributions.Normal(step.mean, step.std).log_prob(step.prev_sample)
    assert torch.allclose(step.log_prob, ref.flatten(1).mean(1), rtol=1e-12, atol=1e-12)
    assert step.log_prob.shape == (3,) and step.log_prob.dtype == F64


def test_per_sample_times_match_scalar_times():
    x, v = _xv()
    sig, nxt = torch.tensor([0.9, 0.5, 0.2], dtype=F64), torch.tensor([0.8, 0.4, 0.1], dtype=F64)
    batched = sde_step_with_logprob(x, v, sig, nxt, kind="flow_grpo", noise_level=0.9, prev_sample=x)
    for i in range(3):
        one = sde_step_with_logprob(
            x[i : i + 1],
            v[i : i + 1],
            sig[i],
            nxt[i],
            kind="flow_grpo",
            noise_level=0.9,
            prev_sample=x[i : i + 1],
        )
        assert torch.allclose(batched.log_prob[i], one.log_prob[0], rtol=1e-13)
        assert torch.allclose(batched.mean[i], one.mean[0], rtol=1e-13)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_proxy_signal_equals_affine_slope(kind):
    """dL/dv by autograd through a proxy == slope b of mu in v times dL/dmu (no model involved)."""
    x, v = _xv()
    sigma, sigma_next, a = 0.7, 0.55, 0.8
    target = sde_step_with_logprob(x, v, sigma, sigma_next, kind=kind, noise_level=a).prev_sample
    proxy = v.clone().requires_grad_(True)
    lp = sde_step_with_logprob(x, proxy, sigma, sigma_next, kind=kind, noise_level=a, prev_sample=target)
    loss = (lp.log_prob * torch.tensor([1.0, -2.0, 0.5], dtype=F64)).sum()
    (s,) = torch.autograd.grad(loss, proxy)

    mu = lp.mean.detach().requires_grad_(True)
    if kind == "cps":
        lp_mu = -((target - mu) ** 2).flatten(1).mean(1)
        std = sigma_next * math.sin(a * math.pi / 2)
        slope = -sigma * (1 - sigma_next) + (1 - sigma) * math.sqrt(sigma_next**2 - std**2)
    else:
        std = lp.std
        lp_mu = torch.distributions.Normal(mu, std).log_prob(target).flatten(1).mean(1)
        dt = sigma_next - sigma
        g = diffusion_coefficient(
            kind, torch.tensor(sigma, dtype=F64), torch.tensor(sigma_next, dtype=F64), a
        )
        slope = dt * (1 + g**2 * (1 - sigma) / (2 * sigma))
    (d_mu,) = torch.autograd.grad((lp_mu * torch.tensor([1.0, -2.0, 0.5], dtype=F64)).sum(), mu)
    assert torch.allclose(s, slope * d_mu, rtol=1e-12, atol=1e-14)


def test_flow_grpo_coefficient_at_sigma_one_uses_second_entry():
    g = diffusion_coefficient("flow_grpo", torch.tensor(1.0), torch.tensor(0.9), 0.7)
    assert g.item() == pytest.approx(0.7 * math.sqrt(1.0 / (1 - 0.9)))


def test_dance_mean_matches_danceGRPO_score_form():
    """DanceGRPO writes the mean as x + v dt - eta^2 / 2 * score * dt with score = -(x - (1-s) x0_hat)/s^2."""
    x, v = _xv()
    s, s_next, eta = 0.6, 0.5, 0.3
    dt = s_next - s
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s**2
    mean_ref = x + v * dt - 0.5 * eta**2 * score * dt
    step = sde_step_with_logprob(x, v, s, s_next, kind="dance", noise_level=eta)
    assert torch.allclose(step.mean, mean_ref, rtol=1e-12)
    assert step.std.item() == pytest.approx(eta * math.sqrt(-dt))


def test_ode_step_is_euler_and_cps_is_deterministic_at_zero():
    x, v = _xv()
    ode = sde_step_with_logprob(x, v, 0.5, 0.3, kind="ode", noise_level=0.0)
    assert torch.allclose(ode.prev_sample, x + v * (0.3 - 0.5))
    assert torch.all(ode.log_prob == 0)
    cps = sde_step_with_logprob(x, v, 0.2, 0.0, kind="cps", noise_level=0.8)
    assert torch.allclose(cps.prev_sample, x - 0.2 * v)  # x0_hat
    assert torch.allclose(cps.log_prob, torch.zeros(3, dtype=F64))


def test_sampling_uses_generator_and_matches_moments():
    x, v = torch.zeros(4000, 1, dtype=F64), torch.ones(4000, 1, dtype=F64)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = sde_step_with_logprob(x, v, 0.5, 0.4, kind="dance", noise_level=0.3, generator=g1)
    b = sde_step_with_logprob(x, v, 0.5, 0.4, kind="dance", noise_level=0.3, generator=g2)
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert a.prev_sample.std().item() == pytest.approx(0.3 * math.sqrt(0.1), rel=0.05)
    assert a.prev_sample.mean().item() == pytest.approx(a.mean.mean().item(), abs=0.01)


def test_bf16_inputs_give_float32_log_probs():
    x, v = (t.to(torch.bfloat16) for t in _xv())
    step = sde_step_with_logprob(x, v, 0.5, 0.4, kind="flow_grpo", noise_level=0.9)
    assert step.log_prob.dtype == torch.float32 and torch.isfinite(step.log_prob).all()


def test_unknown_kind_is_rejected():
    x, v = _xv()
    with pytest.raises(ValueError, match="kind must be one of"):
        sde_step_with_logprob(x, v, 0.5, 0.4, kind="sde", noise_level=0.7)


def test_shifted_linear_schedule():
    s = shifted_linear_sigmas(16, shift=3.0)
    assert s.shape == (17,) and s[0] == 1 and s[-1] == 0
    assert torch.all(s[1:] < s[:-1])
    lin = torch.linspace(1, 0, 17, dtype=F64)
    assert torch.allclose(s, 3 * lin / (1 + 2 * lin))
    assert torch.allclose(shift_sigmas(lin, 1.0), lin)


def test_diffusers_flux_schedule_matches_scheduler():
    """Flux-style dynamic shift: mu from the sequence length, then the scheduler's exponential shift."""
    cfg = dict(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    s = diffusers_sigmas(cfg, num_steps=6, image_seq_len=1024)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (1024 - 256)
    lin = torch.linspace(1.0, 1 / 6, 6, dtype=F64)
    expected = math.e**mu / (math.e**mu + (1 / lin - 1))
    assert s.shape == (7,) and s[-1] == 0
    assert torch.allclose(s[:-1], expected, atol=1e-6)  # scheduler works in float32
