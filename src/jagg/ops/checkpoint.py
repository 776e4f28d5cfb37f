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

Verified: after writing, ``manifest.json`` records every file's size and SHA-256 (each rank hashes its
share of the files, in parallel: a shard is hashed right after it is written, from the page cache); loading
checks every size and, again split over the ranks, every hash before reading anything, and a mismatch is a
``CheckpointError`` naming the file (the CLI prints it as one line, exit 2). A checkpoint without its manifest,
or with a file the manifest does not list, is refused: deleting the manifest must not switch verification
off. One without ``.metadata`` or ``progress.pt`` is incomplete, an error as well (not "no checkpoint").
``log.keep_checkpoints: 2`` keeps the previous checkpoint as
``checkpoint.prev/`` (removed when the next save starts, so a save never needs more than two copies on
disk); resuming falls back to it automatically, with a warning, when the newest one fails verification (the
lost iterations are redone exactly: iteration ``it`` depends only on the seed and the restored state).

Disk space: a save writes the new checkpoint while the previous one is still on disk (that is what makes it
atomic), so it needs one more checkpoint's worth of free space, more than its tensors' bytes; it checks that
before it writes anything. A write that fails (full disk or quota, a file past the file-size limit of
``ulimit -f``, any I/O error), on any rank, sync or async, is one ``CheckpointError`` on every rank naming the
file and the reason (the errno's text and name: ENOSPC, EFBIG, ...; a full disk adds the free and the needed
space; torch's zip writer may drop the errno of a write past the size limit, and a file that reached the limit
is then named as EFBIG all the same). The partial ``checkpoint.tmp/`` is removed, the previous checkpoint stays,
and the next run start removes a ``checkpoint.tmp/`` a kill left.

The optimizer is saved once it has stepped (its state exists); saving before that writes the weights only,
because building an AdamW state dict of a fresh optimizer would take a zero step and change the live run.

