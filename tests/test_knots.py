"""Shared knots (float64): the gradient against an independent oracle, where it is exact, where it equals JAGG,
the placement rules, the pass counts against the cost model, and a training run.

The oracle builds the piecewise-linear weights with ``numpy.interp`` of one-hot knot values (not
``hat_weights``) and takes every knot's vector-Jacobian product with its own ``torch.autograd.grad`` call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    MODEL_NAMES,
    Steps,
    count_passes,
    grads_of,
    make_grpo_step_loss,
    make_model,
    model_tol,
    rel_err,
    straight_path_latents,
)
from jagg.engine.knots import PLACEMENTS, Knots, expert_segments, hat_weights, split_count
from jagg.engine.routing import BackwardSetting, Routing, plan_cost
from jagg.engine.strategies import ENDPOINT_SIGNALS, GRAPH_MODES, Interpolation, interpolated_backward

# 9 steps of a shifted schedule (non-uniform in t, so t- and index-spacing differ)
SIGMAS = torch.tensor([0.97, 0.9, 0.81, 0.71, 0.6, 0.47, 0.33, 0.19, 0.08, 0.02], dtype=torch.float64)
T = 9


def setup(name, *, seed=0, sigmas=SIGMAS):
    module, velocity, shape = make_model(name, seed=seed)
    latents = straight_path_latents(shape, sigmas[:T], seed=seed + 7)
    loss = make_grpo_step_loss(velocity, latents, sigmas[:T], sigmas[1 : T + 1], seed=seed + 3)
    return module, velocity, latents, sigmas[:T], loss


def run(module, velocity, latents, sigmas, loss, plan, **kw):
    module.zero_grad(set_to_none=True)
    kw = {"graph_mode": "batched", "endpoint_signals": "graph", **kw}
    stats = interpolated_backward(velocity, latents, sigmas, loss, plan, **kw)
    return grads_of(module), stats


def exact_grad(module, velocity, latents, sigmas, loss):
    return run(module, velocity, latents, sigmas, loss, Interpolation.identity(latents.shape[0]))[0]


def oracle_grad(module, velocity, latents, sigmas, loss, knots):
    """sum_k J_k^T g_k with g_k = sum_j w_jk s_j: w from numpy.interp of one-hot knot values, s_j by autograd
    on each step's own forward, one ``autograd.grad`` per knot. (Summing J_k^T (w_jk s_j) over (j, k) instead
    differs by ~2e-9 on the tiny diffusers backbones: the per-step terms cancel, so rounding is amplified.)"""
    params = list(module.parameters())
    t = sigmas.numpy()
    signals = []
    for j in range(latents.shape[0]):
        v_j = velocity(latents[j], sigmas[j]).detach().requires_grad_(True)
        signals.append(torch.autograd.grad(loss(j, v_j), v_j)[0])
    total = [torch.zeros_like(p) for p in params]
    for i, k in enumerate(knots):
        one_hot = np.eye(len(knots))[i]
        w = [
            float(np.interp(-t[j], -t[list(knots)], one_hot)) for j in range(len(t))
        ]  # interp needs x increasing
        g_k = sum(w_j * s_j for w_j, s_j in zip(w, signals))
        grads = torch.autograd.grad(
            velocity(latents[k], sigmas[k]), params, grad_outputs=g_k, allow_unused=True
        )
        total = [a + (g if g is not None else 0) for a, g in zip(total, grads)]
    return torch.cat([g.flatten() for g in total])


@pytest.mark.parametrize("name", ["mlp", "flux", "qwenimage", "wan"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("count", [3, 5])
def test_knots_gradient_equals_the_oracle(name, placement, count):
    module, velocity, latents, sigmas, loss = setup(name)
    plan = Knots(count=count, placement=placement).interpolation(sigmas)
    assert len(plan.knots) == count and plan.knots[0] == 0 and plan.knots[-1] == T - 1
    g, stats = run(module, velocity, latents, sigmas, loss, plan)
    g_oracle = oracle_grad(module, velocity, latents, sigmas, loss, plan.knots)
    assert g_oracle.norm() > 0
    assert rel_err(g, g_oracle) < model_tol(name, 1e-12)
    assert stats.backward_passes == count and stats.backward_calls == 1
    # a nonlinear model is not exact with fewer knots than steps: the test can tell
    assert rel_err(g, exact_grad(module, velocity, latents, sigmas, loss)) > 1e-6


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
@pytest.mark.parametrize("stored", [False, True])
def test_every_step_a_knot_is_exact(name, graph_mode, stored):
    module, velocity, latents, sigmas, loss = setup(name)
    plan = Knots(count=T, placement="low_noise").interpolation(sigmas)
    assert plan.knots == tuple(range(T)) and torch.equal(plan.weights, torch.eye(T, dtype=torch.float64))
    outputs = None
    if stored:
        with torch.no_grad():
            outputs = torch.stack([velocity(latents[j], sigmas[j]) for j in range(T)])
    g, stats = run(module, velocity, latents, sigmas, loss, plan, graph_mode=graph_mode, outputs=outputs)
    assert rel_err(g, exact_grad(module, velocity, latents, sigmas, loss)) < model_tol(name, 1e-12)
    assert stats.backward_passes == T


@pytest.mark.parametrize("name", ["mlp", "flux", "qwenimage", "wan"])
@pytest.mark.parametrize("stored", [False, True])
def test_per_knot_backward_equals_the_stacked_graph_at_exacts_peak(name, stored):
    """``graph_mode: sequential`` is the per-knot backward: each knot's forward with autograd and its backward
    with its aggregated signal g_k, one graph alive. Same gradient as one stacked graph of the K knots (float64),
    the same forwards (no extra signal forward: a knot's hat weights never reach its neighbour knots), K backward
    calls, and the saved activations' peak of one per-step graph: at most the exact loop's (which also keeps
    its step loss's few tensors), where the stacked graph holds more (~K of them at scale)."""
    from jagg.engine.profiling import SavedActivationMeter

    module, velocity, latents, sigmas, loss = setup(name)
    plan = Knots(count=4, placement="low_noise").interpolation(sigmas)
    outputs = None
    if stored:
        with torch.no_grad():
            outputs = torch.stack([velocity(latents[j], sigmas[j]) for j in range(T)])
    grads, stats, counts, peaks = {}, {}, {}, {}
    for mode, p in (("batched", plan), ("sequential", plan), ("exact", Interpolation.identity(T))):
        module.zero_grad(set_to_none=True)
        with count_passes(module) as n, SavedActivationMeter() as meter:
            stats[mode] = interpolated_backward(
                velocity,
                latents,
                sigmas,
                loss,
                p,
                graph_mode="batched" if mode == "exact" else mode,
                endpoint_signals="graph",
                outputs=outputs,
            )
        grads[mode], counts[mode], peaks[mode] = grads_of(module), n, meter.peak_bytes
    assert rel_err(grads["sequential"], grads["batched"]) < model_tol(name, 1e-12)
    assert rel_err(grads["sequential"], grads["exact"]) > 1e-6  # 4 knots of 9 steps: not exact, can tell
    seq, stacked = counts["sequential"], counts["batched"]
    assert seq["forward_grad"] == seq["backward_calls"] == seq["backward_graphs"] == 4
    assert stacked["forward_grad"] == stacked["backward_calls"] == 1
    assert seq["forward"] - seq["forward_grad"] == stacked["forward"] - stacked["forward_grad"]
    assert stats["sequential"].forward_passes == stats["batched"].forward_passes
    assert peaks["sequential"] <= peaks["exact"] < 2 * peaks["sequential"]
    # the stacked graph's rows grow K-fold; on these tiny models part of a graph does not grow with its rows
    # (conditioning, rotary tables), so the ratio is 1.3-2.6 here, not K
    assert peaks["batched"] > 1.3 * peaks["exact"]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("count", [2, 3, 4])
def test_theorem_1_for_knots_linear_velocity_on_a_straight_path(placement, count):
    """Every interval between two knots is a JAGG group on the chord: exact for v linear in (z, t)."""
    module, velocity, latents, sigmas, loss = setup("linear")
    plan = Knots(count=count, placement=placement).interpolation(sigmas)
    g, _ = run(module, velocity, latents, sigmas, loss, plan)
    assert rel_err(g, exact_grad(module, velocity, latents, sigmas, loss)) < 1e-10
    # off the chord it is not
    bent = latents.clone()
    bent[T // 2] += 0.5
    loss_bent = make_grpo_step_loss(velocity, bent, sigmas, SIGMAS[1 : T + 1], seed=3)
    g_bent, _ = run(module, velocity, bent, sigmas, loss_bent, plan)
    assert rel_err(g_bent, exact_grad(module, velocity, bent, sigmas, loss_bent)) > 1e-4


@pytest.mark.parametrize("name", ["mlp", "flux"])
def test_knots_at_jagg_group_ends_equal_jagg(name):
    """Groups (0..3), (4..7) of W = 4 on 8 steps: knots at 0, 3, 4, 7 leave no step between two groups, so the
    hat weights are JAGG's t-weights group by group."""
    module, velocity, latents, sigmas, loss = setup(name)
    latents, sigmas = latents[:8], sigmas[:8]
    plan = Interpolation((0, 3, 4, 7), hat_weights(sigmas, (0, 3, 4, 7)), ((0, 1, 2, 3),), "knots")
    g_knots, _ = run(module, velocity, latents, sigmas, loss, plan)
    module.zero_grad(set_to_none=True)
    groups = BackwardSetting(routing=Routing(strategy="jagg", group_size=4))
    groups.backward(velocity, Steps(latents, sigmas, loss))  # the first 8 of the loss's 9 steps
    g_jagg = grads_of(module)
    assert rel_err(g_knots, g_jagg) < 1e-12
    # with a step between two groups (knots 0, 3, 5, 7 on 8 steps) the two differ
    other = Interpolation((0, 3, 5, 7), hat_weights(sigmas, (0, 3, 5, 7)), ((0, 1, 2, 3),), "knots")
    assert rel_err(run(module, velocity, latents, sigmas, loss, other)[0], g_jagg) > 1e-8


def test_per_sample_times_match_separate_calls():
    """sigmas (T, B): each sample's hat weights from its own times, equal to running the samples one by one."""
    module, velocity, _, _, _ = setup("mlp")
    b = 2
    sig = torch.stack(
        [SIGMAS[:6], torch.tensor([0.95, 0.85, 0.7, 0.5, 0.3, 0.1], dtype=torch.float64)], dim=1
    )
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(6, b, 2, 4, 4, generator=g, dtype=torch.float64)
    target = torch.randn_like(latents)
    knots = Knots(count=3, placement="index")
    plan = knots.interpolation(sig)
    assert plan.weights.shape == (6, 3, b)
    g_batch, _ = run(module, velocity, latents, sig, lambda j, v: ((v - target[j]) ** 2).mean(), plan)
    module.zero_grad(set_to_none=True)
    for i in range(b):
        one = knots.interpolation(sig[:, i])
        assert one.knots == plan.knots

        def loss_i(j, v, i=i):
            return ((v - target[j, i : i + 1]) ** 2).mean() / b

        interpolated_backward(
            velocity,
            latents[:, i : i + 1],
            sig[:, i],
            loss_i,
            one,
            graph_mode="joint",
            endpoint_signals="graph",
        )
    assert rel_err(grads_of(module), g_batch) < 1e-12


def test_placement_rules():
    sig = SIGMAS[:T]
    for name, rule in PLACEMENTS.items():
        for k in range(2, T + 1):
            pos = rule(sig, k)
            assert len(pos) == k and pos[0] == 0 and pos[-1] == T - 1, (name, k, pos)
            assert all(a < b for a, b in zip(pos, pos[1:])), (name, k, pos)
    assert PLACEMENTS["index"](sig, 3) == (0, 4, 8)
    gaps = np.diff(PLACEMENTS["low_noise"](torch.linspace(1, 0, 20, dtype=torch.float64), 5))
    assert gaps[0] > gaps[-1] and list(gaps) == sorted(gaps, reverse=True)  # denser toward low noise
    uneven = torch.tensor([1.0, 0.98, 0.96, 0.94, 0.92, 0.5, 0.1], dtype=torch.float64)
    assert PLACEMENTS["time"](uneven, 3) == (0, 5, 6)  # mid-time 0.55 is nearest to step 5
    assert Knots(count=12, placement="time").positions(sig) == tuple(range(T))
    with pytest.raises(ValueError, match="backward.knots must be an integer >= 2"):
        Knots(count=1, placement="index")
    with pytest.raises(ValueError, match="backward.placement must be one of"):
        Knots(count=3, placement="bogus")


# --------------------------------------------------------------------------- expert boundaries (Wan2.2-A14B)
def test_expert_segments_cut_where_any_sample_changes_network():
    sig = SIGMAS[:T]  # 0.97 0.9 0.81 0.71 0.6 ...
    assert expert_segments(sig, ()) == [range(9)]
    assert expert_segments(sig, (0.875,)) == [range(2), range(2, 9)]
    assert expert_segments(sig, (0.9,)) == [range(2), range(2, 9)]  # sigma >= b is the noisier side
    assert expert_segments(sig, (0.99,)) == [range(9)]  # every step on one side: nothing to cut
    assert expert_segments(sig, (0.875, 0.5)) == [range(2), range(2, 5), range(5, 9)]
    per_sample = torch.stack([sig, torch.tensor([0.99, 0.95, 0.92, 0.85, 0.6, 0.5, 0.3, 0.2, 0.1])], dim=1)
    # sample 0 switches after step 1, sample 1 after step 2: no stretch holds a switch of either
    assert expert_segments(per_sample.double(), (0.875,)) == [range(2), range(2, 3), range(3, 9)]


def test_one_step_is_one_stretch_and_plans_as_a_plain_step():
    """A window of one trained step (Flow-Factory's A14B recipe) on either side of a boundary: one stretch, and
    every routing's plan of it is the plain step. Before, the cut reshaped the (0[, B]) empty difference of its
    sides to (0, -1), which torch refuses: the recipe's first update crashed."""
    for sig in (torch.tensor([0.9]), torch.tensor([0.3]), torch.tensor([[0.9, 0.3]]).double()):
        assert expert_segments(sig, (0.875,)) == [range(1)]
        for routing in (
            Routing.exact(),
            Routing(strategy="jagg", group_size=3),
            Knots(count=4, placement="time"),
        ):
            plan = routing.interpolation(sig, (0.875,))
            assert plan.knots == (0,) and plan.blocks == ((0,),) and plan.is_plain((0,))


def test_split_count_gives_every_stretch_its_ends_and_shares_the_rest():
    assert split_count(6, [9]) == [6] and split_count(12, [9]) == [9]
    assert split_count(4, [3, 6]) == [2, 2]
    assert split_count(6, [3, 6]) == [2, 4]  # the 2 left: quotas 0.4 and 1.6 of the non-knot steps 1 and 4
    assert split_count(2, [3, 6]) == [2, 2]  # raised: each expert needs its own two ends
    assert split_count(3, [1, 5]) == [1, 2] and split_count(9, [2, 7]) == [2, 7]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("count", [2, 3, 4, 6])
@pytest.mark.parametrize("per_sample", [False, True])
def test_no_knot_interval_straddles_an_expert_boundary(placement, count, per_sample):
    """Random schedules: every step's hat weights reach only knots of its own stretch, every stretch's ends are
    knots, the knots of each stretch are the rule's on that stretch, and without boundaries nothing changes."""
    g = torch.Generator().manual_seed(count)
    for trial in range(20):
        t = int(torch.randint(2, 14, (1,), generator=g))
        shape = (t + 1, 3) if per_sample else (t + 1,)
        sig = torch.rand(shape, generator=g, dtype=torch.float64).sort(dim=0, descending=True).values[:t]
        bounds = tuple(sorted(torch.rand(int(torch.randint(1, 3, (1,), generator=g)), generator=g).tolist()))
        knots = Knots(count=count, placement=placement)
        segments = expert_segments(sig, bounds)
        plan = knots.interpolation(sig, bounds) if t > 1 else None
        pos = knots.positions(sig, bounds)
        assert all(seg.start in pos and seg.stop - 1 in pos for seg in segments), (trial, pos, segments)
        which = {j: i for i, seg in enumerate(segments) for j in seg}
        if plan is not None:
            used = (plan.weights != 0).reshape(t, len(pos), -1).any(dim=2)
            for j, k in used.nonzero().tolist():
                assert which[j] == which[pos[k]], (trial, j, pos[k])
        for seg, k in zip(segments, split_count(count, [len(s) for s in segments])):
            mine = [p - seg.start for p in pos if p in seg]
            ref = sig.mean(dim=1) if per_sample else sig
            expect = (
                list(range(len(seg)))
                if len(seg) <= k
                else list(PLACEMENTS[placement](ref[seg.start : seg.stop], k))
            )
            assert mine == expect
        assert knots.positions(sig) == (
            tuple(range(t))
            if t <= count
            else PLACEMENTS[placement](sig.mean(dim=1) if per_sample else sig, count)
        )


def test_groups_are_cut_at_an_expert_boundary():
    """A JAGG group of W = 4 over steps 0..3 with the switch after step 1 becomes two groups of 2 (each exact at
    W = 2); the routing's other groups are left as they were."""
    routing = Routing(strategy="jagg", group_size=4)
    plain, cut = routing.interpolation(SIGMAS[:T]), routing.interpolation(SIGMAS[:T], (0.875,))
    assert plain.knots == (0, 3, 4, 7, 8)
    assert cut.knots == (0, 1, 2, 3, 4, 7, 8)
    assert not bool((cut.weights[:2, 2:] != 0).any()) and not bool((cut.weights[2:, :2] != 0).any())


@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
@pytest.mark.parametrize("signals", ENDPOINT_SIGNALS)
@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize("max_rows", [None, 2, 5])
def test_pass_counts_equal_the_cost_model(graph_mode, signals, stored, max_rows):
    """Hooks count forwards (with / without grad), graphs and backward calls; ``plan_cost`` predicts them."""
    module, velocity, latents, sigmas, loss = setup("mlp")  # counting needs no transformer (tested above)
    b = latents.shape[1]
    plan = Knots(count=4, placement="low_noise").interpolation(sigmas)
    outputs = None
    if stored:
        with torch.no_grad():
            outputs = torch.stack([velocity(latents[j], sigmas[j]) for j in range(T)])
    module.zero_grad(set_to_none=True)
    with count_passes(module) as counts:
        stats = interpolated_backward(
            velocity,
            latents,
            sigmas,
            loss,
            plan,
            graph_mode=graph_mode,
            endpoint_signals=signals,
            outputs=outputs,
            max_rows=max_rows,
        )
    cost = plan_cost(
        plan,
        graph_mode=graph_mode,
        stored_outputs=stored,
        endpoint_signals=signals,
        max_rows=max_rows,
        batch=b,
    )
    assert stats.backward_passes == cost.backward_passes == 4
    assert stats.forward_calls == counts["forward"] == cost.forward_calls
    assert stats.backward_graphs == counts["backward_graphs"] == cost.backward_graphs
    assert stats.backward_calls == counts["backward_calls"] == cost.backward_calls
    for key in ("forward_passes", "forward_passes_with_grad", "forwards_skipped"):
        assert getattr(stats, key) == getattr(cost, key), key
    if graph_mode == "batched" and max_rows is None:  # ONE forward with a graph and ONE backward
        assert counts["forward_grad"] == 1 and counts["backward_calls"] == 1
        detached = 0 if stored else (T if signals == "nograd" else T - 4)
        assert counts["forward"] == detached + 1
    if graph_mode == "batched" and max_rows == 5:  # 5 rows of B = 2: chunks of 2 knots
        assert counts["backward_calls"] == 2 and cost.graphs_alive == 2


def test_setting_backward_and_cost_for_knots_and_groups():
    """``BackwardSetting.backward`` runs the routing's plan; its ``cost`` predicts the run."""
    module, velocity, latents, sigmas, loss = setup("mlp")
    for routing in (Knots(count=4, placement="time"), Routing(strategy="jagg", group_size=3, jagg_frac=0.6)):
        setting = BackwardSetting(routing=routing, stored_outputs=False)
        module.zero_grad(set_to_none=True)
        stats = setting.backward(velocity, loss)
        g = grads_of(module)
        ref, _ = run(module, velocity, latents, sigmas, loss, routing.interpolation(sigmas))
        assert rel_err(g, ref) == 0
        cost = setting.cost(T, batch=latents.shape[1])
        assert (stats.backward_passes, stats.forward_passes) == (cost.backward_passes, cost.forward_passes)
    assert BackwardSetting(routing=Knots(count=4, placement="time")).key == "knots/K4/time/batched+stored"
    assert setting.cost(T).backward_passes == 2 * 2 + 3  # 2 JAGG groups of 3 (2 passes each) + 3 exact steps


@pytest.mark.parametrize(
    "config", ["configs/world/flux_dancegrpo_knots.yaml", "configs/world/qwenimage_dancegrpo_knots.yaml"]
)
def test_world_knots_configs_train_every_step_with_k_passes(config, tiny_cfg):
    """The shipped every-step configs: all usable steps trained, K = 4 backward passes per sample."""
    from helpers import build_trainer

    cfg = tiny_cfg("sampling.num_steps=9", "train.iterations=1", config=config)
    assert (cfg.backward.strategy, cfg.backward.knots, cfg.algorithm.timestep_fraction) == ("knots", 4, 1.0)
    row = build_trainer(cfg).train_iteration(0)
    assert row["backward_passes_per_sample"] == 4
    assert row["forwards_skipped"] > 0  # the non-knot steps' signals come from the stored outputs


def test_measured_placement_is_logged_and_restored_on_resume(tiny_cfg):
    """placement=auto: the trainer measures the rules at iteration 0 (metrics: the rule kept, each rule's
    cosine), checkpoints the choice, and a resumed run restores it without measuring again."""
    from helpers import build_trainer

    cfg = tiny_cfg(
        "backward.strategy=knots", "backward.placement=auto", "backward.knots=3", "train.iterations=1"
    )
    trainer = build_trainer(cfg)
    rows = trainer.fit()
    assert rows[0]["placement"] in PLACEMENTS and set(rows[0]["placement_cosines"]) == set(PLACEMENTS)
    chosen = trainer.setting.routing
    again = build_trainer(cfg)
    assert again.setting is None  # measured at run time
    again.load_checkpoint()
    assert again.setting.routing == chosen
