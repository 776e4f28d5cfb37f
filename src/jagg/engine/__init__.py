"""The engine: the method itself, independent of any model, reward or run.

    sde         schedules and the stateless SDE / CPS / ODE step with the log-prob of its sample
    grpo        group-relative advantages, clipped PPO, KL, and ``GRPOStepLoss`` (THE per-step GRPO loss)
    strategies  exact / JAGG / ablation backward of a group of steps, ``jagg_frac`` routing, pass counts
    diagnostics per-group cosine of each strategy's gradient to the exact one (``group_gradient_cosines``) and
                the routing rule built on it (``route_by_cosine``: JAGG where the cosine stays high)
    control     the positive control: the gradient mixed with one fixed random direction at a set cosine
    sampling    trajectory sampling with per-step kinds
    algorithms  DanceGRPO / Flow-GRPO / Flow-GRPO-Fast: which steps are SDE and which are trained
    profiling   bytes autograd saves for backward (memory of a strategy, on CPU or GPU)

Layer: beside ``jagg.models`` and ``jagg.rewards`` (none of the three imports another); from the package it
may import only ``jagg.errors`` and ``jagg.common``. The public entry points are re-exported by ``jagg``.
"""