Asynchronous saves (``log.async_checkpoint``; ``CheckpointWriter``): ``start_checkpoint`` copies the state to
CPU memory (DCP's ``async_save`` stages before it returns) and captures progress.pt's contents (metrics, RNG
states) before returning, so training goes on while a background thread writes the shards, then progress.pt,
and hashes this rank's files. Nothing of it is visible until ``PendingCheckpoint.finish`` (a collective): it
waits for every rank's write, writes the manifest and swaps the directory in exactly as a synchronous save does
(``save_checkpoint`` is ``start_checkpoint(...).finish()``), so at any instant ``find_checkpoint`` sees only
finished, verified saves. It runs as soon as the save is written: ``CheckpointWriter.poll``, at every iteration
boundary (the CLI calls it in ``fit``'s progress callback), asks every rank whether its write is done (one
all-reduce of a 0/1 flag while a save is in flight; nothing on one process) and finishes the save at the first
boundary where all are; the next save, the end of ``fit``, an abort or a resume finish one still in flight by
waiting for it. So a preemption loses at most the iterations since the last save whose write had finished, not
those since the save before it. A kill during the write leaves ``checkpoint.tmp/``, which the next start
removes unless the write had finished: a complete save found there (DCP's ``.metadata``, every shard it lists
at full length, a readable progress.pt; ``promote_interrupted_save``) is given its manifest and swapped in on
``--resume``, never deleted. Under torchrun DCP's collectives in the background run on a gloo group of their
own (timeout ``train.dist_timeout_s``), never interleaved with the training's; the poll's all-reduce runs on the
training's group for that reason.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from jagg.distributed import DistInfo
from jagg.errors import CheckpointError

CHECKPOINT = "checkpoint"  # directory under log.run_dir
PROGRESS = "progress.pt"
MANIFEST = "manifest.json"  # {"checksum": "sha256", "files": {name: {"bytes": n, "sha256": hex}}}


@dataclass
class Progress:
    """What a checkpoint restores besides the weights and the optimizer."""

    iteration: int
    consecutive_skips: int
    metrics: list[dict]
    ema: list[torch.Tensor] | None
    # each plug-in's own state by name (the trainer's list, the calibrator's under "calibration"; ``state_dict()``)
    plugins: dict[str, dict] = field(default_factory=dict)


# Before the plug-ins kept their own state, a checkpoint held the calibration in these progress.pt keys; a
# checkpoint written before the plug-ins' state was called ``plugins`` holds it as ``components``.
# ``legacy_plugins`` reads both, so that such a checkpoint still resumes.
LEGACY_CALIBRATION_KEYS = ("routing", "group_size", "placement", "windows")


def legacy_plugins(meta: dict) -> dict[str, dict]:
    """The plug-ins' state of a progress.pt: its ``plugins`` (``components`` before they were called so), or
    a checkpoint written before them (the calibration in ``LEGACY_CALIBRATION_KEYS``) as the calibrator's."""
    for key in ("plugins", "components"):
        if key in meta:
            return meta[key]
    old = {k: meta.get(k) for k in LEGACY_CALIBRATION_KEYS}
    return {"calibration": old} if any(v is not None for v in old.values()) else {}


def _single_process_ok() -> None:
    """DCP warns on every save / load without a process group; that is the intended world-size-1 mode. The
    filter stays (for this one message): an asynchronous save warns from its writer thread, after any
    ``catch_warnings`` block of the caller would have ended (and that is not thread-safe)."""
    warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT


def _missing(path: Path) -> list[str]:
    """The files every finished checkpoint holds that ``path`` lacks (DCP's ``.metadata``, ``progress.pt``)."""
    return [n for n in (".metadata", PROGRESS) if not (path / n).is_file()]


def checkpoint_candidates(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint directories, complete or not, newest first: ``checkpoint/``, a ``checkpoint.old/``
    left by a save interrupted between its two renames, the previous one kept by ``log.keep_checkpoints: 2``.
    (``checkpoint.tmp/`` is a save in progress or an interrupted one, never a checkpoint.)"""
    final = checkpoint_dir(run_dir)
    paths = (final, final.with_name(CHECKPOINT + ".old"), final.with_name(CHECKPOINT + ".prev"))
    return [p for p in paths if p.is_dir()]


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The run's newest complete checkpoint directory (``checkpoint_candidates``), or None."""
    return next((p for p in checkpoint_candidates(run_dir) if not _missing(p)), None)


def incomplete_message(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (one line with what to do), or None when it is."""
    missing = _missing(path)
    if not missing:
        return None
    return f"checkpoint {path} is incomplete ({' and '.join(missing)} missing); {_advice(path)}"


# --------------------------------------------------------------------------- verification
def file_digest(path: Path, chunk: int = 16 * 2**20) -> dict:
    """``{"bytes": size, "sha256": hex}`` of one file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _gather_dicts(part: dict, dist: DistInfo) -> dict:
    """The union of every rank's ``part`` (one ``all_gather_object``); ``part`` itself on one process."""
    if not dist.enabled:
        return dict(part)
    import torch.distributed

    parts: list = [None] * dist.world_size
    torch.distributed.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _digest_share(path: Path, names: list[str], dist: DistInfo) -> dict:
    """Digests of ``names`` in ``path``, each rank hashing every world_size-th one (``__<r>_0.distcp`` first,
    so after a save rank r hashes the shard it wrote); gathered on every rank."""
    mine = sorted(names, key=lambda n: (n.startswith("."), n))[dist.rank :: dist.world_size]
    return _gather_dicts({n: file_digest(path / n) for n in mine}, dist)


def _advice(path: Path) -> str:
    return (
        f"delete {path} to resume from an earlier checkpoint, if the run kept one (log.keep_checkpoints=2; the "
        "iterations since it are lost), or start again with --overwrite (every iteration is lost)"
    )


def _read_manifest(path: Path) -> dict:
    """The manifest's ``{name: {"bytes", "sha256"}}``; ``CheckpointError`` when it is missing or corrupt, or
    leaves out a file the checkpoint holds (verification cannot be skipped by deleting or editing it)."""
    if not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST}, so its files cannot be verified; {_advice(path)}"
        )
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint file {path / MANIFEST} is corrupt ({err}); {_advice(path)}"
        ) from None
    unlisted = sorted(p.name for p in path.iterdir() if p.name != MANIFEST and p.name not in files)
    if unlisted:
        raise CheckpointError(
            f"checkpoint file {path / unlisted[0]} is not in {path / MANIFEST}, so it cannot be verified; "
            + _advice(path)
        )
    return files


