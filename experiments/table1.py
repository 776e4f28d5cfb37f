"""Table 1: wall-clock per training iteration, exact vs JAGG vs the endpoints ablation, side by side.

For every backbone x algorithm, one trainer samples a rollout per iteration and then runs the update once per
strategy on that same rollout, the strategy order rotating between iterations (updates are applied in turn;
the cost of an update does not depend on the weights). Reported per strategy: median seconds per iteration and
per phase (sampling, reward, update; forward and backward inside the update), forward/backward passes per
sample, peak memory held by autograd for backward, the reduction vs exact, and the reduction predicted by pass
counting from the measured per-pass costs (forward with grad and backward from the exact update, forward
without grad from the rollout). A second table sweeps W and jagg_frac.

    python experiments/table1.py [--scale world|paper] [--iterations N] [--quick]
    -> results/table1.csv, results/table1.md, results/table1.tex, results/table1_sweep.csv
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import statistics
import time
from pathlib import Path

from jagg.common import (
    ProgressETA,
    SeedStream,
    atomic_write_text,
    command_line,
    run_metadata,
    set_threads,
    write_table,
)
from jagg.config import TINY_RUN, BackwardConfig, load_config
from jagg.engine.profiling import SavedActivationMeter
from jagg.engine.strategies import GroupCost, trajectory_cost
from jagg.loop.components import build_components
from jagg.loop.trainer import Trainer
from plotting import figure_footer, world_scale

SETUPS = [
    ("flux", "dancegrpo"),
    ("flux", "flowgrpo_fast"),
    ("qwenimage", "dancegrpo"),
    ("qwenimage", "flowgrpo_fast"),
]
# The paper (arXiv 2607.17572), Table 1: reduction of wall-clock per training step (DanceGRPO) / update phase
# (Flow-GRPO-Fast).
PAPER = {
    ("flux", "dancegrpo"): "-18.2% per step (279 s -> 228 s)",
    ("qwenimage", "dancegrpo"): "-17.3% per step (835 s -> 691 s)",
    ("flux", "flowgrpo_fast"): "-29.9% to -30.0% update phase",
    ("qwenimage", "flowgrpo_fast"): "-29.9% to -30.0% update phase",
}
# On the embedded world, mirror the paper's step structure (docs/references.md) so that the pass counts per
# sample match the paper's setups: DanceGRPO Flux trains 9 of 15 steps, Qwen-Image 11 of 19 (W = 3, jagg_frac
# 0.6 -> JAGG on the first 2 groups); Flow-GRPO-Fast trains a window of 3 (Flux) or 2 (Qwen-Image) steps.
# The batch is pinned so the timing does not move when the training recipes are re-tuned, and so are the
# paper's KL-free objective (no reference-model forwards, which no strategy can save) and no EMA.
WORLD_TIMING = {
    ("flux", "dancegrpo"): ["sampling.num_steps=16"],
    ("qwenimage", "dancegrpo"): ["sampling.num_steps=20"],
    ("flux", "flowgrpo_fast"): [
        "sampling.num_steps=6",
        "algorithm.sde_window_size=3",
        "algorithm.sde_window_range=[0, 3]",
    ],
    ("qwenimage", "flowgrpo_fast"): [
        "sampling.num_steps=10",
        "algorithm.sde_window_size=2",
        "algorithm.sde_window_range=[0, 4]",
    ],
}
WORLD_BATCH = [
    "train.prompts_per_iter=4",
    "train.images_per_prompt=8",
    "train.train_batch_size=16",
    "train.grad_accum=2",
    "backward.group_size=3",
    "backward.jagg_frac=0.6",
    "algorithm.kl_beta=0.0",
    "optim.ema_decay=0.0",
]
QUICK = [*TINY_RUN, "sampling.num_steps=6", "algorithm.sde_window_range=[0, 4]"]


def strategies_for(cfg, algo: str) -> list[BackwardConfig]:
    """Exact, the paper-literal JAGG (joint endpoints, every step forwarded), this repository's default
    (batched endpoints + stored rollout outputs), the other modes, the endpoints ablation; and for DanceGRPO
    the same JAGG pair at W = 4, the group size the paper's per-step numbers fit (see the README)."""
    w, f = cfg.backward.group_size, cfg.backward.jagg_frac
    rows = [
        BackwardConfig("exact", w, f),
        BackwardConfig("jagg", w, f, endpoints="joint", reuse_rollout=False),
        BackwardConfig("jagg", w, f, endpoints="batched", reuse_rollout=True),
        BackwardConfig("jagg", w, f, endpoints="batched", reuse_rollout=False),
        BackwardConfig("jagg", w, f, endpoints="sequential", reuse_rollout=True),
        BackwardConfig("endpoints", w, f, endpoints="batched", reuse_rollout=True),
    ]
    if algo == "dancegrpo":
        rows += [
            BackwardConfig("jagg", 4, f, endpoints="joint", reuse_rollout=False),
            BackwardConfig("jagg", 4, f, endpoints="batched", reuse_rollout=True),
        ]
    return rows


