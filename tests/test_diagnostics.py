"""``group_gradient_cosines``: per-group cosine of each strategy's gradient to the exact one (float64)."""

from __future__ import annotations

import pytest
import torch

from helpers import Steps, make_grpo_step_loss, make_model, one_group, straight_path_latents
from jagg.engine.diagnostics import GroupCosine, flat_grad, group_gradient_cosines, route_by_cosine
from jagg.engine.routing import plan_groups

SIGMAS = torch.tensor([0.95, 0.83, 0.66, 0.52, 0.41, 0.27, 0.15, 0.08], dtype=torch.float64)


def _problem(name: str, t: int = 7):
    module, velocity, shape = make_model(name)
    latents = straight_path_latents(shape, SIGMAS[:t], seed=4)
    step_loss = make_grpo_step_loss(velocity, latents, SIGMAS[:t], SIGMAS[1 : t + 1], seed=5)
    return module, velocity, latents, SIGMAS[:t], step_loss


def test_groups_follow_plan_groups_and_theorem_1():
    """T = 7, W = 3: groups (0, 1, 2), (3, 4, 5); the single-step group (6) is skipped. Linear velocity on a
    straight path: JAGG is exact (Theorem 1), the endpoints ablation is not."""
    module, velocity, latents, sig, step_loss = _problem("linear")
    params = list(module.parameters())
    out = group_gradient_cosines(
        velocity, latents, sig, step_loss, params, group_size=3, strategies=("jagg", "endpoints")
    )
    assert [(c.group, c.steps, c.strategy) for c in out] == [
        (0, (0, 1, 2), "jagg"),
        (0, (0, 1, 2), "endpoints"),
        (1, (3, 4, 5), "jagg"),
        (1, (3, 4, 5), "endpoints"),
    ]
    for c in out:
        if c.strategy == "jagg":
            assert c.rel_norm_err < 1e-10 and abs(c.cosine - 1) < 1e-12
        else:
            assert c.rel_norm_err > 1e-3


def test_equals_a_hand_cut_measurement_bit_for_bit_and_leaves_grads_alone():
    """The numbers are those of cutting the groups by hand and running each as one group from zero gradients
    (what experiments/cosine.py did inline); the caller's ``.grad`` comes back untouched."""
    module, velocity, latents, sig, step_loss = _problem("mlp")
    params = list(module.parameters())
    for p in params:
        p.grad = torch.full_like(p, 7.0)
    before = [p.grad for p in params]
    out = group_gradient_cosines(
        velocity, latents, sig, step_loss, params, group_size=4, strategies=("jagg", "uniform")
    )
    assert all(p.grad is g for p, g in zip(params, before, strict=True))
    expected = []
    for g, start in enumerate(range(0, 7, 4)):
        idx = list(range(start, min(start + 4, 7)))
        grads = {}
        for strategy in ("exact", "jagg", "uniform"):
            module.zero_grad(set_to_none=True)
            group_loss = Steps(latents[idx], sig[idx], lambda j, v, idx=idx: step_loss(idx[j], v))
            one_group(strategy, len(idx)).backward(velocity, group_loss)
            grads[strategy] = flat_grad(params).double()
        for strategy in ("jagg", "uniform"):
            cos = torch.nn.functional.cosine_similarity(grads[strategy], grads["exact"], dim=0).item()
            err = ((grads[strategy] - grads["exact"]).norm() / grads["exact"].norm()).item()
            expected.append((g, strategy, cos, err))
    assert [(c.group, c.strategy, c.cosine, c.rel_norm_err) for c in out] == expected
    assert all(c.cosine < 1 - 1e-9 for c in out)  # a nonlinear model: W = 4 is approximate


def test_w2_is_exact_for_any_model():
    module, velocity, latents, sig, step_loss = _problem("flux", t=4)
    out = group_gradient_cosines(velocity, latents, sig, step_loss, list(module.parameters()), group_size=2)
    assert len(out) == 2 and all(c.rel_norm_err < 1e-10 for c in out)


