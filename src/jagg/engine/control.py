"""A positive control for the quality experiments: a gradient degraded by a set, systematic error.

At every optimizer step the exact gradient g (all trained parameters as one vector) is replaced by

    g' = cos * g + sin * |g| * u_perp,      u_perp = (u - (<u, g> / |g|^2) g) / |u - (<u, g> / |g|^2) g|

where u is a random direction over the trained parameters (``random_direction``) and sin = sqrt(1 - cos^2).
Then |g'| = |g| and cos(g', g) = cos exactly: the error has the size of a gradient whose cosine to the exact
one is ``cos``. ``PositiveControl`` draws u in one of two ways (``plugins.control.direction``):

* ``fixed``: once per run. The error is then a bias, as JAGG's is, which Adam's moments accumulate;
* ``fresh``: anew for every optimizer step. The error is noise, which the moments partly average away.

``experiments/curves.py`` runs controls at several cosines through the same protocol as the strategies: a
design that cannot detect them cannot support an equivalence claim, and the controls' effects against their
cosine are the scale on which each strategy is placed ("behaves like a cosine-c gradient"). A random direction
barely changes the model's function, so on reward and divergence this scale need not match a strategy's
structured error (protocol version 4's pilot: docs/decisions.md 24).

Under FSDP2 the gradients are sharded DTensors: every dot product is a sum of local sums all-reduced across
the ranks (as in ``jagg.engine.diagnostics``), so no rank gathers a full gradient; the direction is drawn at
full size on every rank from the same generator and each rank keeps its shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from jagg.engine.diagnostics import sharded_sums
from jagg.engine.strategies import Interpolation

CONTROL_DIRECTIONS = ("fixed", "fresh")
# fresh directions of iteration i come from draw 1 + i of the control's seed stream (jagg.common.SeedStream,
# draw 0 being the fixed direction), which holds 10_000 draws
MAX_FRESH_ITERATIONS = 9_998


class PositiveControl:
    """The degradation of one run, bound once: its cosine, how its direction is drawn, and from where.

    ``draw(i)`` is the generator of draw i of the run's control stream: draw 0 gives the fixed direction,
    draw 1 + it the fresh directions of iteration ``it`` (one per optimizer step, taken in order), so a resumed
    run degrades exactly as the uninterrupted one.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        cosine: float,
        direction: str,
        draw: Callable[[int], torch.Generator],
    ) -> None:
        if direction not in CONTROL_DIRECTIONS:
            raise ValueError(f"control direction must be one of {CONTROL_DIRECTIONS}, got {direction!r}")
        self.params, self.cosine, self.direction, self.draw = list(params), cosine, direction, draw
        self.fixed = random_direction(self.params, draw(0)) if direction == "fixed" else None
        self._gen: torch.Generator | None = None

    def start_iteration(self, it: int) -> None:
        """Fresh directions: the optimizer steps of iteration ``it`` draw theirs from draw 1 + it."""
        if self.direction == "fresh":
            if not 0 <= it < MAX_FRESH_ITERATIONS:
                raise ValueError(f"fresh control directions hold {MAX_FRESH_ITERATIONS} iterations, got {it}")
            self._gen = self.draw(1 + it)

    def apply(self) -> tuple[float, float]:
        """Degrade the gradients in place (``degrade_gradients``); returns its (a, b)."""
        if self.fixed is None and self._gen is None:
            raise RuntimeError("PositiveControl.start_iteration must run before a fresh direction is drawn")
        direction = self.fixed if self.fixed is not None else random_direction(self.params, self._gen)
        return degrade_gradients(self.params, direction, self.cosine)


def random_direction(params: Sequence[torch.nn.Parameter], gen: torch.Generator) -> list[Tensor]:
    """One standard-normal direction per parameter, in ``params`` order, from ``gen`` (CPU, float32).

    Drawn at each parameter's full shape on every rank and, for a sharded (DTensor) parameter, cut to this
    rank's shard, so the direction depends only on the generator's seed (a resumed run draws the same one).
    """
    out = []
    for p in params:
        full = torch.randn(tuple(p.shape), generator=gen, dtype=torch.float32)
        if hasattr(p, "device_mesh"):  # FSDP2: this rank's shard of the full draw
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full.to(p.to_local().device), p.device_mesh, p.placements).to_local()
        else:
            full = full.to(p.device)
        out.append(full)
    return out


