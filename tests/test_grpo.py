"""Group advantages, the clipped PPO loss and the per-step GRPO loss ``GRPOStepLoss`` (docs/conventions.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import make_model, previous_step_loss
from jagg.engine.grpo import (
    GRPOStepLoss,
    TrainedSteps,
    clipped_ppo_loss,
    gaussian_mean_kl,
    group_advantages,
)
from jagg.engine.sde import sde_step_with_logprob, shifted_linear_sigmas
from jagg.models import Backbone, TextCond

_g = torch.Generator().manual_seed(2)
COND = {
    3: TextCond(
        embeds=torch.randn(3, 5, 32, generator=_g, dtype=torch.float64),
        mask=torch.ones(3, 5, dtype=torch.long),
        pooled=torch.randn(3, 32, generator=_g, dtype=torch.float64),
    )
}


def test_group_advantages_are_normalised_per_prompt():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0)
    for g in (0, 1):
        a = adv[groups == g]
        assert a.mean().abs() < 1e-12
        assert a.std(unbiased=False).item() == pytest.approx(1.0)
    adv_unbiased = group_advantages(rewards, groups, unbiased=True, eps=0.0)
    assert adv_unbiased[groups == 0].std(unbiased=True).item() == pytest.approx(1.0)


def test_global_std_and_clamp_and_degenerate_groups():
    rewards = torch.tensor([0.0, 0.0, 0.0, 100.0])
    groups = torch.tensor([0, 0, 0, 0])
    adv = group_advantages(rewards, groups, eps=1e-8, clip=5.0)
    assert adv.max() <= 5.0 and adv.min() >= -5.0
    same = group_advantages(torch.tensor([2.0, 2.0]), torch.tensor([0, 0]))
    assert torch.all(same == 0)  # no signal when every image of a prompt scores the same
    rewards = torch.tensor([1.0, 3.0, 5.0, 9.0])
    groups = torch.tensor([0, 0, 1, 1])
    glob = group_advantages(rewards, groups, std_mode="global", eps=0.0)
    assert torch.allclose(
        glob, torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64) / rewards.std(unbiased=False)
    )
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(rewards, groups, std_mode="batch")


def test_ppo_on_policy_gradient_is_minus_advantage():
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    lp = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    loss, stats = clipped_ppo_loss(lp, lp.detach(), adv, clip_range=1e-4)
    assert stats.ratio_max_dev == 0.0 and stats.clip_frac == 0.0 and stats.approx_kl == 0.0
    assert loss.item() == pytest.approx(-adv.mean().item())
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(g, -adv / 3)


def test_ppo_clipping_stops_gradient_beyond_the_trust_region():
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    old = torch.zeros(2, dtype=torch.float64)
    lp = torch.tensor(
        [0.1, -0.1], dtype=torch.float64, requires_grad=True
    )  # ratio moved past the clip in the favoured direction
    loss, stats = clipped_ppo_loss(lp, old, adv, clip_range=0.01)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.all(g == 0) and stats.clip_frac == 1.0
    with pytest.raises(ValueError, match="clip_range"):
        clipped_ppo_loss(lp, old, adv, clip_range=0.0)


def test_gaussian_mean_kl():
    mean, ref = torch.ones(2, 3), torch.zeros(2, 3)
    assert torch.allclose(gaussian_mean_kl(mean, ref, torch.tensor(2.0)), torch.full((2,), 1 / 8))


# --------------------------------------------------------------------------- GRPOStepLoss
def _problem(model_name: str, kind: str, dtype, t: int = 3, b: int = 3):
    """A model, a frozen perturbed copy (the KL reference), and T trained steps per sample at per-sample
    times (T, B), with stored next latents and slightly off-policy old log-probs."""
    module, velocity, shape = make_model(model_name, batch=b, seed=1)
    ref_module = copy.deepcopy(module).requires_grad_(False)
    with torch.no_grad():
        for p in ref_module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    module, ref_module = module.to(dtype), ref_module.to(dtype)
    if isinstance(module, Backbone):
        velocity, ref_velocity = module.bind(COND[b]), ref_module.bind(COND[b])
    else:
        velocity, ref_velocity = module, ref_module
    g = torch.Generator().manual_seed(3)
    sig = shifted_linear_sigmas(6).to(dtype)
    steps = torch.stack([torch.randperm(5, generator=g)[:t].sort().values for _ in range(b)])  # (B, T)
    s, s_next = sig[steps.T], sig[steps.T + 1]  # (T, B)
    x = torch.randn(t, *shape, generator=g, dtype=torch.float64).to(dtype)
    x_next, old_lp = [], []
    with torch.no_grad():
        for i in range(t):
            st = sde_step_with_logprob(
                x[i], velocity(x[i], s[i]), s[i], s_next[i], kind=kind, noise_level=0.7, generator=g
            )
            x_next.append(st.prev_sample)
            old_lp.append(st.log_prob + 1e-3 * torch.randn(b, generator=g, dtype=st.log_prob.dtype))
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return module, velocity, ref_velocity, x, torch.stack(x_next), s, s_next, torch.stack(old_lp), adv


def _steps(x, x_next, sigma, sigma_next, old_log_prob) -> TrainedSteps:
    return TrainedSteps(x=x, x_next=x_next, sigma=sigma, sigma_next=sigma_next, old_log_prob=old_log_prob)


@pytest.mark.parametrize("scale", [1.0, 1 / 6])
@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
@pytest.mark.parametrize("kind", ["dance", "flow_grpo", "cps"])
@pytest.mark.parametrize(("model_name", "dtype"), [("mlp", torch.float32), ("flux", torch.float64)])
def test_grpo_step_loss_equals_the_previous_trainer_formula_bit_for_bit(
    model_name, dtype, kind, kl_beta, scale
):
    module, velocity, ref_velocity, x, x_next, s, s_next, old_lp, adv = _problem(model_name, kind, dtype)
    ref_velocity = ref_velocity if kl_beta > 0 else None
    a = dict(kind=kind, noise_level=0.7, clip_range=0.2, kl_beta=kl_beta)
    new = GRPOStepLoss(
        _steps(x, x_next, s, s_next, old_lp), adv, kind, 0.7, 0.2, kl_beta, ref_velocity, scale
    )
    old_log: list = []
    old = previous_step_loss(x, x_next, s, s_next, old_lp, adv, a, ref_velocity, scale, old_log)
    assert len(new) == x.shape[0]
    new_log = []

    def new_recorded(i, v):
        value, stats = new.evaluate(i, v)
        new_log.append((stats.loss, stats.ppo))
        return value

    for i in range(x.shape[0]):
        losses, grads = [], []
        for fn in (old, new, new_recorded):
            module.zero_grad(set_to_none=True)
            loss = fn(i, velocity(x[i], s[i]))
            loss.backward()
            losses.append(loss.detach())
            grads.append(torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]))
        assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
        assert torch.equal(losses[0], losses[2]) and torch.equal(grads[0], grads[2])
    assert [lo for lo, _ in new_log] == [lo for lo, _ in old_log]
    assert [st for _, st in new_log] == [st for _, st in old_log]
    if kl_beta > 0:  # the KL term is there: the loss differs from the KL-free one
        plain = GRPOStepLoss(_steps(x, x_next, s, s_next, old_lp), adv, kind, 0.7, 0.2, scale=scale)
        with torch.no_grad():
            assert plain(0, velocity(x[0], s[0])) != new(0, velocity(x[0], s[0]))


def test_grpo_step_loss_on_policy_ratios_are_one_and_kl_needs_a_reference():
    module, velocity, _, x, _, s, s_next, _, adv = _problem("mlp", "dance", torch.float64)
    with torch.no_grad():
        steps = [
            sde_step_with_logprob(x[i], velocity(x[i], s[i]), s[i], s_next[i], kind="dance", noise_level=0.7)
            for i in range(x.shape[0])
        ]
    loss = GRPOStepLoss(
        _steps(
            x,
            torch.stack([st.prev_sample for st in steps]),
            s,
            s_next,
            torch.stack([st.log_prob for st in steps]),
        ),
        adv,
        "dance",
        0.7,
        1e-4,
    )
    with torch.no_grad():
        stats = []
        for i in range(len(loss)):
            value, st = loss.evaluate(i, velocity(x[i], s[i]))
            assert value.item() == loss(i, velocity(x[i], s[i])).item() == pytest.approx(-adv.mean().item())
            stats.append(st)
    assert len(stats) == 3 and all(st.ppo.ratio_max_dev == 0.0 for st in stats)
    with pytest.raises(ValueError, match="ref_velocity"):
        GRPOStepLoss(_steps(x, x, s, s_next, adv), adv, "dance", 0.7, 0.2, kl_beta=0.1)


@pytest.mark.parametrize(
    ("kind", "noise_level", "kl"),
    [
        # g^2 = 0.49 * 0.6 / 0.4 = 0.735; d mu / d v = (1 + g^2 (1 - 0.6) / (2 * 0.6)) * dt = 1.245 * -0.2 = -0.249
        # KL = 0.249^2 / (2 g^2) = 0.042177551 (the step variance g^2 |dt| would give 0.210887755, |dt| = 0.2 x)
        ("flow_grpo", 0.7, 0.042177551020408155),
        # g = eta = 0.3: d mu / d v = (1 + 0.09 * 0.4 / 1.2) * -0.2 = -0.206; KL = 0.206^2 / (2 * 0.09)
        ("dance", 0.3, 0.23575555555555547),
        # CPS: std = 0.4 sin(0.4 pi) = 0.380423 (the step std, unchanged); d mu / d v = -0.6 * 0.6
        # + sqrt(0.4^2 - std^2) * 0.4 = -0.310557; KL = 0.310557^2 / (2 std^2)
        ("cps", 0.8, 0.33321212922508603),
    ],
)
def test_kl_divides_by_flow_grpo_std_dev_t(kind, noise_level, kl):
    """Flow-GRPO scripts/train_flux.py: beta * mean((mu - mu_ref)^2) / (2 std_dev_t^2), std_dev_t without sqrt(dt).

    One step from sigma 0.6 to 0.4, v - v_ref = 1 everywhere, zero advantages (the surrogate is 0), beta = 1:
    the loss is the KL term alone, hand-computed above.
    """
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)  # (T=1, B=2, ...)
    v = torch.randn(2, 3, 4, dtype=torch.float64)
    s, s_next = torch.tensor([0.6], dtype=torch.float64), torch.tensor([0.4], dtype=torch.float64)
    step = sde_step_with_logprob(x[0], v, s[0], s_next[0], kind=kind, noise_level=noise_level)
    loss = GRPOStepLoss(
        _steps(x, step.prev_sample[None], s, s_next, step.log_prob[None]),
        torch.zeros(2, dtype=torch.float64),
        kind,
        noise_level,
        clip_range=0.2,
        kl_beta=1.0,
        ref_velocity=lambda z, t: v - 1.0,
    )
    assert loss(0, v).item() == pytest.approx(kl, rel=1e-12)
    expected_std_dev_t = {"flow_grpo": 0.7 * 1.5**0.5, "dance": 0.3, "cps": float(step.std)}[kind]
    assert float(step.std_dev_t) == pytest.approx(expected_std_dev_t, rel=1e-12)


@pytest.mark.parametrize(("kind", "noise_level"), [("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_kl_std_step_is_the_exact_step_kl(kind, noise_level):
    """``kl_std="step"`` divides by the step variance (the exact KL of the two step Gaussians; the world recipe
    was tuned with it), which is Flow-GRPO's term divided by |dt| for the flow_grpo / dance kinds."""
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    v = torch.randn(2, 3, 4, dtype=torch.float64)
    s, s_next = torch.tensor([0.6], dtype=torch.float64), torch.tensor([0.4], dtype=torch.float64)
    step = sde_step_with_logprob(x[0], v, s[0], s_next[0], kind=kind, noise_level=noise_level)
    args = (
        _steps(x, step.prev_sample[None], s, s_next, step.log_prob[None]),
        torch.zeros(2, dtype=torch.float64),
    )
    kw = dict(
        kind=kind, noise_level=noise_level, clip_range=0.2, kl_beta=1.0, ref_velocity=lambda z, t: v - 1.0
    )
    exact = GRPOStepLoss(*args, **kw, kl_std="step")(0, v).item()
    flow = GRPOStepLoss(*args, **kw)(0, v).item()
    ref = sde_step_with_logprob(x[0], v - 1.0, s[0], s_next[0], kind=kind, noise_level=noise_level)
    assert exact == pytest.approx(gaussian_mean_kl(step.mean, ref.mean, step.std).mean().item(), rel=1e-12)
    ratio = 1.0 if kind == "cps" else 0.2  # |dt|
    assert flow == pytest.approx(ratio * exact, rel=1e-12)
    with pytest.raises(ValueError, match="kl_std"):
        GRPOStepLoss(*args, **kw, kl_std="bogus")


def test_world_recipe_keeps_the_step_kl_it_was_tuned_with():
    from jagg.config import load_config

    assert load_config("configs/world/flux_dancegrpo.yaml").algorithm.kl_std == "step"
    assert load_config("configs/paper/flux_dancegrpo.yaml").algorithm.kl_std == "flow_grpo"
