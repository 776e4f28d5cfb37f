"""Routing: which backward each group of a trajectory's trained steps uses, what that costs, and measuring it.

The T time-sorted trained steps of a micro-batch are cut into consecutive groups of W (``plan_groups``); each
group runs its plan's strategy, all groups together as one block-diagonal plan (``Routing.interpolation``). A
``Routing`` says how the groups are chosen: the leading ``jagg_frac`` of them on the strategy (the paper's rule),
or a measured choice per group position. ``calibrate_routing`` measures that choice: per candidate W the cosine
of each group's gradient to its exact one (``jagg.engine.diagnostics``), the groups at or above ``min_cosine``
routed, and the W whose routed update the cost model predicts cheapest kept.

``BackwardSetting`` is a routing plus how its plan runs (a ``GraphRun``: graph mode, signal source, row bound) and
whether stored outputs are read: everything an update needs to know about its backward, and the one way to run
one (``.backward``, ``.run``). The cost model (``plan_cost``, ``BackwardSetting.cost`` / ``.update_cost``)
predicts the pass counts ``GroupStats`` measures (tested equal), and is what the dry-run plan, the bench and
Table 1 use. Where the trained steps are one window that moves (MixGRPO), ``calibrate_windows`` measures per
window position and its ``WindowRouting`` is looked up by the window's first step (``BackwardSetting.at_window``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from jagg.engine.diagnostics import (
    GroupCosine,
    group_gradient_cosines,
    plan_gradient_cosines,
    route_by_cosine,
)
from jagg.engine.knots import PLACEMENTS, Knots, expert_segments
from jagg.engine.strategies import (
    GRAPH_MODES,
    STRATEGIES,
    GraphRun,
    GroupStats,
    Interpolation,
    StepLoss,
    Velocity,
    expert_boundaries,
    group_interpolation,
)
from jagg.errors import require

# ``backward.strategy``: the group strategies (one weight matrix per group of W) and shared knots.
BACKWARD_STRATEGIES: tuple[str, ...] = (*STRATEGIES, "knots")


def nominal_sigmas(num_steps: int) -> Tensor:
    """Decreasing times standing in for a schedule where only the plan's structure matters (the cost model)."""
    return torch.linspace(1.0, 0.1, num_steps, dtype=torch.float64)


# --------------------------------------------------------------------------- groups and their strategies
@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One group of a trajectory: positions (into the trained-step list) and the strategy it uses."""

    steps: tuple[int, ...]
    strategy: str


def validate_routing(group_size: int, jagg_frac: float, strategy: str) -> None:
    """Raise ValueError naming the offending key and the allowed range (how the plan runs: ``GraphRun``)."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"backward.group_size must be an integer >= 2, got {group_size!r}")
    if not 0.0 <= float(jagg_frac) <= 1.0:
        raise ValueError(f"backward.jagg_frac must be in [0, 1], got {jagg_frac!r}")
    if strategy not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward.strategy must be one of {BACKWARD_STRATEGIES}, got {strategy!r}")


def plan_groups(
    num_steps: int,
    group_size: int,
    jagg_frac: float,
    strategy: str,
    routing: Sequence[bool] | None = None,
) -> list[GroupPlan]:
    """Cut ``num_steps`` time-sorted trained steps into consecutive groups of ``group_size``.

    The last group may be shorter. The first ``round(jagg_frac * n_groups)`` groups (round half up) use
    ``strategy``; the rest, and any group of a single step, use the exact per-step backward. ``routing`` (one
    bool per group position, e.g. from ``route_by_cosine``) replaces the jagg_frac rule: group g uses
    ``strategy`` where ``routing[g]`` is true, exact elsewhere and beyond its length.
    """
    validate_routing(group_size, jagg_frac, strategy)
    starts = range(0, num_steps, group_size)
    n_routed = math.floor(jagg_frac * len(starts) + 0.5)
    plans = []
    for g, start in enumerate(starts):
        steps = tuple(range(start, min(start + group_size, num_steps)))
        chosen = g < n_routed if routing is None else g < len(routing) and bool(routing[g])
        plans.append(GroupPlan(steps=steps, strategy=strategy if chosen and len(steps) > 1 else "exact"))
    return plans


