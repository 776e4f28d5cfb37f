"""Backward strategies for one group of W consecutive trained steps: exact, JAGG and two ablations.

The exact group gradient is  sum_j J_j^T s_j  with J_j = dv_j/dtheta and s_j = dL_j/dv_j. JAGG (the paper,
arXiv 2607.17572; docs/method.md) approximates
    J_j ~ (1 - alpha_j) J_0 + alpha_j J_{W-1},   alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}),
which turns the sum into  J_0^T s_base + J_{W-1}^T s_corr  with
    s_base = sum_j (1 - alpha_j) s_j,   s_corr = sum_j alpha_j s_j,
i.e. ONE joint ``torch.autograd.backward`` through the two endpoint forwards.

JAGG and the ablations differ only in the (W, 2) matrix that maps per-step signals onto the two endpoints:
    jagg       [1 - alpha_j, alpha_j]                       (paper, Theorem 1: exact for linear v, and W = 2)
    endpoints  [1, 0] for j = 0, [0, 1] for j = W-1, else 0 (the paper's reading (a): intermediate signals dropped)
    uniform    [1/2, 1/2]                                   (aggregation without t-weights)
Steps whose row is all zeros need no forward at all, so the endpoints ablation also skips those forwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# velocity(z, t) -> v : z (B, ...), t scalar tensor or (B,) ; v (B, ...)
Velocity = Callable[[Tensor, Tensor], Tensor]
# step_loss(j, v_j) -> scalar loss of step j of the group
StepLoss = Callable[[int, Tensor], Tensor]


@dataclass
class GroupStats:
    """What one ``group_backward`` did. Counts are per call; ``loss`` is sum_j L_j over computed steps."""

    strategy: str
    group_size: int
    loss: float
    step_losses: list[float]
    forward_passes: int  # model forwards (with or without autograd)
    forward_passes_with_grad: int
    backward_passes: int  # model graphs back-propagated
    backward_calls: int  # autograd backward invocations
    time_forward_s: float = 0.0
    time_backward_s: float = 0.0  # transformer backward (the part JAGG saves)
    extras: dict = field(default_factory=dict)

    def merge(self, other: GroupStats) -> GroupStats:
        """Sum of two stats (used to accumulate over the groups of a trajectory)."""
        return GroupStats(
            strategy=self.strategy if self.strategy == other.strategy else "mixed",
            group_size=self.group_size + other.group_size,
            loss=self.loss + other.loss,
            step_losses=self.step_losses + other.step_losses,
            forward_passes=self.forward_passes + other.forward_passes,
            forward_passes_with_grad=self.forward_passes_with_grad + other.forward_passes_with_grad,
            backward_passes=self.backward_passes + other.backward_passes,
            backward_calls=self.backward_calls + other.backward_calls,
            time_forward_s=self.time_forward_s + other.time_forward_s,
            time_backward_s=self.time_backward_s + other.time_backward_s,
        )


class _Timer:
    """Wall-clock accumulator; synchronises CUDA so GPU timings are real."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> _Timer:
        _sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
        self.total += time.perf_counter() - self._t0


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- aggregation weights
def t_weights(sigmas: Tensor) -> Tensor:
    """alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}) for sigmas of shape (W,) or per-sample (W, B)."""
    return (sigmas[0] - sigmas) / (sigmas[0] - sigmas[-1])


def jagg_weights(sigmas: Tensor) -> Tensor:
    """JAGG: step j's signal goes (1 - alpha_j) to the first endpoint and alpha_j to the last."""
    alpha = t_weights(sigmas)
    return torch.stack([1 - alpha, alpha], dim=1)  # (W, 2) or (W, 2, B)


def endpoints_weights(sigmas: Tensor) -> Tensor:
    """Ablation (a): each endpoint gets only its own step's signal; intermediate signals are dropped."""
    w = torch.zeros(sigmas.shape[0], 2, *sigmas.shape[1:], dtype=sigmas.dtype, device=sigmas.device)
    w[0, 0] = 1
    w[-1, 1] = 1
    return w


