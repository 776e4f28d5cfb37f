"""The positive control (jagg.engine.control): a gradient with a set cosine to the exact one, same norm, and a
systematic (fixed per run) error direction; the config key that switches it on."""

from __future__ import annotations

import math

import pytest
import torch

from jagg.common import SeedStream, generator
from jagg.config import load_config
from jagg.engine.control import degrade_gradients, fixed_direction, mix_coefficients
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
    u = [d.double() for d in fixed_direction(params, generator(3, SeedStream.CONTROL))]
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
    u = [d.double() for d in fixed_direction(_params(), generator(3, SeedStream.CONTROL))]
    other = [d.double() for d in fixed_direction(_params(), generator(4, SeedStream.CONTROL))]

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
    a = fixed_direction(params, generator(7, SeedStream.CONTROL))
    b = fixed_direction(params, generator(7, SeedStream.CONTROL))
    c = fixed_direction(params, generator(8, SeedStream.CONTROL))
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
        degrade_gradients(params, fixed_direction(params[:1], generator(0, SeedStream.CONTROL)), 0.5)


def test_config_key_is_validated_with_its_name():
    assert load_config(None, ["train.control_cosine=0.5"]).train.control_cosine == 0.5
    assert load_config(None, []).train.control_cosine is None
    for bad in ("0", "1.2", "-0.1"):
        with pytest.raises(ConfigError, match=r"train\.control_cosine must be null or in \(0, 1\]"):
            load_config(None, [f"train.control_cosine={bad}"])


def test_trainer_degrades_the_gradient_right_before_clipping(tiny_cfg, tiny_trainer):
    """train.control_cosine=0.5 in a tiny world run: the gradient AdamW receives has cosine 0.5 to the one the
    update produced and the same norm; the direction is the seed's (so a resumed run uses the same one)."""
    cfg = tiny_cfg("train.control_cosine=0.5", "optim.max_grad_norm=1e9")
    trainer = tiny_trainer(cfg=cfg)
    again = fixed_direction(trainer.params, generator(cfg.train.seed, SeedStream.CONTROL))
    assert all(torch.equal(x, y) for x, y in zip(trainer.control, again, strict=True))
    gen = torch.Generator().manual_seed(0)
    for p in trainer.params:
        p.grad = torch.randn(p.shape, generator=gen)
    g = _flat([p.grad for p in trainer.params]).double()
    seen = []
    trainer.optimizer.step = lambda: seen.append(_flat([p.grad for p in trainer.params]).double())
    trainer._optimizer_step()
    (g2,) = seen
    assert torch.dot(g2, g).item() / (g2.norm() * g.norm()).item() == pytest.approx(0.5, abs=1e-5)
    assert g2.norm().item() == pytest.approx(g.norm().item(), rel=1e-5)