@dataclass(frozen=True, kw_only=True)
class Routing:
    """How a trajectory's groups of ``group_size`` steps are routed to ``strategy`` (the others run exact).

    Fixed: the leading ``jagg_frac`` of the groups (``backward.jagg_frac``). Measured (``measured`` given, one
    bool per group position, from ``calibrate_routing``): the groups marked true; ``jagg_frac`` is unused.
    As a plan (``interpolation``) a routed group is a (W, 2) block onto its endpoints and an exact group is one
    plain step per step: routing is one rule for placing knots, ``Knots`` (``jagg.engine.knots``) the other.
    """

    strategy: str
    group_size: int
    jagg_frac: float = 1.0
    measured: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        validate_routing(self.group_size, self.jagg_frac, self.strategy)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Routing cuts groups for {STRATEGIES}; knots are routed by Knots")

    @classmethod
    def exact(cls) -> Routing:
        """The exact per-step backward: every step a plain step (W is not read; 2, the smallest legal one)."""
        return cls(strategy="exact", group_size=2)

    def plans(self, num_steps: int) -> list[GroupPlan]:
        """The groups of ``num_steps`` trained steps and the strategy of each (``plan_groups``)."""
        return plan_groups(num_steps, self.group_size, self.jagg_frac, self.strategy, self.measured)

    def interpolation(self, sigma: Tensor, boundaries: Sequence[float] = ()) -> Interpolation:
        """The plan of T steps at times ``sigma`` (T,) or (T, B): the groups' blocks, stacked. A group that
        ``boundaries`` (a velocity's expert switches) cut is split there (``split_at_experts``)."""
        sigma = torch.as_tensor(sigma)
        plans = split_at_experts(self.plans(sigma.shape[0]), expert_segments(sigma, boundaries))
        return plans_interpolation(plans, sigma)

    @property
    def frac_label(self) -> str:
        """``jagg_frac`` as the config writes it: a number, or ``auto`` for a measured routing."""
        return "auto" if self.measured is not None else f"{self.jagg_frac:g}"

    @property
    def label(self) -> str:
        """e.g. ``jagg/W3/f0.6`` (the part of ``BackwardSetting.key`` before the mode)."""
        return f"{self.strategy}/W{self.group_size}/f{self.frac_label}"


@dataclass(frozen=True, kw_only=True)
class WindowRouting:
    """A measured routing per window position (MixGRPO: the trained steps are one window of consecutive steps,
    one group of ``group_size`` >= its length, that moves along the trajectory): ``routed`` says, per window start
    (its first step), whether that window runs ``strategy`` (True) or exact. ``at(start)`` is one window's
    ``Routing``; a start that was not measured runs exact (nothing is approximated without a measurement)."""

    strategy: str
    group_size: int
    routed: tuple[tuple[int, bool], ...]  # (window start, runs strategy), by start

    def __post_init__(self) -> None:
        Routing(strategy=self.strategy, group_size=self.group_size)  # the same checks

    def at(self, start: int) -> Routing:
        chosen = dict(self.routed).get(start, False)
        return Routing(strategy=self.strategy, group_size=self.group_size, measured=(chosen,))

    def interpolation(self, sigma: Tensor, boundaries: Sequence[float] = ()) -> Interpolation:
        raise TypeError(
            "a WindowRouting routes one window at a time: bind it first (BackwardSetting.at_window)"
        )

    @property
    def label(self) -> str:
        """e.g. ``jagg/W4/fwindow``."""
        return f"{self.strategy}/W{self.group_size}/fwindow"


def split_at_experts(plans: Sequence[GroupPlan], segments: Sequence[range]) -> list[GroupPlan]:
    """``plans`` with every group cut where a stretch of ``segments`` ends (``jagg.engine.knots.expert_segments``),
    so no group interpolates across a switch of network; a part of one step runs exact."""
    out = []
    for plan in plans:
        for seg in segments:
            part = tuple(i for i in plan.steps if i in seg)
            if part:
                out.append(GroupPlan(steps=part, strategy=plan.strategy if len(part) > 1 else "exact"))
    return out


