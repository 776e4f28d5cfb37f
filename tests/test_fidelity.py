"""Gradient fidelity along training (log.fidelity_every, jagg.plugins.fidelity): the update a run applies against
exact's on the same rollout and weights, in float64, checked against independent computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jagg.engine.routing import Routing
from jagg.engine.strategies import Interpolation
from jagg.loop.rollout import micro_batches
from jagg.plugins.fidelity import block_cosines, block_parts

FP64 = ("train.precision=fp64", "optim.max_grad_norm=1e9", "train.grad_accum=2")  # one optimizer step


def _autograd_exact(trainer, ro):
    """Exact's gradient of the whole update by plain autograd on the sum of every step loss (independent of
    the strategies' code), at the current weights; ``.grad`` untouched."""
    grads = [torch.zeros_like(p) for p in trainer.params]
    for idx in micro_batches(len(ro.prompts), trainer.cfg.train.train_batch_size):
        loss, _ = trainer._update_inputs(ro, idx)
        v = trainer.velocity(ro.cond.select(idx))
        total = sum(loss(i, v(loss.x[i], loss.sigma[i])) for i in range(len(loss.x)))
        for g, d in zip(grads, torch.autograd.grad(total, trainer.params, allow_unused=True), strict=True):
            if d is not None:
                g += d
    return torch.cat([g.flatten() for g in grads])


def _update_seen(trainer, ro):
    """(metrics row, the gradient of each optimizer step as the optimizer received it)."""
    seen, step = [], trainer.optimizer.step
    trainer.optimizer.step = lambda: (
        seen.append(torch.cat([p.grad.flatten() for p in trainer.params])),
        step(),
    )
    return trainer.update(ro), seen


