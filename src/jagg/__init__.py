"""JAGG: Jacobian-Aggregated Group Gradient for GRPO fine-tuning of diffusion transformers.

Public entry points (re-exported from the engine):
    sde_step_with_logprob   one SDE/ODE/CPS step and the log-prob of its sample   (jagg.engine.sde)
    group_advantages, clipped_ppo_loss, GRPOStepLoss (the per-step GRPO loss)    (jagg.engine.grpo)
    group_backward, trajectory_backward, plan_groups, STRATEGIES               (jagg.engine.strategies)
    group_gradient_cosines  per-group cosine of a strategy's gradient to the exact one (jagg.engine.diagnostics)

Layers, top first (a module imports only from its own package or from the layers below; see
tests/test_architecture.py):
    jagg.loop, jagg.train          the training loop, its composition root, checkpoints, grids, dry-run plan; CLI
    jagg.world | jagg.scale        the embedded offline world | real models at paper scale
    jagg.config                    config dataclasses, YAML loading, value checks
    jagg.engine | jagg.models | jagg.rewards   SDE, GRPO loss, strategies, sampling, algorithms | backbone
                                   adapters, Components | reward registry, weighted sums, JPEG rewards
    jagg.errors | jagg.common      the user-facing errors | plumbing (threads, seed streams, run metadata,
                                   atomic writes)
"""

from jagg.engine.diagnostics import GroupCosine, group_gradient_cosines
from jagg.engine.grpo import GRPOStepLoss, clipped_ppo_loss, group_advantages
from jagg.engine.sde import SDEStep, sde_step_with_logprob, shifted_linear_sigmas
from jagg.engine.strategies import (
    STRATEGIES,
    GroupPlan,
    GroupStats,
    group_backward,
    plan_groups,
    trajectory_backward,
)

__all__ = [
    "STRATEGIES",
    "GRPOStepLoss",
    "GroupCosine",
    "GroupPlan",
    "GroupStats",
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
