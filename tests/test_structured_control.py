"""Structured controls (train.control_structure, jagg.engine.control): errors of JAGG's kind on exact's own
steps, with a dial. The gradient is linear in the plan's matrix, so moving the matrix from exact's identity
toward the endpoints rule moves the gradient along the line between exact's and the endpoints ablation's:
checked against the two arms' own gradients in float64."""

from __future__ import annotations

import pytest
import torch

from jagg.engine.control import reweighted, toward
from jagg.engine.strategies import Interpolation
from jagg.errors import ConfigError
from test_fidelity import FP64


def _handed_to_optimizer(trainer) -> torch.Tensor:
    """The gradient the optimizer receives in the first update (one optimizer step under FP64)."""
    seen, step = [], trainer.optimizer.step
    trainer.optimizer.step = lambda: (
        seen.append(torch.cat([p.grad.flatten() for p in trainer.params])),
        step(),
    )
    trainer.update(trainer.rollout(0))
    (grad,) = seen
    return grad


@pytest.mark.parametrize("dial", [0.0, 0.3, 1.0])
def test_toward_endpoints_moves_the_gradient_on_the_line_from_exact_to_endpoints(
    tiny_trainer, dial, tmp_path
):
    arms = {
        name: _handed_to_optimizer(tiny_trainer(*FP64, *overrides, run_dir=tmp_path / name))
        for name, overrides in {
            "exact": ["backward.strategy=exact"],
            "endpoints": ["backward.strategy=endpoints"],
            "control": [
                "backward.strategy=exact",
                "train.control_structure=toward_endpoints",
                f"train.control_dial={dial}",
            ],
        }.items()
    }
    expected = (1 - dial) * arms["exact"] + dial * arms["endpoints"]
    torch.testing.assert_close(arms["control"], expected, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(arms["exact"], arms["endpoints"])  # the line has a length here


def test_reweight_scales_each_steps_signal_and_dial_zero_is_exact(tiny_trainer, tmp_path):
    exact = _handed_to_optimizer(tiny_trainer(*FP64, "backward.strategy=exact", run_dir=tmp_path / "e"))
    grads = {
        dial: _handed_to_optimizer(
            tiny_trainer(
                *FP64,
                "train.control_structure=reweight",
                f"train.control_dial={dial}",
                run_dir=tmp_path / str(dial),
            )
        )
        for dial in (0.0, 0.5)
    }
    torch.testing.assert_close(grads[0.0], exact, rtol=1e-10, atol=1e-13)
    cos = torch.dot(grads[0.5], exact) / (grads[0.5].norm() * exact.norm())
    assert 0 < cos < 1 - 1e-4


def test_reweighted_plan_is_diagonal_with_positive_mean_one_weights():
    plan = reweighted(6, 4000, 0.5, torch.Generator().manual_seed(0))
    w = plan.weights
    off = w.clone()
    off[range(6), range(6)] = 0
    assert off.abs().max() == 0 and (w[range(6), range(6)] > 0).all()
    assert w[range(6), range(6)].mean().item() == pytest.approx(1.0, abs=0.02)
    assert w[range(6), range(6)].log().std().item() == pytest.approx(0.5, abs=0.02)


def test_toward_a_group_rule_at_zero_is_the_identity():
    rule = Interpolation.group(
        torch.tensor([[1.0, 0], [0, 0], [0, 0], [0, 1.0]], dtype=torch.float64), "endpoints"
    )
    assert torch.equal(toward(rule, 0.0).weights, torch.eye(4, dtype=torch.float64))
    half = toward(rule, 0.5).weights
    assert torch.equal(torch.diagonal(half), torch.tensor([1.0, 0.5, 0.5, 1.0], dtype=torch.float64))
    assert toward(rule, 1.0) is rule


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["train.control_structure=sideways"], "plugins.structured_control.kind must be null or one of"),
        (["train.control_structure=toward_endpoints", "train.control_dial=1.5"], r"in \[0, 1.0\]"),
        (["train.control_structure=reweight", "train.control_cosine=0.8"], "two controls"),
        (
            [
                "train.control_structure=toward_endpoints",
                "backward.group_size=auto",
                "backward.jagg_frac=auto",
            ],
            "must then be an integer",
        ),
    ],
)
def test_bad_structured_controls_name_the_key(tiny_cfg, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_cfg(*overrides)
