"""Held-out evaluation: ODE samples from fixed noise, scored by every eval reward, with the EMA weights.

``evaluate`` samples this rank's share of the eval prompts with deterministic (ODE) steps, decodes them and
scores them with every eval reward; scores are gathered over ranks. The noise is the same at every evaluation
(``SeedStream.EVAL``, drawn by the caller), so the per-sample scores of two evaluations are paired
(``experiments/world_rl_report.py`` uses that). Multi-process: ``eval_shard`` gives every rank the same number
of rows, padded by repeating a real one, and a mask that drops the padding after the gather.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.distributed import DistInfo
from jagg.engine.sampling import sample_trajectory
from jagg.engine.strategies import Velocity
from jagg.models import Components, TextCond
from jagg.rewards import Reward

EVAL_BATCH = 32  # samples per ODE forward


@dataclass(frozen=True, kw_only=True)
class EvalShard:
    """This rank's eval rows: ``rows[i]`` indexes the global sample list; ``real[i]`` is False for padding."""

    rows: list[int]
    real: list[bool]


def eval_shard(n: int, dist: DistInfo) -> EvalShard:
    """This rank's share of ``n`` samples in contiguous blocks of ceil(n / world), padded to that length by
    repeating its last row (a rank with no real row repeats the last sample), so every rank runs the same
    number of (sharded) forwards."""
    if dist.world_size == 1:
        return EvalShard(rows=list(range(n)), real=[True] * n)
    per = math.ceil(n / dist.world_size)
    real = list(range(dist.rank * per, min(n, (dist.rank + 1) * per)))
    pad = real[-1] if real else n - 1
    return EvalShard(
        rows=real + [pad] * (per - len(real)), real=[True] * len(real) + [False] * (per - len(real))
    )


@contextmanager
def swapped_in(params: Sequence[torch.nn.Parameter], weights: Sequence[Tensor] | None) -> Iterator[None]:
    """Temporarily copy ``weights`` (e.g. the EMA) into ``params``; the trained values come back after.
    No-op when ``weights`` is None."""
    if weights is None:
        yield
        return
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


@torch.no_grad()
def evaluate(
    *,
    velocity: Callable[[TextCond], Velocity],
    components: Components,
    rewards: dict[str, Reward],
    prompts: list[str],
    noise: Tensor,
    sigmas: Tensor,
    dist: DistInfo,
) -> tuple[dict, Tensor, dict]:
    """ODE samples of ``prompts`` (global list) from ``noise`` (one row per prompt) on ``sigmas``, scored by
    every reward in ``rewards``.

    ``velocity(cond)`` gives the model's ``velocity(z, t)`` for a conditioning. Returns the metrics row
    (``eval_<name>_mean`` / ``_std``), this rank's images (padding dropped) and the per-sample scores
    ``{"prompts": [...], name: [...]}`` over the global list.
    """
    shard = eval_shard(len(prompts), dist)
    mine = [prompts[i] for i in shard.rows]
    noise = noise[shard.rows]
    cond = components.text_encoder.encode_prompts(mine)
    finals = [
        sample_trajectory(
            velocity(cond.select(slice(i, i + EVAL_BATCH))),
            noise[i : i + EVAL_BATCH],
            sigmas,
            ["ode"] * (len(sigmas) - 1),
        ).final
        for i in range(0, len(mine), EVAL_BATCH)
    ]
    images = components.decode(torch.cat(finals).float()).cpu()
    real = torch.tensor(shard.real)
    keep = dist.gather_cat(real.to(torch.int64)) == 1  # every rank's real rows, in rank order
    out, per_sample = {}, {"prompts": prompts}
    for name, fn in rewards.items():
        score = dist.gather_cat(fn(images, mine).float().cpu())[keep]
        out[f"eval_{name}_mean"] = score.mean().item()
        out[f"eval_{name}_std"] = score.std().item() if len(score) > 1 else 0.0
        per_sample[name] = score.tolist()
    return out, images[real], per_sample
