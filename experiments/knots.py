"""Shared knots vs JAGG groups: cosine to the exact gradient against backward passes per sample, and the
time of a full-trajectory iteration.

Section 1 (cosine). On the world backbones (21-step DanceGRPO schedule, 20 usable SDE steps, eta 0.3, held-out
prompts), per rollout and step structure, the whole micro-batch gradient of every plan is compared with the
exact one (``plan_gradient_cosines``): JAGG and the two ablations with groups of W = 2..10 (jagg_frac 1), shared
knots with K = 2..T for every placement rule, and the measured placement (``calibrate_knots`` on the OTHER
rollout of the pair, then judged on this one). Structures:
    full         all 20 usable steps trained;
    dancegrpo    DanceGRPO's random 12 of the 20 per sample, sorted (the groups / knots lie among them);
    authors      the JAGG authors' 3 random whole blocks of 4 consecutive steps (5 blocks of 4).
Section 1b (video, ``--video``). The same on the video world's tiny Wan (configs/world/wan_video.yaml, moving-shape
clips of 4 frames), every step trained at T = 10 and T = 20 (an 11- and a 21-step schedule), JAGG W = 2..5 and
knots K = 2..5, the plain loss on the video preference reward -> results/knots_video.csv, knots_video.md,
paper_figures/knots_cosine_video.png (its update and iteration time: ``table1.py --only video``).
Section 2 (time). Full trajectory (``algorithm.timestep_fraction=1.0``: all 20 steps trained): exact, JAGG W = 4
and knots K = 4 / 6 (low_noise), interleaved on the same rollouts (``jagg.loop.timing.time_settings``), with
each phase's median seconds and the iteration / update relative to the rollout.

    python experiments/knots.py [--quick] [--rollouts 2] [--iterations 4] [--video]
    -> results/knots.csv, results/knots_time.csv, results/knots.md, paper_figures/knots_cosine.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

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
from jagg.engine.diagnostics import plan_gradient_cosines
from jagg.engine.knots import PLACEMENTS, Knots
from jagg.engine.routing import BackwardSetting, Routing, calibrate_knots
from jagg.loop.components import build_components
from jagg.loop.timing import time_settings
from jagg.loop.trainer import Trainer
from jagg.world.pretrained import REPORTS as WORLD_REPORTS
from plotting import figure_footer, save_figure, world_scale

BACKBONES = ("flux", "qwenimage")
STRUCTURES = ("full", "dancegrpo", "authors")
GROUP_STRATEGIES = ("jagg", "endpoints", "uniform")
GROUP_SIZES = (2, 4, 5, 7, 10)
KNOT_COUNTS = (2, 3, 4, 6, 8, 10)
PINNED = [  # the gradient-geometry loss (as make cosine pins it), a 21-step schedule, micro-batches of 16
    *PLAIN_DANCEGRPO_LOSS,
    "sampling.num_steps=21",
    "sampling.eval_num_steps=21",
    "train.images_per_prompt=4",
    "train.prompts_per_iter=4",
    "train.train_batch_size=16",
    "train.grad_accum=1",
]
QUICK = [*TINY_RUN, "sampling.num_steps=7", "sampling.eval_num_steps=7", "train.train_batch_size=4"]
IMAGE_CONFIG = "configs/world/flux_dancegrpo.yaml"
VIDEO_CONFIG = "configs/world/wan_video.yaml"
VIDEO_STEPS = (10, 20)  # trained steps: every usable step of an 11- and a 21-step schedule
VIDEO_GROUP_SIZES = VIDEO_KNOT_COUNTS = (2, 3, 4, 5)
# the plain loss scores clips with the video preference reward (the image rewards cannot score clips); quick: the
# weight-free temporal term on the tiny random-init Wan, 5 and 7 steps (4 and 6 trained)
VIDEO_REWARD = ["reward.weights={video_pref: 1.0}", "reward.eval=[video_pref]"]
VIDEO_QUICK = ["reward.weights={temporal: 1.0}", "reward.eval=[temporal]"]
VIDEO_QUICK_STEPS = (4, 6)


class Study(NamedTuple):
    """One panel of the cosine section: a backbone's config and overrides, a step structure, the plan sizes."""

    backbone: str
    structure: str
    config: str
    overrides: list[str]
    group_sizes: tuple[int, ...] = GROUP_SIZES
    knot_counts: tuple[int, ...] = KNOT_COUNTS