def verify_checkpoint(path: str | Path, dist: DistInfo) -> None:
    """Check every file of a checkpoint against its ``manifest.json`` (sizes, then SHA-256 split over the
    ranks; a collective). Raises ``CheckpointError`` naming the first bad file, or the missing manifest."""
    path = Path(path)
    if message := incomplete_message(path):
        raise CheckpointError(message)
    files = _read_manifest(path)
    for name, want in sorted(files.items()):
        f = path / name
        size = f.stat().st_size if f.is_file() else None
        if size != want["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise CheckpointError(
                f"checkpoint file {f} is truncated or corrupt ({found}, written with {want['bytes']} bytes); "
                + _advice(path)
            )
    got = _digest_share(path, list(files), dist)
    for name in sorted(files):
        if got[name]["sha256"] != files[name]["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path / name} is corrupt (SHA-256 differs from the one recorded when it "
                f"was written); {_advice(path)}"
            )


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


def format_bytes(n: float) -> str:
    """``512 B``, ``3.2 MiB``, ``1.50 GiB``: a size in a one-line message."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _tensor_bytes(tree) -> int:
    """Bytes of every tensor in a (nested) state dict held by this rank (a DTensor counts its local shard)."""
    total, stack = 0, [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            total += local.numel() * local.element_size()
    return total


def _space(directory: Path, state: dict, progress: Progress, dist: DistInfo) -> tuple[float, float, bool]:
    """(free bytes, bytes the save needs, short on any rank): the same answer on every rank (a collective).
    Needed: every rank's shards, plus progress.pt (its metrics rows and RNG states) and a 5% margin."""
    local = _tensor_bytes(state)
    extra = len(json.dumps(progress.metrics, default=str)) + 2**20 if dist.is_main else 0
    needed = dist.reduce_scalars({"b": 1.05 * (local + extra)}, op="sum")["b"]
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:  # the run directory may not exist yet
        existing = existing.parent
    free = float(shutil.disk_usage(existing).free)
    short = dist.reduce_scalars({"short": float(free < needed)}, op="max")["short"] > 0
    return free, needed, short


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: an OSError, a RuntimeError (torch's zip writer, which reports a failed
    ``write`` without its errno), or DCP's ``CheckpointException`` holding every rank's error (a
    ``BaseException``, not a ``RuntimeError``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (OSError, RuntimeError, CheckpointException)


def _os_error(err: BaseException | None, depth: int = 0) -> OSError | None:
    """The first OSError with an errno in ``err``, its causes or, for DCP's ``CheckpointException``, its ranks'
    failures (the zip writer's RuntimeError often carries the OSError it hit as its context)."""
    while err is not None and depth < 10:
        if isinstance(err, OSError) and err.errno:
            return err
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                if (found := _os_error(failure[0], depth + 1)) is not None:
                    return found
        err, depth = err.__cause__ or err.__context__, depth + 1
    return None


def _file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``, RLIMIT_FSIZE), None when unlimited."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


class WriteFailure(Exception):
    """A checkpoint file that could not be written: the file, the reason (one line), and whether the disk (or
    the quota) is full. ``PendingCheckpoint.finish`` turns it into one ``CheckpointError`` on every rank."""

    def __init__(self, path: str, reason: str, full: bool = False) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.full = path, reason, full

    @classmethod
    def of(cls, err: BaseException, path: Path) -> WriteFailure:
        """What ``err``, raised while writing ``path``, says: the errno's text and name (ENOSPC, EFBIG, ...)
        wherever in the error it is. Without one (torch's zip writer drops it), a file that reached the
        file-size limit is named as EFBIG; else the error's type and first line."""
        limit = _file_size_limit()
        found = _os_error(err)
        if found is not None:
            code = found.errno
            where = Path(found.filename) if isinstance(found.filename, str) else path
            reason = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
            if code == errno.EFBIG and limit is not None:
                reason += f": the file-size limit (ulimit -f) is {format_bytes(limit)}"
            return cls(str(where), reason, code in (errno.ENOSPC, errno.EDQUOT))
        if limit is not None and path.is_file() and path.stat().st_size >= limit:
            return cls(
                str(path),
                f"{os.strerror(errno.EFBIG)} (EFBIG): it reached the file-size limit "
                f"(ulimit -f) of {format_bytes(limit)}",
            )
        if isinstance(failures := getattr(err, "failures", None), dict) and failures:
            err = next(iter(failures.values()))[0]  # DCP: {rank: (exception, traceback)}
        first = (str(err).strip().splitlines() or [""])[0]
        return cls(str(path), f"{type(err).__name__}: {first}")