def time_strategies(
    trainer: Trainer, strategies: list[BackwardConfig], iterations: int, progress: ProgressETA | None = None
) -> dict[str, list[dict]]:
    """Per strategy, one row per iteration: rollout phases (shared) + that strategy's update; a ``progress``
    line after each iteration."""
    rows: dict[str, list[dict]] = {s_key(s): [] for s in strategies}
    trainer.update(trainer.rollout(0, SeedStream.WARMUP), strategies[0])  # warm-up, not recorded
    for it in range(iterations):
        ro = trainer.rollout(it)
        k = it % len(strategies)
        for s in strategies[k:] + strategies[:k]:
            t0 = time.perf_counter()
            upd = trainer.update(ro, s)
            upd["time_update_s"] = time.perf_counter() - t0
            rows[s_key(s)].append({**ro.timing, **upd, "n": len(ro.prompts), "T": ro.trained.shape[1]})
        if progress:
            cfg = trainer.cfg
            progress.step(f"{cfg.model.backbone} {cfg.algorithm.name} iteration {it + 1}/{iterations}")
    return rows


def s_key(s: BackwardConfig) -> str:
    frac = s.jagg_frac if isinstance(s.jagg_frac, str) else f"{s.jagg_frac:g}"  # a number or "auto"
    return f"{s.strategy}/W{s.group_size}/f{frac}/{mode_of(s)}"


def mode_of(s: BackwardConfig) -> str:
    """The endpoint mode ("-" for exact), with "+stored" when the rollout's outputs are reused."""
    return "-" if s.strategy == "exact" else s.endpoints + ("+stored" if s.reuse_rollout else "")


