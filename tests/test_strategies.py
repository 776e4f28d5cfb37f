"""Numerics and cost of the backward strategies (float64, tight tolerances).

Invariants (the paper, arXiv 2607.17572; docs/method.md): exact == plain autograd; JAGG == exact for W = 2 (any model) and for a velocity
linear in (z, t) on a straight path (Theorem 1); JAGG != exact for a nonlinear model at W >= 3;
pass/call counts W/W for exact vs 2/1 for the two-endpoint strategies, counted with hooks.
"""

from __future__ import annotations

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
    one_group,
    rel_err,
    straight_path_latents,
)
from jagg.engine.strategies import (
    AGGREGATION_WEIGHTS,
    ENDPOINT_SIGNALS,
    GRAPH_MODES,
    STRATEGIES,
    exact_at_two,
    jagg_weights,
)

SIGMAS = torch.tensor([0.95, 0.83, 0.66, 0.52, 0.41, 0.27, 0.15, 0.08, 0.03], dtype=torch.float64)


def setup_group(name, w, *, sigmas=None, seed=0):
    module, velocity, shape = make_model(name, seed=seed)
    sig = SIGMAS[: w + 1] if sigmas is None else sigmas
    latents = straight_path_latents(shape, sig[:w], seed=seed + 7)
    step_loss = make_grpo_step_loss(velocity, latents, sig[:w], sig[1 : w + 1], seed=seed + 3)
    return module, velocity, latents, sig[:w], step_loss


def backward(strategy, velocity, latents, sigmas, step_loss, outputs=None, **how):
    """One group of the W steps on ``strategy`` (``one_group``), run ``how``; ADDS to ``.grad``."""
    setting = one_group(strategy, latents.shape[0], **how)
    return setting.backward(velocity, Steps(latents, sigmas, step_loss), outputs)


def run(strategy, module, velocity, latents, sigmas, step_loss, **kw):
    module.zero_grad(set_to_none=True)
    stats = backward(strategy, velocity, latents, sigmas, step_loss, **kw)
    return grads_of(module), stats


def stored_outputs(velocity, latents, sigmas):
    """What the rollout keeps: each step's model output at the current parameters, (W, B, ...)."""
    with torch.no_grad():
        return torch.stack([velocity(latents[j], sigmas[j]) for j in range(latents.shape[0])])


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_exact_equals_plain_autograd(name, graph_mode):
    """The exact strategy ignores the graph mode and stored outputs: it differentiates its own forwards."""
    module, velocity, latents, sigmas, step_loss = setup_group(name, 4)
    outputs = stored_outputs(velocity, latents, sigmas) + 1.0  # deliberately wrong: must not be read
    g_exact, stats = run(
        "exact", module, velocity, latents, sigmas, step_loss, graph_mode=graph_mode, outputs=outputs
    )
    module.zero_grad(set_to_none=True)
    total = sum(step_loss(j, velocity(latents[j], sigmas[j])) for j in range(4))
    params = list(module.parameters())
    plain = torch.autograd.grad(total, params, allow_unused=True)
    g_plain = torch.cat(
        [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(plain, params)]
    )
    assert g_plain.norm() > 0
    assert rel_err(g_exact, g_plain) < 1e-10
    assert stats.loss == pytest.approx(total.item(), rel=1e-12)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("strategy", ["jagg", "endpoints"])
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_two_step_group_is_exact_for_any_model(name, strategy, graph_mode):
    """W = 2: alpha = (0, 1), so both endpoints get exactly their own signal."""
    module, velocity, latents, sigmas, step_loss = setup_group(name, 2)
    g_exact, _ = run("exact", module, velocity, latents, sigmas, step_loss)
    g_jagg, _ = run(strategy, module, velocity, latents, sigmas, step_loss, graph_mode=graph_mode)
    assert rel_err(g_jagg, g_exact) < model_tol(name, 1e-10)


@pytest.mark.parametrize("w", [3, 4, 6, 9])
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_theorem1_linear_velocity_on_straight_path(w, graph_mode):
    """Velocity linear in (z, t), latents on the chord at t-proportional positions: JAGG is exact."""
    # non-uniform times, so the t-weights alpha_j are not just j / (W - 1)
    sigmas = torch.tensor([0.97, 0.9, 0.71, 0.66, 0.43, 0.4, 0.22, 0.1, 0.05, 0.01], dtype=torch.float64)
    module, velocity, latents, sig, step_loss = setup_group("linear", w, sigmas=sigmas[: w + 1])
    g_exact, _ = run("exact", module, velocity, latents, sig, step_loss)
    outputs = stored_outputs(velocity, latents, sig)
    for out in (None, outputs):
        g_jagg, _ = run("jagg", module, velocity, latents, sig, step_loss, graph_mode=graph_mode, outputs=out)
        assert rel_err(g_jagg, g_exact) < 1e-10
    # the t-weights are what makes it exact: the ablations are not
    for ablation in ("endpoints", "uniform"):
        g_abl, _ = run(ablation, module, velocity, latents, sig, step_loss, graph_mode=graph_mode)
        assert rel_err(g_abl, g_exact) > 1e-3