@contextmanager
def _writing(path: Callable[[BaseException], Path]):
    """Within the block a failed write ``err`` is a ``WriteFailure`` naming ``path(err)``, the file it wrote."""
    try:
        yield
    except _write_errors() as err:
        raise WriteFailure.of(err, path(err)) from err


def _shard_of(tmp: Path, err: BaseException, rank: int) -> Path:
    """The shard file a failed DCP write ``err`` was writing: that of the first rank DCP's error names (every
    rank raises it, holding each failed rank's error), else ``rank``'s; its largest ``__<rank>_<i>.distcp``."""
    failures = getattr(err, "failures", None)
    rank = min(failures) if isinstance(failures, dict) and failures else rank
    shards = sorted(tmp.glob(f"__{rank}_*.distcp"), key=lambda p: p.stat().st_size)
    return shards[-1] if shards else tmp / f"__{rank}_0.distcp"


def save_checkpoint(run_dir: str | Path, **kwargs) -> Path:
    """Atomically write ``run_dir/checkpoint/`` with its manifest (module docstring) and return it: a synchronous
    ``start_checkpoint(run_dir, **kwargs).finish()``. A collective: every rank calls it."""
    return start_checkpoint(run_dir, **kwargs).finish()


def start_checkpoint(
    run_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    config: dict,
    dist: DistInfo,
    keep: int = 1,
    asynchronous: bool = False,
    group=None,
) -> PendingCheckpoint:
    """Start a save of ``run_dir/checkpoint/`` (``keep=2`` keeps the previous one as ``checkpoint.prev/``) from a
    snapshot of the state taken before it returns; the shards are written here or, ``asynchronous``, by a
    background thread (DCP's collectives on ``group``, a gloo group, under torchrun). The result's ``finish()``
    makes it the run's checkpoint. A collective. ``CheckpointError`` when the disk has not the space it needs
    (checked first)."""
    final = checkpoint_dir(run_dir)
    tmp, prev = final.with_name(CHECKPOINT + ".tmp"), final.with_name(CHECKPOINT + ".prev")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        if keep < 2 or final.exists():  # the one before the newest goes (never the only complete one)
            shutil.rmtree(prev, ignore_errors=True)
    stepped = bool(optimizer.state)  # the same on every rank (steps are global decisions)
    state = _state(model, optimizer if stepped else None, progress.ema)
    free, needed, short = _space(final.parent, state, progress, dist)
    if short:
        raise CheckpointError(
            f"not enough disk space for checkpoint {final}: {format_bytes(free)} free on {final.parent}, "
            f"{format_bytes(needed)} needed (the previous checkpoint stays until the new one is complete); "
            "free some space and resume with --resume"
        )
    meta = _progress_meta(progress, config, stepped, dist) if dist.is_main else None
    written = _write(tmp, state, meta, dist, asynchronous=asynchronous, group=group)
    previous = prev if keep >= 2 else final.with_name(CHECKPOINT + ".old")
    return PendingCheckpoint(final=final, previous=previous, needed=needed, dist=dist, written=written)


