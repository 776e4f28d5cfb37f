"""The equal-cost view of a recipe (issue 39: is every step worth training?): held-out reward against the
training wall-clock and against the backward passes spent, and the time each arm takes to reach a share of the
reference's final gain. Called by curves.py's summary for a recipe with an ``equal_cost`` block; reads the
CSVs that curves.py collects (``wall_clock_s``: cumulative training seconds; ``backward_passes``: per
iteration; ``eval_*``: the evaluations)."""

from __future__ import annotations

import math
from pathlib import Path

from plotting import figure_footer, save_figure

# the metrics drawn and tabled: the primary (held-out pref), the renderer's own geometry judge and the distance
# to the nearest clean render (no weights, never trained on; issue 56): a gain they show is not the policy
# reading its own reward back
METRICS = ("eval_pref_mean", "eval_attr_geom_mean", "eval_render_match_mean")
SHARE = 0.8  # time to reach this share of the reference's final gain (the 80%)


def budget_seconds(ec: dict) -> float:
    """The recipe's budget: ``budget_iterations`` of the budget arm at its recorded seconds per iteration."""
    return ec["budget_iterations"] * ec["seconds_per_iteration"][ec["budget_arm"]]


def evaluations(df, arm: str, metric: str, recorded: float | None = None):
    """One row per (seed, evaluation) of ``arm``: the metric, the training seconds measured (``train_seconds``),
    the backward passes spent up to it (the evaluation after iteration k has seen iterations 1..k) and
    ``budget``: the seconds at the arm's ``recorded`` pace (iteration x recorded seconds per iteration; the
    measured seconds where none is given). The budget clock is the design's: every arm ends at the budget and
    is evaluated at the same fractions of it, whatever other run shared the cores."""
    runs = df[df.strategy == arm].sort_values(["seed", "iteration"])
    train = runs.dropna(subset=["backward_passes"]) if "backward_passes" in runs else runs.iloc[:0]
    passes = train.groupby("seed").backward_passes.cumsum()
    seconds = train_seconds(train).groupby(train.seed).cumsum()
    out = runs.dropna(subset=[metric])[["seed", "iteration", metric]].copy()
    spent = {(int(s), int(i)): p for s, i, p in zip(train.seed, train.iteration, passes, strict=True)}
    clock = {(int(s), int(i)): c for s, i, c in zip(train.seed, train.iteration, seconds, strict=True)}
    out["passes"] = [spent.get((int(s), int(i)), 0.0) for s, i in zip(out.seed, out.iteration, strict=True)]
    out["seconds"] = [clock.get((int(s), int(i)), 0.0) for s, i in zip(out.seed, out.iteration, strict=True)]
    out["budget"] = out.iteration * recorded if recorded else out.seconds
    return out


# the measuring plug-ins' own seconds, logged inside an iteration's time (fidelity's and landing's shadow exact
# backward at their cadence): the same extra for every arm, which the budget (timed without them) leaves out
INSTRUMENT_SECONDS = ("time_fidelity_s", "time_landing_s")


def train_seconds(train):
    """Each training row's seconds without the instruments': ``time_iteration_s`` less ``INSTRUMENT_SECONDS``
    (the CSV's cumulative ``wall_clock_s`` differenced where the rows have no ``time_iteration_s``)."""
    if "time_iteration_s" not in train:
        return train.wall_clock_s.groupby(train.seed).diff().fillna(train.wall_clock_s)
    t = train.time_iteration_s.copy()
    for col in (c for c in INSTRUMENT_SECONDS if c in train):
        t = t - train[col].fillna(0.0)
    return t


