"""Measurement (not a timed test): how long a checkpoint save blocks training, synchronous vs asynchronous
(``log.async_checkpoint``), side by side on random-init world backbones on the CPU, one process.

Each model (full fine-tuning: every weight trained, AdamW stepped once, an EMA copy) is saved ``--repeats``
times per mode, the modes interleaved (rotating order), each into its own run directory:

    sync   ``save_checkpoint``: the shards' write, progress.pt, hashing, manifest and swap all block
    async  ``start_checkpoint(asynchronous=True)`` blocks for the copy to CPU memory and the launch of the write
           (``block_at_save_s``); the write then runs in the background (``write_s``, from the start, untimed
           by the training, which would run meanwhile) and ``finish()`` at the next save blocks for the
           gather, manifest and swap (``block_at_finish_s``, measured after the write has ended)

Medians per model and mode go to the Markdown table. On a CPU the background write competes with training for
the same cores, so what async saves there is an upper bound; on CUDA (the ``auto`` default) it does not.

    python experiments/checkpoint_bench.py --out results/checkpoint_async.csv [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.distributed import DistInfo
from jagg.models import build_tiny_backbone
from jagg.ops.checkpoint import Progress, save_checkpoint, start_checkpoint
from jagg.scale.tiny_pipeline import MEDIUM_FLUX

# The world's tiny Flux (model.source=tiny, what the loop tests train) and a ~60M-parameter random-init Flux (the
# 2-rank checkpoint test's size).
SIZES = {
    "flux tiny": {},
    "flux 60M": MEDIUM_FLUX,
}


def trained_state(sizes: dict, seed: int) -> dict:
    """A random-init Flux backbone with an AdamW that has stepped once (moments exist) and an EMA copy."""
    model = build_tiny_backbone("flux", seed=seed, **sizes)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    ema = [p.detach().clone() for p in params]
    progress = Progress(iteration=1, consecutive_skips=0, metrics=[{"iteration": 1}], ema=ema)
    return dict(model=model, optimizer=optimizer, progress=progress, config={}, dist=DistInfo())


def save_once(mode: str, run_dir: Path, state: dict) -> dict:
    """One save of ``state`` in ``mode``: seconds blocked at the save, at the next save's finish, and written."""
    t0 = time.perf_counter()
    if mode == "sync":
        save_checkpoint(run_dir, **state)
        blocked = time.perf_counter() - t0
        return {"block_at_save_s": blocked, "block_at_finish_s": 0.0, "write_s": blocked}
    pending = start_checkpoint(run_dir, asynchronous=True, **state)
    t1 = time.perf_counter()
    pending.written.result()  # the background write (training would run here)
    t2 = time.perf_counter()
    pending.finish()
    return {"block_at_save_s": t1 - t0, "block_at_finish_s": time.perf_counter() - t2, "write_s": t2 - t0}


def bench(name: str, repeats: int, seed: int, root: Path) -> list[dict]:
    state = trained_state(SIZES[name], seed)
    n = sum(p.numel() for p in state["model"].parameters())
    modes, rows = ["sync", "async"], []
    for r in range(repeats):
        for mode in modes[r % 2 :] + modes[: r % 2]:  # rotating order
            timing = save_once(mode, root / name.replace(" ", "_") / mode, state)
            bytes_ = sum(
                f.stat().st_size for f in (root / name.replace(" ", "_") / mode / "checkpoint").iterdir()
            )
            timing["blocking_s"] = timing["block_at_save_s"] + timing["block_at_finish_s"]
            rows.append(
                {"model": name, "params": n, "checkpoint_bytes": bytes_, "mode": mode, "repeat": r, **timing}
            )
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Checkpoint save: training blocked, synchronous vs asynchronous (`log.async_checkpoint`)",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}. "
        f"Command: `{meta['command']}`. Medians of {meta['config']['repeats']} saves per mode (interleaved), one "
        "process, full fine-tuning (weights + AdamW moments + EMA), DCP with fsync, SHA-256 manifest.",
        "",
        "| model | params | checkpoint | sync: blocked s | async: blocked at save s | async: blocked at finish s "
        "| async: background write s | blocked async / sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        med = {
            (mode, key): statistics.median(r[key] for r in rows if r["model"] == name and r["mode"] == mode)
            for mode in ("sync", "async")
            for key in ("blocking_s", "block_at_save_s", "block_at_finish_s", "write_s")
        }
        first = next(r for r in rows if r["model"] == name)
        lines.append(
            f"| {name} | {first['params'] / 1e6:.2f}M | {first['checkpoint_bytes'] / 2**20:.1f} MiB "
            f"| {med['sync', 'blocking_s']:.3f} | {med['async', 'block_at_save_s']:.3f} "
            f"| {med['async', 'block_at_finish_s']:.3f} | {med['async', 'write_s']:.3f} "
            f"| {med['async', 'blocking_s'] / med['sync', 'blocking_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# What make bench-checkpoint rewrites:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/checkpoint_async*",)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/checkpoint_async.csv")
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dir", default=None, help="where the checkpoints are written (default: a temporary one)"
    )
    ap.add_argument("--quick", action="store_true", help="seconds-scale smoke run (tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.repeats = ["flux tiny"], 1
    set_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint_bench_"))
    try:
        rows = [row for name in args.models for row in bench(name, args.repeats, args.seed, root)]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    meta = run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/checkpoint_bench.py", argv),
        seed=args.seed,
        config=vars(args),
        sizes={k: SIZES[k] for k in args.models},
    )
    write_table(rows, args.out, meta)
    md = to_markdown(rows, meta)
    atomic_write_text(Path(args.out).with_suffix(".md"), md)
    print(md)


if __name__ == "__main__":
    main()
