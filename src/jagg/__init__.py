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
