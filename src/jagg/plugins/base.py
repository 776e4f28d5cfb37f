"""The plug-in surface of the training loop: what an instrument or a control may see and when it acts.

An update (``Trainer.update``) runs its micro-batches through the bound ``BackwardSetting`` and takes an
optimizer step every ``train.grad_accum`` of them. A plug-in acts at the update's touch points, in this order:

    begin_update(view)              once, before the first micro-batch's backward
    before_step(view, pending)      after the backward of the micro-batches ``pending``, before their
                                    optimizer step: the gradient in ``.grad`` is the one AdamW will receive
                                    (before clipping, which only rescales)
    metrics()                       after the update: the keys the plug-in adds to the iteration's row
    after_evaluation(it, images, weights)   after a held-out evaluation at iteration ``it``
    state_dict() / load_state_dict(state)  what a checkpoint keeps of it

Plug-ins run in the order of ``jagg.plugins.PLUGINS``; one that degrades the gradient (the positive control)
comes before one that measures it (fidelity), so the measurement sees what is applied.

What a plug-in sees is ``UpdateView``: the trained parameters, the update's backward setting, for any
micro-batch its loss, its velocity and an exact backward. It never sees the trainer. This follows the component
style of torchtitan's trainer (each component decides when it acts and holds its own state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from jagg.distributed import DistInfo
from jagg.engine.grpo import GRPOStepLoss, StepStats
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import Velocity
from jagg.errors import require as require  # a plug-in config's check (re-exported for the plug-ins)


@dataclass
class MicroBatch:
    """One micro-batch of the update: its rows of the rollout and the per-step loss stats of its backward."""

    rows: slice
    stats: list[StepStats] = field(default_factory=list)


@dataclass(frozen=True)
class UpdateView:
    """What a plug-in sees of one update, bound to its rollout.

    ``inputs(rows)``: the micro-batch's loss over its trained steps (scaled as the update scales it) and its
    stored outputs where they are valid (on the rollout's weights), else None. ``velocity(rows)``: the
    trained model's velocity conditioned on those rows' prompts.
    """

    iteration: int
    params: Sequence[torch.nn.Parameter]
    setting: BackwardSetting
    micro_batches: list[slice]
    inputs: Callable[[slice], tuple[GRPOStepLoss, Tensor | None]]
    velocity: Callable[[slice], Velocity]
    dist: DistInfo

    def exact_backward(self, batches: Sequence[MicroBatch]) -> None:
        """Exact's backward of ``batches`` at the current weights, ADDED to ``.grad`` (every trained step a
        plain per-step backward, forwards recomputed: the reference an instrument compares with)."""
        for batch in batches:
            loss, _ = self.inputs(batch.rows)
            self.setting.exact.backward(self.velocity(batch.rows), loss)


@dataclass(frozen=True, kw_only=True)
class PluginConfig:
    """A plug-in's config, the YAML section ``plugins.<name>``: a frozen dataclass declared in the plug-in's
    module, its fields the keys with their defaults (``jagg.config`` composes the section from ``PLUGINS`` and
    reads it like any other). ``validate`` checks it against the whole config (``cfg``, a
    ``jagg.config.Config``) and raises ``ConfigError`` naming the key and what is allowed."""

    def validate(self, cfg) -> None:
        pass


class Plugin:
    """A plug-in of the update; every touch point does nothing unless overridden (module docstring).

    ``name`` keys its checkpoint state and its config section ``plugins.<name>``; ``CONFIG`` is that section's
    ``PluginConfig`` subclass, None for a plug-in without keys."""

    name: str = "plugin"
    CONFIG: type[PluginConfig] | None = None

    @classmethod
    def from_config(cls, cfg, run: RunView) -> Plugin | None:
        """The plug-in this run needs, or None where its keys (``cfg.plugins.<name>``; ``cfg`` is the run's
        ``jagg.config.Config``) leave it off."""
        raise NotImplementedError

    def begin_update(self, view: UpdateView) -> None:
        pass

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def after_evaluation(self, it: int, images: Tensor, weights: Sequence[Tensor]) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass(frozen=True)
class RunView:
    """What a plug-in is built from: the run's trained parameters, its seed, its directory, this rank, the
    device it trains on and its optimizer (read, never stepped: ``jagg.plugins.landing.shadow_step``)."""

    params: Sequence[torch.nn.Parameter]
    seed: int
    run_dir: Path
    dist: DistInfo
    device: torch.device
    optimizer: torch.optim.Optimizer