def test_theorem1_needs_the_chord():
    """Same linear model, latents off the straight path: the interpolation is no longer exact."""
    module, velocity, latents, sig, step_loss = setup_group("linear", 4)
    latents = latents.clone()
    latents[1] += 0.5 * torch.randn_like(latents[1])
    step_loss = make_grpo_step_loss(velocity, latents, sig, SIGMAS[1:5], seed=3)
    g_exact, _ = run("exact", module, velocity, latents, sig, step_loss)
    g_jagg, _ = run("jagg", module, velocity, latents, sig, step_loss)
    assert rel_err(g_jagg, g_exact) > 1e-4


@pytest.mark.parametrize("name", ["mlp", "flux", "qwenimage", "wan"])
@pytest.mark.parametrize("w", [3, 5])
def test_jagg_is_approximate_for_nonlinear_models(name, w):
    module, velocity, latents, sigmas, step_loss = setup_group(name, w)
    g_exact, _ = run("exact", module, velocity, latents, sigmas, step_loss)
    g_jagg, _ = run("jagg", module, velocity, latents, sigmas, step_loss)
    err = rel_err(g_jagg, g_exact)
    assert 1e-6 < err < 1.0  # different, yet an approximation rather than noise
    assert torch.nn.functional.cosine_similarity(g_jagg, g_exact, dim=0) > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("strategy", ["jagg", "endpoints", "uniform", "jagg_index"])
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
@pytest.mark.parametrize("reuse", [False, True], ids=["forward", "stored"])
@pytest.mark.parametrize("signals", ENDPOINT_SIGNALS)
def test_graph_modes_and_stored_outputs_give_the_same_gradient(name, strategy, graph_mode, reuse, signals):
    """Every graph mode, with or without the rollout's stored outputs, with the endpoints' signals from
    their graphs or (the authors' code) from extra forwards without autograd, computes the paper-literal
    ("joint", all forwards, signals from the graphs) gradient of the same strategy (float64, relative error
    <= 1e-12)."""
    module, velocity, latents, sigmas, step_loss = setup_group(name, 4)
    g_ref, ref = run(strategy, module, velocity, latents, sigmas, step_loss, graph_mode="joint")
    outputs = stored_outputs(velocity, latents, sigmas) if reuse else None
    g, stats = run(
        strategy,
        module,
        velocity,
        latents,
        sigmas,
        step_loss,
        graph_mode=graph_mode,
        outputs=outputs,
        endpoint_signals=signals,
    )
    assert g_ref.norm() > 0
    assert rel_err(g, g_ref) <= model_tol(name, 1e-12)
    assert stats.step_losses == pytest.approx(ref.step_losses, rel=model_tol(name, 1e-12))


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
@pytest.mark.parametrize("reuse", [False, True], ids=["forward", "stored"])
@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("signals", ENDPOINT_SIGNALS)
def test_pass_and_call_counts(name, strategy, graph_mode, reuse, w, signals):
    """Hooks on the model count forward calls (with / without grad) and back-propagated graphs; a wrapped
    ``torch.autograd.backward`` counts backward calls. GroupStats reports them, and the cost model
    ``BackwardSetting.cost`` predicts them (the one cost model the plan, bench and Table 1 use). With the endpoints'
    signals from forwards without autograd (the authors' code), a group of W runs W + 2 forwards."""
    module, velocity, latents, sigmas, step_loss = setup_group(name, w)
    outputs = stored_outputs(velocity, latents, sigmas) if reuse else None
    module.zero_grad(set_to_none=True)
    setting = one_group(strategy, w, graph_mode=graph_mode, endpoint_signals=signals)
    with count_passes(module) as counts:
        stats = setting.backward(velocity, Steps(latents, sigmas, step_loss), outputs)
    cost = setting.cost(w, stored_outputs=reuse)
    batched = strategy != "exact" and graph_mode == "batched"
    if strategy == "exact":
        assert counts == dict(forward=w, forward_grad=w, backward_graphs=w, backward_calls=w)
    else:
        if signals == "nograd":  # every signal from its own detached forward, endpoints included
            detached = 0 if reuse else (2 if strategy == "endpoints" else w)
        else:
            mid = 0 if reuse or strategy == "endpoints" else w - 2
            extra = int(graph_mode == "sequential" and strategy == "uniform" and not reuse)  # s_{W-1} first
            detached = mid + extra
        assert counts["forward"] == detached + (1 if batched else 2)
        if signals == "nograd" and not reuse and strategy != "endpoints":
            assert stats.forward_passes == w + 2
        assert counts["forward_grad"] == (1 if batched else 2)
        assert counts["backward_graphs"] == (1 if batched else 2)
        assert counts["backward_calls"] == (2 if graph_mode == "sequential" else 1)
        assert stats.backward_passes == 2 and stats.forward_passes_with_grad == 2
    assert stats.forward_calls == counts["forward"] == cost.forward_calls
    assert stats.backward_graphs == counts["backward_graphs"] == cost.backward_graphs
    assert stats.backward_calls == counts["backward_calls"] == cost.backward_calls
    for key in ("forward_passes", "forward_passes_with_grad", "backward_passes", "forwards_skipped"):
        assert getattr(stats, key) == getattr(cost, key), key