def crossing(points: list[tuple[float, float]], target: float) -> float:
    """The first x at which the piecewise-linear curve of (x, y) points reaches ``target`` (y >= target),
    interpolated between evaluations; ``inf`` if it never does."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if y0 >= target:
            return x0
        if y1 >= target:
            return x0 + (target - y0) / (y1 - y0) * (x1 - x0)
    return points[-1][0] if points and points[-1][1] >= target else math.inf


def time_to_share(
    df, stats: dict, arm: str, metric: str, ref: str, recorded: float | None = None, share: float = SHARE
) -> dict[int, float]:
    """Per seed: the seconds on the budget clock (``evaluations``; ``recorded``: the arm's seconds per
    iteration) after which ``arm`` first reaches ``share`` of the reference's final gain over the base model
    on that seed (``inf``: not within its budget). Seeds where the reference gained nothing (no target) are
    left out."""
    ev, out = evaluations(df, arm, metric, recorded), {}
    for seed, e in ev.groupby("seed"):
        base, final = stats["base"].get(int(seed), {}).get(metric), stats["runs"].get((ref, int(seed)))
        if base is None or final is None or final[metric][0] <= base:
            continue
        target = base + share * (final[metric][0] - base)
        out[int(seed)] = crossing(list(zip(e.budget, e[metric], strict=True)), target)
    return out


def median_time(times: dict[int, float]) -> str:
    """The median over seeds, in seconds, with how many seeds reached the target ("not reached" where the
    median did not)."""
    import numpy as np

    if not times:
        return "no target"
    med, hit = float(np.median(list(times.values()))), sum(math.isfinite(t) for t in times.values())
    return f"{med:.0f} s ({hit}/{len(times)})" if math.isfinite(med) else f"not reached ({hit}/{len(times)})"


def goal_lines(
    d: list[float], goal: dict, alpha: float, power: float, control: bool | None, pilot: bool = False
) -> list[str]:
    """The recipe's goal read as non-inferiority: ``goal['arm']`` reaches the reference's value within
    ``margin`` at the end of the budget (better counts: at equal cost a better arm meets the goal), from the
    paired differences ``d`` = arm - reference. One-sided t-test and sign-flip test of mean(d) > -margin, both
    required, as the contrasts; a claim only where the positive control is detected (``control``), and none
    from a ``pilot``, which sizes the test on other seeds."""
    from jagg.stats import one_sided_above, paired_interval

    m = goal["margin"]
    test = one_sided_above([x + m for x in d], alpha, power)  # mean(d) > -m; the shift leaves the SD as it is
    if pilot:
        reading = "the pilot's look (it sizes the test), NOT the test: no verdict"
    elif not test.passed:
        reading = "**not shown**"
    elif control:
        reading = "**reached** (non-inferior within the margin; the positive control is detected)"
    else:
        reading = "the tests pass, NO claim: the positive control is not detected"
    return [
        f"### Goal: {goal['arm']} within {m} of {goal['reference']}'s {goal['metric'][5:-5]} at the end of the "
        "budget (non-inferiority)",
        "",
        f"{goal['arm']} - {goal['reference']}: {paired_interval(d)} over {len(d)} seeds; one-sided tests of a "
        f"difference above -{m}: t-test p = {test.p_t:.4f}, sign-flip p = {test.p_flip:.4f}: {reading} at alpha "
        f"{alpha} (both tests must pass). Paired SD {test.sd:.3f}: {len(d)} seeds show non-inferiority with power "
        f"{power} where the true difference is at least {test.mdd - m:+.3f}.",
        "",
    ]


def section_lines(df, stats: dict, view: dict, ec: dict) -> list[str]:
    """The equal-cost table: per arm its iterations and recorded seconds per iteration (the design), the
    training seconds and backward passes it measured, its gain at the end of the budget and its time to
    ``SHARE`` of the reference's final gain on the budget clock, on each metric of ``METRICS``."""
    import numpy as np

    ref, secs = view.get("reference", "exact"), ec.get("seconds_per_iteration") or {}
    metrics = [m for m in METRICS if m in stats["metrics"]]
    arms = [a for a in view["arms"] if a in set(df.strategy)]
    if not metrics or not arms or not secs:
        return []
    head = " | ".join(
        f"{m[5:-5]} gain at the end | {m[5:-5]}: time to {SHARE:.0%} of {ref}'s gain" for m in metrics
    )
    lines = [
        "### Equal cost: what each arm bought with the budget",
        "",
        f"Budget: {ec['budget_iterations']} iterations of {ref} at its recorded {secs[ref]:.2f} s = "
        f"{budget_seconds(ec):.0f} s of training per run. Each arm trains the whole iterations that fit at its own "
        "recorded seconds per iteration (the timing run's median, in the protocol). Measured: the training "
        "seconds the runs logged, less the instruments' own (fidelity, landing) (median over seeds; two runs "
        "share the 2 cores, and which ones differs by arm, so they differ from the recorded ones) and the "
        f"backward passes they spent. Time to {SHARE:.0%}: the seconds on the budget clock (iterations x the "
        f"arm's recorded seconds per iteration) after which its held-out value first reaches {SHARE:.0%} of "
        f"{ref}'s final gain over the base model on the same seed (linear between evaluations), median over "
        "seeds (seeds that reached it / seeds).",
        "",
        f"| arm | iterations | s/iteration recorded | training s measured | backward passes | {head} |",
        "|---|---|---|---|---|" + "---|---|" * len(metrics),
    ]
    for arm in arms:
        ev = evaluations(df, arm, metrics[0])
        last = ev.sort_values("iteration").groupby("seed").tail(1)
        cells = []
        for m in metrics:
            g = [v[m][0] - stats["base"][s][m] for (a, s), v in stats["runs"].items() if a == arm]
            cells += [
                f"{np.mean(g):+.3f} (n {len(g)})" if g else "-",
                median_time(time_to_share(df, stats, arm, m, ref, secs.get(arm))),
            ]
        lines.append(
            f"| {arm} | {int(last.iteration.median())} | {secs.get(arm, float('nan')):.2f} | "
            f"{last.seconds.median():.0f} | {last.passes.median():.0f} | " + " | ".join(cells) + " |"
        )
    return lines + [""]