def mix_coefficients(dot_gu: float, norm2_g: float, norm2_u: float, cosine: float) -> tuple[float, float]:
    """(a, b) with a * g + b * u = cos * g + sin * |g| * u_perp (formula in the module docstring).

    From the three global sums <g, u>, |g|^2, |u|^2. (1, 0) when g = 0 (nothing to degrade) or u is parallel
    to g (no orthogonal part to mix in).
    """
    if not 0 < cosine <= 1:
        raise ValueError(f"control cosine must be in (0, 1], got {cosine!r}")
    perp2 = norm2_u - dot_gu * dot_gu / norm2_g if norm2_g > 0 else 0.0
    if norm2_g <= 0 or perp2 <= 1e-12 * norm2_u:
        return 1.0, 0.0
    b = math.sqrt(1 - cosine * cosine) * math.sqrt(norm2_g) / math.sqrt(perp2)
    return cosine - b * dot_gu / norm2_g, b


@torch.no_grad()
def degrade_gradients(
    params: Sequence[torch.nn.Parameter], direction: Sequence[Tensor], cosine: float
) -> tuple[float, float]:
    """Replace every ``.grad`` of ``params`` in place by the degraded one (module docstring); returns (a, b).

    One ``direction`` tensor per parameter (``random_direction``); a missing gradient counts as zero. Under
    FSDP2 the gradients are DTensors and the sums are all-reduced. The coefficients come from float64 sums;
    the update is applied in the gradients' dtype.
    """
    if len(params) != len(direction):
        raise ValueError(f"{len(params)} parameters but {len(direction)} direction tensors")
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sharded = any(hasattr(g, "to_local") for g in grads)
    g64 = [g.detach().double().flatten() for g in local]
    u64 = [u.double().flatten() for u in direction]
    dot_gu, norm2_g, norm2_u, _ = sharded_sums(g64, u64, sharded)
    a, b = mix_coefficients(dot_gu, norm2_g, norm2_u, cosine)
    for g, u in zip(local, direction, strict=True):
        g.mul_(a).add_(u.to(device=g.device, dtype=g.dtype), alpha=b)
    return a, b


# --------------------------------------------------------------------------- structured controls
# Errors with JAGG's kind of structure, on the exact gradient's own steps, each with a dial (0: exact):
#   reweight          every trained step's signal scaled by a random positive weight per sample,
#                     w = exp(dial * e - dial^2 / 2), e ~ N(0, 1): mean 1, log-spread ``dial``
#   toward_endpoints  the aggregation matrix moved from exact's identity toward the endpoints rule's:
#                     (1 - dial) I + dial M, M the endpoints ablation's (T, K) block matrix on the same groups;
#                     dial 1 is the endpoints ablation itself
STRUCTURED_CONTROLS = ("reweight", "toward_endpoints")


def reweighted(num_steps: int, batch: int, dial: float, gen: torch.Generator) -> Interpolation:
    """Exact's plan with every step's signal scaled per sample by ``exp(dial e - dial^2 / 2)``."""
    e = torch.randn(num_steps, batch, generator=gen, dtype=torch.float64)
    weights = torch.zeros(num_steps, num_steps, batch, dtype=torch.float64)
    weights[range(num_steps), range(num_steps)] = torch.exp(dial * e - dial**2 / 2)
    return Interpolation(tuple(range(num_steps)), weights, tuple((k,) for k in range(num_steps)), "reweight")


def toward(rule: Interpolation, dial: float) -> Interpolation:
    """The plan ``(1 - dial) I + dial M`` over every step as a knot, M = ``rule``'s matrix with its knot
    columns placed at their steps: exact at 0, ``rule`` at 1 (returned as is, so dropped steps need no
    forward)."""
    if dial >= 1:
        return rule
    t = rule.num_steps
    tail = rule.weights.shape[2:]
    full = torch.zeros(t, t, *tail, dtype=torch.float64)
    full[:, list(rule.knots)] = rule.weights
    eye = torch.eye(t, dtype=torch.float64).view(t, t, *([1] * len(tail)))
    weights = (1 - dial) * eye + dial * full
    return Interpolation(tuple(range(t)), weights, tuple((k,) for k in range(t)), f"toward_{rule.name}")