def plans_interpolation(plans: Sequence[GroupPlan], sigma: Tensor) -> Interpolation:
    """Consecutive groups (``plan_groups``) as one block-diagonal plan over the T steps at times ``sigma``,
    named by the groups' strategy other than exact (a routing has one)."""
    covered = [i for plan in plans for i in plan.steps]
    if covered != list(range(sigma.shape[0])):
        raise ValueError(
            f"plans must cover the {sigma.shape[0]} trained steps once each, in order, got {covered}"
        )
    parts = [group_interpolation(p.strategy, sigma[list(p.steps)]) for p in plans]
    names = {p.strategy for p in plans} - {"exact"}
    return Interpolation.stack(parts, names.pop() if len(names) == 1 else "exact")


@dataclass(frozen=True, kw_only=True)
class BackwardSetting(GraphRun):
    """Everything an update needs about its backward, bound once: the routing that places each micro-batch's
    knots (``Routing`` of groups or shared ``Knots``), how the plan runs (``GraphRun``: ``backward.graph_mode``,
    ``backward.endpoint_signals``, ``backward.max_rows``; the defaults are written there; and ``backward_fn``,
    the engine's backward, autograd by default) and whether stored rollout outputs may replace forwards
    (``backward.stored_outputs``; the loop decides when they are valid: only for a rollout made by this
    trainer's own forward at the current weights)."""

    routing: Routing | Knots | WindowRouting
    stored_outputs: bool = True

    def __post_init__(self) -> None:
        r = self.routing
        size = r.group_size if isinstance(r, (Routing, WindowRouting)) else 2
        validate_routing(size, getattr(r, "jagg_frac", 1.0), r.strategy)
        super().__post_init__()

    def at_window(self, start: int) -> BackwardSetting:
        """The setting of a window whose first step is ``start``: its entry of a ``WindowRouting``. Any other
        routing does not depend on where the trained steps lie and is returned as it is."""
        if not isinstance(self.routing, WindowRouting):
            return self
        return dataclasses.replace(self, routing=self.routing.at(start))

    def backward(self, velocity: Velocity, loss: StepLoss, outputs: Tensor | None = None) -> GroupStats:
        """ADD the micro-batch's gradient to ``.grad``: ``loss`` is the per-step loss of its T trained steps
        (``loss.x`` (T, B, ...), ``loss.sigma`` (T,) or (T, B), ``loss(i, v)``; e.g. ``GRPOStepLoss``);
        ``outputs`` (T, B, ...) the stored outputs at the current weights, read when ``stored_outputs``."""
        return self.run(self.plan(velocity, loss.sigma), velocity, loss, outputs)

    def plan(self, velocity: Velocity, sigma: Tensor) -> Interpolation:
        """The plan of the T trained steps at times ``sigma`` for ``velocity``: the routing's, with no knot
        interval or group across a switch of network the velocity declares (``expert_boundaries``)."""
        return self.routing.interpolation(sigma, expert_boundaries(velocity))

    def run(
        self, plan: Interpolation, velocity: Velocity, loss: StepLoss, outputs: Tensor | None = None
    ) -> GroupStats:
        """``backward`` with another plan of the same T steps (a part of this setting's plan, the identity),
        run the way this setting runs its own (graph mode, signals, stored outputs, row bound)."""
        outputs = outputs if self.stored_outputs else None
        return self.run_plan(plan, velocity, loss.x, loss.sigma, loss, outputs)

    @property
    def exact(self) -> BackwardSetting:
        """Exact's backward in this setting's place: every step a plain step (the modes do not apply to it)."""
        return replace(self, routing=Routing.exact())

    def cost(self, num_steps: int, *, batch: int = 1, stored_outputs: bool = False) -> GroupCost:
        """The predicted counts of ``backward`` on a micro-batch of ``batch`` samples with ``num_steps``
        trained steps (``stored_outputs``: the micro-batch comes with valid stored outputs, read where this
        setting reads them)."""
        return plan_cost(
            self.routing.interpolation(nominal_sigmas(num_steps)),
            graph_mode=self.graph_mode,
            stored_outputs=stored_outputs and self.stored_outputs,
            endpoint_signals=self.endpoint_signals,
            max_rows=self.max_rows,
            batch=batch,
        )

    def update_cost(
        self, num_steps: int, *, micro_batches: int, grad_accum: int, batch: int = 1
    ) -> GroupCost:
        """One update: ``micro_batches`` micro-batches and an optimizer step every ``grad_accum``. Stored
        outputs are valid only at the rollout's weights, so only the micro-batches before the first optimizer
        step (the first ``min(grad_accum, micro_batches)``) read them."""
        valid = min(grad_accum, micro_batches) if self.stored_outputs else 0
        costs = [self.cost(num_steps, batch=batch, stored_outputs=k < valid) for k in range(micro_batches)]
        return functools.reduce(operator.add, costs)

    @property
    def holds_gradients(self) -> bool:
        """Whether one backward call runs over several knot graphs (``joint``, an aggregated strategy): under
        FSDP2 a later graph's gradient then waits unsharded for the earlier one (the memory plan's held
        gradient). Stacked modes build one graph per backward call."""
        return self.routing.strategy != "exact" and not GRAPH_MODES[self.graph_mode].stacked

    @property
    def mode(self) -> str:
        """The graph mode ("-" for exact), with "+stored" when stored outputs are read, "+nograd_ends" when the
        knots' signals come from forwards without autograd and "+rows<n>" under ``max_rows``."""
        if self.routing.strategy == "exact":
            return "-"
        stored = "+stored" if self.stored_outputs else ""
        rows = f"+rows{self.max_rows}" if self.max_rows is not None else ""
        return self.graph_mode + stored + ("+nograd_ends" if self.endpoint_signals == "nograd" else "") + rows

    @property
    def label(self) -> str:
        """``exact``, or the strategy and its mode, e.g. ``jagg/batched+stored`` (the routing left out)."""
        return "exact" if self.routing.strategy == "exact" else f"{self.routing.strategy}/{self.mode}"

    @property
    def key(self) -> str:
        """A short unique label, e.g. ``jagg/W3/f0.6/batched+stored`` or ``knots/K4/low_noise/batched+stored``."""
        return f"{self.routing.label}/{self.mode}"


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True, kw_only=True)
class GroupCost:
    """Predicted work of a backward (the counts ``GroupStats`` measures), plus memory and FSDP2 traffic.

    Passes are in units of one model evaluation on the micro-batch. ``graphs_alive`` is the peak number of
    B-sample autograd graphs held at once (saved activations; the exact baseline holds 1). ``all_gathers`` /
    ``reduce_scatters`` are per FSDP2 unit that reshards after forward and after backward.
    """

    forward_passes: int
    forward_passes_with_grad: int
    forward_calls: int
    forwards_skipped: int
    backward_passes: int
    backward_graphs: int
    backward_calls: int
    graphs_alive: int
    all_gathers: int
    reduce_scatters: int

    def __add__(self, other: GroupCost) -> GroupCost:
        """Backwards run one after another: counts add up, the activation peak is the larger one."""
        total = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        total["graphs_alive"] = max(self.graphs_alive, other.graphs_alive)
        return GroupCost(**total)

    def time(self, forward: float = 1.0, backward: float = 2.0) -> float:
        """Time in the unit of ``forward``, with one backward pass costing ``backward`` (about 2 forwards)."""
        return self.forward_passes * forward + self.backward_passes * backward


