"""``algorithm.adv_aggregation``: several training rewards, each group-normalised and then summed with the weights
as shares of their sum (``per_reward``, MixGRPO's ``advantage_aggr``), checked against a float64 NumPy port of
MixGRPO's lines; the default ``weighted_sum`` normalises the weighted sum, as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jagg.config import load_config
from jagg.engine.grpo import group_advantages, per_reward_advantages
from jagg.errors import ConfigError


def mixgrpo_reward_weights(weights: dict[str, float]) -> dict[str, float]:
    """Port of MixGRPO's weight setup (``fastvideo/train_grpo_flux.py`` lines 763-770, Tencent-Hunyuan/MixGRPO @
    e5cdd6a): the ``--*_weight`` arguments normalised to sum 1, or equal shares when they do not sum above 0."""
    reward_weights = dict(weights)
    # Normalize weights
    total_weight = sum(reward_weights.values())
    if total_weight > 0:
        reward_weights = {k: v / total_weight for k, v in reward_weights.items()}
    else:
        reward_weights = {k: 1.0 / len(weights) for k in weights}
    return reward_weights


def mixgrpo_advantage_aggr(rewards: dict[str, np.ndarray], weights: dict[str, float], num_generations: int):
    """Port of MixGRPO's ``advantage_aggr`` (``fastvideo/train_grpo_flux.py`` : ``train_one_step`` lines 429-456,
    Tencent-Hunyuan/MixGRPO @ e5cdd6a, ``use_group`` on, ``trimmed_ratio`` 0) in float64 NumPy, with the weights
    as their setup leaves them (``mixgrpo_reward_weights``, given the launch arguments ``weights``): contiguous
    groups of ``num_generations`` samples, ``(r - mean) / (std + 1e-8)`` with torch's unbiased std, the
    advantages of every reward added with ``reward_weights``. Their clamp to ``adv_clip_max`` happens in the loss
    (``mixgrpo_clamp``)."""
    reward_weights = mixgrpo_reward_weights(weights)
    model_advantages = {}
    for model_name, model_rewards in rewards.items():
        model_rewards = np.asarray(model_rewards, dtype=np.float64)
        n = len(model_rewards) // num_generations
        advantages = np.zeros_like(model_rewards)
        for i in range(n):
            start_idx, end_idx = i * num_generations, (i + 1) * num_generations
            group_rewards = model_rewards[start_idx:end_idx]
            group_mean = group_rewards.mean()
            group_std = group_rewards.std(ddof=1) + 1e-8
            advantages[start_idx:end_idx] += (group_rewards - group_mean) / group_std
        model_advantages[model_name] = advantages
    # add all advantages
    merged_advantages = np.zeros_like(np.asarray(next(iter(rewards.values())), dtype=np.float64))
    for model_name, model_advs in model_advantages.items():
        merged_advantages += model_advs * reward_weights[model_name]
    return merged_advantages


def mixgrpo_clamp(advantages: np.ndarray, adv_clip_max: float) -> np.ndarray:
    """Their clamp in the loss (``train_one_step`` lines 565-569): ``torch.clamp(advantages, -max, max)``."""
    return np.clip(advantages, -adv_clip_max, adv_clip_max)


MIX = dict(std_mode="group", unbiased=True, eps=1e-8)  # MixGRPO / DanceGRPO normalisation


def _rewards(n_groups=5, size=6, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = n_groups * size
    return {  # three rewards on very different scales, as HPS (~0.3), ImageReward (~N(0, 1)) and PickScore (~22)
        "hpsv2": 0.3 + 0.01 * torch.randn(n, generator=g, dtype=torch.float64),
        "imagereward": torch.randn(n, generator=g, dtype=torch.float64),
        "pickscore": 22 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_reward_equals_mixgrpo_port(seed):
    rewards = _rewards(seed=seed)
    weights = {"hpsv2": 1.0, "imagereward": 0.5, "pickscore": 2.0}
    group_ids = torch.arange(5).repeat_interleave(6)
    expected = mixgrpo_advantage_aggr({k: v.numpy() for k, v in rewards.items()}, weights, 6)
    got = per_reward_advantages(rewards, weights, group_ids, **MIX, clip=float("inf"))
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-13, atol=1e-13)
    # clamped afterwards, as their adv_clip_max in the loss (the sum can exceed one reward's range)
    clip = 0.9 * float(np.abs(expected).max())  # some samples beyond it
    clipped = per_reward_advantages(rewards, weights, group_ids, **MIX, clip=clip)
    np.testing.assert_allclose(clipped.numpy(), mixgrpo_clamp(expected, clip), rtol=1e-13, atol=1e-13)
    assert (np.abs(clipped.numpy()) == clip).any()
    # groups need not be contiguous: the same samples shuffled give the same advantages, shuffled
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(seed))
    shuffled = per_reward_advantages(
        {k: v[perm] for k, v in rewards.items()}, weights, group_ids[perm], **MIX, clip=float("inf")
    )
    np.testing.assert_allclose(shuffled.numpy(), expected[perm.numpy()], rtol=1e-13, atol=1e-13)


def test_per_reward_ignores_scales_weighted_sum_does_not():
    """Rescaling one reward (r -> 100 r + 7) leaves ``per_reward`` unchanged but changes ``weighted_sum`` (eps 0,
    so that only the scale is at play)."""
    rewards = _rewards()
    norm = {**MIX, "eps": 0.0}
    weights = {"hpsv2": 1.0, "imagereward": 1.0, "pickscore": 1.0}
    group_ids = torch.arange(5).repeat_interleave(6)
    scaled = {**rewards, "hpsv2": 100 * rewards["hpsv2"] + 7}
    a = per_reward_advantages(rewards, weights, group_ids, **norm, clip=10.0)
    torch.testing.assert_close(per_reward_advantages(scaled, weights, group_ids, **norm, clip=10.0), a)

    def weighted_sum(r):
        return group_advantages(sum(weights[k] * r[k] for k in weights), group_ids, **norm, clip=10.0)

    assert not torch.allclose(weighted_sum(scaled), weighted_sum(rewards), atol=1e-3)
    # one reward with weight 1: both aggregations are the plain group advantages
    one = {"pickscore": rewards["pickscore"]}
    torch.testing.assert_close(
        per_reward_advantages(one, {"pickscore": 1.0}, group_ids, **norm, clip=10.0),
        group_advantages(rewards["pickscore"], group_ids, **norm, clip=10.0),
    )


def test_weights_are_shares_of_their_sum():
    """Only the weights' ratios matter (they are normalised to sum 1, as MixGRPO's setup); weights that do not sum
    above 0 give equal shares, as theirs."""
    rewards = _rewards(seed=3)
    group_ids = torch.arange(5).repeat_interleave(6)
    weights = {"hpsv2": 1.0, "imagereward": 0.5, "pickscore": 2.0}
    a = per_reward_advantages(rewards, weights, group_ids, **MIX, clip=float("inf"))
    scaled = {k: 7.0 * w for k, w in weights.items()}
    torch.testing.assert_close(per_reward_advantages(rewards, scaled, group_ids, **MIX, clip=float("inf")), a)
    shares = {k: w / 3.5 for k, w in weights.items()}
    torch.testing.assert_close(per_reward_advantages(rewards, shares, group_ids, **MIX, clip=float("inf")), a)
    assert mixgrpo_reward_weights(weights) == pytest.approx(shares)
    zeros = {k: 0.0 for k in weights}
    equal = per_reward_advantages(rewards, {k: 1.0 for k in weights}, group_ids, **MIX, clip=float("inf"))
    torch.testing.assert_close(
        per_reward_advantages(rewards, zeros, group_ids, **MIX, clip=float("inf")), equal
    )
    expected = mixgrpo_advantage_aggr({k: v.numpy() for k, v in rewards.items()}, zeros, 6)
    np.testing.assert_allclose(equal.numpy(), expected, rtol=1e-13, atol=1e-13)


def test_mixgrpo_launch_stays_inside_the_clamp():
    """MixGRPO's launch: three unit weights, 12 images per prompt, clamp at 5. Three rewards that agree, with one
    outlier per group, give the largest z-score a group of 12 allows, 11 / sqrt(12) = 3.18 (Bessel), and not three
    times that (9.5, which the clamp at 5 would cut): the advantages are one reward's group advantages."""
    n = 12
    base = torch.cat([torch.zeros(n - 1), torch.ones(1)]).double().repeat(2)
    rewards = {"hpsv2": 0.3 + 0.01 * base, "imagereward": base, "pickscore": 22 + 0.5 * base}
    group_ids = torch.arange(2).repeat_interleave(n)
    got = per_reward_advantages(rewards, dict.fromkeys(rewards, 1.0), group_ids, **MIX, clip=5.0)
    assert float(got.max()) == pytest.approx((n - 1) / n**0.5, rel=1e-5) and float(got.abs().max()) < 5.0
    torch.testing.assert_close(got, group_advantages(base, group_ids, **MIX, clip=5.0), rtol=1e-5, atol=1e-5)
    expected = mixgrpo_advantage_aggr(
        {k: v.numpy() for k, v in rewards.items()}, dict.fromkeys(rewards, 1.0), n
    )
    np.testing.assert_allclose(got.numpy(), mixgrpo_clamp(expected, 5.0), rtol=1e-13, atol=1e-13)


