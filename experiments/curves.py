"""Reward curves: GRPO training with exact, JAGG and the two ablations over several seeds.

Each (strategy, seed) is one ``python -m jagg.train`` run of the same config (runs go two at a time, one
torch thread each, on 2 cores; a finished run is reused, an interrupted one resumed). The per-iteration
metrics are collected into ``results/curves/<strategy>_seed<k>.csv`` and summarised: training reward and
held-out rewards (pref, clip, attr) vs iteration and vs wall-clock, mean and spread over seeds.

    python experiments/curves.py [--config configs/world/flux_dancegrpo.yaml] [--seeds 3] [--quick]
    -> results/curves/*.csv, results/curves/summary.md, paper_figures/reward_curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jagg.common import (
    atomic_write_text,
    command_line,
    markdown_table,
    run_metadata,
    set_threads,
    write_table,
)

STRATEGIES = ("exact", "jagg", "endpoints", "uniform")
QUICK = [
    "train.iterations=4",
    "log.eval_every=2",
    "log.checkpoint_every=2",
    "log.eval_prompts=8",
    "train.prompts_per_iter=2",
    "train.images_per_prompt=4",
    "train.train_batch_size=8",
]


def run_one(config: str, strategy: str, seed: int, runs: Path, extra: list[str]) -> Path:
    """Train one (strategy, seed); reuse a finished run, resume an interrupted one."""
    run_dir = runs / f"{strategy}_seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "jagg.train",
        "--config",
        config,
        f"backward.strategy={strategy}",
        f"train.seed={seed}",
        f"log.run_dir={run_dir}",
        *extra,
    ]
    ckpt = run_dir / "checkpoint.pt"
    if (run_dir / "done").is_file():
        return run_dir
    cmd.append("--resume" if ckpt.is_file() else "--overwrite")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    (run_dir / "done").write_text("ok\n")
    return run_dir


def collect(run_dir: Path, strategy: str, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clock = 0.0
    for r in rows:
        clock += r.get("time_iteration_s", 0.0)
        r.update(strategy=strategy, seed=seed, wall_clock_s=clock)
    return rows


def summarise(df) -> str:
    ev = df.dropna(subset=["eval_pref_mean"]) if "eval_pref_mean" in df else df
    last = ev[ev.iteration == ev.iteration.max()]
    first = ev[ev.iteration == 0]
    cols = [c for c in ("eval_pref_mean", "eval_clip_mean", "eval_attr_mean", "eval_jpeg_mean") if c in df]
    agg = last.groupby("strategy")[cols].agg(["mean", "std"])
    agg.columns = [f"{a}_{b}" for a, b in agg.columns]
    agg = agg.reset_index()
    t = (
        df.dropna(subset=["time_iteration_s"])
        .groupby("strategy")[["time_iteration_s", "time_update_s"]]
        .median()
    )
    agg = agg.merge(t.reset_index(), on="strategy")
    base = first[cols].mean().to_frame("base (iteration 0)").T.reset_index(drop=True)
    return (
        f"Final held-out rewards at iteration {int(ev.iteration.max())} (mean and std over seeds "
        f"{sorted(int(k) for k in df.seed.unique())}), and median seconds per iteration:\n\n"
        + markdown_table(agg)
        + "\n\nBefore training (same noise, same prompts):\n\n"
        + markdown_table(base)
        + "\n"
    )


def plot(csv_dir: Path, png: Path) -> None:
    """Mean and min-max band over seeds, vs iteration and vs wall-clock, from results/curves/*.csv only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.concat([pd.read_csv(p) for p in sorted(csv_dir.glob("*_seed*.csv"))])
    metrics = [m for m in ("reward_mean", "eval_pref_mean", "eval_clip_mean", "eval_attr_mean") if m in df]
    fig, axes = plt.subplots(2, len(metrics), figsize=(3.6 * len(metrics), 6.2), squeeze=False)
    for col, m in enumerate(metrics):
        d = df.dropna(subset=[m])
        for strategy, e in d.groupby("strategy"):
            g = e.groupby("iteration")
            mean, lo, hi = g[m].mean(), g[m].min(), g[m].max()
            clock = g.wall_clock_s.mean()
            for row, x in ((0, mean.index), (1, clock.values)):
                ax = axes[row][col]
                ax.plot(x, mean.values, label=strategy, marker="o" if m != "reward_mean" else None, ms=3)
                ax.fill_between(x, lo.values, hi.values, alpha=0.15)
        axes[0][col].set(title=m, xlabel="iteration")
        axes[1][col].set(xlabel="wall-clock s (mean over seeds)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def render(csv_dir: Path, png: Path) -> None:
    """summary.md and the figure from results/curves/*.csv and their metadata only."""
    import pandas as pd

    csvs = sorted(csv_dir.glob("*_seed*.csv"))
    meta = json.loads(csvs[0].with_suffix(".meta.json").read_text())
    df = pd.concat([pd.read_csv(p) for p in csvs])
    md = (
        "# Reward curves\n\n"
        f"Hardware: {meta['hardware']}; git {meta['git_sha']}; config {meta['config']} {' '.join(meta['overrides'])}. "
        "Runs two at a time on 2 cores (wall-clock includes that contention).\n\n" + summarise(df)
    )
    atomic_write_text(csv_dir / "summary.md", md)
    plot(csv_dir, png)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/world/curves_flux_flowgrpo_fast.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--runs", default="runs/curves")
    ap.add_argument("--out", default=None, help="default results/curves (results/curves_quick with --quick)")
    ap.add_argument("--figure", default=None, help="default paper_figures/reward_curves[_quick].png")
    ap.add_argument("--quick", action="store_true", help="few iterations (QUICK=1)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    set_threads(1)  # this process only orchestrates; each run uses one thread
    extra = (QUICK if args.quick else []) + args.overrides
    suffix = "_quick" if args.quick else ""
    runs = Path(args.runs + suffix)
    args.out = args.out or f"results/curves{suffix}"
    args.figure = args.figure or f"paper_figures/reward_curves{suffix}.png"
    jobs = [(s, k) for k in range(args.seeds) for s in args.strategies]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda j: run_one(args.config, j[0], j[1], runs, extra), jobs))
    out = Path(args.out)
    meta = run_metadata(
        command=command_line("experiments/curves.py", argv),
        config=args.config,
        overrides=extra,
        seed=list(range(args.seeds)),
        run_json=json.loads((dirs[0] / "run.json").read_text())["config"],
    )
    for (strategy, seed), run_dir in zip(jobs, dirs, strict=True):
        write_table(collect(run_dir, strategy, seed), out / f"{strategy}_seed{seed}.csv", meta)
    render(out, Path(args.figure))
    print((out / "summary.md").read_text())
    print(f"wrote {out}/*.csv, {out}/summary.md, {args.figure}")


if __name__ == "__main__":
    main()
