"""Gradient quality per group: cosine(JAGG group gradient, exact group gradient) along the trajectory.

On trained backbones and held-out prompts: sample DanceGRPO rollouts (SDE but the last step), score them,
take the GRPO per-step losses of every step but the last, cut the steps into consecutive groups of W, and for each group
compare the gradient of each two-endpoint strategy (jagg, endpoints, uniform) with the exact per-step
gradient: cosine similarity and relative norm error ||g - g_exact|| / ||g_exact||. Settings stress the
linearity assumption: W up to the whole trajectory, few sampling steps, high noise, both together, and the
backbone after a short RL fine-tune. (Larger images are not included: the world backbones and rewards are
trained at one image size, so a larger latent would be out of distribution for the reward models too.) A recommended jagg_frac per backbone is derived
as the fraction of leading groups whose median JAGG cosine is at least a threshold.

A second section (``--only authors`` runs it alone) reads the JAGG authors' recipe
(configs/world/<backbone>_dancegrpo_authors.yaml: 21 steps, 20 usable, W = 4, eta 0.3): per group the cosine
to the exact gradient for the t-weights (jagg) vs the step-index weights (jagg_index), on the authors'
contiguous groups (the 5 blocks of 4 consecutive steps, all measured) and on this repository's reading (a
random 12 of the 20 steps per sample, sorted, cut into 3 groups of 4 that can span steps far apart).

    python experiments/cosine.py [--quick] [--threshold 0.9] [--only main|authors]
    -> results/cosine.csv, results/cosine.md, paper_figures/cosine_per_group.png,
       results/cosine_authors.csv, paper_figures/cosine_authors.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from jagg.common import (
    ProgressETA,
    SeedStream,
    atomic_write_text,
    command_line,
    markdown_table,
    run_metadata,
    set_threads,
    write_table,
)
from jagg.config import PLAIN_DANCEGRPO_LOSS, TINY_RUN, load_config
from jagg.engine.algorithms import DanceGRPO
from jagg.engine.diagnostics import group_gradient_cosines
from jagg.loop.components import build_components
from jagg.loop.trainer import Trainer
from jagg.world.pretrained import REPORTS as WORLD_REPORTS
from plotting import figure_footer, save_figure, world_scale

BACKBONES = ("flux", "qwenimage")
COMPARED = ("jagg", "endpoints", "uniform")
# name -> (config overrides, group sizes). The first is the reference setting.
SETTINGS: dict[str, tuple[list[str], list[int]]] = {
    "default": ([], [2, 3, 4, 9]),
    "few_steps": (["sampling.num_steps=5"], [4]),
    "high_noise": (["algorithm.noise_level=1.0"], [3]),
    "few_steps_high_noise": (["sampling.num_steps=5", "algorithm.noise_level=1.0"], [4]),
    "after_rl": ([], [3]),
}
# The gradient-geometry experiment pins a plain DanceGRPO loss (``PLAIN_DANCEGRPO_LOSS``), so its numbers do not
# move when the world training recipe (configs/world/) is re-tuned.
PINNED = [*PLAIN_DANCEGRPO_LOSS, "optim.lr=1e-4", "train.grad_accum=1"]


def measurement_index(seed: int, w: int) -> int:
    """Draw index of the measurement rollout for (seed, W) in the trainer's ``SeedStream.ROLLOUT`` stream.

    Each setting has a fresh trainer, so these are the draws of its training iterations 2..9 (seed 0),
    1002.. (seed 1), ...; the formula is the one the committed results were measured with.
    """
    return 1000 * seed + w


def group_rows(trainer: Trainer, index: int, w: int, meta: dict) -> list[dict]:
    """One rollout; per group of W consecutive steps: each strategy's gradient vs the exact one."""
    ro = trainer.rollout(index)
    n_steps = len(trainer.sigmas) - 1
    steps = torch.arange(n_steps - 1).expand(len(ro.prompts), n_steps - 1)  # all steps but the last
    loss = trainer.grpo_loss(ro, steps)
    cosines = group_gradient_cosines(
        trainer.velocity(ro.cond), loss.x, loss.sigma, loss, trainer.params, group_size=w, strategies=COMPARED
    )
    return [
        dict(
            **meta,
            W=w,
            group=c.group,
            group_len=len(c.steps),
            step_start=c.steps[0],
            sigma_start=float(trainer.sigmas[c.steps[0]]),
            sigma_end=float(trainer.sigmas[c.steps[-1]]),
            iteration=index,
            strategy=c.strategy,
            cosine=c.cosine,
            rel_norm_err=c.rel_norm_err,
        )
        for c in cosines
    ]


