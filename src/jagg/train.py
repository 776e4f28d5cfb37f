"""Command line: ``python -m jagg.train --config configs/world/flux_dancegrpo.yaml [key=value ...]``.

    --resume     continue the run in log.run_dir from its checkpoint
    --overwrite  replace an existing run directory
Invalid configs exit with status 2 and one line naming the key, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from jagg.common import atomic_write_text, run_metadata, set_threads
from jagg.config import ConfigError, load_config


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
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        _fail(str(err))
    run_dir = Path(cfg.log.run_dir)
    ckpt = run_dir / "checkpoint.pt"
    if args.resume and not ckpt.is_file():
        _fail(f"--resume: missing checkpoint {ckpt} (log.run_dir={cfg.log.run_dir})")
    if not args.resume and run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite:
        _fail(
            f"log.run_dir={cfg.log.run_dir} already exists; pass --resume to continue or --overwrite to replace"
        )

    set_threads(1)
    from jagg.components import build_components
    from jagg.trainer import Trainer, TrainingAborted
    from jagg.world import ArtefactError

    try:
        comp = build_components(cfg)
    except (ConfigError, ArtefactError) as err:
        _fail(str(err))
    if args.overwrite and not args.resume and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(config=cfg.to_dict(), seed=cfg.train.seed, argv=sys.argv if argv is None else argv)
    atomic_write_text(run_dir / "run.json", json.dumps(meta, indent=2, default=str) + "\n")

    trainer = Trainer(cfg, comp, run_dir)
    if args.resume:
        trainer.load_checkpoint()
    try:
        trainer.fit(progress=_progress(cfg.train.iterations, trainer.iteration))
    except TrainingAborted as err:
        _fail(str(err), code=3)
    print(f"done: {run_dir}/metrics.jsonl, {run_dir}/samples/, {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