def image_studies(args) -> list[Study]:
    return [
        Study(b, s, IMAGE_CONFIG, [f"model.backbone={b}", *args.overrides])
        for b in args.backbones
        for s in args.structures
    ]


def video_studies(args) -> list[Study]:
    """Every step of the video world trained, at each of ``VIDEO_STEPS`` (``VIDEO_QUICK_STEPS`` when quick)."""
    steps, reward = (VIDEO_QUICK_STEPS, VIDEO_QUICK) if args.quick else (VIDEO_STEPS, VIDEO_REWARD)
    return [
        Study(
            "wan",
            "full",
            VIDEO_CONFIG,
            [*args.overrides, *reward, f"sampling.num_steps={t + 1}", f"sampling.eval_num_steps={t + 1}"],
            VIDEO_GROUP_SIZES,
            VIDEO_KNOT_COUNTS,
        )
        for t in steps
    ]


def trained_steps(structure: str, trainer: Trainer, n: int, index: int) -> torch.Tensor:
    """(n, T) sorted trained steps of a structure (its draws from a generator of the rollout index)."""
    usable = len(trainer.sigmas) - 2
    gen = torch.Generator().manual_seed(10_000 + index)
    if structure == "full":
        return torch.arange(usable).expand(n, usable)
    if structure == "dancegrpo":
        t = int(usable * 0.6)
        return torch.stack([torch.randperm(usable, generator=gen)[:t].sort().values for _ in range(n)])
    w = 4
    blocks = [
        torch.randperm(usable // w, generator=gen)[: int(usable // w * 0.6)].sort().values for _ in range(n)
    ]
    return torch.stack([(b[:, None] * w + torch.arange(w)).flatten() for b in blocks])


def plans(study: Study, t: int) -> dict[str, tuple[str, int, Routing | Knots]]:
    """label -> (rule, size, routing) for every fixed plan of T steps (groups of W, knots of every rule)."""
    out = {}
    for s in GROUP_STRATEGIES:
        for w in study.group_sizes:
            if w <= t:
                out[f"{s}/W{w}"] = (s, w, Routing(strategy=s, group_size=w, jagg_frac=1.0))
    for k in study.knot_counts:
        if k <= t:
            for rule in PLACEMENTS:
                out[f"knots_{rule}/K{k}"] = (f"knots_{rule}", k, Knots(count=k, placement=rule))
    return out


def measure(study: Study, args, progress: ProgressETA) -> tuple[list[dict], dict]:
    """Rows (one per rollout x plan) of one study, and the resolved config."""
    backbone, structure = study.backbone, study.structure
    cfg = load_config(study.config, study.overrides)
    comp = dataclasses.replace(build_components(cfg), train_prompts=build_components(cfg).eval_prompts)
    trainer = Trainer(cfg, comp, run_dir=Path("runs/knots"))
    b = cfg.train.train_batch_size
    losses = []  # (velocity, loss) of the first micro-batch of each rollout
    for r in range(args.rollouts):
        ro = trainer.rollout(r, SeedStream.KNOTS)
        idx = slice(0, b)
        steps = trained_steps(structure, trainer, len(ro.prompts), r)[idx]
        losses.append((trainer.velocity(ro.cond.select(idx)), trainer.grpo_loss(ro, steps, idx)))
    rows = []
    for r, (velocity, loss) in enumerate(losses):
        t = loss.x.shape[0]
        compared = plans(study, t)
        cal_velocity, cal = losses[
            (r + 1) % len(losses)
        ]  # the measured placement comes from the OTHER rollout
        for k in (k for k in study.knot_counts if k <= t):
            chosen = calibrate_knots(
                cal_velocity,
                cal,
                trainer.params,
                count=k,
                graph_mode=cfg.backward.graph_mode,
            ).chosen
            compared[f"knots_auto/K{k}"] = ("knots_auto", k, chosen)
        interps = {name: routing.interpolation(loss.sigma) for name, (_, _, routing) in compared.items()}
        cosines = plan_gradient_cosines(velocity, loss.x, loss.sigma, loss, trainer.params, interps)
        for name, (rule, size, routing) in compared.items():
            rows.append(
                dict(
                    backbone=backbone,
                    structure=structure,
                    rollout=r,
                    T=t,
                    plan=name,
                    rule=rule,
                    size=size,
                    placement=getattr(routing, "placement", ""),
                    knots=",".join(map(str, interps[name].knots)),
                    backward_passes=BackwardSetting(routing=routing, stored_outputs=False)
                    .cost(t)
                    .backward_passes,
                    cosine=cosines[name][0],
                    rel_err=cosines[name][1],
                )
            )
        progress.step(f"{backbone} {structure} T={t} rollout {r}")
    return rows, cfg.to_dict()


def time_full_trajectory(backbone: str, args, progress: ProgressETA) -> tuple[list[dict], dict]:
    """Exact, JAGG W = 4 and knots K = 4 / 6 on the full trajectory, interleaved on the same rollouts."""
    cfg = load_config(
        "configs/world/flux_dancegrpo.yaml",
        [
            f"model.backbone={backbone}",
            *args.overrides,
            "algorithm.timestep_fraction=1.0",
            "train.grad_accum=2",
        ],
    )
    trainer = Trainer(cfg, build_components(cfg), run_dir=Path("runs/knots"))
    settings = [
        cfg.backward.setting(Routing(strategy="exact", group_size=2)),
        cfg.backward.setting(Routing(strategy="jagg", group_size=4, jagg_frac=1.0)),
        cfg.backward.setting(Knots(count=4, placement="low_noise")),
        cfg.backward.setting(Knots(count=6, placement="low_noise")),
    ]
    timed = time_settings(trainer, settings, args.iterations, progress)
    rows = []
    for key, runs in timed.items():
        for it, row in enumerate(runs):
            rollout = row["time_sample_s"] + row["time_reward_s"]
            rows.append(
                dict(
                    backbone=backbone,
                    setting=key,
                    iteration=it,
                    T=row["T"],
                    backward_passes_per_sample=row["backward_passes_per_sample"],
                    time_rollout_s=rollout,
                    time_update_s=row["time_update_s"],
                    time_iteration_s=rollout + row["time_update_s"],
                )
            )
    return rows, cfg.to_dict()


# --------------------------------------------------------------------------- summary and figure
def best_at(df, rule_prefix: str, passes: int) -> float:
    """The best (highest mean over rollouts) cosine of plans of one family at exactly ``passes`` passes."""
    sel = df[df.rule.str.startswith(rule_prefix) & (df.backward_passes == passes)]
    return float(sel.groupby("plan").cosine.mean().max()) if len(sel) else float("nan")


def summary(df, timing) -> str:
    """Markdown: per backbone x structure, 1 - cos of JAGG's best W and of every knot rule at equal passes,
    and the full-trajectory timing relative to the rollout."""
    import pandas as pd

    lines = ["## Cosine to exact at equal backward passes per sample (mean over rollouts)", ""]
    rules = ["knots_index", "knots_time", "knots_low_noise", "knots_auto"]
    table = []
    for (backbone, structure, _), g in df.groupby(["backbone", "structure", "T"], sort=False):
        # every pass count a JAGG group size or a knot count reaches (the other family's cell "-")
        for passes in sorted(set(g[g.rule.isin(["jagg", *rules])].backward_passes)):
            jagg = best_at(g, "jagg", passes)
            row = {
                "backbone": backbone,
                "structure": structure,
                "T": int(g["T"].iloc[0]),
                "passes": passes,
                "JAGG (best W)": "-" if jagg != jagg else f"{jagg:.4f}",
            }
            best_fixed = max(best_at(g, r, passes) for r in rules[:3])
            for r in rules:
                c = best_at(g, r, passes)
                row[r] = "-" if c != c else f"{c:.4f}"
            ratio = (1 - best_fixed) / (1 - jagg) if 1 - jagg > 1e-6 else float("nan")  # W = 2: both exact
            row["(1-cos) best rule / JAGG"] = "-" if ratio != ratio else f"{ratio:.2f}"
            table.append(row)
    lines += [markdown_table(pd.DataFrame(table)), ""]
    if timing is not None and len(timing):
        lines += ["## Full trajectory (20 of 20 steps trained): median seconds per iteration", ""]
        trows = []
        for (backbone, setting), g in timing.groupby(["backbone", "setting"], sort=False):
            med = g[["time_rollout_s", "time_update_s", "time_iteration_s"]].median()
            trows.append(
                {
                    "backbone": backbone,
                    "setting": setting,
                    "backward passes / sample": f"{g.backward_passes_per_sample.iloc[0]:g}",
                    "rollout s": f"{med.time_rollout_s:.2f}",
                    "update s": f"{med.time_update_s:.2f}",
                    "iteration / rollout": f"{med.time_iteration_s / med.time_rollout_s:.2f}",
                }
            )
        lines += [markdown_table(pd.DataFrame(trows)), ""]
    return "\n".join(lines)


def render(csv: Path, figure: Path) -> None:
    """Cosine vs backward passes per sample, one panel per backbone x structure, from the CSV alone."""
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.read_csv(csv)
    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    timing_csv = csv.with_name(csv.stem.replace("knots", "knots_time") + ".csv")
    timing = pd.read_csv(timing_csv) if timing_csv.is_file() else None
    atomic_write_text(csv.with_suffix(".md"), summary(df, timing))
    panels = list(df.groupby(["backbone", "structure", "T"], sort=False))
    n_cols = max(df.structure.nunique(), df.groupby(["backbone", "structure"])["T"].nunique().max())
    rows = -(-len(panels) // n_cols)
    fig, axes = plt.subplots(rows, n_cols, figsize=(4.4 * n_cols, 3.5 * rows), squeeze=False, sharey=True)
    for ax, ((backbone, structure, _), g) in zip(axes.flat, panels):
        for rule, style in [
            ("jagg", "o-"),
            ("endpoints", "x:"),
            ("uniform", "+:"),
            ("knots_index", "s--"),
            ("knots_time", "^--"),
            ("knots_low_noise", "v-"),
            ("knots_auto", "*"),
        ]:
            # per pass count the best plan of the rule (mean over rollouts), as the summary table reads it
            sel = g[g.rule == rule].groupby(["backward_passes", "plan"]).cosine.mean().groupby(level=0).max()
            ax.plot(sel.index, sel.values, style, label=rule, ms=4)
        ax.set_title(f"{backbone}, {structure} (T = {g['T'].iloc[0]})", fontsize=9)
        ax.set_xlabel("backward passes per sample")
        ax.set_ylim(max(0.5, g.cosine.min() - 0.02), 1.002)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("cos(gradient, exact)")
    axes[0, -1].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "Shared knots vs JAGG groups: gradient cosine to exact at equal backward passes", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    figure_footer(fig, meta, world_scale(csv.parent))
    save_figure(fig, figure, dpi=130)


# What make knots rewrites, and make pretrain's reports of the world it runs first:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/knots*", "paper_figures/knots_*", *WORLD_REPORTS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="default results/knots.csv (--video: results/knots_video.csv)")
    ap.add_argument(
        "--figure", help="default paper_figures/knots_cosine.png (--video: knots_cosine_video.png)"
    )
    ap.add_argument("--video", action="store_true", help="the video world's Wan, T = 10 and 20 (no timing)")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=4, help="timed full-trajectory iterations per backbone")
    ap.add_argument("--quick", action="store_true", help="tiny random-init models, seconds (tests)")
    ap.add_argument("--render-only", action="store_true", help="summary and figure from the CSVs")
    ap.add_argument("--backbones", nargs="+", default=list(BACKBONES), choices=BACKBONES)
    ap.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    args = ap.parse_args(argv)
    set_threads(1)
    args.overrides = PINNED + (QUICK if args.quick else [])
    suffix = "_video" if args.video else ""
    out = Path(args.out or f"results/knots{suffix}.csv")
    figure = Path(args.figure or f"paper_figures/knots_cosine{suffix}.png")
    studies = video_studies(args) if args.video else image_studies(args)
    timed = [] if args.video else args.backbones
    if not args.render_only:
        eta = ProgressETA(len(studies) * args.rollouts + len(timed) * args.iterations, "knots")
        # recorded before the runs: the commit the measured code came from, not the one at write time
        meta = run_metadata(
            outputs=OUTPUTS,
            command=command_line("experiments/knots.py", argv),
            seed="rollout index",
            config={k: v for k, v in vars(args).items() if k != "overrides"},
            overrides=args.overrides,
        )
        rows, timing, configs = [], [], {}
        for study in studies:
            new, cfg = measure(study, args, eta)
            configs[f"{study.backbone}/{study.structure}/T{new[0]['T']}"] = cfg
            rows += new
        for backbone in timed:
            new, configs[f"{backbone}/time"] = time_full_trajectory(backbone, args, eta)
            timing += new
        meta["train_configs"] = configs
        if timed:
            write_table(timing, out.with_name("knots_time.csv"), meta)
        write_table(rows, out, meta)
    render(out, figure)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
