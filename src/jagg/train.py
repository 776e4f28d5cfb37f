"""Command line: ``python -m jagg.train --config configs/world/flux_dancegrpo.yaml [key=value ...]``.

    --resume        continue the run in log.run_dir from its checkpoint (log.run_dir/checkpoint/, sharded)
    --overwrite     replace an existing run directory
    --dry-run       validate the config and print the plan (steps, groups, passes, memory); no weights, no writes
    --export OUT    no training: write the weights of log.run_dir's checkpoint to OUT, a diffusers transformer
                    folder (full fine-tuning) or a peft / diffusers LoRA adapter (jagg.loop.export)
Invalid configs exit with status 2 and one line naming the key, before anything is written.

Multi-process (FSDP2): ``torchrun --standalone --nproc_per_node N -m jagg.train --config ...`` (gloo on CPU,
nccl on GPU). Every rank validates and builds; rank 0 alone writes run.json, metrics and grids; each rank
writes its own shards of a checkpoint. ``--export`` runs under torchrun too (any world size; rank 0 writes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from jagg.common import atomic_write_text, run_metadata, set_threads
from jagg.config import load_config, validate_world_size
from jagg.errors import ArtefactError, CheckpointError, ConfigError, WeightsUnavailableError


def _fail(msg: str, code: int = 2) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def _progress(total: int, start: int):
    """A tqdm bar (iterations, reward, s/it) on a TTY, a plain line per iteration otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, unit="it")

        def update(row: dict) -> None:
            bar.set_postfix(reward=f"{row['reward_mean']:.4f}", s_it=f"{row['time_iteration_s']:.1f}")
            bar.update(1)

        return update
    return lambda row: print(
        f"iter {row['iteration']}/{total} reward {row['reward_mean']:.4f} "
        f"({row['time_iteration_s']:.1f} s/it, {row['backward_passes']} backward passes)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jagg.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", help="YAML config (see configs/)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (offline, no weights)")
    ap.add_argument(
        "--export",
        metavar="OUT_DIR",
        help="no training: export the weights of log.run_dir's checkpoint to OUT_DIR and exit",
    )
    ap.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 1)),
        help="ranks assumed by --dry-run (default: $WORLD_SIZE or 1)",
    )
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args(argv)
    from jagg.loop.checkpoint import find_checkpoint
    from jagg.loop.components import build_components, check_config  # the registries: world, diffusers

    try:
        cfg = load_config(args.config, args.overrides)
        check_config(cfg)
        if args.dry_run:
            return _dry_run(cfg, args.world_size)
    except ConfigError as err:
        _fail(str(err))
    run_dir = Path(cfg.log.run_dir)
    ckpt = find_checkpoint(run_dir)
    if args.export:
        if args.resume or args.overwrite:
            _fail("--export does not train: drop --resume / --overwrite (train first, then export)")
        if ckpt is None:
            _fail(f"--export: missing checkpoint {run_dir / 'checkpoint'} (log.run_dir={cfg.log.run_dir})")
        return _export(cfg, Path(args.export))
    if args.resume and ckpt is None:
        _fail(f"--resume: missing checkpoint {run_dir / 'checkpoint'} (log.run_dir={cfg.log.run_dir})")
    if not args.resume and run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite:
        _fail(
            f"log.run_dir={cfg.log.run_dir} already exists; pass --resume to continue or --overwrite to replace"
        )

    set_threads(1)
    from jagg.loop.trainer import Trainer, TrainingAborted
    from jagg.scale.distributed import DistInfo, init_distributed

    init_distributed(timeout_s=cfg.train.dist_timeout_s)
    info = DistInfo.current()
    info.barrier()  # every rank has checked run_dir before rank 0 touches it
    try:
        validate_world_size(cfg, info.world_size)
        comp = build_components(cfg)
    except (ConfigError, ArtefactError, WeightsUnavailableError) as err:
        _fail(str(err))
    if info.is_main:
        if args.overwrite and not args.resume and run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        argv_used = sys.argv if argv is None else argv
        meta = run_metadata(
            config=cfg.to_dict(), seed=cfg.train.seed, argv=argv_used, world_size=info.world_size
        )
        atomic_write_text(run_dir / "run.json", json.dumps(meta, indent=2, default=str) + "\n")
    info.barrier()

    trainer = Trainer(cfg, comp, run_dir)
    if args.resume:
        try:
            trainer.load_checkpoint()
        except CheckpointError as err:  # the same on every rank; one line from rank 0
            if info.is_main:
                _fail(str(err))
            raise SystemExit(2) from None
    try:
        trainer.fit(progress=_progress(cfg.train.iterations, trainer.iteration) if info.is_main else None)
    except TrainingAborted as err:
        _fail(str(err), code=3)
    if info.is_main:
        print(f"done: {run_dir}/metrics.jsonl, {run_dir}/samples/, {trainer.checkpoint_path}/")
    del trainer, comp  # the sharded model and its gloo / NCCL work objects go before the process group
    _shutdown()
    return 0


def _export(cfg, out_dir: Path) -> int:
    """``--export``: the checkpoint's weights to ``out_dir`` (``jagg.loop.export.export_run``), no training."""
    set_threads(1)
    from jagg.loop.export import export_run
    from jagg.scale.distributed import DistInfo, init_distributed

    init_distributed(timeout_s=cfg.train.dist_timeout_s)
    try:
        out = export_run(cfg, out_dir)
    except (ConfigError, ArtefactError, WeightsUnavailableError, CheckpointError) as err:
        _fail(str(err))
    if DistInfo.current().is_main:
        print(f"exported: {out}")
    _shutdown()
    return 0


def _dry_run(cfg, world_size: int) -> int:
    """Validate against ``world_size`` and print the plan (``jagg.loop.plan``); no weights read, nothing written."""
    from jagg.loop.plan import build_plan

    if world_size < 1:
        _fail(f"--world-size must be >= 1, got {world_size}")
    validate_world_size(cfg, world_size)
    print(f"dry run: config valid; plan for world size {world_size}")
    print(build_plan(cfg, world_size))
    return 0


def _shutdown() -> None:
    """Ordered teardown: free the sharded model while the interpreter is alive (FSDP modules sit in reference
    cycles; collected at interpreter exit, a tensor held by a finished gloo work object is destroyed without a
    usable Python runtime and the process aborts), wait for every rank, then destroy the process group."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
