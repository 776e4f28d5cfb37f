"""Where an update lands, a plug-in of the update: the optimizer step it makes and the function it changes,
beside the gradient that fidelity compares.

Why: AdamW scales every coordinate of the gradient to a step of about the learning rate, so the gradient's
cosine to exact's understates how differently an update lands, and it puts structured errors (JAGG's) and
random ones (the controls') on different scales: a random direction at gradient cosine 0.95 fills the small
coordinates and becomes a step at cosine about 0.5. At a fidelity iteration (``plugins.fidelity.every``) with
``plugins.landing.enabled: true`` this plug-in measures, before each optimizer step:

* the step's fidelity: the step the arm's gradient makes (clipped as the trainer clips, through the optimizer's
  current state) against the step exact's gradient of the same micro-batches would make through a copy of that
  state (``shadow_step``: weights, gradients and state are left as they were). Cosine, the fraction of
  coordinates whose signs agree, and the cosine per parameter tensor (its minimum and median);
* the function's fidelity: the velocity's change after each of the two steps on the step's first micro-batch,
  at the states it trains on (the rollout's latents and times of its trained steps): cosine and relative error
  of the arm's change to exact's.

An exact arm gets 1 and 0 to rounding. Cost per fidelity iteration: one exact backward of the update (as
fidelity's), two optimizer steps undone, and three forwards of one micro-batch per trained step. Under FSDP2 every
sum is all-reduced over the ranks' shards.

Config key: ``plugins.landing.enabled`` (``LandingConfig``; log.landing before, still read so).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.plugins.base import MicroBatch, Plugin, PluginConfig, RunView, UpdateView, require


@dataclass(frozen=True, kw_only=True)
class LandingConfig(PluginConfig):
    """plugins.landing: at the fidelity iterations also compare where the arm's update lands with where exact's
    would (the AdamW steps, through a copy of the optimizer state, and the velocity's change on the
    micro-batch's own states); logs landing_step_cosine / landing_sign_agreement / landing_function_cosine ..."""

    enabled: bool = False

    def validate(self, cfg) -> None:
        require(
            not self.enabled or cfg.plugins.fidelity.every > 0,
            "plugins.landing.enabled=true measures at the fidelity iterations: needs plugins.fidelity.every >= 1, "
            "got 0",
        )


def _sums(parts: list[Tensor], sharded: bool) -> Tensor:
    """Stack per-shard partial sums and add them over the ranks where the tensors are sharded."""
    out = torch.stack(parts)
    if sharded and torch.distributed.is_initialized():
        torch.distributed.all_reduce(out)
    return out


def _local(t: Tensor) -> Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().double().flatten()


def step_agreement(arm: Sequence[Tensor], exact: Sequence[Tensor], sharded: bool) -> dict[str, float]:
    """Cosine of two parameter changes, the fraction of coordinates where either moves whose signs agree, and
    the per-tensor cosines (minimum, median)."""
    a, e = [_local(t) for t in arm], [_local(t) for t in exact]
    per = _sums([torch.stack([(x * y).sum(), (x * x).sum(), (y * y).sum()]) for x, y in zip(a, e)], sharded)
    moved = [(x != 0) | (y != 0) for x, y in zip(a, e)]
    agree = sum(((torch.sign(x) == torch.sign(y)) & m).sum() for x, y, m in zip(a, e, moved))
    counts = _sums([agree.double(), sum(m.sum() for m in moved).double()], sharded)
    dot, na, ne = per.sum(dim=0).tolist()
    cosines = [float(d / max(x * y, 1e-300) ** 0.5) for d, x, y in per.tolist() if x > 0 and y > 0]
    return {
        "landing_step_cosine": dot / max(na * ne, 1e-300) ** 0.5,
        "landing_sign_agreement": float(counts[0] / max(float(counts[1]), 1.0)),
        "landing_tensor_cosine_min": min(cosines, default=float("nan")),
        "landing_tensor_cosine_median": statistics.median(cosines) if cosines else float("nan"),
    }


@torch.no_grad()
def function_change(view: UpdateView, rows: slice, steps: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """The velocity at the micro-batch's trained states (its rollout latents and times) after each of
    ``steps`` (parameter changes) minus before: one (T, B, ...) tensor per step. Weights are restored."""
    loss, _ = view.inputs(rows)
    v = view.velocity(rows)

    def at_states() -> Tensor:
        return torch.stack([v(loss.x[j], loss.sigma[j]).double() for j in range(len(loss.x))])

    before, changes = at_states(), []
    weights = [p.detach().clone() for p in view.params]  # restored by copy: (w + d) - d is not w in float32
    for delta in steps:
        for p, d in zip(view.params, delta, strict=True):
            p.add_(d)
        try:
            changes.append(at_states() - before)
        finally:
            for p, w in zip(view.params, weights, strict=True):
                p.copy_(w)
    return changes


class Landing(Plugin):
    """The landing measurements of a fidelity iteration, per optimizer step (module docstring)."""

    name = "landing"
    CONFIG = LandingConfig

    def __init__(self, every: int) -> None:
        self.every = every
        self.active = False

    @classmethod
    def from_config(cls, cfg, run: RunView) -> Landing | None:
        return cls(cfg.plugins.fidelity.every) if cfg.plugins.landing.enabled else None

    def begin_update(self, view: UpdateView) -> None:
        self.active = view.iteration % self.every == 0
        self.rows: list[dict[str, float]] = []
        self.seconds = 0.0

    def before_step(self, view: UpdateView | None, pending: Sequence[MicroBatch]) -> None:
        if not self.active or view is None:
            return
        t0 = time.perf_counter()
        arm = view.shadow_step()
        saved = [p.grad for p in view.params]
        for p in view.params:
            p.grad = None
        try:
            view.exact_backward(pending)
            exact = view.shadow_step()
        finally:
            for p, g in zip(view.params, saved, strict=True):
                p.grad = g
        if arm is not None and exact is not None:
            sharded = any(hasattr(p, "to_local") for p in view.params)
            row = step_agreement(arm, exact, sharded)
            d_arm, d_exact = function_change(view, pending[0].rows, [arm, exact])
            # each rank's own samples: their sums add over the ranks
            parts = [
                (d_arm * d_exact).sum(),
                (d_arm**2).sum(),
                (d_exact**2).sum(),
                ((d_arm - d_exact) ** 2).sum(),
            ]
            dot, na, ne, nd = _sums(parts, sharded).tolist()
            row["landing_function_cosine"] = dot / max(na * ne, 1e-300) ** 0.5
            row["landing_function_rel_err"] = (nd / max(ne, 1e-300)) ** 0.5
            self.rows.append(row)
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict:
        """Means over the iteration's measured optimizer steps, and the seconds they took."""
        if not self.active or not self.rows:
            return {}
        keys = self.rows[0]
        return {k: sum(r[k] for r in self.rows) / len(self.rows) for k in keys} | {
            "time_landing_s": self.seconds
        }
