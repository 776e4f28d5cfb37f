"""The dry run's pass plan: which steps of a trajectory are trained, their groups and strategies, and what the
update costs per sample in each graph mode (forward / backward passes, FSDP2 collectives, graphs alive), counted
by the engine's cost model (``jagg.engine.routing.BackwardSetting.cost``) without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from jagg.config import Config
from jagg.scale.architectures import CFG_TWO_CALLS, TRUE_CFG

if TYPE_CHECKING:
    from jagg.engine.routing import GroupCost


@dataclass
class Report:
    """The dry-run report: its lines, added section by section (``jagg.capacity.dry_run.build_plan``)."""

    lines: list[str] = field(default_factory=list)

    def add(self, key: str, value) -> None:
        self.lines.append(f"  {key:<34} {value}")

    def section(self, title: str) -> None:
        self.lines.append(title)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def trained_steps_per_sample(cfg: Config) -> int:
    """T: how many steps of one trajectory are trained (drawn once with a fixed generator)."""
    from jagg.engine.algorithms import ALGORITHMS

    alg = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
    gen = torch.Generator().manual_seed(0)
    kinds = alg.step_kinds(cfg.sampling.num_steps, gen)
    return int(alg.trained_steps(kinds, 1, gen).shape[1])


def _routing_lines(p: Report, cfg: Config, T: int, routing) -> None:
    """The update section's header and where the knots sit: each group and its strategy, or the shared knots."""
    from jagg.capacity.memory_model import expert_boundaries
    from jagg.engine.knots import Knots
    from jagg.engine.routing import nominal_sigmas

    backward = cfg.backward
    modes = (
        f"graph_mode={backward.graph_mode}, stored_outputs={backward.stored_outputs}, "
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
        bounds = expert_boundaries(cfg)
        if bounds:  # the schedule's own times place the switch (a window's trained steps: its first T)
            from jagg.engine.sde import shifted_linear_sigmas

            sigmas = shifted_linear_sigmas(cfg.sampling.num_steps, cfg.sampling.shift)[:T].double()
            where += f" (no interval spans the expert switch at sigma {', '.join(map(str, bounds))}):"
        p.add(
            "knots (positions among the trained steps)",
            f"{where} {list(routing.positions(sigmas if bounds else nominal_sigmas(T), bounds))}".strip(),
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
        from jagg.engine.algorithms import ALGORITHMS

        algorithm = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, backward)
        windowed = algorithm.windows(cfg.sampling.num_steps, range(1)) is not None
        where = "window position (the windows trained until the next calibration)" if windowed else "group"
        p.add(
            "routing",
            f"auto: cos(JAGG, exact) per {where} measured at iteration 0 and every {backward.calibrate_every}; "
            f"JAGG where >= {backward.min_cosine}; the costs below assume every group qualifies",
        )


def cfg_work(backbone: str) -> str:
    """How true CFG doubles the transformer's work: two calls per velocity (Qwen-Image), or one call on twice
    the rows (SD3.5, the negative prompt batched in)."""
    return "two calls" if backbone in CFG_TWO_CALLS else "one call, twice the rows"


def add_pass_plan(p: Report, cfg: Config, world_size: int) -> GroupCost:
    """The update section of the plan: trained steps, groups, stored outputs, the cost table; returns the
    configured mode's cost (its graphs alive and all-gathers size the memory plan)."""
    import dataclasses

    from jagg.engine.strategies import GRAPH_MODES

    model, sampling, backward, train = cfg.model, cfg.sampling, cfg.backward, cfg.train
    T = trained_steps_per_sample(cfg)
    setting = backward.planned_setting()  # auto: planned with the largest candidate W, every group routed
    routing = setting.routing
    _routing_lines(p, cfg, T, routing)
    n_micro = max(1, train.prompts_per_iter * train.images_per_prompt // world_size // train.train_batch_size)
    reused = min(n_micro, train.grad_accum) if backward.stored_outputs else 0
    p.add(
        "stored rollout outputs used",
        f"{reused} of {n_micro} micro-batches per iteration (before the 1st step)",
    )
    cfg_mult = 2 if model.backbone in TRUE_CFG and model.true_cfg_scale > 1 else 1
    batch = train.train_batch_size
    exact = setting.exact.cost(T, batch=batch)
    p.section(
        "cost per sample by endpoint mode (passes of one micro-batch; FSDP2 collectives per sharded unit;"
        + (f" x2 transformer work with true CFG ({cfg_work(model.backbone)});" if cfg_mult > 1 else "")
        + " * = configured)"
    )
    p.lines.append(
        f"    {'mode':<26}{'forwards (grad)':>16}{'bwd passes':>11}{'bwd calls':>10}"
        f"{'all-gathers':>12}{'reduce-scat.':>13}{'graphs alive':>13}"
    )
    # every mode's cost of the configured strategy, with and without stored outputs (exact has no modes)
    costs = {
        (mode, stored): dataclasses.replace(setting, graph_mode=mode, stored_outputs=stored).cost(
            T, batch=batch, stored_outputs=stored
        )
        for mode in GRAPH_MODES
        for stored in (False, True)
    }
    rows = [("exact", exact, backward.strategy == "exact")]
    if backward.strategy != "exact":
        rows += [
            (
                f"{backward.strategy}/{mode}" + ("+stored" if stored else ""),
                c,
                (mode, stored) == (backward.graph_mode, reused > 0),
            )
            for (mode, stored), c in costs.items()
        ]
    for name, c, mark in rows:
        p.lines.append(
            f"  {'*' if mark else ' '} {name:<26}{f'{c.forward_passes} ({c.forward_passes_with_grad})':>16}"
            f"{c.backward_passes:>11}{c.backward_calls:>10}{c.all_gathers:>12}{c.reduce_scatters:>13}"
            f"{c.graphs_alive:>13}"
        )
    ours = costs[(backward.graph_mode, reused > 0)]
    p.add("backward passes saved", f"{1 - ours.backward_passes / exact.backward_passes:.0%}")
    p.add(
        "update time saved (pass counting, bwd = 2 fwd)",
        f"{1 - costs[(backward.graph_mode, True)].time() / exact.time():.0%} with stored outputs, "
        f"{1 - costs[(backward.graph_mode, False)].time() / exact.time():.0%} without",
    )
    p.add("rollout forwards per sample", sampling.num_steps * cfg_mult)
    add_advice(p, cfg, T, setting, n_micro)
    return ours


ADVISED_KNOTS = (4, 6)  # the knot counts the advisor prices (results/knots.md measured both on the world)


def advice(cfg: Config, T: int, setting, micro_batches: int) -> tuple[dict[str, tuple[float, float]], str]:
    """What each strategy would save on ``cfg`` by the cost model, and a one-line recommendation.

    Per strategy: (update saving, iteration saving) against the exact baseline, in pass-counting time (a backward
    pass = 2 forwards; the rollout = ``sampling.num_steps`` forwards per sample, x2 with true CFG), over one
    update of ``micro_batches`` micro-batches with this config's stored-output rule. Quality is not predicted.
    """
    import dataclasses

    from jagg.engine.knots import Knots
    from jagg.engine.routing import Routing

    model, train = cfg.model, cfg.train
    w = cfg.backward.group_size or max(cfg.backward.candidate_group_sizes)
    candidates = {
        "exact": Routing(strategy="exact", group_size=2),
        f"jagg W={w}, every group": Routing(strategy="jagg", group_size=w, jagg_frac=1.0),
        **{f"knots K={k}": Knots(count=k, placement="low_noise") for k in ADVISED_KNOTS},
    }
    cfg_mult = 2 if model.backbone in TRUE_CFG and model.true_cfg_scale > 1 else 1
    rollout = cfg.sampling.num_steps * cfg_mult * micro_batches  # forwards of the update's samples

    def times(routing) -> tuple[float, float]:
        cost = dataclasses.replace(setting, routing=routing).update_cost(
            T, micro_batches=micro_batches, grad_accum=train.grad_accum, batch=train.train_batch_size
        )
        return cost.time() * cfg_mult, cost.time() * cfg_mult + rollout

    exact_update, exact_iteration = times(candidates["exact"])
    saved = {}
    for name, routing in candidates.items():
        update, iteration = times(routing)
        saved[name] = (1 - update / exact_update, 1 - iteration / exact_iteration)
    if T <= 2:
        line = (
            f"{T} trained step(s) per sample: every strategy is exact here (a group of 2 is exact) and none saves a "
            "backward pass; JAGG saves nothing on this config"
        )
    else:
        best = max((n for n in saved if n != "exact"), key=lambda n: saved[n][1])
        configured = " (as configured)" if candidates[best] == setting.routing else ""
        line = (
            f"largest predicted saving: {best}{configured}, {_saving(saved[best][1])} per iteration "
            f"({_saving(saved[best][0])} update); "
            "its gradient quality is not predicted: measure it (backward.jagg_frac / placement auto, make knots)"
        )
    return saved, line


def _saving(fraction: float) -> str:
    """-34% for a saving of 0.34; 0% where nothing is saved."""
    return f"-{fraction:.0%}" if round(fraction, 2) > 0 else f"{-fraction:+.0%}".replace("+0%", "0%")


def add_advice(p: Report, cfg: Config, T: int, setting, micro_batches: int) -> None:
    """The dry run's advisor: each strategy's predicted update / iteration saving, then the recommendation."""
    saved, line = advice(cfg, T, setting, micro_batches)
    p.section("advisor (cost model: what each strategy saves against exact on this config)")
    for name, (update, iteration) in saved.items():
        if name != "exact":
            p.add(f"  {name}", f"update {_saving(update)}, iteration {_saving(iteration)}")
    p.add("recommendation", line)
