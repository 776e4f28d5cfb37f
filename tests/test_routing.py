"""Routing: the groups of a trajectory, their backward, the cost model, and calibration (float64)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import grads_of, make_grpo_step_loss, make_model, rel_err, straight_path_latents
from jagg.engine.diagnostics import group_gradient_cosines, route_by_cosine
from jagg.engine.routing import (
    BackwardSetting,
    Calibration,
    GroupPlan,
    Routing,
    calibrate_routing,
    plan_groups,
    plans_interpolation,
)

SIGMAS = torch.tensor([0.95, 0.83, 0.66, 0.52, 0.41, 0.27, 0.15, 0.08, 0.03], dtype=torch.float64)


def setup_group(name, w, *, seed=0):
    module, velocity, shape = make_model(name, seed=seed)
    sig = SIGMAS[: w + 1]
    latents = straight_path_latents(shape, sig[:w], seed=seed + 7)
    step_loss = make_grpo_step_loss(velocity, latents, sig[:w], sig[1 : w + 1], seed=seed + 3)
    return module, velocity, latents, sig[:w], step_loss


@pytest.mark.parametrize("strategy", ["jagg", "endpoints", "uniform"])
def test_trajectory_routing_with_w2_and_frac1_is_exact_for_jagg(strategy):
    module, velocity, latents, sigmas, step_loss = setup_group("flux", 7)
    module.zero_grad(set_to_none=True)
    BackwardSetting(routing=Routing(strategy="exact", group_size=2)).backward(velocity, step_loss)
    g_exact = grads_of(module)
    module.zero_grad(set_to_none=True)
    setting = BackwardSetting(routing=Routing(strategy=strategy, group_size=2, jagg_frac=1.0))
    stats = setting.backward(velocity, step_loss)
    # 7 steps in groups of 2: three two-step groups (2 passes each) + one single-step group (exact)
    assert stats.backward_passes == 7 and stats.backward_calls == 4
    cost = setting.cost(7)
    assert (cost.forward_passes, cost.backward_passes, cost.backward_calls) == (7, 7, 4)
    if strategy != "uniform":
        assert rel_err(grads_of(module), g_exact) < 1e-10


def test_a_backward_of_groups_rejects_plans_that_miss_a_step():
    module, velocity, latents, sigmas, step_loss = setup_group("mlp", 3)
    setting = BackwardSetting(routing=Routing(strategy="jagg", group_size=2))
    with pytest.raises(ValueError, match="cover the 3 trained steps once each"):
        setting.run(
            plans_interpolation([GroupPlan(steps=(0, 1), strategy="jagg")], sigmas), velocity, step_loss
        )


def test_plan_groups_routing():
    plans = plan_groups(9, 3, 0.6, "jagg")  # 3 groups, round(1.8) = 2 routed to JAGG
    assert [p.steps for p in plans] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert [p.strategy for p in plans] == ["jagg", "jagg", "exact"]
    assert [p.strategy for p in plan_groups(11, 4, 0.6, "jagg")] == ["jagg", "jagg", "exact"]
    assert all(p.strategy == "exact" for p in plan_groups(9, 3, 0.0, "jagg"))
    # last group of one step is always exact
    assert [p.strategy for p in plan_groups(7, 3, 1.0, "jagg")] == ["jagg", "jagg", "exact"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(group_size=1, jagg_frac=0.5, strategy="jagg"), "group_size"),
        (dict(group_size=3, jagg_frac=1.5, strategy="jagg"), r"jagg_frac must be in \[0, 1\]"),
        (dict(group_size=3, jagg_frac=-0.1, strategy="jagg"), "jagg_frac"),
        (dict(group_size=3, jagg_frac=0.5, strategy="bogus"), "strategy"),
    ],
)
def test_plan_groups_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_groups(9, **kwargs)
    with pytest.raises(ValueError, match=match):
        Routing(**kwargs)


def test_routing_fixed_and_measured_and_the_setting_label():
    fixed = Routing(strategy="jagg", group_size=3, jagg_frac=0.6)
    assert fixed.plans(9) == plan_groups(9, 3, 0.6, "jagg") and fixed.frac_label == "0.6"
    measured = Routing(strategy="jagg", group_size=3, measured=(False, True))
    assert [p.strategy for p in measured.plans(9)] == ["exact", "jagg", "exact"]
    assert measured.frac_label == "auto"
    setting = BackwardSetting(routing=fixed, graph_mode="joint", stored_outputs=False)
    assert setting.key == "jagg/W3/f0.6/joint" and setting.mode == "joint"
    stored = BackwardSetting(routing=measured)
    assert stored.key == "jagg/W3/fauto/batched+stored"
    assert BackwardSetting(routing=Routing(strategy="exact", group_size=2)).mode == "-"
    with pytest.raises(ValueError, match="backward.graph_mode"):
        BackwardSetting(routing=fixed, graph_mode="diagonal")
    authors = BackwardSetting(
        routing=fixed, graph_mode="sequential", stored_outputs=False, endpoint_signals="nograd"
    )
    assert authors.key == "jagg/W3/f0.6/sequential+nograd_ends"
    with pytest.raises(ValueError, match=r"backward.endpoint_signals must be one of \('graph', 'nograd'\)"):
        BackwardSetting(routing=fixed, endpoint_signals="detached")
    with pytest.raises(TypeError):
        Routing("jagg", 3)  # keyword-only: a positional W can never be read as a fraction


def test_setting_update_cost_reads_stored_outputs_before_the_first_optimizer_step_only():
    """4 micro-batches, a step every 2: the first 2 read stored outputs, the last 2 forward again."""
    routing = Routing(strategy="jagg", group_size=3)
    reusing = BackwardSetting(routing=routing, graph_mode="batched", stored_outputs=True)
    stored, fresh = (reusing.cost(3, stored_outputs=r) for r in (True, False))
    cost = reusing.update_cost(3, micro_batches=4, grad_accum=2)
    assert cost == stored + stored + fresh + fresh
    assert cost.forwards_skipped == 2 and cost.forward_passes == 2 * 2 + 2 * 3
    never = replace(reusing, stored_outputs=False).update_cost(3, micro_batches=4, grad_accum=2)
    assert never == fresh + fresh + fresh + fresh
    assert reusing.update_cost(3, micro_batches=3, grad_accum=8) == stored + stored + stored


def _calibration_problem():
    module, velocity, latents, sigmas, step_loss = setup_group("mlp", 7)
    return module, velocity, latents, sigmas, step_loss


@pytest.mark.parametrize("min_cosine", [-1.0, 1.0])
def test_calibrate_routing_measures_routes_and_keeps_the_cheapest_w(min_cosine):
    """Each candidate W is measured and routed exactly as ``group_gradient_cosines`` + ``route_by_cosine`` +
    ``plan_groups`` say, its cost is ``BackwardSetting.update_cost`` of that routing, and the cheapest W is kept (ties: the
    smaller). Gradients come back untouched."""
    module, velocity, latents, sigmas, step_loss = _calibration_problem()
    params = list(module.parameters())
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    before = [p.grad for p in params]
    setting = BackwardSetting(routing=Routing(strategy="jagg", group_size=4), graph_mode="batched")
    kw = dict(micro_batches=2, grad_accum=1)
    cal = calibrate_routing(
        velocity,
        step_loss,
        params,
        setting=setting,
        group_sizes=[4, 2, 3],
        min_cosine=min_cosine,
        **kw,
    )
    assert isinstance(cal, Calibration) and all(p.grad is g for p, g in zip(params, before, strict=True))
    assert sorted(cal.candidates) == [2, 3, 4]
    for w, cand in cal.candidates.items():
        cosines = group_gradient_cosines(velocity, latents, sigmas, step_loss, params, group_size=w)
        assert [c.cosine for c in cand.cosines] == [c.cosine for c in cosines]
        plans = plan_groups(7, w, 1.0, "jagg", route_by_cosine(cosines, min_cosine))
        assert cand.routing == Routing(
            strategy="jagg", group_size=w, measured=tuple(p.strategy == "jagg" for p in plans)
        )
        # an optimizer step per micro-batch: only the first of the two reads stored outputs
        routed = replace(setting, routing=cand.routing)
        stored, fresh = (routed.cost(7, stored_outputs=r) for r in (True, False))
        assert cand.predicted_cost == (stored + fresh).time()
    costs = {w: c.predicted_cost for w, c in cal.candidates.items()}
    assert cal.routing.group_size == min(costs, key=lambda w: (costs[w], w))
    if min_cosine == -1.0:  # every group qualifies: W = 4 (groups 4 + 3) is the cheapest
        assert cal.routing == Routing(strategy="jagg", group_size=4, measured=(True, True))
    else:  # only the exact two-step groups qualify: W = 2 (three JAGG pairs + one exact step)
        assert cal.routing == Routing(strategy="jagg", group_size=2, measured=(True, True, True, False))
    row = cal.as_metrics(per_group_size=True)
    assert row["group_size"] == cal.routing.group_size
    assert row["routing"] == ["jagg" if r else "exact" for r in cal.routing.measured]
    assert set(row["calibration_by_group_size"]) == {"2", "3", "4"}
    assert "calibration_by_group_size" not in cal.as_metrics(per_group_size=False)


@pytest.mark.parametrize("graph_mode", ["batched", "sequential"])
def test_setting_cost_with_nograd_endpoint_signals_matches_the_backward(graph_mode):
    """The authors' forward count on a trajectory of 12 steps in groups of 4 (all aggregated): W + 2 = 6
    forwards per group, 2 of them with autograd; ``BackwardSetting.cost`` predicts what its ``backward``
    reports, and the gradient is the default's (signals from the graphs) to float64 rounding."""
    module, velocity, shape = make_model("mlp", seed=2)
    sig = torch.linspace(0.97, 0.05, 13, dtype=torch.float64)
    latents = straight_path_latents(shape, sig[:12], seed=9)
    step_loss = make_grpo_step_loss(velocity, latents, sig[:12], sig[1:], seed=4)
    routing = Routing(strategy="jagg_index", group_size=4, jagg_frac=1.0)
    grads, stats = {}, {}
    for signals in ("graph", "nograd"):
        module.zero_grad(set_to_none=True)
        setting = BackwardSetting(routing=routing, graph_mode=graph_mode, endpoint_signals=signals)
        stats[signals] = setting.backward(velocity, step_loss)
        grads[signals] = grads_of(module)
        cost = setting.cost(12)
        for key in ("forward_passes", "forward_passes_with_grad", "forward_calls", "backward_passes"):
            assert getattr(cost, key) == getattr(stats[signals], key), (signals, key)
    assert (stats["graph"].forward_passes, stats["nograd"].forward_passes) == (12, 18)
    assert stats["nograd"].forward_passes_with_grad == 6 and stats["nograd"].backward_passes == 6
    assert grads["graph"].norm() > 0 and rel_err(grads["nograd"], grads["graph"]) < 1e-12