def plot(name: str, df, view: dict, png: Path, meta: dict, ec: dict | None = None) -> None:
    """Held-out reward gain over the base model (same seed) against the budget clock (``evaluations``;
    measured training seconds without ``ec``), against backward passes and against iterations (the
    per-iteration view: gain follows iterations, and a cheaper arm runs more of them), one curve per arm: the
    mean over seeds at each evaluation, the band +- one standard error across seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in METRICS if m in df]
    arms = [a for a in view["arms"] if a in set(df.strategy)]
    if not metrics or not arms:
        return
    secs = (ec or {}).get("seconds_per_iteration") or {}
    fig, axes = plt.subplots(len(metrics), 3, figsize=(15, 3.6 * len(metrics)), squeeze=False)
    colour = dict(zip(arms, plt.get_cmap("tab10" if len(arms) <= 10 else "tab20").colors, strict=False))
    for row, m in enumerate(metrics):
        for arm in arms:
            e = evaluations(df, arm, m, secs.get(arm))
            # the gain over the base model of the same seed: the seeds' evaluation noise is shared by every
            # arm, so the band shows how far the arms' gains spread, not how the seeds' prompts differ
            e["gain"] = e[m] - e.seed.map(e[e.iteration == 0].groupby("seed")[m].first())
            g = e.groupby("iteration")
            mean, se = g.gain.mean(), g.gain.sem().fillna(0)
            for col, x in enumerate((g.budget.mean(), g.passes.mean(), mean.index.to_series())):
                ax = axes[row][col]
                ax.plot(x.values, mean.values, marker="o", ms=3, color=colour[arm], label=arm)
                ax.fill_between(
                    x.values, (mean - se).values, (mean + se).values, alpha=0.15, color=colour[arm]
                )
        label = m.replace("_mean", "").replace("eval_", "held-out ") + " gain over the base"
        clock = (
            "wall-clock at each arm's recorded s/iteration" if secs else "training seconds (mean over seeds)"
        )
        axes[row][0].set(ylabel=label, xlabel=clock)
        axes[row][1].set(ylabel=label, xlabel="backward passes spent (mean over seeds)")
        axes[row][2].set(ylabel=label, xlabel="training iterations")
        if secs:
            axes[row][0].axvline(budget_seconds(ec), color="grey", lw=0.8, ls=":")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{name}: equal cost, mean over seeds +- 1 SE", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    figure_footer(fig, meta, f"world, seeds {sorted(int(k) for k in df.seed.unique())}")
    save_figure(fig, png, 75)


DRIFT = 0.15  # the amendment's default tolerance (issue 56): measured pace against the recorded one


def measured_pace(df, arm: str) -> float:
    """The arm's measured seconds per training iteration: each run's median (``train_seconds``: instruments
    left out), the median over its runs."""
    import numpy as np

    train = df[(df.strategy == arm)].dropna(subset=["backward_passes"])
    per_run = train_seconds(train).groupby(train.seed).median()
    return float(np.median(per_run)) if len(per_run) else math.nan


def value_at(df, arm: str, metric: str, iteration: float) -> dict[int, float]:
    """Per seed: the arm's ``metric`` at ``iteration`` on its evaluation curve (linear between evaluations;
    its last evaluation where the run ended before it)."""
    import numpy as np

    out = {}
    for seed, e in df[df.strategy == arm].dropna(subset=[metric]).sort_values("iteration").groupby("seed"):
        out[int(seed)] = float(np.interp(iteration, e.iteration, e[metric]))
    return out


def drift_rows(df, ec: dict, arms: list[str]) -> list[dict]:
    """Equal cost checked in measured seconds (issue 56): per arm its recorded and measured seconds per
    iteration, the drift, whether it exceeds ``drift_tolerance``, and the iterations its budget buys at the
    runs' own medians (``budget_iterations`` x the budget arm's measured median / the arm's). Arms of fixed
    length (``iterations``) are not at equal cost and get no recomputed budget."""
    tol, secs = ec.get("drift_tolerance", DRIFT), ec.get("seconds_per_iteration") or {}
    budget = ec["budget_iterations"] * measured_pace(df, ec["budget_arm"])
    rows = []
    for arm in arms:
        pace, fixed = measured_pace(df, arm), arm in (ec.get("iterations") or {})
        drift = pace / secs[arm] - 1 if arm in secs else math.nan
        trained = int(df[df.strategy == arm].iteration.max())
        rows.append(
            {
                "arm": arm,
                "recorded_s": secs.get(arm, math.nan),
                "measured_s": pace,
                "drift": drift,
                "flagged": bool(abs(drift) > tol) if math.isfinite(drift) else False,
                "iterations": trained,
                "iterations_measured": None if fixed or not math.isfinite(pace) else int(budget // pace),
            }
        )
    return rows


def drift_lines(df, stats: dict, ec: dict, arms: list[str], metric: str = "eval_pref_mean") -> list[str]:
    """Markdown: ``drift_rows``, and for a flagged arm its gain over the base at its recomputed budget."""
    import numpy as np

    if "backward_passes" not in df or ec.get("drift_tolerance") is None:
        return []
    rows = drift_rows(df, ec, arms)
    lines = [
        f"### Equal cost in measured seconds (drift tolerance {ec['drift_tolerance']:.0%})",
        "",
        "Measured: each run's median training seconds per iteration (instruments left out), median over the "
        "arm's runs. A flagged arm's budget is recomputed from the runs' own medians: "
        f"{ec['budget_iterations']} x {ec['budget_arm']}'s measured median / the arm's; its {metric[5:-5]} gain "
        "is read there on its curve (linear between evaluations; 'ran short': the run ended before it, its end).",
        "",
        f"| arm | s/iteration recorded | measured | drift | flagged | iterations run | iterations at the measured "
        f"budget | {metric[5:-5]} gain there |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        there = "-"
        if r["flagged"] and r["iterations_measured"] is not None:
            at = value_at(df, r["arm"], metric, r["iterations_measured"])
            g = [v - stats["base"][k][metric] for k, v in at.items() if k in stats["base"]]
            short = " (ran short)" if r["iterations_measured"] > r["iterations"] else ""
            there = f"{np.mean(g):+.3f} (n {len(g)}){short}" if g else "-"
        lines.append(
            f"| {r['arm']} | {r['recorded_s']:.2f} | {r['measured_s']:.2f} | {r['drift']:+.1%} | "
            f"{'**yes**' if r['flagged'] else 'no'} | {r['iterations']} | "
            f"{r['iterations_measured'] if r['iterations_measured'] is not None else 'fixed length'} | {there} |"
        )
    return lines + [""]


def share(
    runs: dict, spec: dict, k: int, n_boot: int = 4000, seed: int = 0
) -> tuple[float, float, float, int]:
    """The share of ``arm``'s win over ``over`` that ``without`` loses: mean(arm - without) / mean(arm - over)
    over the seeds all three ran (paired), with a 95% percentile bootstrap over seeds (seeds drawn with
    replacement, numerator and denominator from the same draw). Returns (share, lo, hi, n)."""
    import numpy as np

    a, w, o, m = spec["arm"], spec["without"], spec["over"], spec["metric"]
    seeds = sorted(s for x, s in runs if x == a and (w, s) in runs and (o, s) in runs)
    num = np.array([runs[(a, s)][m][k] - runs[(w, s)][m][k] for s in seeds])
    den = np.array([runs[(a, s)][m][k] - runs[(o, s)][m][k] for s in seeds])
    draws = np.random.default_rng(seed).integers(len(seeds), size=(n_boot, len(seeds)))
    boot = num[draws].mean(1) / den[draws].mean(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(num.mean() / den.mean()), float(lo), float(hi), len(seeds)


def share_lines(stats: dict, spec: dict | None, k: int) -> list[str]:
    """Markdown: the recipe's ``share`` (``share``), where its three arms have 2 paired seeds."""
    if not spec or spec["metric"] not in stats["metrics"]:
        return []
    runs = stats["runs"]
    if (
        sum(
            1
            for x, s in runs
            if x == spec["arm"] and (spec["without"], s) in runs and (spec["over"], s) in runs
        )
        < 2
    ):
        return []
    value, lo, hi, n = share(runs, spec, k)
    return [
        f"### {spec['name'][0].upper()}{spec['name'][1:]}",
        "",
        f"({spec['arm']} - {spec['without']}) / ({spec['arm']} - {spec['over']}), {spec['metric'][5:-5]} at the "
        f"{spec['summary']}: {value:+.2f} [{lo:+.2f}, {hi:+.2f}] (95% percentile bootstrap over {n} paired seeds).",
        "",
    ]


