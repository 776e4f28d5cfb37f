"""The gradient's norm before each optimizer step, a plug-in of the update: the L2 norm of the gradient the
trained parameters (the LoRA adapters under LoRA, every weight under full fine-tuning) hand to AdamW, after a
positive control and before clipping, for every optimizer step of the iteration (the trainer's ``grad_norm``
is their mean, from the clipping call).

Under FSDP2 the norm is summed over the ranks' shards (``jagg.engine.diagnostics.sharded_sums``), in float64.
No state; costs one pass over the gradient per optimizer step.

Config key: ``plugins.grad_norm.every`` (``GradNormConfig``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jagg.engine.diagnostics import local_grads, sharded_sums
from jagg.plugins.base import MicroBatch, Plugin, PluginConfig, RunView, UpdateView, require


@dataclass(frozen=True, kw_only=True)
class GradNormConfig(PluginConfig):
    """plugins.grad_norm: every ``every`` iterations (iteration 0 included; 0: off) log ``grad_norm_steps``,
    the gradient's L2 norm before each optimizer step of the iteration, and ``grad_norm_max``, the largest."""

    every: int = 0

    def validate(self, cfg) -> None:
        require(self.every >= 0, f"plugins.grad_norm.every must be >= 0, got {self.every}")


class GradNorm(Plugin):
    name = "grad_norm"
    CONFIG = GradNormConfig

    def __init__(self, every: int) -> None:
        self.every = every
        self.norms: list[float] | None = None

    @classmethod
    def from_config(cls, cfg, run: RunView) -> GradNorm | None:
        every = cfg.plugins.grad_norm.every
        return cls(every) if every else None

    def begin_update(self, view: UpdateView) -> None:
        self.norms = [] if view.iteration % self.every == 0 else None

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        if self.norms is None:
            return
        grads = local_grads(view.params)
        sharded = any(hasattr(p, "to_local") for p in view.params)  # DTensors: FSDP2's shards
        _, squared, _, _ = sharded_sums(grads, grads, sharded)
        self.norms.append(math.sqrt(squared))

    def metrics(self) -> dict:
        if not self.norms:
            return {}
        return {"grad_norm_steps": self.norms, "grad_norm_max": max(self.norms)}
