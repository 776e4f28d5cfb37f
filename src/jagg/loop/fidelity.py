"""Gradient fidelity along training (``log.fidelity_every``): how close the update a run applies is to exact's.

At a fidelity iteration the trainer measures, on the same rollout and the same weights:

* per optimizer step, the update the arm applies (after a positive control's degradation, before clipping,
  which only rescales) against exact's update of the same micro-batches, computed as a shadow and never
  applied (``compare_to_exact``): its cosine and relative error. An exact arm gets cosine 1 to rounding, a
  control arm exactly its ``train.control_cosine``;
* on the update's first micro-batch, every block of the arm's plan alone against the exact backward of the
  steps it spans (``block_cosines``): where along the trajectory the error comes from.

Under FSDP2 both compare local shards through all-reduced sums (``jagg.engine.diagnostics.compare_grads``), so
no rank holds a full gradient. Cost: one exact update per fidelity iteration, one more backward of each
aggregated block and of the steps it spans on one micro-batch, and two float64 copies of this rank's gradient
shard while comparing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from jagg.engine.diagnostics import compare_grads, local_grads
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import Interpolation, StepLoss, Velocity


def compare_to_exact(
    params: Sequence[torch.nn.Parameter], run_exact: Callable[[], None]
) -> tuple[float, float]:
    """(cosine, relative error) of the gradients now in ``params``' ``.grad`` to those ``run_exact``
    accumulates from zero. The ``.grad`` are left as they were."""
    params = list(params)
    sharded = any(hasattr(p, "to_local") for p in params)
    applied, arm = [p.grad for p in params], local_grads(params)
    for p in params:
        p.grad = None
    try:
        run_exact()
        exact = local_grads(params)
    finally:
        for p, g in zip(params, applied, strict=True):
            p.grad = g
    return compare_grads(arm, exact, sharded)


def block_parts(plan: Interpolation) -> list[tuple[str, Interpolation, Interpolation]]:
    """Per aggregated block of ``plan`` (plain per-step blocks are exact by construction and left out):
    ``(span, the block alone, the exact backward of the steps it spans)``. A block spans the steps from its
    first to its last feeding step (``"j0-j1"``); where blocks share a step (hat functions of neighbouring knot
    blocks), both spans hold it."""
    parts = []
    for block in plan.blocks:
        if plan.is_plain(block):
            continue
        feed = plan.feeding(block) or [plan.knots[k] for k in block]
        span = list(range(min(feed), max(feed) + 1))
        alone = Interpolation(
            tuple(plan.knots[k] for k in block),
            plan.weights[:, list(block)],
            (tuple(range(len(block))),),
            plan.name,
        )
        pick = torch.zeros(plan.num_steps, len(span), dtype=torch.float64)
        pick[span, range(len(span))] = 1.0
        exact = Interpolation(tuple(span), pick, tuple((i,) for i in range(len(span))), "exact")
        parts.append((f"{span[0]}-{span[-1]}", alone, exact))
    return parts


def block_cosines(
    setting: BackwardSetting,
    velocity: Velocity,
    loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    outputs: torch.Tensor | None = None,
) -> dict[str, float]:
    """``{span: cosine}`` of each aggregated block of ``setting``'s plan for ``loss``'s steps, run as the
    setting runs it, against exact over its span (``block_parts``). ``.grad`` is left as it was."""
    params = list(params)
    saved = [p.grad for p in params]
    out = {}
    try:
        for span, alone, exact in block_parts(setting.routing.interpolation(loss.sigma)):
            for p in params:
                p.grad = None
            setting.run(alone, velocity, loss, outputs)
            out[span] = compare_to_exact(params, lambda e=exact: setting.run(e, velocity, loss))[0]
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return out