def rl_finetune(trainer: Trainer, iterations: int) -> None:
    """A short GRPO run (the config's strategy) so the after_rl setting measures a policy moved by RL."""
    for it in range(iterations):
        trainer.update(trainer.rollout(it, SeedStream.FINETUNE))


def measure(
    backbone: str, setting: str, args, extra: list[str], progress: ProgressETA | None = None
) -> tuple[list[dict], dict]:
    """Rows of one (backbone, setting) and its resolved config (recorded in the metadata); a ``progress``
    line per (W, seed) measurement."""
    overrides, ws = SETTINGS[setting]
    cfg = load_config(
        "configs/world/flux_dancegrpo.yaml",
        [
            f"model.backbone={backbone}",
            "train.images_per_prompt=4",
            "train.prompts_per_iter=2",
            "train.train_batch_size=8",
            *PINNED,
            *overrides,
            *extra,
        ],
    )
    comp = build_components(cfg)
    # Score held-out prompts: the rollouts (and the after_rl fine-tune) draw from the evaluation prompt set.
    comp = dataclasses.replace(comp, train_prompts=comp.eval_prompts)
    trainer = Trainer(cfg, comp, run_dir=Path("runs/cosine"))
    if setting == "after_rl":
        rl_finetune(trainer, args.rl_iterations)
    rows = []
    for w in ws:
        for seed in range(args.seeds):
            meta = dict(
                backbone=backbone,
                setting=setting,
                num_steps=cfg.sampling.num_steps,
                noise_level=cfg.algorithm.noise_level,
                latent_size=cfg.sampling.latent_size,
                seed=seed,
            )
            rows += group_rows(trainer, measurement_index(seed, w), w, meta)
            if progress:
                progress.step(f"{backbone} {setting} W={w} seed {seed}")
    return rows, cfg.to_dict()


# --------------------------------------------------------------------------- the authors' recipe
AUTHORS_COMPARED = ("jagg", "jagg_index")
AUTHORS_BATCH = ["train.images_per_prompt=4", "train.prompts_per_iter=2", "train.train_batch_size=8"]