_PLAIN_STEP = GroupCost(
    forward_passes=1,
    forward_passes_with_grad=1,
    forward_calls=1,
    forwards_skipped=0,
    backward_passes=1,
    backward_graphs=1,
    backward_calls=1,
    graphs_alive=1,
    all_gathers=2,
    reduce_scatters=1,
)


def _block_cost(
    plan: Interpolation, block: tuple[int, ...], mode, nograd: bool, stored: bool, chunk: int
) -> GroupCost:
    """What ``interpolated_backward`` does for one block, counted the same way without running it."""
    if plan.is_plain(block):
        return _PLAIN_STEP
    knots = {plan.knots[k] for k in block}
    detached = {j for j in plan.feeding(block) if nograd or j not in knots}
    chunks = [block[i : i + chunk] for i in range(0, len(block), chunk)]
    for c, part in enumerate(chunks):  # a later chunk's knot needed first: its signal without the graph
        later = {plan.knots[k] for rest in chunks[c + 1 :] for k in rest}
        detached |= later.intersection(plan.feeding(part))
    fwd = 0 if stored else len(detached)
    n = len(block)
    grad_calls = len(chunks) if mode.stacked else n
    graphs = len(chunks) if mode.stacked else n
    return GroupCost(
        forward_passes=fwd + n,
        forward_passes_with_grad=n,
        forward_calls=fwd + grad_calls,
        forwards_skipped=len(detached) if stored else 0,
        backward_passes=n,
        backward_graphs=graphs,
        backward_calls=len(chunks),
        graphs_alive=max(len(p) for p in chunks),
        all_gathers=fwd + grad_calls + graphs,
        reduce_scatters=len(chunks),
    )