class GrowingNonlinearity(torch.nn.Module):
    """Theorem 1's linear field plus a nonlinear term whose weight grows as t falls (1 = noise, 0 = data):
    v = A z + b t + c + gamma (1 - t)^3 sin(M z). Early (high-noise) groups are nearly linear, late ones not."""

    def __init__(self, d: int, gamma: float) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(d, d) / d**0.5)
        self.b, self.c = torch.nn.Parameter(torch.randn(d)), torch.nn.Parameter(torch.randn(d))
        self.M = torch.nn.Parameter(20 * torch.randn(d, d) / d**0.5)
        self.gamma = gamma

    def forward(self, z, t):
        t = torch.as_tensor(t, dtype=z.dtype).expand(z.shape[0])[:, None]
        flat = z.flatten(1)
        v = flat @ self.A.T + t * self.b + self.c + self.gamma * (1 - t) ** 3 * torch.sin(flat @ self.M.T)
        return v.view(z.shape)


def _routing_for(gamma: float, w: int, min_cosine: float = 0.95) -> tuple[list[bool], list[float]]:
    torch.manual_seed(0)
    shape = (2, 2, 4, 4)
    model = GrowingNonlinearity(32, gamma).double()
    sigmas = torch.linspace(0.98, 0.02, 13, dtype=torch.float64)  # 12 trained steps on a straight path
    latents = straight_path_latents(shape, sigmas[:-1], seed=1)
    loss = make_grpo_step_loss(model, latents, sigmas[:-1], sigmas[1:], seed=2)
    cos = group_gradient_cosines(model, latents, sigmas[:-1], loss, list(model.parameters()), group_size=w)
    return route_by_cosine(cos, min_cosine), [c.cosine for c in cos]


def test_auto_routing_sends_early_groups_to_jagg_and_late_ones_to_exact():
    """12 trained steps, W = 3: the nonlinearity grows as t falls, so the cosine falls along the trajectory
    (here 0.9999, 0.983, 0.961, 0.799) and the rule routes a leading run of groups to JAGG, the rest to exact."""
    routing, cosines = _routing_for(gamma=10.0, w=3)
    assert cosines == sorted(cosines, reverse=True) and cosines[0] > 0.99 and cosines[-1] < 0.9, cosines
    assert routing[0] and not routing[-1], (routing, cosines)
    assert routing == sorted(routing, reverse=True), (routing, cosines)  # a leading run of JAGG groups
    assert routing == [True, True, True, False]
    plans = plan_groups(12, 3, 0.0, "jagg", routing)
    assert [p.strategy == "jagg" for p in plans] == [r and len(p.steps) > 1 for r, p in zip(routing, plans)]


def test_auto_routing_on_a_linear_model_routes_everything_to_jagg():
    routing, cosines = _routing_for(gamma=0.0, w=4)
    assert all(c > 1 - 1e-10 for c in cosines) and all(routing) and len(routing) == 3  # Theorem 1


def test_groups_of_two_qualify_for_strategies_exact_at_two_only():
    """JAGG and the endpoints ablation are exact on two steps (identity weights): a two-step group qualifies
    whatever its cosine (below 1 only by rounding). Uniform is not: its two-step groups are measured."""
    routing, cosines = _routing_for(gamma=10.0, w=2)
    assert all(routing) and len(routing) == 6
    for strategy in ("jagg", "endpoints"):
        two = [GroupCosine(0, (0, 1), strategy, 0.5, 1.0)]
        assert route_by_cosine(two, 0.9, strategy) == [True]  # rounding, not error
    assert route_by_cosine([GroupCosine(0, (0, 1), "uniform", 0.5, 1.0)], 0.9, "uniform") == [False]
    assert route_by_cosine([GroupCosine(0, (0, 1), "uniform", 0.95, 0.1)], 0.9, "uniform") == [True]
    assert route_by_cosine([GroupCosine(0, (0, 1, 2), "jagg", 0.5, 1.0)], 0.9) == [False]
    assert route_by_cosine([], 0.9) == []
    with pytest.raises(ValueError, match="min_cosine"):
        route_by_cosine([], 1.5)