def authors_rows(trainer: Trainer, index: int, meta: dict) -> list[dict]:
    """One rollout of the authors' recipe; per group of W steps of each reading (``contiguous``: every block
    of W consecutive usable steps; ``sorted_subset``: this repository's per-sample random subset of the same
    size as the recipe trains, sorted, cut into groups of W), t-weights and index weights vs exact."""
    cfg = trainer.cfg
    w, n_usable = cfg.backward.group_size, len(trainer.sigmas) - 2
    ro = trainer.rollout(index)
    batch = len(ro.prompts)
    subset = DanceGRPO(dataclasses.replace(cfg.algorithm, step_selection="sorted_subset"), cfg.backward)
    readings = {
        "contiguous": torch.arange(n_usable).expand(batch, n_usable),
        "sorted_subset": subset.trained_steps(
            ["sde"] * (n_usable + 1), batch, torch.Generator().manual_seed(10_000 + index)
        ),
    }
    rows = []
    for reading, steps in readings.items():
        loss = trainer.grpo_loss(ro, steps)
        cosines = group_gradient_cosines(
            trainer.velocity(ro.cond),
            loss.x,
            loss.sigma,
            loss,
            trainer.params,
            group_size=w,
            strategies=AUTHORS_COMPARED,
        )
        for c in cosines:
            first, last = steps[:, c.steps[0]].double(), steps[:, c.steps[-1]].double()
            rows.append(
                dict(
                    **meta,
                    reading=reading,
                    W=w,
                    group=c.group,
                    n_groups=-(-steps.shape[1] // w),
                    step_first_mean=float(first.mean()),
                    step_span_mean=float((last - first).mean() + 1),
                    sigma_start=float(trainer.sigmas[steps[:, c.steps[0]]].mean()),
                    sigma_end=float(trainer.sigmas[steps[:, c.steps[-1]]].mean()),
                    iteration=index,
                    strategy=c.strategy,
                    cosine=c.cosine,
                    rel_norm_err=c.rel_norm_err,
                )
            )
    return rows


def measure_authors(backbone: str, args, extra: list[str], progress: ProgressETA | None) -> tuple[list, dict]:
    """Rows of the authors' recipe on one backbone (``authors_rows`` per seed) and its resolved config."""
    cfg = load_config(
        f"configs/world/{backbone}_dancegrpo_authors.yaml",
        [*AUTHORS_BATCH, *PINNED, "model.gradient_checkpointing=false", *extra],
    )
    comp = build_components(cfg)
    comp = dataclasses.replace(comp, train_prompts=comp.eval_prompts)  # held-out prompts, as ``measure``
    trainer = Trainer(cfg, comp, run_dir=Path("runs/cosine"))
    rows = []
    for seed in range(args.seeds):
        meta = dict(
            backbone=backbone, num_steps=cfg.sampling.num_steps, noise_level=cfg.algorithm.noise_level
        )
        rows += authors_rows(trainer, measurement_index(seed, 4), meta | {"seed": seed})
        if progress:
            progress.step(f"{backbone} authors' recipe seed {seed}")
    return rows, cfg.to_dict()


def authors_markdown(df, meta: dict) -> str:
    """Median cosine per (backbone, reading, group, weight rule), with the groups' mean times and spans."""
    table = (
        df.groupby(["backbone", "reading", "group", "strategy"])
        .agg(
            sigma_start=("sigma_start", "mean"),
            sigma_end=("sigma_end", "mean"),
            span_steps=("step_span_mean", "mean"),
            cosine_median=("cosine", "median"),
            cosine_min=("cosine", "min"),
        )
        .reset_index()
    )
    wide = table.pivot_table(
        index=["backbone", "reading", "group", "sigma_start", "sigma_end", "span_steps"],
        columns="strategy",
        values="cosine_median",
    ).reset_index()
    overall = (
        df.groupby(["backbone", "reading", "strategy"]).cosine.median().unstack("strategy").reset_index()
    )
    return (
        "\n".join(
            [
                "## The JAGG authors' recipe: weight rule x grouping (configs/world/*_dancegrpo_authors.yaml)",
                "",
                f"git {meta['git_sha']}, seeds {meta['seeds']}, eta {df.noise_level.iloc[0]}, "
                f"{int(df.num_steps.iloc[0])} steps, W = {int(df.W.iloc[0])}. Command: `{meta['command']}`. "
                "contiguous: the 5 blocks of 4 consecutive usable steps (the authors' groups; a sample trains 3 of "
                "them). sorted_subset: this repository's reading, a random 12 of the 20 usable steps per sample, "
                "sorted, in 3 groups of 4 (span_steps: first to last step of a group, in steps). Median cosine "
                "to the exact group gradient; jagg = t-weights, jagg_index = alpha_j = j / (W - 1).",
                "",
                "### Per group (0 = highest noise)",
                "",
                markdown_table(wide),
                "",
                "### Median over all groups",
                "",
                markdown_table(overall),
            ]
        )
        + "\n"
    )


def plot_authors(csv: Path, png: Path) -> None:
    """Per backbone, cosine per group along the trajectory (x: the group's mean start time, high noise on the
    left) for each reading x weight rule; median over seeds, min-max shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.read_csv(csv)
    backbones = sorted(df.backbone.unique())
    fig, axes = plt.subplots(1, len(backbones), figsize=(6 * len(backbones), 4.2), squeeze=False)
    colors = {"contiguous": "C0", "sorted_subset": "C1"}
    styles = {"jagg": "-", "jagg_index": "--"}
    for ax, backbone in zip(axes[0], backbones, strict=True):
        for (reading, strategy), e in df[df.backbone == backbone].groupby(["reading", "strategy"]):
            m = e.groupby("group").agg(
                t=("sigma_start", "mean"),
                cos=("cosine", "median"),
                lo=("cosine", "min"),
                hi=("cosine", "max"),
            )
            label = f"{reading} groups, {'t-weights' if strategy == 'jagg' else 'index weights'}"
            ax.plot(m.t, m.cos, styles[strategy], color=colors[reading], marker="o", ms=3, label=label)
            ax.fill_between(m.t, m.lo, m.hi, color=colors[reading], alpha=0.1)
        ax.invert_xaxis()
        ax.set(
            title=f"{backbone}: authors' recipe (21 steps, W = 4, eta 0.3)",
            xlabel="group start time t (high noise -> low noise)",
            ylabel="cosine to the exact group gradient",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    figure_footer(fig, meta, world_scale(csv.parent) + ", float64 cosines of float32 gradients")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, png, dpi=120)


def recommend(df, threshold: float, w: int = 3) -> dict[str, float]:
    """jagg_frac per backbone: leading groups (default setting, W) with median JAGG cosine >= threshold."""
    out = {}
    sub = df[(df.setting == "default") & (w == df.W) & (df.strategy == "jagg")]
    for backbone, d in sub.groupby("backbone"):
        med = d.groupby("group").cosine.median().sort_index()
        lead = 0
        for c in med:
            if c < threshold:
                break
            lead += 1
        out[backbone] = lead / len(med)
    return out


def plot(csv: Path, png: Path) -> None:
    """(a) cosine per group along the trajectory (W = 3 settings); (b) median cosine per setting and W.

    Reads the CSV only.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.read_csv(csv)
    colors = {"flux": "C0", "qwenimage": "C3"}
    styles = {"jagg": "-", "endpoints": ":", "uniform": "--"}
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    per_group = df[(df.W == 3) & (df.setting == "default")]
    for (backbone, strategy), e in per_group.groupby(["backbone", "strategy"]):
        m = e.groupby("group").agg(cos=("cosine", "median"), lo=("cosine", "min"), hi=("cosine", "max"))
        ax_a.plot(
            m.index,
            m.cos,
            styles[strategy],
            color=colors.get(backbone, "C2"),
            marker="o",
            ms=3,
            label=f"{backbone} {strategy}",
        )
        ax_a.fill_between(m.index, m.lo, m.hi, color=colors.get(backbone, "C2"), alpha=0.12)
    ax_a.set(
        title="(a) per group, default setting, W=3",
        xlabel="group (0 = highest noise)",
        ylabel="cosine to the exact group gradient",
    )
    ax_a.legend(fontsize=7)
    summary = df.groupby(["setting", "W", "backbone", "strategy"]).cosine.median().reset_index()
    keys = summary[["setting", "W"]].drop_duplicates().sort_values(["setting", "W"]).values.tolist()
    bars = [(b, s) for b in sorted(df.backbone.unique()) for s in ("jagg", "uniform", "endpoints")]
    width = 0.8 / len(bars)
    for k, (backbone, strategy) in enumerate(bars):
        vals = [
            summary[
                (summary.setting == st)
                & (summary.W == w)  # noqa: SIM300
                & (summary.backbone == backbone)
                & (summary.strategy == strategy)
            ].cosine.mean()
            for st, w in keys
        ]
        alpha = {"jagg": 1.0, "uniform": 0.6, "endpoints": 0.3}[strategy]
        ax_b.bar(
            [i + (k - len(bars) / 2) * width for i in range(len(keys))],
            vals,
            width,
            color=colors.get(backbone, "C2"),
            alpha=alpha,
            label=f"{backbone} {strategy}",
        )
    ax_b.set_xticks(range(len(keys)), [f"{st}\nW={w}" for st, w in keys], fontsize=7)
    ax_b.set(title="(b) median over groups and seeds, per setting", ylim=(0.5, 1.01))
    ax_b.legend(fontsize=6, ncol=2, loc="lower left")
    for ax in (ax_a, ax_b):
        ax.grid(alpha=0.3)
    fig.suptitle("Gradient quality per group: cos(JAGG, exact) and the ablations, on trained world backbones")
    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    figure_footer(fig, meta, world_scale(csv.parent) + ", float64 cosines of float32 gradients")
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    save_figure(fig, png, dpi=120)


def to_markdown(df, rec: dict, threshold: float, meta: dict) -> str:
    summary = (
        df[df.strategy == "jagg"]
        .groupby(["backbone", "setting", "W", "group"])
        .agg(
            sigma_start=("sigma_start", "mean"),
            cosine_median=("cosine", "median"),
            cosine_min=("cosine", "min"),
            rel_err_median=("rel_norm_err", "median"),
        )
        .reset_index()
    )
    abl = (
        df.groupby(["backbone", "setting", "W", "strategy"]).cosine.median().unstack("strategy").reset_index()
    )
    lines = [
        "# Gradient quality per group: cosine(JAGG, exact)",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}, "
        f"seeds {meta['seeds']}. Command: `{meta['command']}`",
        "",
        f"Recommended jagg_frac (leading groups, default setting, W=3, median cosine >= {threshold}): "
        + ", ".join(f"{k}: {v:.2f}" for k, v in rec.items()),
        "",
        "## JAGG per group",
        "",
        markdown_table(summary),
        "",
        "## Median cosine over all groups, per strategy",
        "",
        markdown_table(abl),
    ]
    return "\n".join(lines) + "\n"


