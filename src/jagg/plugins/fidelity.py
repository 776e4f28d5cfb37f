"""Gradient fidelity along training, a plug-in of the update: how close the gradient a run hands to its optimizer
is to exact's (the gradient, not the step AdamW then takes, which its moments reshape).

At a fidelity iteration it measures, on the same rollout and the same weights:

* per optimizer step, the gradient the arm hands to AdamW (after a positive control's degradation, before
  clipping, which only rescales) against exact's gradient of the same micro-batches, computed as a shadow and
  never applied (``compare_to_exact``): its cosine and relative error. An exact arm gets cosine 1 to rounding, a
  control arm exactly its ``plugins.control.cosine``;
* on the update's first micro-batch, every block of the arm's plan alone against the exact backward of the
  steps it spans (``block_cosines``): where along the trajectory the error comes from.

Under FSDP2 both compare local shards through all-reduced sums (``jagg.engine.diagnostics.compare_grads``), so
no rank holds a full gradient. Cost: one exact update per fidelity iteration, one more backward of each
aggregated block and of the steps it spans on one micro-batch, and two float64 copies of this rank's gradient
shard while comparing.

Config key: ``plugins.fidelity.every`` (``FidelityConfig``; log.fidelity_every before, still read so).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from jagg.engine.diagnostics import compare_grads, grads_held, local_grads
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import Interpolation, StepLoss, Velocity
from jagg.plugins.base import MicroBatch, Plugin, PluginConfig, RunView, UpdateView, require


@dataclass(frozen=True, kw_only=True)
class FidelityConfig(PluginConfig):
    """plugins.fidelity: every ``every`` iterations (iteration 0 included; 0: off) also compute exact's update on
    the same rollout and weights (not applied) and log fidelity_cosine / fidelity_rel_err /
    fidelity_group_cosines; costs one exact update."""

    every: int = 0

    def validate(self, cfg) -> None:
        require(self.every >= 0, f"plugins.fidelity.every must be >= 0, got {self.every}")


def compare_to_exact(
    params: Sequence[torch.nn.Parameter], run_exact: Callable[[], None]
) -> tuple[float, float]:
    """(cosine, relative error) of the gradients now in ``params``' ``.grad`` to those ``run_exact``
    accumulates from zero. The ``.grad`` are left as they were."""
    params = list(params)
    sharded = any(hasattr(p, "to_local") for p in params)
    arm = local_grads(params)
    with grads_held(params):  # the arm's gradients, put back after
        run_exact()
        exact = local_grads(params)
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
    out = {}
    with grads_held(params):
        for span, alone, exact in block_parts(setting.plan(velocity, loss.sigma)):
            for p in params:
                p.grad = None
            setting.run(alone, velocity, loss, outputs)
            out[span] = compare_to_exact(params, lambda e=exact: setting.run(e, velocity, loss))[0]
    return out


class Fidelity(Plugin):
    """The measurements of a fidelity iteration, made where the update reaches them: the blocks of the first
    micro-batch when the update begins, then each optimizer step's gradient (module docstring)."""

    name = "fidelity"
    CONFIG = FidelityConfig

    def __init__(self, every: int) -> None:
        self.every = every
        self.active = False

    @classmethod
    def from_config(cls, cfg, run: RunView) -> Fidelity | None:
        every = cfg.plugins.fidelity.every
        return cls(every) if every else None

    def begin_update(self, view: UpdateView) -> None:
        self.active = view.iteration % self.every == 0
        if not self.active:
            return
        self.cosines: list[float] = []
        self.rel_errs: list[float] = []
        t0 = time.perf_counter()
        rows = view.micro_batches[0]
        loss, outputs = view.inputs(rows)
        self.group_cosines = block_cosines(view.setting, view.velocity(rows), loss, view.params, outputs)
        self.seconds = time.perf_counter() - t0

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        if not self.active:
            return
        t0 = time.perf_counter()
        cos, rel = compare_to_exact(view.params, lambda: view.exact_backward(pending))
        self.cosines.append(cos)
        self.rel_errs.append(rel)
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict:
        """Means over the iteration's optimizer steps, the per-block cosines and the seconds it all took."""
        if not self.active:
            return {}
        return {
            "fidelity_cosine": sum(self.cosines) / len(self.cosines),
            "fidelity_rel_err": sum(self.rel_errs) / len(self.rel_errs),
            "fidelity_group_cosines": self.group_cosines,
            "time_fidelity_s": self.seconds,
        }
