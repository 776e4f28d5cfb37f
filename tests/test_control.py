"""The positive control (jagg.engine.control): a gradient with a set cosine to the exact one, same norm, and a
systematic (fixed per run) error direction; the config key that switches it on."""

from __future__ import annotations

import math

import pytest
import torch

from jagg.common import SeedStream, generator
from jagg.config import load_config
from jagg.engine.control import PositiveControl, degrade_gradients, mix_coefficients, random_direction
from jagg.errors import ConfigError


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    return params


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.flatten() for t in ts])


@pytest.mark.parametrize("cosine", [0.2, 0.5, 0.8, 1.0])
def test_degraded_gradient_has_the_set_cosine_and_the_exact_norm(cosine):
    params = _params()
    g = _flat([p.grad for p in params]).clone()
    u = [d.double() for d in random_direction(params, generator(3, SeedStream.CONTROL))]
    degrade_gradients(params, u, cosine)
    g2 = _flat([p.grad for p in params])
    assert torch.dot(g2, g).item() / (g2.norm() * g.norm()).item() == pytest.approx(cosine, abs=1e-13)
    assert g2.norm().item() == pytest.approx(g.norm().item(), rel=1e-13)
    # the error lies in span(g, u): what is left of g2 after removing g's part is parallel to u's orthogonal part
    uf = _flat(u)
    u_perp = uf - torch.dot(uf, g) / torch.dot(g, g) * g
    resid = g2 - cosine * g
    expected = math.sqrt(1 - cosine**2) * g.norm() * u_perp / u_perp.norm()
    torch.testing.assert_close(resid, expected, rtol=0, atol=1e-12)


def test_the_error_is_systematic_the_same_direction_at_every_step():
    """Two different gradients degraded with the same direction: their errors point the same way (cosine near 1:
    a bias that Adam accumulates, not zero-mean noise); degraded with another seed's direction, they do not."""
    u = [d.double() for d in random_direction(_params(), generator(3, SeedStream.CONTROL))]
    other = [d.double() for d in random_direction(_params(), generator(4, SeedStream.CONTROL))]

    def error(seed, direction):
        params = _params(seed)
        g = _flat([p.grad for p in params]).clone()
        degrade_gradients(params, direction, 0.5)
        return _flat([p.grad for p in params]) - 0.5 * g

    cos = torch.nn.functional.cosine_similarity
    assert cos(error(1, u), error(2, u), dim=0).item() > 0.9
    assert abs(cos(error(1, u), error(2, other), dim=0).item()) < 0.3


def test_direction_is_a_function_of_the_seed_only():
    params = _params()
    a = random_direction(params, generator(7, SeedStream.CONTROL))
    b = random_direction(params, generator(7, SeedStream.CONTROL))
    c = random_direction(params, generator(8, SeedStream.CONTROL))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(_flat(a), _flat(c))
    assert [tuple(x.shape) for x in a] == [tuple(p.shape) for p in params]


def test_edge_cases_zero_gradient_parallel_direction_and_range():
    assert mix_coefficients(0.0, 0.0, 1.0, 0.5) == (1.0, 0.0)  # g = 0: nothing to degrade
    assert mix_coefficients(2.0, 4.0, 1.0, 0.5) == (1.0, 0.0)  # u parallel to g (|u_perp| = 0)
    assert mix_coefficients(0.3, 4.0, 1.0, 1.0) == (1.0, 0.0)  # cosine 1: the exact gradient
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            mix_coefficients(0.3, 4.0, 1.0, bad)
    params = _params()
    with pytest.raises(ValueError, match="direction tensors"):
        degrade_gradients(params, random_direction(params[:1], generator(0, SeedStream.CONTROL)), 0.5)


def test_config_key_is_validated_with_its_name():
    assert load_config(None, ["train.control_cosine=0.5"]).plugins.control.cosine == 0.5  # the old name reads
    assert load_config(None, ["plugins.control.cosine=0.5"]).plugins.control.cosine == 0.5
    assert load_config(None, []).plugins.control.cosine is None
    for bad in ("0", "1.2", "-0.1"):
        with pytest.raises(ConfigError, match=r"plugins\.control\.cosine must be null or in \(0, 1\]"):
            load_config(None, [f"train.control_cosine={bad}"])


