"""Shared knots: the Jacobian of the velocity interpolated piecewise-linearly in t over a whole trajectory.

JAGG interpolates the Jacobian linearly inside each group of W steps, between the group's two endpoints, so two
adjacent groups back-propagate two knots one step apart. Shared knots use each knot for the steps on both sides
of it: for K knot steps k_0 = 0 < k_1 < ... < k_{K-1} = T - 1 among the T time-sorted trained steps, a step j
between knots a = k_i and c = k_{i+1} takes

    J_j ~ (1 - alpha_j) J_a + alpha_j J_c,    alpha_j = (t_a - t_j) / (t_a - t_c),

so the gradient sum_j J_j^T s_j becomes sum_i J_{k_i}^T g_i with g_i = sum_j hat_i(t_j) s_j: the hat functions
of t over the knots (``hat_weights``). That is K backward passes for T steps, in one block (one stacked forward
and one backward, ``jagg.engine.strategies.interpolated_backward``). Exact when every step is a knot, and for a
velocity linear in (z, t) on a straight path (the Theorem 1 argument applies to every interval); equal to JAGG
when the knots are JAGG's group endpoints and no step lies between two groups.

Where the knots sit is a rule (``PLACEMENTS``): evenly in step index, evenly in t, or denser toward low noise,
where the Jacobian bends most in the world backbones (docs/method.md, "Knots"). ``Knots`` is the routing that
applies a rule; ``backward.placement: auto`` measures the rules on the rollout and keeps the best
(``jagg.engine.routing.calibrate_knots``).

A velocity made of several networks that switch at fixed times (Wan2.2-A14B's high- and low-noise experts)
declares the switches as ``expert_boundaries`` (sigmas b: a step at sigma >= b is on the noisier side). No knot
interval may straddle one, or it would interpolate the Jacobians of two different models: ``expert_segments``
cuts the T steps where any sample's step changes side, and each stretch gets its own knots
(``Knots.positions``: both ends of every stretch, the rest of K shared by the stretches' steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.common import expert_side
from jagg.engine.strategies import Interpolation


def _distinct(targets: list[float], num_steps: int) -> tuple[int, ...]:
    """Round increasing targets in [0, T - 1] to K strictly increasing step positions with both ends kept."""
    k = len(targets)
    pos = [round(x) for x in targets]
    pos[0], pos[-1] = 0, num_steps - 1
    for i in range(1, k - 1):  # push collisions up ...
        pos[i] = max(pos[i], pos[i - 1] + 1)
    for i in range(k - 2, 0, -1):  # ... and back down from the last step
        pos[i] = min(pos[i], pos[i + 1] - 1)
    return tuple(pos)


def index_knots(sigma: Tensor, count: int) -> tuple[int, ...]:
    """Knots evenly spaced in step index."""
    t = sigma.shape[0]
    return _distinct([i * (t - 1) / (count - 1) for i in range(count)], t)


def time_knots(sigma: Tensor, count: int) -> tuple[int, ...]:
    """Knots at the steps nearest to K times evenly spaced in t between the first and the last step."""
    t = sigma.shape[0]
    targets = torch.linspace(float(sigma[0]), float(sigma[-1]), count, dtype=torch.float64)
    nearest = [float((sigma.double() - x).abs().argmin()) for x in targets]
    return _distinct(nearest, t)


def low_noise_knots(sigma: Tensor, count: int) -> tuple[int, ...]:
    """Knots denser toward the low-noise end: position (T - 1) (1 - (1 - u)^2) for u evenly spaced in [0, 1]
    (the spacing shrinks linearly toward the last step, where the world backbones' Jacobians bend)."""
    t = sigma.shape[0]
    return _distinct([(t - 1) * (1 - (1 - i / (count - 1)) ** 2) for i in range(count)], t)


# name -> rule(reference times (T,), K) -> K ascending step positions with 0 and T - 1 among them
PLACEMENTS: dict[str, Callable[[Tensor, int], tuple[int, ...]]] = {
    "index": index_knots,
    "time": time_knots,
    "low_noise": low_noise_knots,
}


def expert_segments(sigma: Tensor, boundaries: Sequence[float]) -> list[range]:
    """The T time-sorted steps cut into maximal stretches in which no sample crosses an expert boundary (which
    side a step is on: ``jagg.common.expert_side``, the rule the model runs its experts by); one stretch without
    boundaries. ``sigma`` (T,) or per sample (T, B): a cut wherever any sample's step j and step j + 1 lie on
    different sides. One step (a window of one) is one stretch."""
    t = sigma.shape[0]
    if not boundaries:
        return [range(t)]
    side = expert_side(sigma, boundaries)  # (T[, B]): the model's own rule (float32 timesteps), jagg.common
    # (T, B or 1) before the difference, whose T - 1 rows may be none: an empty tensor has no -1 to infer
    side = side.reshape(t, math.prod(side.shape[1:]))
    changes = (side[1:] != side[:-1]).any(dim=1)  # (T - 1,): any sample changes side after step j
    cuts = [0, *(j + 1 for j in range(t - 1) if bool(changes[j])), t]
    return [range(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def split_count(count: int, lengths: Sequence[int]) -> list[int]:
    """K knots over stretches of ``lengths`` steps: each gets its two ends (one for a one-step stretch), so K is
    raised to that where it is smaller; the knots left go to the stretches in proportion to their steps that are
    not yet knots (largest remainder, ties to the earlier, noisier stretch), never more than a stretch has."""
    base = [min(2, n) for n in lengths]
    room = [n - b for n, b in zip(lengths, base)]
    extra = min(max(count - sum(base), 0), sum(room))
    if extra == 0:
        return base
    quotas = [extra * r / sum(room) for r in room]
    share = [math.floor(q) for q in quotas]
    order = sorted(range(len(lengths)), key=lambda i: (-(quotas[i] - share[i]), i))
    for i in order[: extra - sum(share)]:
        share[i] += 1
    return [b + s for b, s in zip(base, share)]


def hat_weights(sigma: Tensor, knots: tuple[int, ...]) -> Tensor:
    """(T, K[, B]) piecewise-linear interpolation weights in t: a knot step gives its own knot weight 1; a step
    between knots a and c gives 1 - alpha to a and alpha = (t_a - t_j) / (t_a - t_c) to c (per sample where
    ``sigma`` is (T, B))."""
    sigma = sigma.to(torch.float64)
    w = torch.zeros(sigma.shape[0], len(knots), *sigma.shape[1:], dtype=torch.float64)
    for i, k in enumerate(knots):
        w[k, i] = 1.0
    for i in range(len(knots) - 1):
        a, c = knots[i], knots[i + 1]
        for j in range(a + 1, c):
            alpha = (sigma[a] - sigma[j]) / (sigma[a] - sigma[c])
            w[j, i], w[j, i + 1] = 1 - alpha, alpha
    return w


@dataclass(frozen=True, kw_only=True)
class Knots:
    """The routing of ``backward.strategy: knots``: ``count`` shared knots placed by ``placement`` (a key of
    ``PLACEMENTS``), all back-propagated in one block. With T <= ``count`` every step is a knot (exact). Given
    ``boundaries`` (a velocity's ``expert_boundaries``), each stretch between them gets its own knots
    (``expert_segments``, ``split_count``): no interval between two knots spans a switch of network."""

    count: int
    placement: str
    strategy: str = "knots"

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 2:
            raise ValueError(f"backward.knots must be an integer >= 2, got {self.count!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"backward.placement must be one of {(*PLACEMENTS, 'auto')}, got {self.placement!r}"
            )

    def positions(self, sigma: Tensor, boundaries: Sequence[float] = ()) -> tuple[int, ...]:
        """The knot positions among the T steps; per-sample times (T, B) are placed by their mean over B. With
        ``boundaries``, the rule places each stretch's share of the knots within that stretch."""
        segments = expert_segments(sigma, boundaries)
        ref = sigma.double().mean(dim=1) if sigma.ndim == 2 else sigma.double()
        counts = split_count(self.count, [len(seg) for seg in segments])
        knots: list[int] = []
        for seg, k in zip(segments, counts):
            if len(seg) <= k:
                knots += list(seg)
            else:
                knots += [seg.start + i for i in PLACEMENTS[self.placement](ref[seg.start : seg.stop], k)]
        return tuple(knots)

    def interpolation(self, sigma: Tensor, boundaries: Sequence[float] = ()) -> Interpolation:
        """The (T, K[, B]) hat weights over the placed knots, one block (a single step is a plain step)."""
        sigma = torch.as_tensor(sigma)
        if sigma.shape[0] == 1:
            return Interpolation.identity(1, self.strategy)
        knots = self.positions(sigma, boundaries)
        return Interpolation(knots, hat_weights(sigma, knots), (tuple(range(len(knots))),), self.strategy)

    @property
    def label(self) -> str:
        """e.g. ``knots/K4/low_noise`` (the part of ``BackwardSetting.key`` before the mode)."""
        return f"{self.strategy}/K{self.count}/{self.placement}"