def _progress_meta(progress: Progress, config: dict, stepped: bool, dist: DistInfo) -> dict:
    """progress.pt's contents, copied now: an asynchronous save writes them later, when the run has moved on."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    meta = {
        "iteration": progress.iteration,
        "consecutive_skips": progress.consecutive_skips,
        "metrics": progress.metrics,
        "plugins": progress.plugins,
        "rng": rng,
        "config": config,
        "optimizer_saved": stepped,
        "world_size": dist.world_size,
    }
    return copy.deepcopy(meta)


def _write(tmp: Path, state: dict, meta: dict | None, dist: DistInfo, *, asynchronous: bool, group) -> Future:
    """Every rank's shards into ``tmp``, then rank 0's progress.pt (``meta``); the future holds this rank's
    digests of the files it wrote, or the ``WriteFailure`` of a write that failed (full disk, file-size limit,
    I/O error), reported by ``PendingCheckpoint.finish`` on every rank. Asynchronous: ``async_save`` returns
    once ``state`` is copied to CPU memory, and a thread writes and hashes."""
    import torch.distributed.checkpoint as dcp

    def shard(err: BaseException) -> Path:
        return _shard_of(tmp, err, dist.rank)

    def then_progress_and_digests(upload: Future | None = None) -> dict:
        if upload is not None:
            with _writing(shard):
                upload.result()
        if meta is not None:
            with _writing(lambda _: tmp / PROGRESS):
                torch.save(meta, tmp / PROGRESS)
        return {n: file_digest(tmp / n) for n in _own_files(tmp, dist)}  # from the page cache

    done: Future = Future()
    if dist.is_main:
        tmp.mkdir(parents=True)
    dist.barrier()
    _single_process_ok()
    try:
        if asynchronous:
            upload = dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=group, no_dist=not dist.enabled
            )
            return _in_background(then_progress_and_digests, getattr(upload, "upload_completion", upload))
        with _writing(shard):
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.enabled)
        done.set_result(then_progress_and_digests())
    except WriteFailure as failure:
        done.set_exception(failure)  # PendingCheckpoint.finish reports it on every rank
    return done


def _in_background(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a thread of its own, which ends with it (interpreter exit waits for it)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="jagg-checkpoint")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


def _own_files(tmp: Path, dist: DistInfo) -> list[str]:
    """The files this rank wrote into ``tmp``: its DCP shards ``__<rank>_<i>.distcp``; rank 0 also DCP's
    ``.metadata`` and progress.pt. (``PendingCheckpoint.finish`` hashes anything else it finds.)"""
    names = sorted(p.name for p in tmp.glob(f"__{dist.rank}_*.distcp"))
    return names + ([".metadata", PROGRESS] if dist.is_main else [])


@dataclass
class PendingCheckpoint:
    """A started save (``start_checkpoint``): its state is a snapshot, its files may still be being written."""

    final: Path
    previous: Path  # where ``finish`` moves the current checkpoint: checkpoint.prev (kept) or checkpoint.old
    needed: float  # bytes the save needs (the disk-full message names them)
    dist: DistInfo
    written: Future = field(repr=False)  # this rank's {file: digest} once its files are on disk

    def finish(self) -> Path:
        """Wait for every rank's write, add the manifest and swap the directory in: from here on the save is the
        run's checkpoint. A collective. ``CheckpointError`` when a write failed on any rank."""
        dist, tmp = self.dist, self.final.with_name(CHECKPOINT + ".tmp")
        mine = self._unless_failed(self.written.result)  # waits for this rank's write
        digests = _gather_dicts(mine, dist)  # past it, every rank's files are on disk
        others = sorted(p.name for p in tmp.iterdir() if p.name not in digests)  # files DCP named otherwise
        digests |= _digest_share(tmp, others, dist)

        def manifest() -> None:
            with _writing(lambda _: tmp / MANIFEST):
                _write_manifest(tmp, digests, dist)

        self._unless_failed(manifest)
        if dist.is_main:
            _swap_in(tmp, self.final, self.previous)
        dist.barrier()
        return self.final

    def _unless_failed(self, step: Callable):
        """``step()``'s result; a ``WriteFailure`` on any rank (one reduction, so every rank decides alike)
        removes ``checkpoint.tmp/`` and is one ``CheckpointError`` on every rank, naming the first failed
        rank's file and reason (and, for a full disk, the free and the needed space)."""
        failure = None
        try:
            result = step()
        except WriteFailure as err:
            result, failure = None, err
        if self.dist.reduce_scalars({"failed": float(failure is not None)}, op="max")["failed"] == 0:
            return result  # rank 0 alone may have failed (progress.pt): every rank takes the same branch
        mine = (failure.path, failure.reason, failure.full) if failure is not None else None
        path, reason, full = next(
            f for _, f in sorted(_gather_dicts({self.dist.rank: mine}, self.dist).items()) if f
        )
        where = self.final.parent
        if self.dist.is_main:
            shutil.rmtree(self.final.with_name(CHECKPOINT + ".tmp"), ignore_errors=True)
        if full:
            free = format_bytes(shutil.disk_usage(where).free)
            raise CheckpointError(
                f"disk full while writing checkpoint {self.final}: {path}: {reason}; {free} free on {where}, "
                f"{format_bytes(self.needed)} needed; free some space and resume with --resume"
            )
        raise CheckpointError(
            f"writing checkpoint {self.final} failed: {path}: {reason}; the previous checkpoint stays; "
            "resume with --resume once that is fixed"
        )


