"""The gradient's norm before each optimizer step (plugins.grad_norm, jagg.plugins.grad_norm): the instrument a
reviewer added as one module and one registry line; here against torch's own norm of the same gradient."""

from __future__ import annotations

import math

import pytest

from helpers import build_trainer
from jagg.config import load_config
from jagg.errors import ConfigError


def test_the_norm_before_each_step_is_the_one_the_step_clips(tiny_cfg):
    """The loop tests' run (two optimizer steps per iteration), every 2nd iteration: at iterations 0 and 2 two
    norms, whose mean is the trainer's grad_norm (torch.nn.utils.clip_grad_norm_ on the same gradient, float32);
    nothing at iteration 1, and the default leaves the rows as they were."""
    rows = build_trainer(tiny_cfg("plugins.grad_norm.every=2", "train.iterations=3")).fit()
    measured = [r for r in rows if "grad_norm_steps" in r]
    assert [rows.index(r) for r in measured] == [0, 2]
    for row in measured:
        norms = row["grad_norm_steps"]
        assert len(norms) == row["optimizer_steps"] == 2 and all(n > 0 for n in norms)
        assert math.isclose(sum(norms) / len(norms), row["grad_norm"], rel_tol=1e-5)
        assert row["grad_norm_max"] == max(norms)
    plain = build_trainer(tiny_cfg("train.iterations=1")).fit()
    assert not any(k.startswith(("grad_norm_steps", "grad_norm_max")) for k in plain[0])


def test_its_key_is_read_and_checked_beside_it():
    assert load_config(None, []).plugins.grad_norm.every == 0
    with pytest.raises(ConfigError, match=r"^plugins\.grad_norm\.every must be >= 0, got -1$"):
        load_config(None, ["plugins.grad_norm.every=-1"])
    with pytest.raises(ConfigError, match=r"unknown key plugins\.grad_norm\.evry \(did you mean"):
        load_config(None, ["plugins.grad_norm.evry=1"])