def render(csv: Path, png: Path) -> None:
    """Markdown summary (with the recommended jagg_frac) and the figure from the CSV + metadata only."""
    import pandas as pd

    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    df = pd.read_csv(csv)
    threshold = meta["config"]["threshold"]
    md = to_markdown(df, recommend(df, threshold), threshold, meta)
    authors_csv = csv.with_name("cosine_authors.csv")
    if authors_csv.is_file():
        authors_meta = json.loads(authors_csv.with_suffix(".meta.json").read_text())
        md += "\n" + authors_markdown(pd.read_csv(authors_csv), authors_meta)
        plot_authors(authors_csv, png.with_name("cosine_authors.png"))
    atomic_write_text(csv.with_suffix(".md"), md)
    plot(csv, png)


# What make cosine rewrites, and make pretrain's reports of the world it runs first:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/cosine*", "paper_figures/cosine_*", *WORLD_REPORTS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/cosine.csv")
    ap.add_argument("--figure", default="paper_figures/cosine_per_group.png")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--rl-iterations", type=int, default=15)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--quick", action="store_true", help="tiny random-init models, seconds (tests)")
    ap.add_argument("--only", choices=["main", "authors"], help="run one section (the other's CSV is kept)")
    args = ap.parse_args(argv)
    set_threads(1)
    extra = list(TINY_RUN) if args.quick else []
    if args.quick:
        args.seeds, args.rl_iterations = 1, 1
    units = len(BACKBONES) * args.seeds * sum(len(SETTINGS[setting][1]) for setting in args.settings)
    eta = ProgressETA(
        {"main": units, "authors": len(BACKBONES) * args.seeds}.get(
            args.only, units + len(BACKBONES) * args.seeds
        ),
        "cosine",
    )
    if args.only != "authors":
        _main_section(args, argv, extra, eta)
    if args.only != "main":
        _authors_section(args, argv, extra, eta)
    render(Path(args.out), Path(args.figure))
    print(Path(args.out).with_suffix(".md").read_text())
    print(f"wrote {args.out}, {Path(args.out).with_suffix('.md')}, {args.figure}")


def _main_section(args, argv, extra: list[str], eta: ProgressETA) -> None:
    rows, configs = [], {}
    for backbone in BACKBONES:
        for setting in args.settings:
            new_rows, configs[f"{backbone}/{setting}"] = measure(backbone, setting, args, extra, eta)
            rows += new_rows
            print(f"{backbone} {setting}: {len(rows)} rows", flush=True)
    write_table(rows, args.out, _meta(args, argv, configs))


def _authors_section(args, argv, extra: list[str], eta: ProgressETA) -> None:
    rows, configs = [], {}
    for backbone in BACKBONES:
        new_rows, configs[f"{backbone}/authors"] = measure_authors(backbone, args, extra, eta)
        rows += new_rows
    write_table(rows, Path(args.out).with_name("cosine_authors.csv"), _meta(args, argv, configs))


def _meta(args, argv, configs: dict) -> dict:
    return run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/cosine.py", argv),
        seeds=args.seeds,
        seed="per row",
        config=vars(args),
        train_configs=configs,
    )


if __name__ == "__main__":
    main()