def _write_manifest(tmp: Path, digests: dict, dist: DistInfo) -> None:
    if dist.is_main:
        manifest = {"checksum": "sha256", "files": dict(sorted(digests.items()))}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _swap_in(tmp: Path, final: Path, previous: Path) -> None:
    """``final`` -> ``previous`` (``.prev``, kept, or ``.old``, removed), then ``tmp`` -> ``final``."""
    old = final.with_name(CHECKPOINT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(previous)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    """A run's saves, one at a time. ``asynchronous`` (``log.async_checkpoint``): the newest may still be written
    in the background; ``poll`` at each iteration boundary finishes it as soon as every rank's write is done (and
    the next ``save``, or ``finish``, waits for it). Under torchrun an asynchronous writer makes a gloo group of
    its own for DCP's background collectives (so every rank constructs it), with ``timeout_s`` as its timeout
    (``train.dist_timeout_s``; torch's default for a gloo group is 30 minutes)."""

    def __init__(
        self, run_dir: str | Path, dist: DistInfo, *, keep: int, asynchronous: bool, timeout_s: float = 3600.0
    ) -> None:
        self.run_dir, self.dist, self.keep, self.asynchronous = Path(run_dir), dist, keep, asynchronous
        self.pending: PendingCheckpoint | None = None
        self.group = None
        if asynchronous and dist.enabled:
            from datetime import timedelta

            import torch.distributed

            self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def save(self, **state) -> None:
        """Finish the save in flight, then start one of ``state`` (``start_checkpoint``'s model, optimizer,
        progress, config); a synchronous writer finishes it at once. A collective."""
        self.finish()
        self.pending = start_checkpoint(
            self.run_dir,
            dist=self.dist,
            keep=self.keep,
            asynchronous=self.asynchronous,
            group=self.group,
            **state,
        )
        if not self.asynchronous:
            self.finish()

    def poll(self) -> Path | None:
        """At an iteration boundary: finish the save in flight if every rank's write is done, so that it is the
        run's checkpoint from now on, not only from the next save. Every rank calls it at the same boundaries
        (a save in flight is the same on every rank): under torchrun one all-reduce of a 0/1 flag while a save
        is in flight, on the training's group, not the writer's gloo group, whose collectives DCP's writer
        thread may be running at that moment; nothing on one process. Returns the checkpoint it finished, or
        None (none in flight, or a rank still writing)."""
        if self.pending is None:
            return None
        writing = not self.pending.written.done()
        if self.dist.enabled:
            writing = self.dist.reduce_scalars({"writing": float(writing)}, op="max")["writing"] > 0
        return None if writing else self.finish()

    def finish(self) -> Path | None:
        """Make the save in flight the run's checkpoint (waiting for its write; a collective); None if none is."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None

    @contextmanager
    def finishing(self):
        """Finish the save in flight when the block ends; after an exception only on one process: under torchrun
        another rank may be inside another collective (that save is lost: the previous checkpoint stays and the
        next start removes ``checkpoint.tmp/``)."""
        try:
            yield
        except BaseException:
            if not self.dist.enabled:
                self.finish()
            raise
        self.finish()


def _complete_save(tmp: Path) -> int:
    """The iteration of the save in ``tmp`` when every file of it is on disk: DCP's ``.metadata`` (written once
    every rank's shards are), each shard it lists at least as long as the data it places there, progress.pt
    readable. ``CheckpointError`` otherwise (or when a manifest there disagrees)."""
    from torch.distributed.checkpoint import FileSystemReader

    if missing := _missing(tmp):
        raise CheckpointError(f"{tmp}: {' and '.join(missing)} missing")
    metadata = _readable(tmp, lambda: FileSystemReader(str(tmp)).read_metadata())
    for info in (metadata.storage_data or {}).values():
        shard = tmp / info.relative_path
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            raise CheckpointError(f"{shard} is missing or shorter than its data")
    iteration = int(_readable(tmp, lambda: read_progress(tmp))["iteration"])
    if not (tmp / MANIFEST).is_file():
        _write_manifest(tmp, {p.name: file_digest(p) for p in sorted(tmp.iterdir())}, DistInfo())
    verify_checkpoint(tmp, DistInfo())
    return iteration


def promote_interrupted_save(run_dir: str | Path, *, keep: int = 1) -> int | None:
    """Make a complete save that a killed run left in ``checkpoint.tmp/`` the run's checkpoint (an asynchronous
    save becomes visible only at the iteration boundary after its write, so a kill may catch it written but not
    swapped in): it gets
    its manifest and is swapped in as ``PendingCheckpoint.finish`` would have. Returns its iteration, or None
    (nothing there, or incomplete: then the caller removes it as ``jagg.ops.rundir.clean_stale`` does; or not
    newer than the checkpoint in place). One process (rank 0), holding the run directory's lock."""
    final = checkpoint_dir(run_dir)
    tmp, prev = final.with_name(CHECKPOINT + ".tmp"), final.with_name(CHECKPOINT + ".prev")
    if not tmp.is_dir():
        return None
    try:
        iteration = _complete_save(tmp)
    except CheckpointError:
        return None
    current = find_checkpoint(run_dir)
    try:
        newer = (
            current is None
            or int(_readable(current, lambda: read_progress(current))["iteration"]) < iteration
        )
    except CheckpointError:  # the one in place cannot be read: the complete save replaces it
        newer = True
    if not newer:
        return None
    if keep < 2 or final.exists():  # as start_checkpoint: the one before the newest goes
        shutil.rmtree(prev, ignore_errors=True)
    _swap_in(tmp, final, prev if keep >= 2 else final.with_name(CHECKPOINT + ".old"))
    return iteration


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
    verify_checkpoint(path, dist)
    meta = _readable(path, lambda: read_progress(path))
    with_optim = meta["optimizer_saved"]
    state = _state(model, optimizer if with_optim else None, ema)
    _single_process_ok()
    _readable(path, lambda: dcp.load(state, checkpoint_id=str(path), no_dist=not dist.enabled))
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
        plugins=legacy_plugins(meta),
    )


