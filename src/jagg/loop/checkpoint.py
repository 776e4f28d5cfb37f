"""Checkpoint state of a run, sharded: trainable weights, optimizer, EMA (``torch.distributed.checkpoint``),
plus RNG states, counters and metrics.

Layout: ``run_dir/checkpoint/`` is a DCP directory (``.metadata`` + one ``__<rank>_0.distcp`` file per rank)
holding ``model.<name>`` (trainable parameters only: the adapters with LoRA, every weight in full
fine-tuning), ``optimizer.*`` (AdamW moments and steps, keyed by parameter name) and ``ema.<name>``, next to
``progress.pt`` (iteration, skips, metrics, the torch / Python / NumPy RNG states and the config; written by
rank 0). Under FSDP2 the state dicts come from ``get_state_dict`` with the default sharded options, so every
rank writes and reads only its own shards: nothing is gathered, no rank holds more than its shards. DCP
reshards on load, so a checkpoint does not depend on the world size (e.g. export it on one process). All
ranks write into one directory: ``log.run_dir`` must be on a filesystem every rank sees (as DCP requires).

One process needs no process group: DCP saves and loads without one (``no_dist``), so the same code and
format serve world size 1 (one ``.distcp`` file).

Saving is atomic: every rank writes into ``checkpoint.tmp/``; once all have finished, rank 0 adds
``progress.pt`` and swaps the directory in (``checkpoint`` -> ``checkpoint.old``, ``checkpoint.tmp`` ->
``checkpoint``, then removes ``checkpoint.old``); a crash at any point leaves a complete checkpoint under
``checkpoint/`` or, between the two renames, ``checkpoint.old/``, which ``find_checkpoint`` falls back to.
Restoring also restores the RNG states, which makes a resumed run equal the uninterrupted one.

The optimizer is saved once it has stepped (its state exists); saving before that writes the weights only,
because building an AdamW state dict of a fresh optimizer would take a zero step and change the live run.
"""

from __future__ import annotations

import random
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from jagg.distributed import DistInfo

CHECKPOINT = "checkpoint"  # directory under log.run_dir
PROGRESS = "progress.pt"


@dataclass
class Progress:
    """What a checkpoint restores besides the weights and the optimizer."""

    iteration: int
    consecutive_skips: int
    metrics: list[dict]
    ema: list[torch.Tensor] | None
    routing: list[bool] | None = None  # backward.jagg_frac=auto: the last calibrated routing
    group_size: int | None = None  # backward.group_size=auto: the last calibrated W


@contextmanager
def _single_process_ok():
    """DCP warns on every save / load without a process group; that is the intended world-size-1 mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT


def _complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / PROGRESS).is_file()


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The run's complete checkpoint directory (``checkpoint/``, else a ``checkpoint.old/`` left by a save
    interrupted between its two renames), or None."""
    final = checkpoint_dir(run_dir)
    for path in (final, final.with_name(CHECKPOINT + ".old")):
        if _complete(path):
            return path
    return None


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters, in ``model.parameters()`` order (the trainer's ``params``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kw)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ema: list[torch.Tensor] | None) -> dict:
    """The DCP state dict: sharded views of the live tensors (no copies), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
        state = {"model": model_sd, "optimizer": optim_sd}
    else:
        state = {"model": get_model_state_dict(model, options=_options())}
    if ema is not None:
        state["ema"] = dict(zip(trainable_names(model), ema, strict=True))
    return state


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    config: dict,
    dist: DistInfo,
) -> Path:
    """Atomically write ``run_dir/checkpoint/`` (module docstring); a collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint_dir(run_dir)
    tmp, old = final.with_name(CHECKPOINT + ".tmp"), final.with_name(CHECKPOINT + ".old")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    stepped = bool(optimizer.state)  # the same on every rank (steps are global decisions)
    state = _state(model, optimizer if stepped else None, progress.ema)
    with _single_process_ok():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.enabled)
    if dist.is_main:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        meta = {
            "iteration": progress.iteration,
            "consecutive_skips": progress.consecutive_skips,
            "metrics": progress.metrics,
            "routing": progress.routing,
            "group_size": progress.group_size,
            "rng": rng,
            "config": config,
            "optimizer_saved": stepped,
            "world_size": dist.world_size,
        }
        torch.save(meta, tmp / PROGRESS)
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def read_progress(path: str | Path) -> dict:
    """``progress.pt`` of a checkpoint directory (iteration, metrics, RNG states, config, ...)."""
    return torch.load(Path(path) / PROGRESS, map_location="cpu", weights_only=False)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: list[torch.Tensor] | None,
    dist: DistInfo,
) -> Progress:
    """Load the trainable weights and (when saved) the optimizer into the live, possibly sharded ``model`` /
    ``optimizer``, EMA into ``ema`` (the trainer's EMA tensors, laid out like the parameters), restore the RNG
    states; returns the saved progress. Every rank calls it and reads only its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    meta = read_progress(path)
    with_optim = meta["optimizer_saved"]
    state = _state(model, optimizer if with_optim else None, ema)
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.enabled)
    if with_optim:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_options(strict=False),
        )
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"], options=_options(strict=False))
    torch.set_rng_state(meta["rng"]["torch"])
    random.setstate(meta["rng"]["python"])
    np.random.set_state(meta["rng"]["numpy"])
    return Progress(
        iteration=meta["iteration"],
        consecutive_skips=meta["consecutive_skips"],
        metrics=meta["metrics"],
        ema=ema,
        routing=meta.get("routing"),
        group_size=meta.get("group_size"),
    )


def load_weights(path: str | Path, model: nn.Module, *, ema: bool = False) -> None:
    """Only the trainable weights of a checkpoint into ``model`` (sharded or not; every rank calls it):
    the EMA weights when ``ema`` (the checkpoint must hold them), else the trained ones. No optimizer."""
    import torch.distributed.checkpoint as dcp

    params = dict(model.named_parameters())
    names = trainable_names(model)
    key = "ema" if ema else "model"
    state = {key: {n: params[n].detach() for n in names}}  # DCP loads into these views in place
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path), no_dist=not DistInfo.current().enabled)


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as a full CPU tensor, keyed ``model.<name>``, ``ema.<name>``,
    ``optimizer.state.<name>.exp_avg``, ... (one process, no model needed: inspection and tests)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with _single_process_ok():
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out
