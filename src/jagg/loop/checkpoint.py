"""Checkpoint state of a run: trainable weights, optimizer, EMA, RNG states, counters and metrics.

The functions take the trainer's parts, not the trainer. Under FSDP2 the sharded parameters and optimizer
state are gathered to full tensors on save (a collective: every rank calls ``save_checkpoint``; rank 0
writes) and re-sharded like the live parameters on load, so a checkpoint does not depend on the world size.
Saving is atomic (temporary file, then rename). Restoring also restores the torch / Python / NumPy RNG
states, which makes a resumed run equal the uninterrupted one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from jagg.scale.distributed import (
    DistInfo,
    full_optimizer_state,
    full_tensor,
    load_full_optimizer_state,
    shard_like,
)


@dataclass
class Progress:
    """What a checkpoint restores besides the weights and the optimizer."""

    iteration: int
    consecutive_skips: int
    metrics: list[dict]
    ema: list[torch.Tensor] | None


def save_checkpoint(
    path: Path,
    *,
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    config: dict,
    dist: DistInfo,
) -> None:
    """Atomically write ``path``; sharded tensors are gathered to full ones first (every rank calls this)."""
    dist_on, ema = dist.enabled, progress.ema
    state = {
        "iteration": progress.iteration,
        "trainable": [full_tensor(p.detach()).cpu() for p in params],
        "optimizer": full_optimizer_state(optimizer) if dist_on else optimizer.state_dict(),
        "ema": [full_tensor(e).cpu() for e in ema] if dist_on and ema else ema,
        "consecutive_skips": progress.consecutive_skips,
        "metrics": progress.metrics,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        "config": config,
    }
    if dist.is_main:
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        tmp.replace(path)
    dist.barrier()


def load_checkpoint(
    path: Path, *, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, dist: DistInfo
) -> Progress:
    """Copy the saved weights into ``params`` (sharded like them), load the optimizer, restore the RNG
    states; returns the saved progress (EMA tensors sharded like ``params``)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    with torch.no_grad():
        for p, saved in zip(params, state["trainable"], strict=True):
            p.copy_(shard_like(saved, p))
    if dist.enabled:
        load_full_optimizer_state(optimizer, params, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    ema = state["ema"]
    progress = Progress(
        iteration=state["iteration"],
        consecutive_skips=state["consecutive_skips"],
        metrics=state["metrics"],
        ema=[shard_like(e, p) for e, p in zip(ema, params)] if ema is not None else None,
    )
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return progress
