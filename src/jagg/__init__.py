"""JAGG: Jacobian-Aggregated Group Gradient for GRPO fine-tuning of diffusion transformers.

Public entry points:
    sde_step_with_logprob   one SDE/ODE/CPS step and the log-prob of its sample   (jagg.sde)
    group_advantages, clipped_ppo_loss                                          (jagg.grpo)
    group_backward, trajectory_backward, plan_groups, STRATEGIES               (jagg.strategies)
"""

from jagg.grpo import clipped_ppo_loss, group_advantages
from jagg.sde import SDEStep, sde_step_with_logprob, shifted_linear_sigmas
from jagg.strategies import (
    STRATEGIES,
    GroupPlan,
    GroupStats,
    group_backward,
    plan_groups,
    trajectory_backward,
)

__all__ = [
    "STRATEGIES",
    "GroupPlan",
    "GroupStats",
    "SDEStep",
    "clipped_ppo_loss",
    "group_advantages",
    "group_backward",
    "plan_groups",
    "sde_step_with_logprob",
    "shifted_linear_sigmas",
    "trajectory_backward",
]
