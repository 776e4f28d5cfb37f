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

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.distributed import full_tensor
from jagg.engine.diagnostics import grads_held, reduced, sharded_sums
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


def shadow_step(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], max_grad_norm: float
) -> list[Tensor] | None:
    """The parameter change the trainer's step would make from the gradient now in ``.grad``: clipped to
    ``max_grad_norm`` as the trainer clips, then one ``optimizer`` step through its current state. Weights,
    ``.grad`` and the optimizer's state are left exactly as they were (the step runs on them and is undone), so
    the landing can compare the steps two gradients would make from the same state. None where the gradient
    is not finite (the trainer would skip that step). Under FSDP2 the changes are this rank's shards."""
    params = list(params)
    weights = [p.detach().clone() for p in params]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    state = {p: _copied(optimizer.state[p]) for p in params if p in optimizer.state}
    try:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if not math.isfinite(float(full_tensor(norm))):
            return None
        optimizer.step()
        return [p.detach() - w for p, w in zip(params, weights, strict=True)]
    finally:
        with torch.no_grad():
            for p, w, g in zip(params, weights, grads, strict=True):
                p.copy_(w)
                p.grad = g
        for p in params:
            if p in state:
                optimizer.state[p] = state[p]
            else:
                optimizer.state.pop(p, None)


def _copied(state: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _local(t: Tensor) -> Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().double().flatten()


def step_agreement(arm: Sequence[Tensor], exact: Sequence[Tensor], sharded: bool) -> dict[str, float]:
    """Cosine of two parameter changes, the fraction of coordinates where either moves whose signs agree, and
    the per-tensor cosines (minimum, median)."""
    a, e = [_local(t) for t in arm], [_local(t) for t in exact]
    per = reduced(
        torch.stack([torch.stack([(x * y).sum(), (x * x).sum(), (y * y).sum()]) for x, y in zip(a, e)]),
        sharded,
    )
    moved = [(x != 0) | (y != 0) for x, y in zip(a, e)]
    agree = sum(((torch.sign(x) == torch.sign(y)) & m).sum() for x, y, m in zip(a, e, moved))
    counts = reduced(torch.stack([agree.double(), sum(m.sum() for m in moved).double()]), sharded)
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

    def __init__(self, every: int, shadow: Callable[[], list[Tensor] | None]) -> None:
        # the parameter change the optimizer step would make from the gradient now in ``.grad``, leaving
        # weights, gradients and optimizer state as they were (``shadow_step``); None if not finite
        self.every, self.shadow_step = every, shadow
        self.active = False

    @classmethod
    def from_config(cls, cfg, run: RunView) -> Landing | None:
        if not cfg.plugins.landing.enabled:
            return None
        return cls(
            cfg.plugins.fidelity.every,
            functools.partial(shadow_step, run.optimizer, run.params, cfg.optim.max_grad_norm),
        )

    def begin_update(self, view: UpdateView) -> None:
        self.active = view.iteration % self.every == 0
        self.rows: list[dict[str, float]] = []
        self.seconds = 0.0

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        if not self.active:
            return
        t0 = time.perf_counter()
        arm = self.shadow_step()
        with grads_held(view.params):
            view.exact_backward(pending)
            exact = self.shadow_step()
        if arm is not None and exact is not None:
            sharded = any(hasattr(p, "to_local") for p in view.params)
            row = step_agreement(arm, exact, sharded)
            d_arm, d_exact = function_change(view, pending[0].rows, [arm, exact])
            # each rank's own samples: their sums add over the ranks
            dot, na, ne, nd = sharded_sums([d_arm], [d_exact], sharded)
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
