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

``paired_divergence`` reads two runs' evaluated states (``log.save_eval_state``) and says how far one run's
held-out samples and weights are from the other's (exact's, same seed) relative to how far exact moved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

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


class FidelityRecord:
    """The measurements of one fidelity iteration, made where the update reaches them: the blocks before the
    first micro-batch, then each optimizer step's update; ``row`` gives the metrics."""

    def __init__(self) -> None:
        self.cosines: list[float] = []
        self.rel_errs: list[float] = []
        self.group_cosines: dict[str, float] = {}
        self.seconds = 0.0

    def measure_blocks(
        self, setting: BackwardSetting, velocity: Velocity, loss: StepLoss, params, outputs
    ) -> None:
        t0 = time.perf_counter()
        self.group_cosines = block_cosines(setting, velocity, loss, params, outputs)
        self.seconds += time.perf_counter() - t0

    def measure_step(self, params: Sequence[torch.nn.Parameter], run_exact: Callable[[], None]) -> None:
        """The gradient about to be applied vs ``run_exact``'s (``compare_to_exact``)."""
        t0 = time.perf_counter()
        cos, rel = compare_to_exact(params, run_exact)
        self.cosines.append(cos)
        self.rel_errs.append(rel)
        self.seconds += time.perf_counter() - t0

    def row(self) -> dict:
        """Means over the iteration's optimizer steps, the per-block cosines and the seconds it all took."""
        return {
            "fidelity_cosine": sum(self.cosines) / len(self.cosines),
            "fidelity_rel_err": sum(self.rel_errs) / len(self.rel_errs),
            "fidelity_group_cosines": self.group_cosines,
            "time_fidelity_s": self.seconds,
        }


def _eval_states(run_dir: Path) -> dict[int, list[dict]]:
    """``{iteration: [rank 0's state, rank 1's, ...]}`` of the run's ``samples/eval_<it>.rank<r>.pt``
    (``log.save_eval_state``)."""
    found: dict[int, dict[int, Path]] = {}
    for path in (Path(run_dir) / "samples").glob("eval_*.rank*.pt"):
        it, rank = path.name[5:-3].split(".rank")
        found.setdefault(int(it), {})[int(rank)] = path
    return {
        it: [torch.load(ranks[r], weights_only=True) for r in sorted(ranks)] for it, ranks in found.items()
    }


def _sq_dist(a: list[dict], b: list[dict], key: str) -> float:
    """The squared distance of two runs' ``key`` (images or weights) over every rank's part, float64."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        xs, ys = (x[key], y[key]) if key == "weights" else ([x[key]], [y[key]])
        total += sum(float(((u.double() - v.double()) ** 2).sum()) for u, v in zip(xs, ys, strict=True))
    return total


def paired_divergence(run_dir: Path, exact_dir: Path) -> dict[int, dict[str, float]]:
    """How far a run has moved from exact's run of the same seed, at each evaluation both saved:

        div_weights_rel = ||theta_run - theta_exact|| / ||theta_exact - theta_0||
        div_samples_rel = ||x_run - x_exact|| / ||x_exact - x_0||   (all held-out images, same noise)

    with theta_0 and x_0 exact's evaluation at iteration 0 (the base model, identical for every arm). 0 for
    exact itself; runs are deterministic, so no evaluation noise enters. NaN where exact has not moved yet
    (iteration 0). A difference grows once two runs' rollouts differ: protocol version 4's pilot found every
    non-exact arm near 1 (docs/decisions.md 24)."""
    mine, exact = _eval_states(run_dir), _eval_states(exact_dir)
    if 0 not in exact:
        raise FileNotFoundError(f"{exact_dir}: no samples/eval_00000.rank*.pt (log.save_eval_state)")
    out = {}
    for it in sorted(set(mine) & set(exact)):
        row = {}
        for key, name in (("weights", "div_weights_rel"), ("images", "div_samples_rel")):
            moved = _sq_dist(exact[it], exact[0], key)
            row[name] = (_sq_dist(mine[it], exact[it], key) / moved) ** 0.5 if moved > 0 else float("nan")
        out[it] = row
    return out
