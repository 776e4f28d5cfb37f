"""Routing: which backward each group of a trajectory's trained steps uses, what that costs, and measuring it.

The T time-sorted trained steps of a micro-batch are cut into consecutive groups of W (``plan_groups``); each
group runs ``group_backward`` with its plan's strategy (``trajectory_backward``). A ``Routing`` says how the
groups are chosen: the leading ``jagg_frac`` of them on the strategy (the paper's rule), or a measured choice
per group position. ``calibrate_routing`` measures that choice: per candidate W the cosine of each group's
gradient to its exact one (``jagg.engine.diagnostics``), the groups at or above ``min_cosine`` routed, and
the W whose routed update the cost model predicts cheapest kept. The cost model (``group_cost``,
``trajectory_cost``, ``update_cost``) predicts the pass counts ``GroupStats`` measures (tested equal), and is
what the dry-run plan, the bench and Table 1 use. ``BackwardSetting`` is a routing plus how each group's
endpoint backward runs: everything an update needs to know about its backward.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from jagg.engine.diagnostics import GroupCosine, group_gradient_cosines, route_by_cosine
from jagg.engine.strategies import (
    AGGREGATION_WEIGHTS,
    ENDPOINT_MODES,
    ENDPOINT_SIGNALS,
    STRATEGIES,
    GroupStats,
    StepLoss,
    Velocity,
    group_backward,
)


# --------------------------------------------------------------------------- groups and their strategies
@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One group of a trajectory: positions (into the trained-step list) and the strategy it uses."""

    steps: tuple[int, ...]
    strategy: str


def validate_routing(
    group_size: int,
    jagg_frac: float,
    strategy: str,
    endpoints: str = "batched",
    endpoint_signals: str = "graph",
) -> None:
    """Raise ValueError naming the offending key and the allowed range."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"backward.group_size must be an integer >= 2, got {group_size!r}")
    if not 0.0 <= float(jagg_frac) <= 1.0:
        raise ValueError(f"backward.jagg_frac must be in [0, 1], got {jagg_frac!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"backward.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if endpoints not in ENDPOINT_MODES:
        raise ValueError(f"backward.endpoints must be one of {ENDPOINT_MODES}, got {endpoints!r}")
    if endpoint_signals not in ENDPOINT_SIGNALS:
        raise ValueError(
            f"backward.endpoint_signals must be one of {ENDPOINT_SIGNALS}, got {endpoint_signals!r}"
        )


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
    """

    strategy: str
    group_size: int
    jagg_frac: float = 1.0
    measured: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        validate_routing(self.group_size, self.jagg_frac, self.strategy)

    def plans(self, num_steps: int) -> list[GroupPlan]:
        """The groups of ``num_steps`` trained steps and the strategy of each (``plan_groups``)."""
        return plan_groups(num_steps, self.group_size, self.jagg_frac, self.strategy, self.measured)

    @property
    def frac_label(self) -> str:
        """``jagg_frac`` as the config writes it: a number, or ``auto`` for a measured routing."""
        return "auto" if self.measured is not None else f"{self.jagg_frac:g}"


@dataclass(frozen=True, kw_only=True)
class BackwardSetting:
    """Everything an update needs about its backward: the routing of each micro-batch's groups, the endpoint
    mode of an aggregated group (``ENDPOINT_MODES``), whether stored rollout outputs may replace forwards
    (``backward.reuse_rollout``; the loop decides when they are valid) and where the endpoints' own signals
    come from (``ENDPOINT_SIGNALS``, ``backward.endpoint_signals``)."""

    routing: Routing
    endpoints: str = "batched"
    reuse_outputs: bool = True
    endpoint_signals: str = "graph"

    def __post_init__(self) -> None:
        r = self.routing
        validate_routing(r.group_size, r.jagg_frac, r.strategy, self.endpoints, self.endpoint_signals)

    @property
    def mode(self) -> str:
        """The endpoint mode ("-" for exact), with "+stored" when the rollout's outputs are reused and
        "+nograd_ends" when the endpoints' signals come from forwards without autograd."""
        if self.routing.strategy == "exact":
            return "-"
        stored = "+stored" if self.reuse_outputs else ""
        return self.endpoints + stored + ("+nograd_ends" if self.endpoint_signals == "nograd" else "")

    @property
    def key(self) -> str:
        """A short unique label, e.g. ``jagg/W3/f0.6/batched+stored``."""
        r = self.routing
        return f"{r.strategy}/W{r.group_size}/f{r.frac_label}/{self.mode}"


