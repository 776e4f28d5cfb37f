"""Regenerate every table and figure from results/ alone (no training, seconds).

python experiments/figures.py [--results results] [--figures paper_figures]   (make figures)

Every figure names its hardware and scale on the figure. The memory figure's dry-run numbers are computed
from configs/paper/ by jagg.capacity.memory_model (no weights, no GPU) and written to results/memory_plan.csv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The drivers whose drawing functions regenerate their own figures (experiments/, which is sys.path[0] when
# this file runs): figures.py is the one place that imports drivers; they never import each other.
import cosine
import curves
import knots
import table1
import theorem1
from jagg.loop.timing import TIMING_SETUPS
from plotting import (
    figure_footer,
    save_figure,
    world_scale,
)  # experiments/plotting.py: drawing helpers, not a driver

EXPERIMENTS = Path(__file__).resolve().parent

PHASES = [  # table1.csv columns, stacked bottom to top
    ("sample_s", "sampling (rollout)"),
    ("reward_s", "reward"),
    ("update_fwd_s", "update forward"),
    ("update_bwd_s", "update backward"),
]
PAPER_CONFIGS = ["flux_dancegrpo", "flux_flowgrpo_fast", "qwenimage_dancegrpo", "qwenimage_flowgrpo_fast"]
MEMORY_MODES = [  # (label, backward overrides) of the memory figure
    ("exact", ["backward.strategy=exact"]),
    ("jagg joint", ["backward.graph_mode=joint"]),
    ("jagg batched", ["backward.graph_mode=batched"]),
    ("jagg sequential", ["backward.graph_mode=sequential"]),
]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_phases(csv: Path, png: Path) -> None:
    """Time per iteration by phase (stacked: sampling, reward, update forward, update backward, other), one
    panel per setup, one bar per strategy / graph mode (results/table1.csv)."""
    import pandas as pd

    plt = _plt()
    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    df = pd.read_csv(csv).fillna("")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, setup in zip(axes.flat, TIMING_SETUPS, strict=True):
        sub = df[(df.backbone == setup[0]) & (df.algorithm == setup[1])]
        x = range(len(sub))
        bottom = [0.0] * len(sub)
        for col, label in PHASES:
            ax.bar(x, sub[col], bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, sub[col], strict=True)]
        other = [max(t - b, 0.0) for t, b in zip(sub.iter_s, bottom, strict=True)]
        ax.bar(x, other, bottom=bottom, label="other (optimizer, bookkeeping)", color="0.8")
        ax.set_xticks(
            list(x),
            [f"{r.strategy} W{r.W}\n{r.mode.replace('sequential', 'seq.')}" for r in sub.itertuples()],
            fontsize=7,
        )
        ax.set_title(f"{setup[0]} {setup[1]}", fontsize=10)
        ax.set_ylabel("seconds per iteration (median)", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.955), fontsize=8, ncol=5)
    fig.suptitle(
        "Time per iteration by phase: JAGG shortens the update (backward; forward too with stored outputs)"
    )
    scale = world_scale(csv.parent) + f", {meta.get('iterations', '?')} timed iterations per strategy"
    figure_footer(fig, meta, scale)
    fig.tight_layout(rect=(0, 0.03, 1, 0.93))
    save_figure(fig, png, dpi=100)


def plot_speedup(results: Path, png: Path) -> None:
    """Speed-up vs W, measured vs ideal (pass counting): one group (results/bench_group_backward.csv, per
    variant) and the whole update of a trajectory (results/table1_sweep.csv, per jagg_frac); panels for the
    files that exist."""
    import pandas as pd

    plt = _plt()
    bench, sweep = results / "bench_group_backward.csv", results / "table1_sweep.csv"
    panels = [p for p in (bench, sweep) if p.is_file()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, path in zip(axes.flat, panels, strict=True):
        df, meta = pd.read_csv(path).fillna(""), json.loads(path.with_suffix(".meta.json").read_text())
        if path == bench:
            df = df[df.variant.isin(["jagg/joint", "jagg/batched+stored"]) & (df.backbone == "flux")]
            for k, (variant, d) in enumerate(df.groupby("variant")):
                color = f"C{k}"
                ax.plot(d.W, d.speedup, "o-", color=color, label=f"{variant}: measured")
                ax.plot(d.W, d.ideal_speedup, "s--", color=color, alpha=0.6, label=f"{variant}: ideal")
            ax.set_title("one group of W steps (tiny Flux, batch 2), make bench", fontsize=9)
            ax.set_ylabel("speed-up of the group update vs exact (x)", fontsize=8)
        else:
            df = df[df.strategy == "jagg"]
            for k, (frac, d) in enumerate(df.groupby("jagg_frac")):
                color = f"C{k + 2}"
                ax.plot(
                    d.W,
                    100 / (100 - d.reduction_update_pct),
                    "o-",
                    color=color,
                    label=f"jagg_frac {frac}: measured",
                )
                ideal = 100 / (100 - d.ideal_reduction_update_pct)
                ax.plot(d.W, ideal, "s--", color=color, alpha=0.6, label=f"jagg_frac {frac}: ideal")
            ax.set_title(
                f"whole update, {df.backbone.iloc[0]} {df.algorithm.iloc[0]}, make table1 sweep", fontsize=9
            )
            ax.set_ylabel("speed-up of the update phase vs exact (x)", fontsize=8)
        ax.axhline(1, color="k", lw=0.5)
        ax.set_xlabel("W (steps per group)")
        ax.set_xticks(sorted(df.W.unique()))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Speed-up vs group size W: measured vs ideal (backward = 2 forwards)")
    meta = json.loads(panels[0].with_suffix(".meta.json").read_text())
    scale = []
    if bench.is_file():
        params = pd.read_csv(bench).query("backbone == 'flux'").params.iloc[0]
        scale.append(f"left: random-init Flux-class backbone, {params / 1e6:.2f}M parameters")
    if sweep.is_file():
        scale.append("right: " + world_scale(results))
    figure_footer(fig, meta, "; ".join(scale))
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    save_figure(fig, png, dpi=100)


def memory_rows(configs: Path = Path("configs/paper"), world_size: int = 8) -> list[dict]:
    """Per paper config x backward mode: the dry run's per-GPU GiB (``jagg.capacity.memory_model.memory_plan``, the
    transformer on the meta device, no weights), resident vs the transient peak (activations, a no-grad forward or the AdamW step)."""
    from jagg.capacity.memory_model import GIB, memory_plan, meta_transformer
    from jagg.capacity.pass_plan import trained_steps_per_sample
    from jagg.config import load_config

    rows = []
    for name in PAPER_CONFIGS:
        for label, overrides in MEMORY_MODES:
            cfg = load_config(configs / f"{name}.yaml", overrides)
            setting = cfg.backward.planned_setting()  # auto: as the dry run plans it
            cost = setting.cost(trained_steps_per_sample(cfg), stored_outputs=True)
            held = setting.holds_gradients  # joint: the later graph's gradients wait unsharded
            model, _ = meta_transformer(cfg)
            mp = memory_plan(cfg, world_size, cost.graphs_alive, held, model)
            peak = mp.transient()  # update activations, a no-grad forward or the AdamW step
            rows.append(
                dict(
                    config=name,
                    mode=label,
                    world_size=world_size,
                    resident_gib=sum(mp.gpu.values()) / GIB,
                    transient_gib=peak / GIB,
                    reserve_gib=mp.reserve() / GIB,
                    total_gib=mp.total() / GIB,
                    graphs_alive=cost.graphs_alive,
                    fits_80gb=mp.fits(80),
                    fits_141gb=mp.fits(141),
                )
            )
    return rows


def plot_memory(results: Path, png: Path) -> None:
    """Memory per graph mode: (a) the dry-run plan per GPU for the four paper configs on 8 GPUs, against
    80 GB and 141 GB; (b) autograd-saved activations at peak measured on the CPU world (results/table1.csv)."""
    import pandas as pd

    from jagg.common import run_metadata, write_table

    plt = _plt()
    rows = memory_rows()
    meta = run_metadata(
        outputs=OUTPUTS,
        command="python experiments/figures.py",
        config={"configs": [f"configs/paper/{c}.yaml" for c in PAPER_CONFIGS], "modes": dict(MEMORY_MODES)},
        seed=None,  # a computed plan: nothing random
        world_size=8,
    )
    meta = write_table(rows, results / "memory_plan.csv", meta)  # an unchanged plan keeps its record
    df = pd.DataFrame(rows)
    t1 = results / "table1.csv"
    fig, axes = plt.subplots(1, 2 if t1.is_file() else 1, figsize=(13, 5), squeeze=False)
    ax = axes.flat[0]
    modes = [m for m, _ in MEMORY_MODES]
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        d = df[df["mode"] == mode]
        x = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(PAPER_CONFIGS))]
        ax.bar(
            x, d.resident_gib, width, color=f"C{k}", label=f"{mode}: resident (weights, grads, AdamW, models)"
        )
        ax.bar(x, d.transient_gib + d.reserve_gib, width, bottom=d.resident_gib, color=f"C{k}", alpha=0.45)
    for gb, style in ((80, "--"), (141, ":")):
        ax.axhline(
            gb * 1e9 / 2**30, color="k", ls=style, lw=1, label=f"{gb} GB GPU ({gb * 1e9 / 2**30:.1f} GiB)"
        )
    ax.set_xticks(range(len(PAPER_CONFIGS)), [c.replace("_", "\n", 1) for c in PAPER_CONFIGS], fontsize=8)
    ax.set_ylabel("GiB per GPU (light: activations / no-grad / AdamW-step peak + 3 GiB reserve)", fontsize=8)
    ax.set_title("(a) dry-run plan, paper configs, FSDP2 over 8 GPUs (computed, not measured)", fontsize=9)
    ax.legend(fontsize=6, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    if t1.is_file():
        t1m = json.loads(t1.with_suffix(".meta.json").read_text())
        d = pd.read_csv(t1).fillna("")
        d = d[d.algorithm == "dancegrpo"]
        ax = axes.flat[1]
        ticks, names = [], []
        for k, (backbone, g) in enumerate(d.groupby("backbone", sort=False)):
            x = [i + k * (len(g) + 1) for i in range(len(g))]
            ax.bar(x, g.peak_activation_mb, color=f"C{k}", label=f"{backbone} DanceGRPO")
            ticks += x
            names += [f"{r.strategy} W{r.W} {r.mode}".replace("sequential", "seq.") for r in g.itertuples()]
        ax.set_xticks(ticks, names, fontsize=7, rotation=60, ha="right")
        ax.set_ylabel("peak autograd-saved activations in the update (MB)", fontsize=8)
        ax.set_title(f"(b) measured on {t1m['hardware']}, world DanceGRPO (make table1)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        "Memory per endpoint mode: 'joint' keeps two graphs alive, 'batched' one 2B graph, 'sequential' one"
    )
    figure_footer(
        fig,
        meta,
        "(b) " + world_scale(results),
        where="(a) computed by the dry-run plan (jagg.capacity.memory_model) for the real FLUX.1-dev / Qwen-Image "
        "architectures, no weights, no GPU",
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    save_figure(fig, png, dpi=100)


# (what, input under results/, figure under paper_figures/, regenerate(input, figure))
TARGETS = [
    ("Theorem 1", "theorem1.csv", "theorem1.png", theorem1.plot),
    ("Table 1", "table1.csv", "table1_update_reduction.png", table1.render),
    ("time per phase", "table1.csv", "table1_phases.png", plot_phases),
    (
        "speed-up vs W",
        "table1_sweep.csv",
        "speedup_vs_w.png",
        lambda path, png: plot_speedup(path.parent, png),
    ),
    ("memory per mode", "table1.csv", "memory_per_mode.png", lambda path, png: plot_memory(path.parent, png)),
    ("cosine", "cosine.csv", "cosine_per_group.png", cosine.render),
    ("knots", "knots.csv", "knots_cosine.png", knots.render),
    ("reward curves", "curves", ".", curves.render),  # one reward_curves_<recipe>.png per recipe
]


def curves_regenerator(protocol: str, pilot: bool):
    """curves.py's ``render`` under a later protocol file (version 3's is its default)."""
    return lambda path, png: curves.render(path, png, EXPERIMENTS / protocol, pilot=pilot)


# the protocols after version 3, by results folder; each with its pilot (figures under <its figures
# folder>/pilot/; the equal-cost protocol's under equal_cost/, as its recipe shares the practitioners' name, and
# its window amendment's under window/)
TARGETS += [
    (
        f"reward curves ({folder}{suffix})",
        folder + suffix,
        str(Path(sub) / ("pilot" if pilot else "")),
        curves_regenerator(p, pilot),
    )
    for folder, p, sub in (
        ("curves_v4", "curves_protocol_v4.yaml", "."),
        ("curves_practitioners", "curves_protocol_practitioners.yaml", "."),
        ("curves_equal_cost", "curves_protocol_equal_cost.yaml", "equal_cost"),
        ("curves_window", "curves_protocol_window.yaml", "window"),
    )
    for pilot, suffix in ((False, ""), (True, "_pilot"))
]


# What make figures rewrites: every figure, and the memory plan it computes:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/memory_plan*", "paper_figures/*")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--figures", default="paper_figures")
    args = ap.parse_args(argv)
    for what, source, figure, regenerate in TARGETS:
        path = Path(args.results) / source
        if path.is_file() or any(path.glob("*/*_seed*.csv")):
            regenerate(path, Path(args.figures) / figure)
            print(f"{what}: regenerated from {path} -> {Path(args.figures) / figure}")
        else:
            print(f"{what}: no {path} yet (run its make target first)")


if __name__ == "__main__":
    main()
