"""Reward curves: GRPO training with exact, JAGG, auto routing and the two ablations over paired seeds.

Two world recipes (DanceGRPO and Flow-GRPO-Fast, ``RECIPES``) x five strategies (``STRATEGIES``) x seeds.
Each (recipe, strategy, seed) is one ``python -m jagg.train`` run; a seed fixes the prompts, the initial noise
and the SDE noise of the first rollout for every strategy, so the comparison with exact is paired by seed.
Runs go two at a time (one torch thread each, on 2 cores); a finished run is reused, an interrupted one
resumed. The per-iteration metrics land in ``results/curves/<recipe>/<strategy>_seed<k>.csv``; the analysis
reads only those files:

* per metric (held-out ``pref``, ``clip``, ``attr`` and the eval-only ``attr_judge``; the policy trains on
  ``pref`` and, in DanceGRPO, ``attr``), at the last evaluation and as the area under the curve (its mean
  level over the evaluations): the mean paired difference to exact with a 95% t interval over seeds;
* equivalence of ``jagg`` and ``auto`` to exact by two one-sided t-tests with the margin fixed before any run
  (``EQUIVALENCE_FRACTION`` of exact's mean gain over the base model, per metric and summary);
* a one-sided t-test of ``endpoints`` below exact;
* each strategy's gain over the base model for ``attr`` next to ``attr_judge`` (an attribute gain is claimed
  only where the eval-only judge confirms it), and the two judges' agreement on the generated samples;
* seconds per iteration and per update, and what the auto calibration cost next to what it saved.

    python experiments/curves.py [--recipes dancegrpo flowgrpo_fast] [--seeds 6] [--quick]
    -> results/curves/<recipe>/*.csv, results/curves/summary.md, paper_figures/reward_curves_<recipe>.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.stats import area_under_curve, one_sided_below, paired_interval, tost

RECIPES = {
    "dancegrpo": "configs/world/curves_flux_dancegrpo.yaml",
    "flowgrpo_fast": "configs/world/curves_flux_flowgrpo_fast.yaml",
}
# Strategy name -> config overrides. "jagg" is the paper's routing (jagg_frac 0.6 of base.yaml), "auto" the
# measured one (backward.jagg_frac=auto); both run in the engine's default mode (batched endpoints, stored
# rollout outputs), the fastest of the exact-equivalent implementations.
STRATEGIES = {
    "exact": ["backward.strategy=exact"],
    "jagg": ["backward.strategy=jagg"],
    "auto": ["backward.strategy=jagg", "backward.jagg_frac=auto"],
    "endpoints": ["backward.strategy=endpoints"],
    "uniform": ["backward.strategy=uniform"],
}
# Fixed before any run (committed with this driver): JAGG / auto count as equivalent to exact on a metric when
# the 90% interval of their paired difference lies within +- this fraction of exact's mean gain over the base
# model on that metric (TOST at alpha = 0.05).
EQUIVALENCE_FRACTION = 0.5
ALPHA = 0.05
METRICS = ("eval_pref_mean", "eval_clip_mean", "eval_attr_mean", "eval_attr_judge_mean", "eval_jpeg_mean")
QUICK = [
    "train.iterations=4",
    "log.eval_every=2",
    "log.checkpoint_every=2",
    "log.eval_prompts=8",
    "log.eval_images_per_prompt=2",
    "train.prompts_per_iter=2",
    "train.images_per_prompt=4",
    "train.train_batch_size=8",
    "train.grad_accum=1",
    "backward.calibrate_every=2",
]


# --------------------------------------------------------------------------- running
def run_one(config: str, strategy: str, seed: int, run_dir: Path, extra: list[str]) -> Path:
    """Train one (strategy, seed); reuse a finished run, resume an interrupted one."""
    cmd = [
        sys.executable,
        "-m",
        "jagg.train",
        "--config",
        config,
        *STRATEGIES[strategy],
        f"train.seed={seed}",
        f"log.run_dir={run_dir}",
        *extra,
    ]
    if (run_dir / "done").is_file():
        return run_dir
    cmd.append("--resume" if (run_dir / "checkpoint").is_dir() else "--overwrite")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    (run_dir / "done").write_text("ok\n")
    return run_dir


def collect(run_dir: Path, strategy: str, seed: int) -> list[dict]:
    """metrics.jsonl rows with strategy, seed, cumulative wall-clock, and the per-sample agreement of the two
    attribute judges at every evaluation (from ``samples/eval_*.json``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clock = 0.0
    for r in rows:
        clock += r.get("time_iteration_s", 0.0)
        r.update(strategy=strategy, seed=seed, wall_clock_s=clock)
        for key in ("calibration_cosines", "routing"):  # lists: keep them readable in a CSV cell
            if key in r:
                r[key] = json.dumps(r[key])
        per = run_dir / "samples" / f"eval_{r['iteration']:05d}.json"
        if per.is_file() and "eval_attr_judge_mean" in r:
            s = json.loads(per.read_text())
            a, j = s["attr"], s["attr_judge"]
            r["judges_agree"] = sum(x == y for x, y in zip(a, j, strict=True)) / len(a)
    return rows


# --------------------------------------------------------------------------- analysis (results/ only)
def load(recipe_dir: Path):
    import pandas as pd

    return pd.concat([pd.read_csv(p) for p in sorted(recipe_dir.glob("*_seed*.csv"))], ignore_index=True)


def per_run(df) -> dict:
    """{(strategy, seed): {metric: (last value, area under the curve)}} over the evaluation rows, and the
    base model's value per seed (iteration 0: the same model for every strategy; the evaluation noise is the
    seed's, so a gain over the base is paired by seed too)."""
    metrics = [m for m in METRICS if m in df]
    out: dict = {}
    for (strategy, seed), e in df.groupby(["strategy", "seed"]):
        ev = e.dropna(subset=[metrics[0]]).sort_values("iteration")
        out[(strategy, int(seed))] = {
            m: (float(ev[m].iloc[-1]), area_under_curve(ev.iteration, ev[m])) for m in metrics
        }
    base = df[df.iteration == 0].dropna(subset=[metrics[0]]).groupby("seed")[metrics].mean()
    return {"runs": out, "base": {int(k): row.to_dict() for k, row in base.iterrows()}, "metrics": metrics}


def gains(stats: dict, strategy: str, metric: str, k: int = 0) -> list[float]:
    """Per seed: the strategy's value (k = 0: end, 1: AUC) minus the base model's on that seed."""
    runs, base = stats["runs"], stats["base"]
    return [v[metric][k] - base[s][metric] for (st, s), v in sorted(runs.items()) if st == strategy]


def _diffs(runs: dict, strategy: str, metric: str, k: int) -> list[float]:
    seeds = sorted(s for st, s in runs if st == strategy and ("exact", s) in runs)
    return [runs[(strategy, s)][metric][k] - runs[("exact", s)][metric][k] for s in seeds]


def comparison_table(stats: dict, strategies: list[str]) -> list[str]:
    """Markdown: per metric and summary (end, AUC), each strategy's paired difference to exact with the
    95% interval, the TOST verdict (jagg, auto) or the one-sided p (endpoints)."""
    runs = stats["runs"]
    lines = [
        "| metric | summary | exact (mean) | gain over base | margin | strategy | paired diff to exact [95% CI] "
        "| test |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in stats["metrics"]:
        for k, summary in enumerate(("end", "AUC")):
            exact = [v[m][k] for (st, _), v in runs.items() if st == "exact"]
            mean_exact = sum(exact) / len(exact)
            exact_gains = gains(stats, "exact", m, k)
            gain = sum(exact_gains) / len(exact_gains)
            margin = EQUIVALENCE_FRACTION * gain
            for strategy in (s for s in strategies if s != "exact"):
                d = _diffs(runs, strategy, m, k)
                if len(d) < 2:
                    continue
                ci = paired_interval(d)
                if strategy in ("jagg", "auto"):
                    if margin > 0:
                        eq = tost(d, margin, ALPHA)
                        test = (
                            f"TOST p {eq.p:.3f}: {'equivalent' if eq.equivalent else 'not shown equivalent'}"
                        )
                    else:
                        test = "no margin (exact did not improve)"
                elif strategy == "endpoints":
                    test = f"one-sided p(below exact) {one_sided_below(d):.3f}"
                else:
                    test = "-"
                lines.append(
                    f"| {m[5:-5]} | {summary} | {mean_exact:.3f} | {gain:+.3f} | {margin:.3f} | {strategy} | "
                    f"{ci} | {test} |"
                )
    return lines


def judge_table(stats: dict, df, strategies: list[str]) -> list[str]:
    """Markdown: each strategy's gain over the base model at the last evaluation, attr vs attr_judge (95% CI
    over seeds), and how often the two judges agreed on the generated samples of the last evaluation."""
    names = [m for m in ("eval_attr_mean", "eval_attr_judge_mean") if m in stats["metrics"]]
    if len(names) < 2:
        return []
    last = df[df.iteration == df.iteration.max()]
    lines = [
        "| strategy | attr gain [95% CI] | attr_judge gain [95% CI] | judges agree (last eval) | verdict |",
        "|---|---|---|---|---|",
    ]
    for strategy in strategies:
        a, j = (paired_interval(gains(stats, strategy, m)) for m in names)
        agree = (
            last[last.strategy == strategy].judges_agree.mean() if "judges_agree" in last else float("nan")
        )
        if a.lo > 0 and j.lo > 0:
            verdict = "attribute gain, confirmed by the eval-only judge"
        elif a.lo > 0:
            verdict = "attr rose, NOT confirmed by the eval-only judge"
        elif j.lo > 0:
            verdict = "the eval-only judge saw a gain, the training classifier did not"
        else:
            verdict = "no attribute gain shown"
        lines.append(f"| {strategy} | {a} | {j} | {agree:.3f} | {verdict} |")
    return lines


def timing_table(df, strategies: list[str]) -> list[str]:
    """Markdown: median seconds per iteration and per update, the update's speed-up over exact (ratio of
    medians), total seconds per run, and for auto the calibration's total cost next to the update time it saved
    relative to exact."""
    import numpy as np

    lines = [
        "| strategy | s / iteration (median) | s / update (median) | update speed-up vs exact | run s (mean) "
        "| calibration s (mean total) | update s saved vs exact (mean total) |",
        "|---|---|---|---|---|---|---|",
    ]
    it = df.dropna(subset=["time_update_s"])
    per_seed = it.groupby(["strategy", "seed"])
    totals = per_seed.time_update_s.sum()
    med_exact = it[it.strategy == "exact"].time_update_s.median()
    for strategy in strategies:
        e = it[it.strategy == strategy]
        cal = (
            e.groupby("seed").time_calibrate_s.sum().mean()
            if "time_calibrate_s" in e and strategy == "auto"
            else 0
        )
        saved = np.mean([totals["exact"][s] - totals[strategy][s] for s in totals[strategy].index])
        lines.append(
            f"| {strategy} | {e.time_iteration_s.median():.3f} | {e.time_update_s.median():.3f} | "
            f"{med_exact / e.time_update_s.median():.2f}x | {e.groupby('seed').time_iteration_s.sum().mean():.0f} "
            f"| {cal:.1f} | {saved:.1f} |"
        )
    return lines


def routing_lines(df) -> list[str]:
    """What auto chose: the routing and cosines of every calibration, pooled over seeds."""
    if "routing" not in df:
        return []
    cal = df.dropna(subset=["routing"])
    cal = cal[cal.strategy == "auto"]
    if cal.empty:
        return []
    routes = cal.routing.value_counts()
    cos = [c for cell in cal.calibration_cosines for c in json.loads(cell)]
    return [
        f"auto routing ({len(cal)} calibrations over {cal.seed.nunique()} seeds): "
        + "; ".join(f"{r} x{n}" for r, n in routes.items())
        + f"; measured cosines min {min(cos):.4f}, median {sorted(cos)[len(cos) // 2]:.4f}.",
        "",
    ]


def recipe_section(name: str, recipe_dir: Path, df) -> str:
    meta = json.loads(next(iter(sorted(recipe_dir.glob("*.meta.json")))).read_text())
    strategies = [s for s in STRATEGIES if s in set(df.strategy)]
    stats = per_run(df)
    seeds = sorted(int(s) for s in df.seed.unique())
    last_it = int(df.dropna(subset=[stats["metrics"][0]]).iteration.max())
    base = ", ".join(
        f"{m[5:-5]} {sum(b[m] for b in stats['base'].values()) / len(stats['base']):.3f}"
        for m in stats["metrics"]
    )
    lines = [
        f"## {name}",
        "",
        f"Config `{meta['config']}` {' '.join(meta['overrides'])}; git {meta['git_sha']}; {meta['hardware']}; "
        f"torch {meta['versions']['torch']}; seeds {seeds} (paired: the same seeds for every strategy); "
        f"{last_it} iterations. Base model (iteration 0, mean over the seeds' evaluation noise): {base}.",
        "",
        "### Paired differences to exact",
        "",
        f"End = the last evaluation (iteration {last_it}); AUC = the mean level over all evaluations. Margin = "
        f"{EQUIVALENCE_FRACTION} x exact's mean gain over the base model (fixed before running). A 95% interval "
        "that contains 0 means no difference was detected, not that there is none.",
        "",
        *comparison_table(stats, strategies),
        "",
    ]
    judge = judge_table(stats, df, strategies)
    if judge:
        lines += [
            "### Attribute gain: training classifier (`attr`) vs eval-only judge (`attr_judge`)",
            "",
            "Gain over the base model at the last evaluation, 95% interval over seeds.",
            "",
            *judge,
            "",
        ]
    lines += [
        "### Time (wall-clock includes two runs sharing 2 cores)",
        "",
        *timing_table(df, strategies),
        "",
        *routing_lines(df),
    ]
    return "\n".join(lines)


def plot(name: str, df, png: Path) -> None:
    """Mean over seeds +- one standard error, vs iteration and vs wall-clock seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in ("reward_mean", *METRICS) if m in df]
    fig, axes = plt.subplots(2, len(metrics), figsize=(3.4 * len(metrics), 6.2), squeeze=False)
    for col, m in enumerate(metrics):
        d = df.dropna(subset=[m])
        for strategy in (s for s in STRATEGIES if s in set(d.strategy)):
            g = d[d.strategy == strategy].groupby("iteration")
            mean, se = g[m].mean(), g[m].sem().fillna(0)
            clock = g.wall_clock_s.mean()
            for row, x in ((0, mean.index), (1, clock.values)):
                ax = axes[row][col]
                ax.plot(x, mean.values, label=strategy, marker="o" if m != "reward_mean" else None, ms=3)
                ax.fill_between(x, (mean - se).values, (mean + se).values, alpha=0.15)
        axes[0][col].set(title=m.replace("_mean", "").replace("eval_", "held-out "), xlabel="iteration")
        axes[1][col].set(xlabel="wall-clock s (mean over seeds)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{name}: mean over seeds +- 1 SE", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=75)
    plt.close(fig)


def render(csv_dir: Path, figures: Path) -> None:
    """summary.md and one figure per recipe (``reward_curves_<recipe>.png``) from the CSVs alone."""
    recipes = sorted(p for p in csv_dir.iterdir() if p.is_dir() and any(p.glob("*_seed*.csv")))
    md = (
        "# Reward curves\n\n"
        "Generated by `make curves` (experiments/curves.py) from `results/curves/<recipe>/*.csv` alone. Every "
        "strategy is trained with the same seeds, so each run is paired with exact's run of the same seed (same "
        "prompts, initial noise, first rollout and evaluation noise); intervals and tests are Student-t over "
        "seeds. `jagg` = the paper's routing (W = 3, jagg_frac 0.6), `auto` = measured routing "
        "(`backward.jagg_frac: auto`, min_cosine 0.9), both in the default mode (batched endpoints + stored "
        "outputs); `endpoints` and `uniform` are the two ablations. `attr_judge` is the eval-only attribute "
        "judge, which no run trains on.\n\n"
    )
    frames = {r: load(r) for r in recipes}
    md += "\n".join(recipe_section(r.name, r, df) for r, df in frames.items())
    atomic_write_text(csv_dir / "summary.md", md)
    for r, df in frames.items():
        plot(r.name, df, figures / f"reward_curves_{r.name}.png")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--config", default=None, help="one custom recipe (named by the file's stem) instead")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--runs", default="runs/curves")
    ap.add_argument("--out", default=None, help="default results/curves (results/curves_quick with --quick)")
    ap.add_argument("--figures", default="paper_figures")
    ap.add_argument("--quick", action="store_true", help="a few iterations, two seeds (QUICK=1: a smoke run)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    set_threads(1)  # this process only orchestrates; each run uses one thread
    extra = (QUICK if args.quick else []) + args.overrides
    suffix = "_quick" if args.quick else ""
    seeds = min(args.seeds, 2) if args.quick else args.seeds
    if seeds < 2:
        raise SystemExit("--seeds must be >= 2: the comparisons are paired over seeds")
    recipes = {Path(args.config).stem: args.config} if args.config else {r: RECIPES[r] for r in args.recipes}
    runs, out = Path(args.runs + suffix), Path(args.out or f"results/curves{suffix}")
    jobs = [(r, s, k) for r in recipes for k in range(seeds) for s in args.strategies]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(
            pool.map(
                lambda j: run_one(recipes[j[0]], j[1], j[2], runs / j[0] / f"{j[1]}_seed{j[2]}", extra), jobs
            )
        )
    tmp = out.with_name(out.name + ".partial")  # written whole, then swapped in: no half-written results
    shutil.rmtree(tmp, ignore_errors=True)
    for r, config in recipes.items():
        first = next(d for (rr, _, _), d in zip(jobs, dirs, strict=True) if rr == r)
        meta = run_metadata(
            command=command_line("experiments/curves.py", argv),
            config=config,
            overrides=extra,
            seed=list(range(seeds)),
            run_json=json.loads((first / "run.json").read_text())["config"],
        )
        for (rr, strategy, seed), run_dir in zip(jobs, dirs, strict=True):
            if rr == r:
                write_table(collect(run_dir, strategy, seed), tmp / r / f"{strategy}_seed{seed}.csv", meta)
    figures = Path(args.figures) / ("quick" if args.quick else "")
    render(tmp, figures)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print((out / "summary.md").read_text())
    print(f"wrote {out}/<recipe>/*.csv, {out}/summary.md, {figures}/reward_curves_<recipe>.png")


if __name__ == "__main__":
    main()
