"""Measured routing per MixGRPO window position (``backward.jagg_frac: auto`` under ``algorithm.name: mixgrpo``).

The tiny world run in float64 with 8 sampling steps, a window of 4 moving one step per iteration: a calibration
every 3 iterations measures the windows at starts 0, 1, 2 (4 steps each) from the rollout of its iteration
(``jagg.loop.calibration.window_losses``), and the update of a window runs exact or JAGG as its start measured.
"""

from __future__ import annotations

import pytest
import torch

from helpers import build_trainer, rel_err, tiny_config
from jagg.config import AlgorithmConfig, load_config
from jagg.engine.algorithms import MixGRPO
from jagg.engine.diagnostics import flat_grad
from jagg.engine.routing import WindowRouting
from jagg.engine.sampling import sample_trajectory
from jagg.errors import ConfigError

CONFIG = "configs/world/flux_mixgrpo.yaml"
WINDOWS = (
    "sampling.num_steps=8",  # windows [s, min(s + 4, 6)): starts 0, 1, 2 hold 4 steps
    "algorithm.iters_per_group=1",  # iteration it trains the window at start it (it < 6)
    "backward.calibrate_every=3",
    "train.grad_accum=2",  # the 2 micro-batches of 3 samples, one optimizer step per update
    "train.precision=fp64",
)
AUTO = (*WINDOWS, "backward.jagg_frac=auto")


def window_cfg(run_dir, *overrides):
    return tiny_config(run_dir, *overrides, config=CONFIG)


def update_gradient(cfg, it: int, calibrate: bool = False) -> tuple[torch.Tensor, dict, object]:
    """A fresh trainer's update gradient (before its one optimizer step) on the rollout of iteration ``it``,
    calibrated on the rollout of iteration 0 first when ``calibrate``."""
    trainer = build_trainer(cfg)
    if calibrate:
        trainer.calibrate(trainer.rollout(0), 0)
    grads, step = [], trainer._optimizer_step

    def record_then_step(*args):  # args: the fidelity measurement, if any
        grads.append(flat_grad(trainer.params).clone())
        return step(*args)

    trainer._optimizer_step = record_then_step
    row = trainer.update(trainer.rollout(it))
    return grads[0], row, trainer


def test_windows_are_the_schedules_next_starts_or_every_random_start():
    progressive = MixGRPO(AlgorithmConfig(name="mixgrpo", group_size=4, iters_per_group=2))
    assert progressive.windows(8, range(3, 6)) == [range(1, 5), range(2, 6)]  # iterations 3 | 4, 5
    assert progressive.windows(8, range(12, 14)) == [range(0, 4)]  # start 6 = S - 2 is the window at 0
    rand = MixGRPO(AlgorithmConfig(name="mixgrpo", group_size=4, sample_strategy="random"))
    assert rand.windows(8, range(1)) == [range(0, 4), range(1, 5), range(2, 6)]  # every start it can draw


def test_a_rebuilt_window_starts_where_a_rollout_with_the_window_there_starts(tmp_path):
    """The calibration's window at start p begins at the ODE state of step p, which is the input of the first
    SDE step of a rollout whose window is at p; its old log-probs are the current weights' (ratio 1)."""
    trainer = build_trainer(window_cfg(tmp_path, *AUTO))
    ro, idx = trainer.rollout(1), slice(0, 3)  # the rollout's window starts at 1
    windows = trainer.algorithm.windows(8, range(0, 3))
    losses = trainer.calibrator.rebuilt(trainer.probe(ro, 1), windows)
    sigmas = trainer.sigmas.to(trainer.device)
    ode = sample_trajectory(
        trainer.velocity(ro.cond.select(idx)), ro.traj.latents[0, idx], sigmas, ["ode"] * 8
    )
    for start, loss in losses.items():
        assert torch.equal(loss.x[0], ode.latents[start])
        assert len(loss) == 4 and torch.equal(loss.sigma, sigmas[start : start + 4])
        v = trainer.velocity(ro.cond.select(idx))(loss.x[0], loss.sigma[0])
        assert loss.evaluate(0, v)[1].ppo.ratio_max_dev < 1e-12
    assert torch.equal(ro.traj.latents[1, idx], losses[1].x[0])  # the rollout's own window: its stored input