def update_cost(trainer: Trainer, s: BackwardConfig, row: dict) -> GroupCost:
    """The cost model's counts for one update (every micro-batch; stored outputs only before the first
    optimizer step), checked against what the update measured."""
    t = trainer.cfg.train
    n_micro = -(-row["n"] // t.train_batch_size)
    route = dict(strategy=s.strategy, group_size=s.group_size, jagg_frac=s.jagg_frac, endpoints=s.endpoints)
    costs = [
        trajectory_cost(row["T"], **route, reuse_outputs=s.reuse_rollout and k < t.grad_accum)
        for k in range(n_micro)
    ]
    total = functools.reduce(operator.add, costs)
    for k in ("forward_passes", "forward_passes_with_grad", "backward_passes", "backward_calls"):
        if getattr(total, k) != row[k]:
            raise AssertionError(
                f"{s_key(s)}: cost model {k}={getattr(total, k)} but the update did {row[k]}"
            )
    return total


def peak_activation_mb(trainer: Trainer, s: BackwardConfig) -> float:
    ro = trainer.rollout(0, SeedStream.MEMORY)
    with SavedActivationMeter() as meter:
        trainer.update(ro, s)
    return meter.peak_mb


def summarise(
    setup: tuple[str, str], trainer: Trainer, rows: dict[str, list[dict]], strategies
) -> list[dict]:
    """Medians per strategy, reductions vs exact, and the pass-counting prediction."""

    def med(key: str, k: str) -> float:
        return statistics.median(r[k] for r in rows[key])

    exact = s_key(strategies[0])
    r0 = rows[exact][0]
    default = (trainer.cfg.backward.group_size, trainer.cfg.backward.jagg_frac)
    n_roll_fwd = (len(trainer.sigmas) - 1) * -(-r0["n"] // trainer.cfg.train.train_batch_size)
    f_grad = med(exact, "time_forward_s") / r0["forward_passes"]
    bwd = med(exact, "time_backward_s") / r0["backward_passes"]
    f_nograd = med(exact, "time_sample_s") / n_roll_fwd
    other = med(exact, "time_update_s") - med(exact, "time_forward_s") - med(exact, "time_backward_s")
    rollout = med(exact, "time_sample_s") + med(exact, "time_reward_s")
    out = []
    for s in strategies:
        key, r = s_key(s), rows[s_key(s)][0]
        cost = update_cost(trainer, s, r)
        n_nograd = cost.forward_passes - cost.forward_passes_with_grad
        ideal_update = (
            other + cost.forward_passes_with_grad * f_grad + n_nograd * f_nograd + cost.backward_passes * bwd
        )
        upd, upd_exact = med(key, "time_update_s"), med(exact, "time_update_s")
        it_s = rollout + upd
        it_exact = rollout + upd_exact
        red_update, ideal_red_update = 1 - upd / upd_exact, 1 - ideal_update / upd_exact
        out.append(
            dict(
                backbone=setup[0],
                algorithm=setup[1],
                strategy=s.strategy,
                mode=mode_of(s),
                W=s.group_size,
                jagg_frac=s.jagg_frac,
                iter_s=it_s,
                sample_s=med(key, "time_sample_s"),
                reward_s=med(key, "time_reward_s"),
                update_s=upd,
                update_fwd_s=med(key, "time_forward_s"),
                update_bwd_s=med(key, "time_backward_s"),
                fwd_per_sample=r["forward_passes"] * trainer.cfg.train.train_batch_size / r["n"],
                bwd_per_sample=r["backward_passes"] * trainer.cfg.train.train_batch_size / r["n"],
                peak_activation_mb=peak_activation_mb(trainer, s),
                reduction_iter_pct=100 * (1 - it_s / it_exact),
                reduction_update_pct=100 * red_update,
                ideal_reduction_update_pct=100 * ideal_red_update,
                ideal_reduction_iter_pct=100 * (upd_exact - ideal_update) / it_exact,
                measured_over_ideal=(red_update / ideal_red_update) if ideal_red_update > 0 else float("nan"),
                paper=PAPER.get(setup, "")
                if s.strategy == "jagg" and mode_of(s) == "joint" and s.jagg_frac == default[1]
                else "",
                iterations=len(rows[key]),
            )
        )
    return out


def to_markdown(rows: list[dict], meta: dict) -> str:
    cols = [
        ("backbone", "{}"),
        ("algorithm", "{}"),
        ("strategy", "{}"),
        ("mode", "{}"),
        ("W", "{}"),
        ("jagg_frac", "{:g}"),
        ("iter_s", "{:.2f}"),
        ("sample_s", "{:.2f}"),
        ("reward_s", "{:.2f}"),
        ("update_s", "{:.2f}"),
        ("update_fwd_s", "{:.2f}"),
        ("update_bwd_s", "{:.2f}"),
        ("bwd_per_sample", "{:g}"),
        ("peak_activation_mb", "{:.1f}"),
        ("reduction_iter_pct", "{:+.1f}%"),
        ("reduction_update_pct", "{:+.1f}%"),
        ("ideal_reduction_update_pct", "{:+.1f}%"),
        ("paper", "{}"),
    ]
    lines = [
        "# Table 1: wall-clock per training iteration (medians; reductions vs exact, positive = faster)",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}, seed {meta['seed']}, "
        f"{meta['iterations']} timed iterations per setup, strategies interleaved on the same rollouts.",
        f"Command: `{meta['command']}`",
        "",
        "| " + " | ".join(c for c, _ in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) for c, f in cols) + " |")
    return "\n".join(lines) + "\n"


