"""experiments/credit.py: the share of a group's reward variance that the trained window's noise carries."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jagg.config import TINY_OVERRIDES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import credit  # noqa: E402


def test_the_anova_split_is_unbiased_for_a_nested_design():
    """r[k, j] = a_k + e_kj with Var a = 4, Var e = 1: within estimates 1, between 4 (mean over 4000 tables of
    3 x 4); a share of 1 / 5. The biased reading (the variance of the row means as between) would give 4.25."""
    rng = np.random.default_rng(0)
    tables = 2 * rng.standard_normal((4000, 3, 1)) + rng.standard_normal((4000, 3, 4))
    within, between = np.mean([credit.split(t) for t in tables], axis=0)
    assert within == pytest.approx(1.0, abs=0.03) and between == pytest.approx(4.0, abs=0.2)
    rows = [{"within": w, "between": b} for w, b in (credit.split(t) for t in tables)]
    assert credit.share(rows, n_boot=200)[0] == pytest.approx(0.2, abs=0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jagg.config import load_config
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    run = tmp_path_factory.mktemp("credit")
    cfg = load_config(credit.CONFIG, [*TINY_OVERRIDES, f"log.run_dir={run}"])
    return Trainer(cfg, build_components(cfg), run)


def test_only_the_windows_noise_moves_the_window_rollout(tiny):
    """The control's premise: under the window rollout (ODE off the window) two trajectories with the same
    window noise and different noise elsewhere score the same; under the every-step rollout they do not."""
    n, shape = len(tiny.sigmas) - 1, tiny.comp.latent_shape
    gen = torch.Generator().manual_seed(1)
    x_T = torch.randn(shape, generator=gen)
    window = torch.randn(shape, generator=gen).expand(2, *shape)
    eps = [window if i in (3, 4) else torch.randn(2, *shape, generator=gen) for i in range(n)]
    prompt = tiny.comp.train_prompts[0]
    kinds = ["flow_grpo" if i in (3, 4) else "ode" for i in range(n)]
    r = credit.rewards_of(tiny, prompt, x_T, kinds, 0.9, eps)
    assert r[0] == r[1]
    every = ["dance"] * (n - 1) + ["ode"]
    r = credit.rewards_of(tiny, prompt, x_T, every, 1.0, eps)
    assert r[0] != r[1]


def test_the_driver_writes_one_row_per_rollout_and_group_and_refuses_a_table_of_one(tmp_path, capsys):
    out = tmp_path / "credit.csv"
    credit.main(["--prompts", "1", "--outer", "2", "--inner", "2", "--out", str(out), *TINY_OVERRIDES])
    rows = out.read_text().splitlines()
    assert len([r for r in rows if not r.startswith("#")]) == 1 + 2 * 9  # header, 2 rollouts x 9 windows
    assert "window's share of the reward variance" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit) as e:
        credit.main(["--inner", "1", "--out", str(out)])
    assert e.value.code == 2 and "--inner must be >= 2" in capsys.readouterr().err