def _cos(a, b):
    return (torch.dot(a, b) / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("strategy", ["exact", "jagg", "endpoints"])
def test_logged_fidelity_equals_an_independent_cosine(tiny_trainer, strategy):
    """One optimizer step per iteration: the logged cosine and relative error equal those of the gradient the
    optimizer received to exact's by plain autograd at the same weights. Exact's is 1; jagg's and endpoints'
    are measurably below 1 on this model, so a shadow that returned the arm's own gradient would fail."""
    trainer = tiny_trainer(*FP64, f"backward.strategy={strategy}", "log.fidelity_every=1")
    ro = trainer.rollout(0)
    exact = _autograd_exact(trainer, ro)
    row, (applied,) = _update_seen(trainer, ro)
    assert row["fidelity_cosine"] == pytest.approx(_cos(applied, exact), abs=1e-10)
    assert row["fidelity_rel_err"] == pytest.approx(
        ((applied - exact).norm() / exact.norm()).item(), abs=1e-10
    )
    if strategy == "exact":
        assert row["fidelity_cosine"] == pytest.approx(1.0, abs=1e-12)
        assert row["fidelity_group_cosines"] == {}  # every block a plain step
    else:
        assert row["fidelity_cosine"] < 1 - 1e-6
        cosines = row["fidelity_group_cosines"]
        assert cosines and all(-1 <= c <= 1 for c in cosines.values())
    assert row["time_fidelity_s"] > 0


@pytest.mark.parametrize("direction", ["fixed", "fresh"])
def test_a_control_arm_measures_its_own_cosine(tiny_trainer, direction):
    """Exact degraded to cosine 0.8 (train.control_cosine): the fidelity is 0.8, measured on what the optimizer
    receives, with either kind of direction."""
    trainer = tiny_trainer(
        *FP64,
        "backward.strategy=exact",
        "train.control_cosine=0.8",
        f"train.control_direction={direction}",
        "log.fidelity_every=1",
    )
    row = trainer.update(trainer.rollout(0))
    assert row["fidelity_cosine"] == pytest.approx(0.8, abs=1e-10)
    assert row["fidelity_rel_err"] == pytest.approx((2 - 2 * 0.8) ** 0.5, abs=1e-10)  # same norm as exact's


def test_measuring_fidelity_changes_nothing_in_training(tiny_trainer, tmp_path):
    """Two iterations with log.fidelity_every=1 and without: the same metrics and the same weights, bit for bit
    (the shadow update is computed, compared and discarded)."""
    runs = []
    for every in (0, 1):
        trainer = tiny_trainer(
            "backward.strategy=jagg", f"log.fidelity_every={every}", run_dir=tmp_path / f"f{every}"
        )
        rows = trainer.fit()
        runs.append((rows, torch.cat([p.detach().flatten() for p in trainer.params])))
    (rows0, w0), (rows1, w1) = runs
    assert torch.equal(w0, w1)
    for a, b in zip(rows0, rows1, strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "clip_frac"):
            assert a[key] == b[key]
    assert "fidelity_cosine" in rows1[0] and "fidelity_cosine" not in rows0[0]


def test_fidelity_every_n_iterations(tiny_trainer):
    trainer = tiny_trainer("backward.strategy=jagg", "log.fidelity_every=2", "train.iterations=3")
    rows = trainer.fit()
    assert ["fidelity_cosine" in r for r in rows] == [True, False, True]


def test_block_parts_cut_the_plan_into_its_aggregated_blocks():
    """7 steps in groups of 3, 3 and 1, half of them routed to JAGG (the leading two groups; a one-step group is
    a plain step anyway): the parts are the two groups (spans 0-2 and 3-5), each alone holds exactly its columns
    of the plan, and each exact twin picks the steps of its span."""
    routing = Routing(strategy="jagg", group_size=3, jagg_frac=0.5)
    plan = routing.interpolation(torch.linspace(1.0, 0.1, 7, dtype=torch.float64))
    parts = block_parts(plan)
    spans = [span for span, _, _ in parts]
    plain = [b for b in plan.blocks if plan.is_plain(b)]
    assert len(parts) + len(plain) == len(plan.blocks) and spans == ["0-2", "3-5"]
    for (span, alone, exact), block in zip(
        parts, [b for b in plan.blocks if not plan.is_plain(b)], strict=True
    ):
        torch.testing.assert_close(alone.weights, plan.weights[:, list(block)])
        j0, j1 = map(int, span.split("-"))
        assert exact.knots == tuple(range(j0, j1 + 1))
        assert exact.weights.sum().item() == j1 - j0 + 1 and isinstance(exact, Interpolation)


def test_block_cosines_of_a_two_step_group_are_exact(tiny_trainer):
    """JAGG on a group of two steps is exact (alpha = (0, 1)): its block cosine is 1; a group of three is not."""
    for size, exact in ((2, True), (3, False)):
        trainer = tiny_trainer(
            *FP64, "backward.strategy=jagg", f"backward.group_size={size}", "backward.jagg_frac=1"
        )
        ro, idx = trainer.rollout(0), slice(0, 3)
        loss, outputs = trainer._update_inputs(ro, idx)
        velocity = trainer.velocity(ro.cond.select(idx))
        cosines = block_cosines(trainer.setting, velocity, loss, trainer.params, outputs)
        assert cosines
        assert all((abs(c - 1) < 1e-10) == exact for c in cosines.values()), (size, cosines)


def test_save_eval_state_writes_images_and_the_evaluated_weights(tiny_trainer):
    trainer = tiny_trainer("log.save_eval_state=true", "log.eval_every=2", "optim.ema_decay=0.5")
    trainer.fit()
    state = torch.load(trainer.run_dir / "samples" / "eval_00002.rank0.pt")
    assert [tuple(w.shape) for w in state["weights"]] == [tuple(p.shape) for p in trainer.params]
    for w, e in zip(state["weights"], trainer.ema, strict=True):  # the EMA is what the evaluation sampled
        assert torch.equal(w, e.float())
    assert state["images"].shape[0] == trainer.cfg.log.eval_prompts * trainer.cfg.log.eval_images_per_prompt
    assert (trainer.run_dir / "samples" / "eval_00000.rank0.pt").is_file()


def test_paired_divergence_is_zero_for_the_same_run_and_grows_with_a_control(tiny_trainer, tmp_path):
    """Exact twice (deterministic): divergence exactly 0 at every evaluation; NaN at iteration 0 (nothing has
    moved). A cosine-0.5 control from the same seed: strictly positive. Recomputed here from the raw files."""
    from jagg.plugins.eval_state import paired_divergence

    runs = {}
    for name, extra in (("a", []), ("b", []), ("c", ["train.control_cosine=0.5"])):
        trainer = tiny_trainer(
            "log.save_eval_state=true", "log.eval_every=2", *extra, run_dir=tmp_path / name
        )
        trainer.fit()
        runs[name] = trainer.run_dir
    same = paired_divergence(runs["b"], runs["a"])
    assert set(same) == {0, 2} and np.isnan(same[0]["div_weights_rel"])
    assert same[2] == {"div_weights_rel": 0.0, "div_samples_rel": 0.0}
    ctrl = paired_divergence(runs["c"], runs["a"])[2]
    a0, a2, c2 = (
        torch.load(runs[r] / "samples" / f"eval_0000{i}.rank0.pt") for r, i in (("a", 0), ("a", 2), ("c", 2))
    )
    flat = lambda s: torch.cat([w.double().flatten() for w in s["weights"]])  # noqa: E731
    expected = ((flat(c2) - flat(a2)).norm() / (flat(a2) - flat(a0)).norm()).item()
    assert ctrl["div_weights_rel"] == pytest.approx(expected, rel=1e-12) and expected > 0
    assert ctrl["div_samples_rel"] > 0
