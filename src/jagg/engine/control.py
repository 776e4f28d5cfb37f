"""A positive control for the quality experiments: a gradient degraded by a set, systematic error.

At every optimizer step the exact gradient g (all trained parameters as one vector) is replaced by

    g' = cos * g + sin * |g| * u_perp,      u_perp = (u - (<u, g> / |g|^2) g) / |u - (<u, g> / |g|^2) g|

where u is ONE random direction over the trained parameters, drawn once per run (``fixed_direction``), and
sin = sqrt(1 - cos^2). Then |g'| = |g| and cos(g', g) = cos exactly: the error has the size of a gradient
whose cosine to the exact one is ``cos``, and because u is the same at every step it is a bias (as JAGG's
error is), not noise that Adam's moments would average away. ``experiments/curves.py`` runs it through the
same protocol as the strategies: a design that cannot detect it cannot support an equivalence claim.

Under FSDP2 the gradients are sharded DTensors: every dot product is a sum of local sums all-reduced across
the ranks (as in ``jagg.engine.diagnostics``), so no rank gathers a full gradient; the direction is drawn at
full size on every rank from the same generator and each rank keeps its shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from jagg.engine.diagnostics import _sharded_sums


def fixed_direction(params: Sequence[torch.nn.Parameter], gen: torch.Generator) -> list[Tensor]:
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

    One ``direction`` tensor per parameter (``fixed_direction``); a missing gradient counts as zero. Under
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
    dot_gu, norm2_g, norm2_u, _ = _sharded_sums(g64, u64, sharded)
    a, b = mix_coefficients(dot_gu, norm2_g, norm2_u, cosine)
    for g, u in zip(local, direction, strict=True):
        g.mul_(a).add_(u.to(device=g.device, dtype=g.dtype), alpha=b)
    return a, b
