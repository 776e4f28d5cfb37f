"""Gradient diagnostics: how close each two-endpoint strategy's group gradient is to the exact one.

``group_gradient_cosines`` cuts the T trained steps into the groups ``plan_groups`` makes, and for every group of
two or more steps computes the exact per-step group gradient and each compared strategy's gradient over the
given (trainable) parameters, then their cosine similarity and relative error. ``experiments/cosine.py``
measures JAGG's gradient quality along the trajectory with it; the same numbers are what an automatic
``jagg_frac`` rule would route on (JAGG where the cosine stays high).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.engine.strategies import StepLoss, Velocity, group_backward, plan_groups


@dataclass(frozen=True)
class GroupCosine:
    """One strategy's gradient of one group vs the exact gradient of that group (float64 comparisons)."""

    group: int  # position of the group along the trajectory (0 = the highest-noise group)
    steps: tuple[int, ...]  # positions of its steps among the T trained steps
    strategy: str
    cosine: float  # cos(g_strategy, g_exact)
    rel_norm_err: float  # ||g_strategy - g_exact|| / ||g_exact||


def flat_grad(params: Iterable[torch.nn.Parameter]) -> Tensor:
    """Every parameter's ``.grad`` flattened into one vector (zeros where a gradient is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def group_gradient_cosines(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    *,
    group_size: int,
    strategies: Sequence[str] = ("jagg",),
    endpoints: str = "batched",
) -> list[GroupCosine]:
    """Per group of ``group_size`` consecutive trained steps: each of ``strategies`` vs the exact gradient.

    Args:
        velocity, latents (T, B, ...), sigmas (T,) or (T, B), step_loss: as for ``trajectory_backward``
            (steps sorted by time, ``step_loss(i, v)`` indexed by the trained-step position i).
        params: the parameters the gradients are taken over (the trainable ones).
        group_size: W; the groups are ``plan_groups(T, W, ...)``'s, a single-step group is skipped.
        strategies: the strategies compared with ``exact``; ``endpoints`` is passed to ``group_backward``.

    Returns one ``GroupCosine`` per (group, strategy), groups in trajectory order. ``.grad`` of ``params`` is
    left as it was (each gradient is taken from zero and the previous gradients are put back).
    """
    params = list(params)
    saved = [p.grad for p in params]
    out = []
    try:
        for g, plan in enumerate(plan_groups(latents.shape[0], group_size, 1.0, "jagg")):
            idx = list(plan.steps)
            if len(idx) < 2:
                continue
            grads = {}
            for strategy in ("exact", *strategies):
                for p in params:
                    p.grad = None
                group_backward(
                    velocity,
                    latents[idx],
                    sigmas[idx],
                    lambda j, v, idx=idx: step_loss(idx[j], v),
                    strategy,
                    endpoints=endpoints,
                )
                grads[strategy] = flat_grad(params).double()
            ref = grads["exact"]
            for strategy in strategies:
                out.append(
                    GroupCosine(
                        group=g,
                        steps=tuple(idx),
                        strategy=strategy,
                        cosine=torch.nn.functional.cosine_similarity(grads[strategy], ref, dim=0).item(),
                        rel_norm_err=((grads[strategy] - ref).norm() / ref.norm()).item(),
                    )
                )
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad
    return out


def route_by_cosine(cosines: Sequence[GroupCosine], min_cosine: float, strategy: str = "jagg") -> list[bool]:
    """Per group position: True (use ``strategy``) where its gradient's cosine to the exact one is at least
    ``min_cosine``, False (exact) elsewhere.

    ``cosines`` come from ``group_gradient_cosines`` (one micro-batch, or several: a position qualifies only if
    every measurement of it does). A group of two steps always qualifies: JAGG is exact there (alpha = (0, 1)),
    so a cosine below 1 can only be rounding. Positions that were not measured (single-step groups) stay exact.
    """
    if not -1.0 <= min_cosine <= 1.0:
        raise ValueError(f"min_cosine must be in [-1, 1], got {min_cosine!r}")
    ok: dict[int, bool] = {}
    for c in cosines:
        if c.strategy != strategy:
            continue
        good = len(c.steps) == 2 or c.cosine >= min_cosine
        ok[c.group] = ok.get(c.group, True) and good
    return [ok.get(g, False) for g in range(max(ok, default=-1) + 1)]