def _readable(path: Path, read):
    """``read()``, with a failure to read the files (e.g. a reader's error the manifest could not foresee) as one
    ``CheckpointError`` naming the checkpoint and what to do, instead of a reader's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return read()
    except (CheckpointException, OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as err:
        if isinstance(err, CheckpointException) and err.failures:  # DCP: {rank: (exception, traceback)}
            err = next(iter(err.failures.values()))[0]
        first = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {first}); {_advice(path)}"
        ) from None


def resume_checkpoint(
    run_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: list[torch.Tensor] | None,
    dist: DistInfo,
) -> tuple[Progress, Path]:
    """``load_checkpoint`` of the newest checkpoint of ``run_dir`` that is complete and verifies; an older one
    (kept by ``log.keep_checkpoints: 2``) is used, with a warning, when a newer one is incomplete or fails.
    Raises the newest one's ``CheckpointError`` when none verifies, ``FileNotFoundError`` when there is none."""
    found = checkpoint_candidates(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint under {run_dir}")
    first: CheckpointError | None = None
    for path in found:
        try:
            progress = load_checkpoint(path, model=model, optimizer=optimizer, ema=ema, dist=dist)
        except CheckpointError as err:
            first = first or err
            continue
        if first is not None and dist.is_main:
            warnings.warn(
                f"{first}; resuming from {path} (iteration {progress.iteration}) instead", stacklevel=2
            )
        return progress, path
    raise first


def load_weights(path: str | Path, model: nn.Module, *, ema: bool = False) -> None:
    """Only the trainable weights of a checkpoint into ``model`` (sharded or not; every rank calls it):
    the EMA weights when ``ema`` (the checkpoint must hold them), else the trained ones. No optimizer."""
    import torch.distributed.checkpoint as dcp

    dist = DistInfo.current()
    verify_checkpoint(path, dist)
    params = dict(model.named_parameters())
    names = trainable_names(model)
    key = "ema" if ema else "model"
    state = {key: {n: params[n].detach() for n in names}}  # DCP loads into these views in place
    _single_process_ok()
    _readable(Path(path), lambda: dcp.load(state, checkpoint_id=str(path), no_dist=not dist.enabled))


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
    _single_process_ok()
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out