def plan_cost(
    plan: Interpolation,
    *,
    graph_mode: str,
    stored_outputs: bool,
    endpoint_signals: str,
    max_rows: int | None = None,
    batch: int = 1,
) -> GroupCost:
    """The counts ``interpolated_backward`` reports for ``plan`` (tested equal), without running it: per block
    the detached forwards (signals not taken from a knot graph; none when ``stored_outputs`` are read), one
    forward with autograd and one backward pass per knot, in calls and graphs as the mode chunks them."""
    mode = GRAPH_MODES[graph_mode]
    costs = []
    for block in plan.blocks:
        size = mode.chunk or (max(1, max_rows // batch) if mode.stacked and max_rows else len(block))
        costs.append(_block_cost(plan, block, mode, endpoint_signals == "nograd", stored_outputs, size))
    return functools.reduce(operator.add, costs)


# --------------------------------------------------------------------------- calibration (measured routing)
@dataclass(frozen=True, kw_only=True)
class CandidateRouting:
    """One candidate W of a calibration: its cosines, the routing they give, the update's predicted cost."""

    cosines: tuple[GroupCosine, ...]
    routing: Routing
    predicted_cost: float  # BackwardSetting.update_cost(...).time(): forwards + 2 x backwards


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What ``calibrate_routing`` measured and chose (``chosen`` is one of ``candidates``, keyed by W)."""

    chosen: CandidateRouting
    candidates: dict[int, CandidateRouting]

    @property
    def routing(self) -> Routing:
        return self.chosen.routing

    def as_metrics(self, *, per_group_size: bool) -> dict:
        """The chosen W's cosines and routing (strategy or "exact" per group), W, and with ``per_group_size``
        each candidate's cosines, routing (bools) and predicted cost, under the names ``metrics.jsonl`` uses."""
        routing = self.routing
        row = {
            "calibration_cosines": [c.cosine for c in self.chosen.cosines],
            "routing": [routing.strategy if r else "exact" for r in routing.measured],
            "group_size": routing.group_size,
        }
        if per_group_size:
            row["calibration_by_group_size"] = {
                str(w): {
                    "cosines": [c.cosine for c in cand.cosines],
                    "routing": list(cand.routing.measured),
                    "predicted_cost": cand.predicted_cost,
                }
                for w, cand in self.candidates.items()
            }
        return row


def calibrate_routing(
    velocity: Velocity,
    loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    *,
    setting: BackwardSetting,
    group_sizes: Sequence[int],
    min_cosine: float,
    micro_batches: int = 1,
    grad_accum: int = 1,
) -> Calibration:
    """Measured routing on one micro-batch, its per-step loss ``loss`` (``loss.x`` (T, B, ...) and ``loss.sigma``
    (T,) or (T, B) sorted by time, sigma decreasing; ``loss(i, v)`` indexed by the trained-step position i);
    gradients over ``params``. The three ``calibrate_*`` take (velocity, the loss, params, *, their choices);
    ``calibrate_windows`` one loss per window.

    ``setting`` is the run's backward with any routing of its strategy: what is measured replaces the routing,
    and its graph mode, stored outputs, signals and row bound are kept (the measurement runs in its graph mode). Per W in ``group_sizes``:
    ``group_gradient_cosines`` of the strategy vs exact, ``route_by_cosine`` at ``min_cosine`` (a position uses
    the strategy where its cosine qualifies), and the predicted cost of an update with that routing
    (``BackwardSetting.update_cost`` with the update's ``micro_batches`` / ``grad_accum``). The cheapest W is
    kept (ties: the smaller W, closer to exact): every routed group of every candidate has passed the cosine
    test, so W is chosen by cost among gradients of known quality. ``.grad`` of ``params`` is left as it was.
    """
    strategy, num_steps = setting.routing.strategy, loss.x.shape[0]
    candidates = {}
    for w in sorted(set(group_sizes)):
        cosines = group_gradient_cosines(
            velocity,
            loss.x,
            loss.sigma,
            loss,
            params,
            group_size=w,
            strategies=(strategy,),
            run=GraphRun(graph_mode=setting.graph_mode),
        )
        qualified = route_by_cosine(cosines, min_cosine, strategy)
        plans = plan_groups(num_steps, w, 1.0, strategy, qualified)
        routing = Routing(
            strategy=strategy, group_size=w, measured=tuple(p.strategy != "exact" for p in plans)
        )
        cost = replace(setting, routing=routing).update_cost(
            num_steps, micro_batches=micro_batches, grad_accum=grad_accum
        )
        candidates[w] = CandidateRouting(cosines=tuple(cosines), routing=routing, predicted_cost=cost.time())
    best = min(candidates, key=lambda w: (candidates[w].predicted_cost, w))
    return Calibration(chosen=candidates[best], candidates=candidates)


@dataclass(frozen=True, kw_only=True)
class WindowCalibration:
    """What ``calibrate_windows`` measured: per window start the cosine of its ``strategy`` gradient to the exact
    one (None for a one-step window: exact, nothing to compare), and the routing it gives."""

    cosines: dict[int, float | None]
    routing: WindowRouting

    def as_metrics(self) -> dict:
        """``window_cosines`` and ``window_routing`` (strategy or "exact") keyed by window start, and W."""
        routing = self.routing
        return {
            "window_cosines": {str(start): cos for start, cos in self.cosines.items()},
            "window_routing": {str(s): routing.strategy if r else "exact" for s, r in routing.routed},
            "group_size": routing.group_size,
        }


def calibrate_windows(
    velocity: Velocity,
    losses: Mapping[int, StepLoss],
    params: Sequence[torch.nn.Parameter],
    *,
    strategy: str,
    group_size: int,
    min_cosine: float,
    graph_mode: str,
) -> WindowCalibration:
    """Measured routing per window position: ``losses[start]`` is the per-step loss of the window starting at step
    ``start`` (``.x`` / ``.sigma`` its steps, one group of at most ``group_size``); its ``strategy`` gradient is
    compared with its exact one (``group_gradient_cosines`` in the run's ``graph_mode``: len + the strategy's
    backward passes) and the window runs ``strategy`` where ``route_by_cosine`` qualifies it at ``min_cosine``.
    ``.grad`` is left as it was."""
    cosines, routed = {}, []
    for start, loss in sorted(losses.items()):
        if loss.x.shape[0] > group_size:
            raise ValueError(f"the window at {start} has {loss.x.shape[0]} steps, more than W = {group_size}")
        measured = group_gradient_cosines(
            velocity,
            loss.x,
            loss.sigma,
            loss,
            params,
            group_size=group_size,
            strategies=(strategy,),
            run=GraphRun(graph_mode=graph_mode),
        )
        cosines[start] = measured[0].cosine if measured else None
        routed.append((start, route_by_cosine(measured, min_cosine, strategy) == [True]))
    routing = WindowRouting(strategy=strategy, group_size=group_size, routed=tuple(routed))
    return WindowCalibration(cosines=cosines, routing=routing)


@dataclass(frozen=True, kw_only=True)
class KnotsCalibration:
    """What ``calibrate_knots`` measured: the cosine of each placement rule's micro-batch gradient to the exact
    one, and the rule kept (the highest cosine; ties: the first in ``PLACEMENTS``)."""

    chosen: Knots
    cosines: dict[str, float]

    @property
    def routing(self) -> Knots:
        return self.chosen

    def as_metrics(self) -> dict:
        return {"placement": self.chosen.placement, "placement_cosines": dict(self.cosines)}


def calibrate_knots(
    velocity: Velocity,
    loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    *,
    count: int,
    graph_mode: str,
) -> KnotsCalibration:
    """The measured placement (``backward.placement: auto``) on one micro-batch's ``loss``: every rule of
    ``PLACEMENTS`` with ``count`` knots, its gradient's cosine to the exact one (``plan_gradient_cosines`` in the
    run's ``graph_mode``: T + |rules| K backward passes), and the best kept. ``.grad`` of ``params`` is left as
    it was."""
    sigmas = torch.as_tensor(loss.sigma)
    rules = {name: Knots(count=count, placement=name) for name in PLACEMENTS}
    plans = {name: k.interpolation(sigmas, expert_boundaries(velocity)) for name, k in rules.items()}
    measured = plan_gradient_cosines(
        velocity, loss.x, sigmas, loss, params, plans, run=GraphRun(graph_mode=graph_mode)
    )
    cosines = {name: cos for name, (cos, _) in measured.items()}
    best = max(rules, key=lambda name: cosines[name])  # max keeps the first of equal cosines
    return KnotsCalibration(chosen=rules[best], cosines=cosines)


# --------------------------------------------------------------------------- the calibrators' keys
@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """A calibrator's keys, with their defaults and checks: flat keys of the ``backward:`` section (the
    calibrators were there before they had a config of their own, so the key paths stay). Every calibrator
    re-measures before the first update and every ``calibrate_every`` iterations; this one is the knots
    calibrator's whole config (``backward.placement: auto`` is its switch, a routing key)."""

    calibrate_every: int = 25

    @classmethod
    def of(cls, backward) -> CalibrationConfig:
        """This config's keys read from ``backward`` (a ``jagg.engine.config.BackwardConfig``)."""
        return cls(**{f.name: getattr(backward, f.name) for f in fields(cls)})

    def validate(self) -> None:
        """``ConfigError`` naming the key and what is allowed."""
        require(
            self.calibrate_every >= 1, f"backward.calibrate_every must be >= 1, got {self.calibrate_every}"
        )


@dataclass(frozen=True, kw_only=True)
class CosineCalibrationConfig(CalibrationConfig):
    """The windows calibrator's keys (``calibrate_windows``): a position is routed to the strategy when the
    cosine of its gradient to the exact one reaches ``min_cosine``."""

    min_cosine: float = 0.9

    def validate(self) -> None:
        super().validate()
        require(
            -1.0 <= self.min_cosine <= 1.0, f"backward.min_cosine must be in [-1, 1], got {self.min_cosine}"
        )


@dataclass(frozen=True, kw_only=True)
class GroupsCalibrationConfig(CosineCalibrationConfig):
    """The groups calibrator's keys (``calibrate_routing``): the cosine threshold, and under
    ``backward.group_size: auto`` the candidate group sizes W it measures."""

    group_sizes: list[int] = dataclasses.field(default_factory=lambda: [2, 3, 4])

    def validate(self) -> None:
        super().validate()
        require(
            bool(self.group_sizes) and all(isinstance(w, int) and w >= 2 for w in self.group_sizes),
            f"backward.group_sizes must be a non-empty list of integers >= 2, got {self.group_sizes!r}",
        )


# The calibrators' configs by routing kind (``jagg.loop.calibration``'s calibrators point at theirs; a test
# checks they agree). ``jagg.engine.config.BackwardConfig`` composes its calibration keys from here.
CALIBRATIONS: dict[str, type[CalibrationConfig]] = {
    "groups": GroupsCalibrationConfig,
    "windows": CosineCalibrationConfig,
    "knots": CalibrationConfig,
}
