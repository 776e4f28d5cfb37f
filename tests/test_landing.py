"""Where an update lands (log.landing, jagg.plugins.landing): the optimizer steps of the arm's and exact's
gradients from the same state, and the velocity's change after each, checked in float64 against an AdamW step
written out by hand and exact's gradient by plain autograd."""

from __future__ import annotations

import pytest
import torch

from jagg.errors import ConfigError
from jagg.plugins.landing import shadow_step, step_agreement
from test_fidelity import FP64, _autograd_exact, _cos

LANDING = (*FP64, "log.fidelity_every=1", "log.landing=true")


def _adamw_by_hand(optimizer, params, grad: torch.Tensor) -> torch.Tensor:
    """The flat parameter change of one AdamW step from ``grad`` (flat, unclipped: FP64 sets no clipping)
    through ``optimizer``'s current state, from the update rule (decoupled weight decay, bias corrections)."""
    group = optimizer.param_groups[0]
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    out, at = [], 0
    for p in params:
        g = grad[at : at + p.numel()].view_as(p)
        at += p.numel()
        st = optimizer.state.get(p, {})
        t = int(st["step"]) + 1 if st else 1
        m = b1 * st["exp_avg"] + (1 - b1) * g if st else (1 - b1) * g
        v = b2 * st["exp_avg_sq"] + (1 - b2) * g * g if st else (1 - b2) * g * g
        new = p.detach() * (1 - lr * wd) - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        out.append((new - p.detach()).flatten())
    return torch.cat(out)


@pytest.mark.parametrize("max_norm", [1e9, 1e-3])
def test_shadow_step_is_the_step_the_trainer_takes_and_leaves_everything_as_it_was(tiny_trainer, max_norm):
    """After a first real step (so the optimizer has state), the shadow of the next step equals the change the
    trainer's clip + step then makes (clipping active or not), and weights, gradients and optimizer state are
    bitwise what they were before the shadow."""
    trainer = tiny_trainer(*FP64, f"optim.max_grad_norm={max_norm}")
    trainer.update(trainer.rollout(0))
    ro = trainer.rollout(1)
    loss, outputs = trainer._update_inputs(ro, slice(0, 3))
    trainer.setting.backward(trainer.velocity(ro.cond.select(slice(0, 3))), loss, outputs)
    before = [(p.detach().clone(), p.grad.clone()) for p in trainer.params]
    state = {k: v.clone() for k, v in trainer.optimizer.state[trainer.params[0]].items()}
    delta = shadow_step(trainer.optimizer, trainer.params, max_norm)
    for p, (w, g) in zip(trainer.params, before, strict=True):
        assert torch.equal(p.detach(), w) and torch.equal(p.grad, g)
    assert all(torch.equal(v, state[k]) for k, v in trainer.optimizer.state[trainer.params[0]].items())
    torch.nn.utils.clip_grad_norm_(trainer.params, max_norm)
    trainer.optimizer.step()
    for p, (w, _), d in zip(trainer.params, before, delta, strict=True):
        torch.testing.assert_close(p.detach() - w, d, rtol=0, atol=1e-15)


@pytest.mark.parametrize("strategy", ["exact", "endpoints"])
def test_logged_landing_equals_independent_adamw_steps(tiny_trainer, strategy):
    """Second iteration (the optimizer has state): the logged step cosine and sign agreement equal those of
    AdamW steps written out by hand from the gradient the optimizer received and from exact's gradient by plain
    autograd. Exact lands on itself (1); endpoints measurably not, so a shadow returning the arm's own step
    would fail."""
    trainer = tiny_trainer(*LANDING, f"backward.strategy={strategy}")
    trainer.update(trainer.rollout(0))
    trainer.iteration = 1
    ro = trainer.rollout(1)
    exact_grad = _autograd_exact(trainer, ro)
    seen, step = [], trainer.optimizer.step

    def record():
        grad = torch.cat([p.grad.flatten() for p in trainer.params])
        seen.append(
            (
                _adamw_by_hand(trainer.optimizer, trainer.params, grad),
                _adamw_by_hand(trainer.optimizer, trainer.params, exact_grad),
            )
        )
        step()

    trainer.optimizer.step = record
    row = trainer.update(ro)
    arm, exact = seen[-1]  # the real step (the shadows call the optimizer's step too)
    assert row["landing_step_cosine"] == pytest.approx(_cos(arm, exact), abs=1e-9)
    moved = (arm != 0) | (exact != 0)
    agree = ((torch.sign(arm) == torch.sign(exact)) & moved).sum().double() / moved.sum()
    assert row["landing_sign_agreement"] == pytest.approx(agree.item(), abs=1e-12)
    if strategy == "exact":
        for key in ("landing_step_cosine", "landing_function_cosine", "landing_tensor_cosine_min"):
            assert row[key] == pytest.approx(1.0, abs=1e-9)
        assert row["landing_function_rel_err"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert row["landing_step_cosine"] < 1 - 1e-4 and row["landing_function_cosine"] < 1 - 1e-6
        assert row["landing_tensor_cosine_min"] <= row["landing_tensor_cosine_median"] <= 1
    assert row["time_landing_s"] > 0


def test_step_agreement_against_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    b = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.tensor([0.0, 1.0, -2.0, 0.0])]
    b[0][0] = 0.0  # a coordinate only one side moves: counted, disagreeing
    out = step_agreement(a, b, sharded=False)
    fa, fb = torch.cat([x.flatten() for x in a]), torch.cat([x.flatten() for x in b])
    assert out["landing_step_cosine"] == pytest.approx(_cos(fa, fb), abs=1e-14)
    moved = (fa != 0) | (fb != 0)
    assert out["landing_sign_agreement"] == pytest.approx(
        (((torch.sign(fa) == torch.sign(fb)) & moved).sum().double() / moved.sum()).item(), abs=1e-14
    )
    per = [_cos(a[0].flatten(), b[0].flatten()), 0.0]  # the zero tensor has no cosine: left out
    assert out["landing_tensor_cosine_min"] == pytest.approx(per[0], abs=1e-14)


def test_measuring_landing_changes_nothing_in_training(tiny_trainer, tmp_path):
    runs = []
    for landing in ("false", "true"):
        trainer = tiny_trainer(
            "backward.strategy=jagg",
            "log.fidelity_every=1",
            f"log.landing={landing}",
            run_dir=tmp_path / landing,
        )
        rows = trainer.fit()
        runs.append((rows, torch.cat([p.detach().flatten() for p in trainer.params])))
    (rows0, w0), (rows1, w1) = runs
    assert torch.equal(w0, w1)
    assert [r["loss"] for r in rows0] == [r["loss"] for r in rows1]
    assert "landing_step_cosine" in rows1[0] and "landing_step_cosine" not in rows0[0]


def test_landing_needs_the_fidelity_cadence(tiny_cfg):
    with pytest.raises(ConfigError, match="plugins.landing.enabled=true .* plugins.fidelity.every"):
        tiny_cfg("log.landing=true", "log.fidelity_every=0")
