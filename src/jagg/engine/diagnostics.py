"""Gradient diagnostics: how close each two-endpoint strategy's group gradient is to the exact one.

``group_gradient_cosines`` cuts the T trained steps into consecutive groups of W (the groups
``jagg.engine.routing.plan_groups`` makes), and for every group of
two or more steps computes the exact per-step group gradient and each compared strategy's gradient over the
given (trainable) parameters, then their cosine similarity and relative error. ``experiments/cosine.py``
measures JAGG's gradient quality along the trajectory with it; ``route_by_cosine`` turns the same numbers into
a routing (``jagg.engine.routing.calibrate_routing``, ``backward.jagg_frac: auto``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.engine.strategies import (
    GraphRun,
    Interpolation,
    StepLoss,
    Velocity,
    exact_at_two,
    group_interpolation,
)


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


def local_grads(params: Sequence[torch.nn.Parameter]) -> list[Tensor]:
    """This rank's part of every gradient in float64 (a DTensor's local shard under FSDP2; zeros where None)."""
    out = []
    for p in params:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.append((g.to_local() if hasattr(g, "to_local") else g).detach().double().flatten())
    return out


@contextlib.contextmanager
def grads_held(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Inside the block every ``.grad`` of ``params`` starts from None (a measurement's own backward); after it,
    whatever happened, the gradients from before are put back (the ones the update goes on with)."""
    params = list(params)
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, held, strict=True):
            p.grad = g


def reduced(sums: Tensor, sharded: bool) -> Tensor:
    """``sums``, partial sums over this rank's shards, added over the ranks when the tensors are sharded (one
    all-reduce, on the GPU under NCCL), so no rank ever holds a full tensor."""
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        sums = sums.to("cuda" if torch.distributed.get_backend() == "nccl" else sums.device)
        torch.distributed.all_reduce(sums)
    return sums


def sharded_sums(a: list[Tensor], b: list[Tensor], sharded: bool) -> tuple[float, float, float, float]:
    """(<a, b>, |a|^2, |b|^2, |a - b|^2) over all parameters: local sums, then one all-reduce across the ranks
    when the gradients are sharded (``reduced``)."""
    sums = torch.stack(
        [
            sum((x * y).sum() for x, y in zip(a, b)),
            sum((x * x).sum() for x in a),
            sum((y * y).sum() for y in b),
            sum(((x - y) ** 2).sum() for x, y in zip(a, b)),
        ]
    )
    return tuple(float(x) for x in reduced(sums, sharded).cpu())


def compare_grads(a: list[Tensor], ref: list[Tensor], sharded: bool) -> tuple[float, float]:
    """(cosine, relative error) of ``a`` vs ``ref``: on the flat vectors in one process, from all-reduced
    sums when the gradients are sharded (never gathering a full gradient)."""
    if not sharded:
        fa, fr = torch.cat(a), torch.cat(ref)
        return (
            torch.nn.functional.cosine_similarity(fa, fr, dim=0).item(),
            ((fa - fr).norm() / fr.norm()).item(),
        )
    dot, n_a, n_ref, n_diff = sharded_sums(a, ref, sharded)
    return dot / max(n_a * n_ref, 1e-300) ** 0.5, (n_diff / max(n_ref, 1e-300)) ** 0.5


def group_gradient_cosines(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    *,
    group_size: int,
    strategies: Sequence[str] = ("jagg",),
    run: GraphRun | None = None,
) -> list[GroupCosine]:
    """Per group of ``group_size`` consecutive trained steps: each of ``strategies`` vs the exact gradient.

    Args:
        velocity, latents (T, B, ...), sigmas (T,) or (T, B), step_loss: the T trained steps sorted by time
            (sigma decreasing), ``step_loss(i, v)`` indexed by the trained-step position i.
        params: the parameters the gradients are taken over (the trainable ones).
        group_size: W; the groups are consecutive (``plan_groups(T, W, ...)``'s), a single-step group is skipped.
        strategies: the strategies compared with ``exact``.
        run: how each group's plan (``group_interpolation``) runs; ``GraphRun()`` (its defaults) when None. The
            gradient is the same whichever way; a calibration passes the run's graph mode for its memory.

    Returns one ``GroupCosine`` per (group, strategy), groups in trajectory order. ``.grad`` of ``params`` is
    left as it was (each gradient is taken from zero and the previous gradients are put back).
    """
    run = run or GraphRun()
    params = list(params)
    sharded = any(hasattr(p, "to_local") for p in params)  # FSDP2 parameters are DTensors
    out = []
    with grads_held(params):
        num_steps = latents.shape[0]
        for g, start in enumerate(range(0, num_steps, group_size)):
            idx = list(range(start, min(start + group_size, num_steps)))
            if len(idx) < 2:
                continue
            grads = {}
            for strategy in ("exact", *strategies):
                for p in params:
                    p.grad = None
                sig = torch.as_tensor(sigmas[idx])
                run.run_plan(
                    group_interpolation(strategy, sig),
                    velocity,
                    latents[idx],
                    sig,
                    lambda j, v, idx=idx: step_loss(idx[j], v),
                )
                grads[strategy] = local_grads(params)
            ref = grads["exact"]
            for strategy in strategies:
                cos, rel = compare_grads(grads[strategy], ref, sharded)
                out.append(GroupCosine(g, tuple(idx), strategy, cos, rel))
    return out


def plan_gradient_cosines(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    plans: dict[str, Interpolation],
    *,
    run: GraphRun | None = None,
) -> dict[str, tuple[float, float]]:
    """Per named plan of the T steps: (cosine, relative error) of its whole gradient to the exact one (the
    identity plan, every step a plain step), over ``params`` (sharded dot products under FSDP2); each plan runs
    ``run`` (``GraphRun()`` when None). ``.grad`` of ``params`` is left as it was."""
    run = run or GraphRun()
    params = list(params)
    sharded = any(hasattr(p, "to_local") for p in params)
    identity = Interpolation.identity(latents.shape[0])
    grads = {}
    with grads_held(params):
        for name, plan in {"": identity, **plans}.items():
            for p in params:
                p.grad = None
            run.run_plan(plan, velocity, latents, sigmas, step_loss)
            grads[name] = local_grads(params)
    return {name: compare_grads(grads[name], grads[""], sharded) for name in plans}


def route_by_cosine(cosines: Sequence[GroupCosine], min_cosine: float, strategy: str = "jagg") -> list[bool]:
    """Per group position: True (use ``strategy``) where its gradient's cosine to the exact one is at least
    ``min_cosine``, False (exact) elsewhere.

    ``cosines`` come from ``group_gradient_cosines`` (one micro-batch, or several: a position qualifies only if
    every measurement of it does). A group of two steps qualifies whatever its cosine when ``strategy`` is exact
    at W = 2 (``exact_at_two``: its weight matrix for two steps is the identity, as JAGG's alpha = (0, 1) and the
    endpoints ablation give), so a cosine below 1 can only be rounding; a strategy that is not (uniform) is
    measured like any other group. Positions that were not measured (single-step groups) stay exact.
    """
    if not -1.0 <= min_cosine <= 1.0:
        raise ValueError(f"min_cosine must be in [-1, 1], got {min_cosine!r}")
    exact_pairs = exact_at_two(strategy)
    ok: dict[int, bool] = {}
    for c in cosines:
        if c.strategy != strategy:
            continue
        good = (exact_pairs and len(c.steps) == 2) or c.cosine >= min_cosine
        ok[c.group] = ok.get(c.group, True) and good
    return [ok.get(g, False) for g in range(max(ok, default=-1) + 1)]
