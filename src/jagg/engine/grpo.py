"""GRPO pieces: group-relative advantages and the clipped PPO per-step loss (docs/conventions.md).

Follows DanceGRPO (XueZeyue/DanceGRPO) and Flow-GRPO (yifan123/flow_grpo): advantages are normalised
within the images of one prompt, clamped to [-clip, clip]; the per-step loss is the PPO clipped surrogate on
the ratio of the per-step log-probs (means over elements, so ratios stay near 1 and the clip range is tiny).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_mode: str = "group",
    unbiased: bool = False,
    eps: float = 1e-4,
    clip: float = 5.0,
) -> Tensor:
    """A_i = (r_i - mean_{group(i)}) / (std + eps), clamped to [-clip, clip].

    Args:
        rewards: (N,) scalar rewards. group_ids: (N,) integer prompt-group id of each sample.
        std_mode: "group" (std within each prompt group, DanceGRPO / Flow-GRPO) or "global" (std over the
            whole batch, as some Flow-GRPO configs do).
        unbiased: Bessel-corrected std (DanceGRPO) or population std (Flow-GRPO).
        eps: added to the std (1e-4 Flow-GRPO, 1e-8 DanceGRPO).
    """
    if std_mode not in ("group", "global"):
        raise ValueError(f"std_mode must be 'group' or 'global', got {std_mode!r}")
    rewards = rewards.to(torch.float64)
    adv = torch.empty_like(rewards)
    global_std = rewards.std(unbiased=unbiased) if rewards.numel() > 1 else rewards.new_zeros(())
    for gid in torch.unique(group_ids):
        idx = group_ids == gid
        r = rewards[idx]
        if std_mode == "global":
            std = global_std
        else:
            std = r.std(unbiased=unbiased) if r.numel() > 1 else r.new_zeros(())
        adv[idx] = (r - r.mean()) / (std + eps)
    return adv.clamp(-clip, clip)


@dataclass
class PPOStats:
    """Diagnostics of one clipped-PPO evaluation (all detached scalars)."""

    ratio_mean: float
    ratio_max_dev: float  # max |ratio - 1|: exactly 0 on-policy
    clip_frac: float
    approx_kl: float  # 0.5 mean (logp_new - logp_old)^2 (Schulman's k2 estimator)


def clipped_ppo_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float
) -> tuple[Tensor, PPOStats]:
    """mean_b max(-A r, -A clip(r, 1 - eps, 1 + eps)) with r = exp(logp_new - logp_old).

    Returns the scalar loss (differentiable in ``log_prob``) and detached diagnostics.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    advantages = advantages.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob.to(log_prob.dtype)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = PPOStats(
            ratio_mean=ratio.mean().item(),
            ratio_max_dev=(ratio - 1).abs().max().item(),
            clip_frac=((ratio - 1).abs() > clip_range).float().mean().item(),
            approx_kl=(0.5 * log_ratio**2).mean().item(),
        )
    return loss, stats


def gaussian_mean_kl(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """KL between two Gaussians of equal std, per sample, averaged over elements (Flow-GRPO's KL term).

    KL(N(mu, s^2) || N(mu_ref, s^2)) = (mu - mu_ref)^2 / (2 s^2). Returns (B,).
    """
    return ((mean - ref_mean) ** 2 / (2 * std**2)).flatten(1).mean(dim=1)