def test_per_reward_needs_every_weighted_score():
    with pytest.raises(ValueError, match="no scores for \\['b'\\]"):
        per_reward_advantages({"a": torch.zeros(4)}, {"a": 1.0, "b": 1.0}, torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("aggregation", ["per_reward", "weighted_sum"])
def test_trainer_rollout_advantages(tiny_trainer, aggregation):
    """The trainer's rollout with two JPEG rewards (different qualities, so not proportional): the advantages are
    the MixGRPO port of the per-reward scores (per_reward) or the group advantages of the weighted sum."""
    trainer = tiny_trainer(
        "reward.weights={jpeg: 1.0, jpeg_incompressibility: 0.5}",
        "reward.kwargs={jpeg_incompressibility: {quality: 20}}",
        f"algorithm.adv_aggregation={aggregation}",
        "algorithm.adv_unbiased=true",
        "algorithm.adv_eps=1e-8",
        "algorithm.adv_std=group",
        "algorithm.adv_clip=100.0",
    )
    cfg = trainer.cfg
    ro = trainer.rollout(0)
    weights = dict(cfg.reward.weights)
    comps = {k: ro.scores[k].double().numpy() for k in weights}
    size = cfg.train.images_per_prompt
    per_reward = mixgrpo_advantage_aggr(comps, weights, size)
    summed = sum(w * comps[k] for k, w in weights.items())
    np.testing.assert_allclose(ro.rewards.double().numpy(), summed, rtol=1e-6)
    plain = mixgrpo_advantage_aggr({"sum": ro.rewards.double().numpy()}, {"sum": 1.0}, size)
    expected, other = (per_reward, plain) if aggregation == "per_reward" else (plain, per_reward)
    np.testing.assert_allclose(ro.advantages.double().numpy(), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ro.advantages.double().numpy(), other, atol=1e-3)


def test_bad_aggregation_names_key_and_values():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.adv_aggregation must be one of \['weighted_sum', 'per_reward'\], got 'sum'",
    ):
        load_config("configs/world/flux_dancegrpo.yaml", ["algorithm.adv_aggregation=sum"])
