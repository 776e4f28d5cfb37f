"""JAGG: Jacobian-Aggregated Group Gradient for GRPO fine-tuning of diffusion transformers.

Public entry points, re-exported from the engine: ``sde_step_with_logprob`` (one SDE / ODE / CPS step and the
log-prob of its sample), ``group_advantages``, ``clipped_ppo_loss`` and ``GRPOStepLoss`` (the per-step GRPO
loss), ``BackwardSetting`` (the one way to run a backward: a routing bound to how its plan runs,
``setting.backward(velocity, loss, outputs)``, and its predicted cost, ``setting.cost(num_steps)``), with
``Routing`` and ``STRATEGIES`` (groups of W steps on a strategy; ``GroupPlan`` and ``plan_groups`` cut them),
``Knots`` (shared knots) and ``GraphRun`` (graph mode, signal source, row bound: the defaults);
``Interpolation`` and ``interpolated_backward`` (any backward as one matrix, the level below), ``GroupStats``
(what a backward did), ``group_gradient_cosines`` (each group's gradient vs the exact one). The layers and
every module are listed once, in docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use (PEP 562), so that ``import jagg`` (which ``python -m jagg.train`` runs first) does not
# import torch: the CLI's signal handling is in place before any heavy import (a Ctrl-C then is one line).
_EXPORTS = {
    "GroupCosine": "jagg.engine.diagnostics",
    "group_gradient_cosines": "jagg.engine.diagnostics",
    "GRPOStepLoss": "jagg.engine.grpo",
    "clipped_ppo_loss": "jagg.engine.grpo",
    "group_advantages": "jagg.engine.grpo",
    "Knots": "jagg.engine.knots",
    "BackwardSetting": "jagg.engine.routing",
    "GroupPlan": "jagg.engine.routing",
    "Routing": "jagg.engine.routing",
    "plan_groups": "jagg.engine.routing",
    "SDEStep": "jagg.engine.sde",
    "sde_step_with_logprob": "jagg.engine.sde",
    "shifted_linear_sigmas": "jagg.engine.sde",
    "STRATEGIES": "jagg.engine.strategies",
    "GraphRun": "jagg.engine.strategies",
    "GroupStats": "jagg.engine.strategies",
    "Interpolation": "jagg.engine.strategies",
    "interpolated_backward": "jagg.engine.strategies",
}

if TYPE_CHECKING:
    from jagg.engine.diagnostics import GroupCosine, group_gradient_cosines
    from jagg.engine.grpo import GRPOStepLoss, clipped_ppo_loss, group_advantages
    from jagg.engine.knots import Knots
    from jagg.engine.routing import BackwardSetting, GroupPlan, Routing, plan_groups
    from jagg.engine.sde import SDEStep, sde_step_with_logprob, shifted_linear_sigmas
    from jagg.engine.strategies import (
        STRATEGIES,
        GraphRun,
        GroupStats,
        Interpolation,
        interpolated_backward,
    )

__all__ = [
    "STRATEGIES",
    "BackwardSetting",
    "GraphRun",
    "Interpolation",
    "Knots",
    "interpolated_backward",
    "GRPOStepLoss",
    "GroupCosine",
    "GroupPlan",
    "GroupStats",
    "Routing",
    "SDEStep",
    "clipped_ppo_loss",
    "group_advantages",
    "group_gradient_cosines",
    "plan_groups",
    "sde_step_with_logprob",
    "shifted_linear_sigmas",
]


def __getattr__(name: str):
    """The engine's public names, imported on first use (``_EXPORTS``)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jagg' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
