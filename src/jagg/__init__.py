"""JAGG: Jacobian-Aggregated Group Gradient for GRPO fine-tuning of diffusion transformers.

Public entry points, re-exported from the engine: ``sde_step_with_logprob`` (one SDE / ODE / CPS step and the
log-prob of its sample), ``group_advantages``, ``clipped_ppo_loss`` and ``GRPOStepLoss`` (the per-step GRPO
loss), ``group_backward`` and ``STRATEGIES`` (the backward of one group), ``Routing``, ``plan_groups`` and
``trajectory_backward`` (the groups of a trajectory and their backward), ``Knots`` (shared knots),
``Interpolation`` and ``interpolated_backward`` (any backward as one matrix), ``BackwardSetting`` (a backward
bound once: ``setting.backward(velocity, loss, outputs)``), ``group_gradient_cosines`` (each group's gradient
vs the exact one). The layers and every module are listed once, in docs/architecture.md.
"""

from jagg.engine.diagnostics import GroupCosine, group_gradient_cosines
from jagg.engine.grpo import GRPOStepLoss, clipped_ppo_loss, group_advantages
from jagg.engine.knots import Knots
from jagg.engine.routing import BackwardSetting, GroupPlan, Routing, plan_groups, trajectory_backward
from jagg.engine.sde import SDEStep, sde_step_with_logprob, shifted_linear_sigmas
from jagg.engine.strategies import (
    STRATEGIES,
    GroupStats,
    Interpolation,
    group_backward,
    interpolated_backward,
)

__all__ = [
    "STRATEGIES",
    "BackwardSetting",
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
    "group_backward",
    "group_gradient_cosines",
    "plan_groups",
    "sde_step_with_logprob",
    "shifted_linear_sigmas",
    "trajectory_backward",
]