def trajectory_backward(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    plans: Sequence[GroupPlan],
    *,
    endpoints: str = "batched",
    outputs: Tensor | None = None,
    endpoint_signals: str = "graph",
) -> GroupStats:
    """Backward over all T trained steps of a trajectory, one ``group_backward`` per plan (e.g.
    ``Routing.plans(T)``).

    ``latents`` (T, B, ...) and ``sigmas`` (T,) or (T, B) must be sorted by time (sigma decreasing);
    ``step_loss(i, v)`` takes the index i into the T trained steps. ``endpoints``, ``endpoint_signals`` and
    ``outputs`` (T, B, ...) are passed to ``group_backward`` for each group.
    """
    covered = sorted(i for plan in plans for i in plan.steps)
    if covered != list(range(latents.shape[0])):
        raise ValueError(f"plans must cover the {latents.shape[0]} trained steps once each, got {covered}")
    total = None
    for plan in plans:
        idx = list(plan.steps)
        stats = group_backward(
            velocity,
            latents[idx],
            torch.as_tensor(sigmas)[idx],
            lambda j, v, idx=idx: step_loss(idx[j], v),
            plan.strategy,
            endpoints=endpoints,
            outputs=None if outputs is None else outputs[idx],
            endpoint_signals=endpoint_signals,
        )
        total = stats if total is None else total.merge(stats)
    return total


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True, kw_only=True)
class GroupCost:
    """Predicted work of one group (the counts ``GroupStats`` measures), plus memory and FSDP2 traffic.

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
        """Groups run one after another: counts add up, the activation peak is the larger one."""
        total = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        total["graphs_alive"] = max(self.graphs_alive, other.graphs_alive)
        return GroupCost(**total)

    def time(self, forward: float = 1.0, backward: float = 2.0) -> float:
        """Time in the unit of ``forward``, with one backward pass costing ``backward`` (about 2 forwards)."""
        return self.forward_passes * forward + self.backward_passes * backward


def _exact_cost(size: int) -> GroupCost:
    """W forwards with autograd and W backwards, one graph alive at a time; 2 all-gathers per step."""
    return GroupCost(
        forward_passes=size,
        forward_passes_with_grad=size,
        forward_calls=size,
        forwards_skipped=0,
        backward_passes=size,
        backward_graphs=size,
        backward_calls=size,
        graphs_alive=1,
        all_gathers=2 * size,
        reduce_scatters=size,
    )


def group_cost(
    size: int,
    strategy: str,
    endpoints: str = "batched",
    reuse_outputs: bool = False,
    endpoint_signals: str = "graph",
) -> GroupCost:
    """The counts ``group_backward`` reports for a group of ``size`` steps (tested equal), without running it.

    ``reuse_outputs``: intermediate outputs come from the rollout (``group_backward(..., outputs=...)``).
    Two endpoint forwards with autograd and two backward passes always; the detached forwards are the
    intermediate steps with a non-zero weight row (plus the last step in sequential mode when it feeds g_0),
    and with ``endpoint_signals="nograd"`` every step with a non-zero row, endpoints included (W + 2 forwards
    per group, as the authors' code).
    """
    validate_routing(max(size, 2), 0.0, strategy, endpoints, endpoint_signals)
    if strategy == "exact" or size == 1:
        return _exact_cost(size)
    weights = AGGREGATION_WEIGHTS[strategy](torch.linspace(1.0, 0.1, size, dtype=torch.float64))
    if endpoint_signals == "nograd":  # every signal from its own forward without autograd
        detached = sum(bool((weights[j] != 0).any()) for j in range(size))
    else:
        mid = sum(bool((weights[j] != 0).any()) for j in range(1, size - 1))  # intermediate signals needed
        early_last = endpoints == "sequential" and bool(weights[-1, 0] != 0)  # s_{W-1} before its graph
        detached = mid + early_last  # outputs needed without autograd
    fwd = 0 if reuse_outputs else detached
    graphs, calls = {"batched": (1, 1), "joint": (2, 1), "sequential": (2, 2)}[endpoints]
    return GroupCost(
        forward_passes=fwd + 2,
        forward_passes_with_grad=2,
        forward_calls=fwd + (1 if endpoints == "batched" else 2),
        forwards_skipped=detached if reuse_outputs else 0,
        backward_passes=2,
        backward_graphs=graphs,
        backward_calls=calls,
        graphs_alive=1 if endpoints == "sequential" else 2,
        all_gathers=fwd + (2 if endpoints == "batched" else 4),
        reduce_scatters=calls,
    )


def trajectory_cost(
    plans: Sequence[GroupPlan],
    *,
    endpoints: str = "batched",
    reuse_outputs: bool = False,
    endpoint_signals: str = "graph",
) -> GroupCost:
    """``group_cost`` summed over ``plans`` (what ``trajectory_backward`` does with them)."""
    costs = [group_cost(len(p.steps), p.strategy, endpoints, reuse_outputs, endpoint_signals) for p in plans]
    return functools.reduce(operator.add, costs)


def update_cost(
    plans: Sequence[GroupPlan],
    *,
    endpoints: str,
    reuse_outputs: bool,
    micro_batches: int,
    grad_accum: int,
    endpoint_signals: str = "graph",
) -> GroupCost:
    """The cost of one update: ``micro_batches`` micro-batches with these plans and an optimizer step every
    ``grad_accum``. Stored outputs are valid only at the rollout's weights, so with ``reuse_outputs`` only the
    micro-batches before the first optimizer step (the first ``min(grad_accum, micro_batches)``) read them."""
    stored = min(grad_accum, micro_batches) if reuse_outputs else 0
    costs = [
        trajectory_cost(
            plans, endpoints=endpoints, reuse_outputs=k < stored, endpoint_signals=endpoint_signals
        )
        for k in range(micro_batches)
    ]
    return functools.reduce(operator.add, costs)


# --------------------------------------------------------------------------- calibration (measured routing)
@dataclass(frozen=True, kw_only=True)
class CandidateRouting:
    """One candidate W of a calibration: its cosines, the routing they give, the update's predicted cost."""

    cosines: tuple[GroupCosine, ...]
    routing: Routing
    predicted_cost: float  # update_cost(...).time(): forwards + 2 x backwards


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
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    params: Sequence[torch.nn.Parameter],
    *,
    strategy: str,
    group_sizes: Sequence[int],
    min_cosine: float,
    endpoints: str = "batched",
    reuse_outputs: bool = False,
    micro_batches: int = 1,
    grad_accum: int = 1,
    endpoint_signals: str = "graph",
) -> Calibration:
    """Measured routing on one micro-batch (inputs as for ``trajectory_backward``; gradients over ``params``).

    Per W in ``group_sizes``: ``group_gradient_cosines`` of ``strategy`` vs exact, ``route_by_cosine`` at
    ``min_cosine`` (a position uses the strategy where its cosine qualifies), and the predicted cost of an
    update with that routing (``update_cost`` with the update's ``micro_batches`` / ``grad_accum`` /
    ``reuse_outputs``). The cheapest W is kept (ties: the smaller W, closer to exact): every routed group of
    every candidate has passed the cosine test, so W is chosen by cost among gradients of known quality.
    ``.grad`` of ``params`` is left as it was.
    """
    num_steps = latents.shape[0]
    candidates = {}
    for w in sorted(set(group_sizes)):
        cosines = group_gradient_cosines(
            velocity,
            latents,
            sigmas,
            step_loss,
            params,
            group_size=w,
            strategies=(strategy,),
            endpoints=endpoints,
        )
        qualified = route_by_cosine(cosines, min_cosine, strategy)
        plans = plan_groups(num_steps, w, 1.0, strategy, qualified)
        routing = Routing(
            strategy=strategy, group_size=w, measured=tuple(p.strategy != "exact" for p in plans)
        )
        cost = update_cost(
            plans,
            endpoints=endpoints,
            reuse_outputs=reuse_outputs,
            micro_batches=micro_batches,
            grad_accum=grad_accum,
            endpoint_signals=endpoint_signals,
        )
        candidates[w] = CandidateRouting(cosines=tuple(cosines), routing=routing, predicted_cost=cost.time())
    best = min(candidates, key=lambda w: (candidates[w].predicted_cost, w))
    return Calibration(chosen=candidates[best], candidates=candidates)