def to_latex(rows: list[dict]) -> str:
    body = [
        f"{r['backbone']} & {r['algorithm'].replace('_', '-')} & {r['strategy']} {r['mode']} W{r['W']} & {r['iter_s']:.2f} & "
        f"{r['update_s']:.2f} & {r['bwd_per_sample']:g} & {r['reduction_iter_pct']:+.1f}\\% & "
        f"{r['reduction_update_pct']:+.1f}\\% & {r['ideal_reduction_update_pct']:+.1f}\\% \\\\"
        for r in rows
    ]
    return (
        "\\begin{tabular}{lllrrrrrr}\n\\toprule\nbackbone & algorithm & strategy & s/iter & update s & bwd/sample & "
        "$\\Delta$iter & $\\Delta$update & ideal $\\Delta$update \\\\\n\\midrule\n"
        + "\n".join(body)
        + "\n\\bottomrule\n\\end{tabular}\n"
    )


def sweep_strategies(cfg) -> list[BackwardConfig]:
    ws = sorted({2, 3, 4, cfg.backward.group_size})
    return [BackwardConfig("exact", 2, 0.0)] + [BackwardConfig("jagg", w, f) for w in ws for f in (0.6, 1.0)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="world", choices=["world", "paper"])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--sweep-iterations", type=int, default=3)
    ap.add_argument("--out", default="results/table1.csv")
    ap.add_argument("--figure", default="paper_figures/table1_update_reduction.png")
    ap.add_argument("--quick", action="store_true", help="tiny random-init models, seconds (tests)")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every setup")
    args = ap.parse_args(argv)
    set_threads(1)
    extra = (QUICK if args.quick else []) + args.overrides
    if args.quick:
        args.iterations, args.sweep_iterations = 2, 1
    rows, sweep_rows, cfg = [], [], None
    eta = ProgressETA(len(SETUPS) * args.iterations + args.sweep_iterations, "table1")
    for backbone, algo in SETUPS:
        timing = (
            WORLD_TIMING[(backbone, algo)] + WORLD_BATCH if args.scale == "world" and not args.quick else []
        )
        cfg = load_config(f"configs/{args.scale}/{backbone}_{algo}.yaml", timing + extra)
        trainer = Trainer(cfg, build_components(cfg), run_dir=Path("runs/table1"))
        strategies = strategies_for(cfg, algo)
        timed = time_strategies(trainer, strategies, args.iterations, eta)
        rows += summarise((backbone, algo), trainer, timed, strategies)
        print(to_markdown(rows[-len(strategies) :], _meta(args, argv, cfg)).split("\n", 6)[-1], flush=True)
        if (backbone, algo) == SETUPS[0]:
            sweep = sweep_strategies(cfg)
            timed = time_strategies(trainer, sweep, args.sweep_iterations, eta)
            sweep_rows += summarise((backbone, algo), trainer, timed, sweep)
    meta = _meta(args, argv, cfg)
    out = Path(args.out)
    write_table(rows, out, meta)
    write_table(sweep_rows, out.with_name("table1_sweep.csv"), meta)
    render(out, Path(args.figure))
    print(out.with_suffix(".md").read_text())
    print(
        f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.tex')}, {out.with_name('table1_sweep.csv')}"
    )


