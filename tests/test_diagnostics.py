"""``group_gradient_cosines``: per-group cosine of each strategy's gradient to the exact one (float64)."""

from __future__ import annotations

import torch

from helpers import make_grpo_step_loss, make_model, straight_path_latents
from jagg.engine.diagnostics import flat_grad, group_gradient_cosines
from jagg.engine.strategies import group_backward

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
    """The numbers are those of cutting the groups by hand and running ``group_backward`` from zero gradients
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
            group_backward(
                velocity, latents[idx], sig[idx], lambda j, v, idx=idx: step_loss(idx[j], v), strategy
            )
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
