"""Group advantages and the clipped PPO loss (docs/conventions.md)."""

from __future__ import annotations

import pytest
import torch

from jagg.engine.grpo import clipped_ppo_loss, gaussian_mean_kl, group_advantages


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