def test_gradients_accumulate_into_grad():
    module, velocity, latents, sigmas, step_loss = setup_group("mlp", 4)
    g1, _ = run("jagg", module, velocity, latents, sigmas, step_loss)
    backward("jagg", velocity, latents, sigmas, step_loss)
    assert rel_err(grads_of(module), 2 * g1) < 1e-12


def test_per_sample_sigmas_match_separate_calls():
    """sigmas (W, B): each sample gets its own t-weights, equal to running the samples one by one."""
    module, velocity, _, _, _ = setup_group("mlp", 3)
    module.zero_grad(set_to_none=True)
    b = 2
    sig = torch.tensor([[0.9, 0.8], [0.6, 0.7], [0.2, 0.3]], dtype=torch.float64)  # (W, B)
    x0, eps = torch.randn(b, 2, 4, 4, dtype=torch.float64), torch.randn(b, 2, 4, 4, dtype=torch.float64)
    latents = torch.stack([(1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps for s in sig])
    target = torch.randn_like(latents)

    def quad(j, v):
        return ((v - target[j]) ** 2).mean()

    g_batch, _ = run("jagg", module, velocity, latents, sig, quad)
    module.zero_grad(set_to_none=True)
    for i in range(b):

        def quad_i(j, v, i=i):
            return ((v - target[j, i : i + 1]) ** 2).mean() / b

        backward("jagg", velocity, latents[:, i : i + 1], sig[:, i], quad_i)
    assert rel_err(grads_of(module), g_batch) < 1e-10


def test_aggregation_weights_sum_to_one_per_step():
    w = jagg_weights(SIGMAS[:5])
    assert torch.allclose(w.sum(dim=1), torch.ones(5, dtype=torch.float64))
    assert w[0].tolist() == [1.0, 0.0] and w[-1].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("strategy", AGGREGATION_WEIGHTS)
def test_exact_at_two_is_read_from_the_weight_rule(strategy):
    """A strategy is exact on a two-step group iff its W = 2 weight matrix is the identity: JAGG, jagg_index and
    the endpoints ablation, not uniform; and then its two-step gradient equals the exact one."""
    expected = {"jagg": True, "jagg_index": True, "endpoints": True, "uniform": False}[strategy]
    assert exact_at_two(strategy) is expected and exact_at_two("exact")
    module, velocity, latents, sigmas, step_loss = setup_group("flux", 2)
    g_exact, _ = run("exact", module, velocity, latents, sigmas, step_loss)
    g, _ = run(strategy, module, velocity, latents, sigmas, step_loss)
    assert (rel_err(g, g_exact) < 1e-10) is expected
    with pytest.raises(ValueError, match="strategy must be one of"):
        exact_at_two("bogus")


def test_a_group_backward_rejects_non_decreasing_sigmas():
    module, velocity, latents, sigmas, step_loss = setup_group("mlp", 3)
    with pytest.raises(ValueError, match="strictly decreasing"):
        backward("jagg", velocity, latents, sigmas.flip(0), step_loss)


def test_per_sample_weights_reach_signals_on_another_device():
    """A plan lives on the CPU; its per-sample (B,) weights must follow the signals to their device.

    The first H200 run of ``make gpu-check`` failed here ("Expected all tensors to be on the same device"):
    ``Interpolation.stack`` kept a JAGG group's (W, 2, B) weights on the CPU and ``knot_signal`` multiplied them
    with CUDA signals. The meta device stands in for the GPU on a CPU-only machine.
    """
    from jagg.engine.knots import Knots
    from jagg.engine.routing import Routing
    from jagg.engine.strategies import _Run

    b = 3
    per_sample = torch.stack([SIGMAS[:6] * f for f in (1.0, 0.9, 0.8)], dim=1)  # (T, B), distinct per sample
    plans = (
        Routing(strategy="jagg", group_size=3).interpolation(per_sample),
        Knots(count=3, placement="index").interpolation(per_sample),
    )
    for plan in plans:
        assert plan.weights.device.type == "cpu" and plan.weights.dtype == torch.float64
        assert plan.weights.ndim == 3 and plan.weights.shape[2] == b
        run = _Run(None, None, per_sample, None, None, plan)
        run.signals = {j: torch.ones(b, 4, 2, 2, device="meta") for j in range(plan.num_steps)}
        for k in range(len(plan.knots)):
            g = run.knot_signal(k)
            assert g.device.type == "meta" and g.shape == (b, 4, 2, 2)
    cpu = _Run(None, None, per_sample, None, None, plans[0])  # the same sums on the CPU, by hand
    cpu.signals = {j: torch.full((b, 1), float(j + 1)) for j in range(plans[0].num_steps)}
    want = sum(plans[0].weights[j, 0] * (j + 1) for j in range(plans[0].num_steps)).float()
    assert torch.allclose(cpu.knot_signal(0).squeeze(1), want)