def render(csv: Path, png: Path) -> None:
    """Markdown, LaTeX and the figure from the CSVs and their metadata only (``make figures``)."""
    import pandas as pd

    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    rows = pd.read_csv(csv).fillna("").to_dict("records")
    sweep_csv = csv.with_name("table1_sweep.csv")
    md = to_markdown(rows, meta)
    if sweep_csv.is_file():
        sweep = pd.read_csv(sweep_csv).fillna("").to_dict("records")
        md += "\n## W / jagg_frac sweep (first setup)\n\n" + to_markdown(sweep, meta).split("\n", 5)[-1]
    atomic_write_text(csv.with_suffix(".md"), md)
    atomic_write_text(csv.with_suffix(".tex"), to_latex(rows))
    plot(rows, png, meta, csv.parent)


# What the paper's Table 1 reports per setup, and the CSV columns that measure the same quantity.
PAPER_METRIC = {
    "dancegrpo": ("per-iteration wall clock", "reduction_iter_pct", "ideal_reduction_iter_pct"),
    "flowgrpo_fast": ("update phase", "reduction_update_pct", "ideal_reduction_update_pct"),
}
PAPER_PCT = {  # the paper's reductions (PAPER), as numbers: (low, high)
    ("flux", "dancegrpo"): (18.2, 18.2),
    ("qwenimage", "dancegrpo"): (17.3, 17.3),
    ("flux", "flowgrpo_fast"): (29.9, 30.0),
    ("qwenimage", "flowgrpo_fast"): (29.9, 30.0),
}


def plot(rows: list[dict], png: Path, meta: dict | None = None, results: Path = Path("results")) -> None:
    """One panel per setup: the reduction vs exact that the paper reports for it (DanceGRPO: per-iteration
    wall clock; Flow-GRPO-Fast: update phase), measured and predicted by pass counting, per strategy and
    endpoint mode, with the paper's number as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = meta or {}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey=False)
    for ax, setup in zip(axes.flat, SETUPS, strict=True):
        what, measured, ideal = PAPER_METRIC[setup[1]]
        sub = [r for r in rows if (r["backbone"], r["algorithm"]) == setup and r["strategy"] != "exact"]
        labels = [f"{r['strategy']} W{r['W']}\n{r['mode'].replace('sequential', 'seq.')}" for r in sub]
        x = list(range(len(sub)))
        ax.bar([i - 0.2 for i in x], [r[measured] for r in sub], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [r[ideal] for r in sub], 0.4, label="ideal (pass counting)")
        lo, hi = PAPER_PCT[setup]
        paper = f"paper: -{lo}%" if lo == hi else f"paper: -{lo}% to -{hi}%"
        ax.axhspan(lo - 0.15, hi + 0.15, color="k", alpha=0.6)
        ax.text(0.0, hi + 0.6, f"{paper} (real model, GPUs)", transform=ax.get_yaxis_transform(), fontsize=7)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(f"{setup[0]} {setup[1]}: {what}", fontsize=10)
        ax.set_ylabel(f"{what} reduction vs exact (%)", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        if all(r[ideal] == 0 for r in sub):
            note = (
                "every group has at most 2 trained steps here (a window of 2):\n"
                "JAGG then needs 2 backward passes, as exact does: ideal saving 0%"
            )
            ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", fontsize=8)
    fig.suptitle(
        "Table 1: time saved by JAGG vs the exact per-step backward, per setup (the paper's metric each)"
    )
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.955), fontsize=8, ncol=2)
    scale = world_scale(results) + f", {meta.get('iterations', '?')} timed iterations per strategy"
    figure_footer(fig, meta, scale)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _meta(args, argv, cfg) -> dict:
    return run_metadata(
        command=command_line("experiments/table1.py", argv),
        seed=cfg.train.seed,
        iterations=args.iterations,
        config=cfg.to_dict(),
        scale=args.scale,
    )


if __name__ == "__main__":
    main()