def test_a_window_below_min_cosine_runs_exact_and_one_above_runs_jagg(tmp_path):
    """(a) The threshold set between the lowest measured window cosine and the next: at train time the lowest
    window's gradient equals the exact update's to rounding with 4 backward passes per micro-batch, and the
    other window's equals the JAGG update's with 2 (the pass counts, not timings, show which ran)."""
    probe = build_trainer(window_cfg(tmp_path / "probe", *AUTO, "backward.min_cosine=0"))
    cosines = probe.calibrate(probe.rollout(0), 0)["window_cosines"]
    (lo, c_lo), (hi, c_hi) = sorted(cosines.items(), key=lambda kv: kv[1])[:2]
    assert 0 < c_lo < c_hi < 1
    routed = window_cfg(tmp_path / "routed", *AUTO, f"backward.min_cosine={(c_lo + c_hi) / 2}")
    exact = window_cfg(tmp_path / "exact", *WINDOWS, "backward.strategy=exact", "backward.jagg_frac=1.0")
    jagg = window_cfg(tmp_path / "jagg", *WINDOWS, "backward.jagg_frac=1.0")
    for start, reference, passes in ((int(lo), exact, 4), (int(hi), jagg, 2)):
        g, row, trainer = update_gradient(routed, start, calibrate=True)
        g_ref, ref_row, _ = update_gradient(reference, start)
        assert (
            rel_err(g, g_ref) < 1e-12 and row["backward_passes"] == ref_row["backward_passes"] == 2 * passes
        )
        assert trainer.setting.routing.at(start).measured == (passes == 2,)
    g_exact, g_jagg = update_gradient(exact, int(hi))[0], update_gradient(jagg, int(hi))[0]
    assert rel_err(g_jagg, g_exact) > 1e-6  # the two references differ: equality above is not trivial


@pytest.mark.parametrize(("min_cosine", "routed", "passes"), [(1.0, "exact", 4), (0.0, "jagg", 2)])
def test_min_cosine_above_every_window_routes_all_exact_and_zero_all_jagg(
    tmp_path, min_cosine, routed, passes
):
    """(b) Control: a threshold no 4-step window reaches (1.0) runs every window exact, 0 runs every one JAGG; the
    calibration row logs each start's cosine and routing."""
    cfg = window_cfg(tmp_path, *AUTO, f"backward.min_cosine={min_cosine}", "train.iterations=3")
    rows = build_trainer(cfg).fit()
    cal = rows[0]
    assert set(cal["window_cosines"]) == {"0", "1", "2"} and all(
        0 < c < 1 for c in cal["window_cosines"].values()
    )
    assert cal["window_routing"] == {"0": routed, "1": routed, "2": routed}
    assert [r["backward_passes"] for r in rows] == [2 * passes] * 3
    assert ["window_routing" in r for r in rows] == [True, False, False]


def test_resume_restores_the_window_table(tmp_path):
    """(c) Killed during iteration 2 (checkpoint after 1), resumed: the table measured at iteration 0 is restored,
    not measured again before iteration 3, and the run equals the uninterrupted one."""
    over = (*AUTO, "train.iterations=3", "log.checkpoint_every=1")
    full_trainer = build_trainer(window_cfg(tmp_path / "full", *over))
    full = full_trainer.fit()
    cfg = window_cfg(tmp_path / "cut", *over)

    def kill_after_second(row):
        if row["iteration"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_trainer(cfg).fit(progress=kill_after_second)
    resumed = build_trainer(cfg)
    resumed.load_checkpoint()
    assert resumed.iteration == 1
    assert isinstance(resumed.setting.routing, WindowRouting) and resumed.setting == full_trainer.setting
    again = resumed.fit()

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time_", "peak_memory"))} for r in rows]

    assert strip(again) == strip(full) and "window_routing" not in again[-1]


@pytest.mark.parametrize("size", ["3", "auto"])
def test_window_routing_needs_w_that_holds_the_window(size):
    auto = "backward.group_sizes=[2, 4]" if size == "auto" else "backward.group_sizes=[2, 3]"
    with pytest.raises(
        ConfigError, match=r"backward.group_size must be an integer >= algorithm.group_size=4"
    ):
        load_config(CONFIG, ["backward.jagg_frac=auto", f"backward.group_size={size}", auto])


def test_dry_run_says_the_routing_is_per_window_position(capsys, monkeypatch):
    from jagg.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--config", "configs/paper/flux_mixgrpo.yaml", "--dry-run", "backward.jagg_frac=auto"]) == 0
    assert "cos(JAGG, exact) per window position" in capsys.readouterr().out