def per_iteration_diffs(df, better: str, worse: str, metric: str) -> dict[int, list[float]]:
    """better - worse at each iteration both evaluated on the same seed: {iteration: diffs over those seeds}.
    The per-iteration view of two arms of different lengths (exact45 against knots4: the same iterations, at
    different costs), where the end-of-budget contrast compares different iterations."""
    ev = {
        arm: {
            (int(s), int(i)): float(v)
            for s, i, v in df[df.strategy == arm]
            .dropna(subset=[metric])[["seed", "iteration", metric]]
            .values
        }
        for arm in (better, worse)
    }
    out: dict[int, list[float]] = {}
    for s, i in sorted(set(ev[better]) & set(ev[worse]), key=lambda si: (si[1], si[0])):
        out.setdefault(i, []).append(ev[better][(s, i)] - ev[worse][(s, i)])
    return out


def per_iteration_lines(df, c: dict, metrics: list[str]) -> list[str]:
    """Markdown: the descriptive contrast ``c`` at every iteration where both arms evaluated 2 seeds or more."""
    from jagg.stats import paired_interval

    by_metric = {m: per_iteration_diffs(df, c["better"], c["worse"], m) for m in metrics}
    its = sorted(
        i
        for i in set.intersection(*(set(d) for d in by_metric.values()))
        if len(by_metric[metrics[0]][i]) >= 2
    )
    if not its:
        return []
    return [
        f"**{c['better']} - {c['worse']}, per iteration** ({' / '.join(m[5:-5] for m in metrics)}; mean [95% t "
        "interval] over the seeds both evaluated at that iteration):",
        "",
        "| iteration | seeds | " + " | ".join(m[5:-5] for m in metrics) + " |",
        "|---|---|" + "---|" * len(metrics),
        *(
            f"| {i} | {len(by_metric[metrics[0]][i])} | "
            + " | ".join(f"{paired_interval(by_metric[m][i])}" for m in metrics)
            + " |"
            for i in its
        ),
        "",
    ]