def test_trainer_degrades_the_gradient_right_before_clipping(tiny_cfg, tiny_trainer):
    """train.control_cosine=0.5 in a tiny world run: the gradient AdamW receives has cosine 0.5 to the one the
    update produced and the same norm; the direction is the seed's (so a resumed run uses the same one)."""
    cfg = tiny_cfg("train.control_cosine=0.5", "optim.max_grad_norm=1e9")
    trainer = tiny_trainer(cfg=cfg)
    again = random_direction(trainer.params, generator(cfg.train.seed, SeedStream.CONTROL))
    assert all(torch.equal(x, y) for x, y in zip(trainer.plugin("control").control.fixed, again, strict=True))
    gen = torch.Generator().manual_seed(0)
    for p in trainer.params:
        p.grad = torch.randn(p.shape, generator=gen)
    g = _flat([p.grad for p in trainer.params]).double()
    seen = []
    trainer.optimizer.step = lambda: seen.append(_flat([p.grad for p in trainer.params]).double())
    view = trainer._view(trainer.rollout(0), trainer.setting)  # an update's view, as the update builds it
    trainer._optimizer_step(view, [])
    (g2,) = seen
    assert torch.dot(g2, g).item() / (g2.norm() * g.norm()).item() == pytest.approx(0.5, abs=1e-5)
    assert g2.norm().item() == pytest.approx(g.norm().item(), rel=1e-5)


def _degrade_twice(control: PositiveControl, its: list[int]) -> list[torch.Tensor]:
    """The error each optimizer step adds, for optimizer steps at iterations ``its`` (same gradient each time)."""
    errors = []
    for it in its:
        for p, g in zip(control.params, _params(1), strict=True):
            p.grad = g.grad.clone()
        g = _flat([p.grad for p in control.params]).clone()
        control.start_iteration(it)
        control.apply()
        errors.append(_flat([p.grad for p in control.params]) - control.cosine * g)
    return errors


def test_fixed_and_fresh_directions():
    """fixed: the same error at every step (a bias); fresh: a new direction per step (near-orthogonal errors in
    this 42-dimensional space), the same for the same iteration whichever run draws it (a resume), and two steps
    of one iteration differ. Both keep the set cosine."""
    draw = lambda i: generator(3, SeedStream.CONTROL, i)  # noqa: E731
    cos = torch.nn.functional.cosine_similarity
    fixed = _degrade_twice(PositiveControl(_params(), 0.5, "fixed", draw), [0, 1])
    assert cos(fixed[0], fixed[1], dim=0).item() == pytest.approx(1.0, abs=1e-12)
    fresh = PositiveControl(_params(), 0.5, "fresh", draw)
    a = _degrade_twice(fresh, [0, 1])
    assert abs(cos(a[0], a[1], dim=0).item()) < 0.5
    again = _degrade_twice(PositiveControl(_params(), 0.5, "fresh", draw), [1])
    torch.testing.assert_close(again[0], a[1], rtol=0, atol=1e-12)
    fresh.start_iteration(2)
    first, second = random_direction(fresh.params, draw(3)), random_direction(fresh.params, draw(3))
    assert torch.equal(_flat(first), _flat(second))  # the generator of a draw is reproducible ...
    steps = []
    for _ in range(2):  # ... and two optimizer steps of one iteration take successive directions from it
        for p, g in zip(fresh.params, _params(1), strict=True):
            p.grad = g.grad.clone()
        fresh.apply()
        steps.append(_flat([p.grad for p in fresh.params]).clone())
    assert not torch.equal(steps[0], steps[1])
    g = _flat([p.grad for p in _params(1)])
    for s in steps:
        assert torch.dot(s, g).item() / (s.norm() * g.norm()).item() == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(RuntimeError, match="start_iteration"):
        PositiveControl(_params(), 0.5, "fresh", draw).apply()


def test_control_direction_key_is_validated_with_its_name():
    assert load_config(None, ["train.control_direction=fresh"]).plugins.control.direction == "fresh"
    with pytest.raises(ConfigError, match=r"plugins\.control\.direction must be one of \['fixed', 'fresh'\]"):
        load_config(None, ["train.control_direction=noise"])
    with pytest.raises(ConfigError, match=r"train\.iterations must be <= 9998"):
        load_config(None, ["train.control_direction=fresh", "train.iterations=10000"])