def uniform_weights(sigmas: Tensor) -> Tensor:
    """Ablation (b): every step's signal split equally onto both endpoints (no t-weights)."""
    return torch.full((sigmas.shape[0], 2, *sigmas.shape[1:]), 0.5, dtype=sigmas.dtype, device=sigmas.device)


# name -> weight rule. "exact" is the per-step baseline and has no weights.
AGGREGATION_WEIGHTS: dict[str, Callable[[Tensor], Tensor]] = {
    "jagg": jagg_weights,
    "endpoints": endpoints_weights,
    "uniform": uniform_weights,
}
STRATEGIES: tuple[str, ...] = ("exact", *AGGREGATION_WEIGHTS)


# --------------------------------------------------------------------------- strategies
def _check_group(latents: Tensor, sigmas: Tensor) -> None:
    w = latents.shape[0]
    if sigmas.shape[0] != w or sigmas.ndim not in (1, 2):
        raise ValueError(f"sigmas must have shape (W,) or (W, B) with W = {w}, got {tuple(sigmas.shape)}")
    if sigmas.ndim == 2 and sigmas.shape[1] != latents.shape[1]:
        raise ValueError(f"per-sample sigmas {tuple(sigmas.shape)} do not match batch {latents.shape[1]}")
    if w > 1 and not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing within a group (t_0 > ... > t_{W-1})")


def exact_backward(velocity: Velocity, latents: Tensor, sigmas: Tensor, step_loss: StepLoss) -> GroupStats:
    """Baseline: for every step one forward with autograd and one backward (DanceGRPO / Flow-GRPO)."""
    t_fwd, t_bwd = _Timer(), _Timer()
    losses = []
    for j in range(latents.shape[0]):
        with t_fwd:
            v = velocity(latents[j], sigmas[j])
        loss = step_loss(j, v)
        with t_bwd:
            torch.autograd.backward(loss)
        losses.append(loss.item())
    w = latents.shape[0]
    return GroupStats("exact", w, sum(losses), losses, w, w, w, w, t_fwd.total, t_bwd.total)


def aggregated_backward(
    velocity: Velocity, latents: Tensor, sigmas: Tensor, step_loss: StepLoss, weights: Tensor, name: str
) -> GroupStats:
    """Two-endpoint backward with per-step signals mapped onto the endpoints by ``weights`` (W, 2[, B]).

    1. Forward every step whose weight row is non-zero; only the endpoints keep an autograd graph.
    2. s_j = dL_j/dv_j by autograd through a detached proxy of v_j (only the light SDE/PPO math).
    3. g_0 = sum_j w[j, 0] s_j,  g_1 = sum_j w[j, 1] s_j.
    4. One ``torch.autograd.backward([v_0, v_{W-1}], [g_0, g_1])``.
    """
    w = latents.shape[0]
    ends = (0, w - 1)
    t_fwd, t_bwd = _Timer(), _Timer()
    endpoint_out: dict[int, Tensor] = {}
    grads = [None, None]
    losses, n_fwd = [], 0
    for j in range(w):
        wj = weights[j]  # (2,) or (2, B)
        if j not in ends and not bool((wj != 0).any()):
            continue
        with t_fwd, torch.set_grad_enabled(j in ends):
            v = velocity(latents[j], sigmas[j])
        n_fwd += 1
        if j in ends:
            endpoint_out[j] = v
        proxy = v.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = step_loss(j, proxy)
            (s_j,) = torch.autograd.grad(loss, proxy)
        losses.append(loss.item())
        for k in range(2):
            wjk = wj[k].to(s_j.dtype)
            if wjk.ndim == 1:  # per-sample alpha: (B,) -> (B, 1, ...)
                wjk = wjk.view(-1, *([1] * (s_j.ndim - 1)))
            contrib = wjk * s_j
            grads[k] = contrib if grads[k] is None else grads[k] + contrib
    with t_bwd:
        torch.autograd.backward(
            [endpoint_out[0], endpoint_out[w - 1]],
            [grads[0].to(endpoint_out[0].dtype), grads[1].to(endpoint_out[w - 1].dtype)],
        )
    return GroupStats(name, w, sum(losses), losses, n_fwd, 2, 2, 1, t_fwd.total, t_bwd.total)


