"""GRPO pieces: group-relative advantages, the clipped PPO surrogate, KL, and THE per-step GRPO loss.

Follows DanceGRPO (XueZeyue/DanceGRPO) and Flow-GRPO (yifan123/flow_grpo): advantages are normalised
within the images of one prompt, clamped to [-clip, clip]; the per-step loss is the PPO clipped surrogate on
the ratio of the per-step log-probs (means over elements, so ratios stay near 1 and the clip range is tiny).
``GRPOStepLoss`` puts the pieces together for the trained steps of a micro-batch; the trainer, the experiments
and the tests all use it (docs/conventions.md, docs/references.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from jagg.engine.sde import sde_step_with_logprob


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


# algorithm.adv_aggregation: how several training rewards become one advantage (MixGRPO's --multi_reward_mix)
#   weighted_sum  normalise the weighted sum of the rewards within each group (MixGRPO's reward_aggr; DanceGRPO,
#                 Flow-GRPO with one reward)
#   per_reward    normalise each reward within each group, then sum with the weights (MixGRPO's advantage_aggr)
ADV_AGGREGATIONS = ("weighted_sum", "per_reward")


def per_reward_advantages(
    rewards: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor,
    *,
    std_mode: str = "group",
    unbiased: bool = False,
    eps: float = 1e-4,
    clip: float = 5.0,
) -> Tensor:
    """A_i = clamp(sum_k (w_k / sum_j w_j) (r_ki - mean_{group(i)} r_k) / (std r_k + eps), -clip, clip).

    MixGRPO's ``advantage_aggr`` (``fastvideo/train_grpo_flux.py`` : ``train_one_step`` lines 429-456, with the
    weights normalised to sum 1 at setup, lines 763-770; Tencent-Hunyuan/MixGRPO @ e5cdd6a; docs/references.md):
    each reward is group-normalised on its own, so a reward's scale does not decide its share, and the weights
    do, as shares of their sum (equal shares when the weights do not sum to a positive number, as theirs); the
    sum is clamped afterwards (their ``adv_clip_max``, in the loss). So with one reward, or several whose group
    z-scores agree, the advantages are the plain group advantages, whatever the weights.
    ``rewards``: {name: (N,)} for every name in ``weights``; the rest as in ``group_advantages``.
    """
    if set(rewards) < set(weights):
        raise ValueError(f"per_reward_advantages: no scores for {sorted(set(weights) - set(rewards))}")
    total_weight = sum(weights.values())
    if total_weight > 0:
        shares = {name: weight / total_weight for name, weight in weights.items()}
    else:  # theirs: "No reward models activated or all weights are 0!", then 1 / (number of rewards) each
        shares = {name: 1.0 / len(weights) for name in weights}
    total = torch.zeros(group_ids.shape[0], dtype=torch.float64)
    for name, share in shares.items():
        normalised = group_advantages(
            rewards[name], group_ids, std_mode=std_mode, unbiased=unbiased, eps=eps, clip=float("inf")
        )
        total += share * normalised
    return total.clamp(-clip, clip)


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


@dataclass(frozen=True)
class StepStats:
    """What one evaluation of ``GRPOStepLoss`` gives besides the differentiable loss."""

    loss: float  # L_i, unscaled (the clipped surrogate plus the KL term)
    ppo: PPOStats

    @staticmethod
    def means(stats: Sequence[StepStats]) -> dict[str, float]:
        """The mean loss, clip fraction and approximate KL over ``stats`` (one per trained step evaluated)."""
        return {
            "loss": float(np.mean([st.loss for st in stats])),
            "clip_frac": float(np.mean([st.ppo.clip_frac for st in stats])),
            "approx_kl": float(np.mean([st.ppo.approx_kl for st in stats])),
        }


@dataclass(frozen=True, kw_only=True)
class TrainedSteps:
    """The T trained steps of a micro-batch of B trajectories, as the rollout stored them: the model inputs
    ``x`` and the sampled next latents ``x_next`` (T, B, ...), their times ``sigma`` / ``sigma_next`` (T,) or
    per-sample (T, B), the log-probs of the samples at sampling time ``old_log_prob`` (T, B), and the model
    outputs ``outputs`` (T, B, ...) where the rollout kept them (None otherwise)."""

    x: Tensor
    x_next: Tensor
    sigma: Tensor
    sigma_next: Tensor
    old_log_prob: Tensor
    outputs: Tensor | None = None


KL_STD = ("flow_grpo", "step")  # which std the KL penalty divides by (GRPOStepLoss.kl_std)


@dataclass
class GRPOStepLoss:
    """The per-step GRPO loss of T trained steps of a micro-batch of B trajectories: ``loss(i, v_i)``.

    For the i-th trained step (input latent x_i at time sigma_i, stored next latent x_{i+1} at sigma_next_i)
    and the model output v_i at (x_i, sigma_i), per sample b:

        mu_i, std_i   = the SDE step's Gaussian (``sde_step_with_logprob(kind, noise_level)``)
        logp_i[b]     = mean over elements of log N(x_{i+1}; mu_i, std_i^2)     (the stored sample's log-prob)
        r_i[b]        = exp(logp_i[b] - old_log_prob[i, b])
        L_i           = mean_b max(-A_b r_i[b], -A_b clip(r_i[b], 1 - eps, 1 + eps))
                        + kl_beta * mean_b mean_elements (mu_i - mu_ref_i)^2 / (2 std_dev_t_i^2)   (if ref_velocity)

    with Flow-GRPO's std_dev_t (``SDEStep.std_dev_t``, ``scripts/train_flux.py``): the diffusion coefficient g
    without the step's sqrt(|dt|) for the ``flow_grpo`` and ``dance`` kinds (so the term is |dt| times the exact
    KL of the two step Gaussians), the step std for ``cps`` (where the two coincide). ``kl_std="step"`` uses the
    step std for every kind instead: the exact KL of the two step Gaussians (the world recipe was tuned with it).

    and ``loss(i, v)`` returns ``scale * L_i`` (the trainer's scale is 1 / (grad_accum * T)). The KL reference
    mean mu_ref_i comes from ``ref_velocity(x_i, sigma_i)`` without autograd. ``evaluate(i, v)`` returns the
    scaled loss and its statistics (``StepStats``: L_i unscaled and the ``PPOStats``); ``loss(i, v)`` is its
    loss alone, so the object is itself the ``loss`` of ``BackwardSetting.backward`` (``loss.x`` and
    ``loss.sigma`` are the latents and times it reads). Evaluating it changes nothing.

    Follows DanceGRPO ``fastvideo/train_grpo_flux.py`` (``grpo_one_step``: recompute the log-prob of the stored
    next latent with ``flux_step``; the clipped loss in ``train_one_step``) and Flow-GRPO
    ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`` (``sde_step_with_logprob`` with ``prev_sample``) with
    the clipped surrogate and KL of ``scripts/train_sd3.py`` / ``scripts/train_flux.py`` (docs/references.md
    lists the deliberate differences).

    ``steps`` holds the T trained steps whole (``TrainedSteps``: x, x_next (T, B, ...); sigma, sigma_next (T,)
    or per-sample (T, B); old_log_prob (T, B)); ``x`` / ``sigma`` read through to it. advantages (B,). ``kind`` / ``noise_level`` as in ``sde_step_with_logprob``; ``clip_range`` is eps.
    """

    steps: TrainedSteps
    advantages: Tensor
    kind: str
    noise_level: float
    clip_range: float
    kl_beta: float = 0.0
    ref_velocity: Callable[[Tensor, Tensor], Tensor] | None = None
    scale: float = 1.0
    kl_std: str = "flow_grpo"  # "flow_grpo": Flow-GRPO's std_dev_t; "step": the step std (the exact step KL)
    stats: list[StepStats] | None = (
        None  # where a list: the StepStats of every call, in order (``recording``)
    )

    def __post_init__(self) -> None:
        if self.kl_std not in KL_STD:
            raise ValueError(f"kl_std must be one of {KL_STD}, got {self.kl_std!r}")
        if self.kl_beta > 0 and self.ref_velocity is None:
            raise ValueError("kl_beta > 0 needs ref_velocity (the reference model's velocity)")

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def x(self) -> Tensor:
        """The inputs of the trained steps (T, B, ...): what a backward setting reads (``StepLoss``)."""
        return self.steps.x

    @property
    def sigma(self) -> Tensor:
        """Their times (T,) or (T, B)."""
        return self.steps.sigma

    @classmethod
    @torch.no_grad()
    def on_policy(
        cls,
        velocity: Callable[[Tensor, Tensor], Tensor],
        x: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        advantages: Tensor,
        *,
        kind: str,
        noise_level: float,
        clip_range: float,
        generator: torch.Generator | None = None,
    ) -> GRPOStepLoss:
        """The loss of a group sampled by ``velocity`` itself: step i's next latent and old log-prob come from
        one SDE step at (x_i, sigma_i) (drawn with ``generator``), so every ratio is 1 at these parameters.
        What a rollout stores, for benchmarks and numerical experiments on a given group of inputs x (T, B, ...)."""
        steps = [
            sde_step_with_logprob(
                x[i],
                velocity(x[i], sigma[i]),
                sigma[i],
                sigma_next[i],
                kind=kind,
                noise_level=noise_level,
                generator=generator,
            )
            for i in range(x.shape[0])
        ]
        trained = TrainedSteps(
            x=x,
            x_next=torch.stack([st.prev_sample for st in steps]),
            sigma=sigma,
            sigma_next=sigma_next,
            old_log_prob=torch.stack([st.log_prob for st in steps]),
        )
        return cls(
            trained,
            advantages=advantages,
            kind=kind,
            noise_level=noise_level,
            clip_range=clip_range,
        )

    @classmethod
    def of(cls, steps: TrainedSteps, advantages: Tensor, **objective) -> GRPOStepLoss:
        """The loss of ``steps`` with ``advantages`` (B,) and the objective's keywords (kind, noise_level,
        clip_range, ...; ``AlgorithmConfig.step_loss`` fills them from a config)."""
        return cls(steps, advantages, **objective)

    def __call__(self, i: int, v: Tensor) -> Tensor:
        value, stats = self.evaluate(i, v)
        if self.stats is not None:
            self.stats.append(stats)
        return value

    def recording(self) -> GRPOStepLoss:
        """This loss keeping the ``StepStats`` of every call in ``stats`` (the trainer's metrics)."""
        return dataclasses.replace(self, stats=[])

    def evaluate(self, i: int, v: Tensor) -> tuple[Tensor, StepStats]:
        """``(scale * L_i, StepStats(L_i, PPOStats))`` for the model output ``v`` of the i-th trained step."""
        steps = self.steps
        x, s, s_next, x_next = steps.x[i], steps.sigma[i], steps.sigma_next[i], steps.x_next[i]
        step = sde_step_with_logprob(
            x, v, s, s_next, kind=self.kind, noise_level=self.noise_level, prev_sample=x_next
        )
        loss, stats = clipped_ppo_loss(step.log_prob, steps.old_log_prob[i], self.advantages, self.clip_range)
        if self.ref_velocity is not None and self.kl_beta != 0:
            with torch.no_grad():
                ref = sde_step_with_logprob(
                    x,
                    self.ref_velocity(x, s),
                    s,
                    s_next,
                    kind=self.kind,
                    noise_level=self.noise_level,
                    prev_sample=x_next,
                )
            std = step.std_dev_t if self.kl_std == "flow_grpo" else step.std
            loss = loss + self.kl_beta * gaussian_mean_kl(step.mean, ref.mean, std).mean()
        scaled = loss if self.scale == 1.0 else loss * self.scale
        return scaled, StepStats(loss.item(), stats)
