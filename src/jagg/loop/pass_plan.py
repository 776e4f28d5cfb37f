"""The dry run's pass plan: which steps of a trajectory are trained, their groups and strategies, and what the
update costs per sample in each endpoint mode (forward / backward passes, FSDP2 collectives, graphs alive), counted
by the engine's cost model (``jagg.engine.routing.trajectory_cost``) without running anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from jagg.config import Config
from jagg.scale.architectures import TRUE_CFG

if TYPE_CHECKING:
    from jagg.engine.routing import GroupCost
    from jagg.loop.dry_run import Plan


def trained_steps_per_sample(cfg: Config) -> int:
    """T: how many steps of one trajectory are trained (drawn once with a fixed generator)."""
    from jagg.engine.algorithms import ALGORITHMS

    alg = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
    gen = torch.Generator().manual_seed(0)
    kinds = alg.step_kinds(cfg.sampling.num_steps, gen)
    return int(alg.trained_steps(kinds, 1, gen).shape[1])


def _routing_lines(p: Plan, cfg: Config, T: int, routing) -> None:
    """The update section's header and where the knots sit: each group and its strategy, or the shared knots."""
    from jagg.engine.knots import Knots
    from jagg.engine.routing import nominal_sigmas

    backward = cfg.backward
    modes = (
        f"endpoints={backward.endpoints}, reuse_rollout={backward.reuse_rollout}, "
        f"endpoint_signals={backward.endpoint_signals})"
    )
    if isinstance(routing, Knots):
        p.section(
            f"update (backward.strategy=knots, K={routing.count}, placement={backward.placement or 'auto'}, "
            + modes
        )
        p.add("trained steps per sample", f"{T} of {cfg.sampling.num_steps}")
        where = (
            "measured at iteration 0 among the rules; e.g. low_noise:" if backward.placement is None else ""
        )
        p.add(
            "knots (positions among the trained steps)",
            f"{where} {list(routing.positions(nominal_sigmas(T)))}".strip(),
        )
        return
    auto = (
        backward.jagg_frac is None
    )  # routed at run time by measured cosines: planned as if every group qualifies
    p.section(
        f"update (backward.strategy={backward.strategy}, W={routing.group_size}"
        + (f" of auto {backward.candidate_group_sizes}" if backward.group_size is None else "")
        + f", jagg_frac={'auto' if auto else backward.jagg_frac}, "
        + modes
    )
    p.add("trained steps per sample", f"{T} of {cfg.sampling.num_steps}")
    for g, plan in enumerate(routing.plans(T)):
        p.add(
            f"group {g}",
            f"steps {list(plan.steps)} -> {plan.strategy}" + (" (if its cosine qualifies)" * auto),
        )
    if auto:
        p.add(
            "routing",
            f"auto: cos(JAGG, exact) per group measured at iteration 0 and every {backward.calibrate_every}; "
            f"JAGG where >= {backward.min_cosine}; the costs below assume every group qualifies",
        )


def add_pass_plan(p: Plan, cfg: Config, world_size: int) -> GroupCost:
    """The update section of the plan: trained steps, groups, stored outputs, the cost table; returns the
    configured mode's cost (its graphs alive and all-gathers size the memory plan)."""
    import dataclasses

    from jagg.engine.routing import Routing
    from jagg.engine.strategies import ENDPOINT_MODES

    model, sampling, backward, train = cfg.model, cfg.sampling, cfg.backward, cfg.train
    T = trained_steps_per_sample(cfg)
    setting = backward.planned_setting()  # auto: planned with the largest candidate W, every group routed
    routing = setting.routing
    _routing_lines(p, cfg, T, routing)
    n_micro = max(1, train.prompts_per_iter * train.images_per_prompt // world_size // train.train_batch_size)
    reused = min(n_micro, train.grad_accum) if backward.reuse_rollout else 0
    p.add(
        "stored rollout outputs used",
        f"{reused} of {n_micro} micro-batches per iteration (before the 1st step)",
    )
    cfg_mult = 2 if model.backbone in TRUE_CFG and model.true_cfg_scale > 1 else 1
    batch = train.train_batch_size
    exact = dataclasses.replace(setting, routing=Routing(strategy="exact", group_size=2)).cost(T, batch=batch)
    p.section(
        "cost per sample by endpoint mode (passes of one micro-batch; FSDP2 collectives per sharded unit;"
        + (" x2 transformer calls with true CFG;" if cfg_mult > 1 else "")
        + " * = configured)"
    )
    p.lines.append(
        f"    {'mode':<26}{'forwards (grad)':>16}{'bwd passes':>11}{'bwd calls':>10}"
        f"{'all-gathers':>12}{'reduce-scat.':>13}{'graphs alive':>13}"
    )
    # every mode's cost of the configured strategy, with and without stored outputs (exact has no modes)
    costs = {
        (mode, reuse): dataclasses.replace(setting, endpoints=mode, reuse_outputs=reuse).cost(
            T, batch=batch, stored=reuse
        )
        for mode in ENDPOINT_MODES
        for reuse in (False, True)
    }
    rows = [("exact", exact, backward.strategy == "exact")]
    if backward.strategy != "exact":
        rows += [
            (
                f"{backward.strategy}/{mode}" + ("+stored" if reuse else ""),
                c,
                (mode, reuse) == (backward.endpoints, reused > 0),
            )
            for (mode, reuse), c in costs.items()
        ]
    for name, c, mark in rows:
        p.lines.append(
            f"  {'*' if mark else ' '} {name:<26}{f'{c.forward_passes} ({c.forward_passes_with_grad})':>16}"
            f"{c.backward_passes:>11}{c.backward_calls:>10}{c.all_gathers:>12}{c.reduce_scatters:>13}"
            f"{c.graphs_alive:>13}"
        )
    ours = costs[(backward.endpoints, reused > 0)]
    p.add("backward passes saved", f"{1 - ours.backward_passes / exact.backward_passes:.0%}")
    p.add(
        "update time saved (pass counting, bwd = 2 fwd)",
        f"{1 - costs[(backward.endpoints, True)].time() / exact.time():.0%} with stored outputs, "
        f"{1 - costs[(backward.endpoints, False)].time() / exact.time():.0%} without",
    )
    p.add("rollout forwards per sample", sampling.num_steps * cfg_mult)
    return ours