def group_backward(
    velocity: Velocity, latents: Tensor, sigmas: Tensor, step_loss: StepLoss, strategy: str
) -> GroupStats:
    """ADD the (approximate) gradient of sum_j L_j over one group to the parameters' ``.grad``.

    Args:
        velocity: ``velocity(z, t)``, differentiable in the trained parameters; z (B, ...), t scalar or (B,).
        latents: (W, B, ...) the stored model inputs of the group's W steps.
        sigmas: (W,) or per-sample (W, B) times, strictly decreasing along the group.
        step_loss: ``step_loss(j, v_j)`` -> scalar loss of step j as a function of its model output.
        strategy: one of ``STRATEGIES``. A group of one step is always exact.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    sigmas = torch.as_tensor(sigmas)
    _check_group(latents, sigmas)
    if strategy == "exact" or latents.shape[0] == 1:
        return exact_backward(velocity, latents, sigmas, step_loss)
    weights = AGGREGATION_WEIGHTS[strategy](sigmas.to(torch.float64))
    return aggregated_backward(velocity, latents, sigmas, step_loss, weights, strategy)


# --------------------------------------------------------------------------- routing (jagg_frac)
@dataclass(frozen=True)
class GroupPlan:
    """One group of a trajectory: positions (into the trained-step list) and the strategy it uses."""

    steps: tuple[int, ...]
    strategy: str


def validate_routing(group_size: int, jagg_frac: float, strategy: str) -> None:
    """Raise ValueError naming the offending key and the allowed range."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"backward.group_size must be an integer >= 2, got {group_size!r}")
    if not 0.0 <= float(jagg_frac) <= 1.0:
        raise ValueError(f"backward.jagg_frac must be in [0, 1], got {jagg_frac!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"backward.strategy must be one of {STRATEGIES}, got {strategy!r}")


def plan_groups(num_steps: int, group_size: int, jagg_frac: float, strategy: str) -> list[GroupPlan]:
    """Cut ``num_steps`` time-sorted trained steps into consecutive groups of ``group_size``.

    The last group may be shorter. The first ``round(jagg_frac * n_groups)`` groups (round half up) use
    ``strategy``; the rest, and any group of a single step, use the exact per-step backward.
    """
    validate_routing(group_size, jagg_frac, strategy)
    starts = range(0, num_steps, group_size)
    n_groups = len(starts)
    n_routed = math.floor(jagg_frac * n_groups + 0.5)
    plans = []
    for g, s in enumerate(starts):
        steps = tuple(range(s, min(s + group_size, num_steps)))
        routed = g < n_routed and len(steps) > 1
        plans.append(GroupPlan(steps, strategy if routed else "exact"))
    return plans


def trajectory_backward(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    *,
    strategy: str,
    group_size: int,
    jagg_frac: float,
) -> GroupStats:
    """Backward over all T trained steps of a trajectory with ``jagg_frac`` routing.

    ``latents`` (T, B, ...) and ``sigmas`` (T,) or (T, B) must be sorted by time (sigma decreasing);
    ``step_loss(i, v)`` takes the index i into the T trained steps.
    """
    total = None
    for plan in plan_groups(latents.shape[0], group_size, jagg_frac, strategy):
        idx = list(plan.steps)
        stats = group_backward(
            velocity,
            latents[idx],
            torch.as_tensor(sigmas)[idx],
            lambda j, v, idx=idx: step_loss(idx[j], v),
            plan.strategy,
        )
        total = stats if total is None else total.merge(stats)
    return total
