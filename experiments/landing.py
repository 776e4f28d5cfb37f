"""Where one update lands, arm by arm, and the estimator's own noise as the yardstick (issue 43).

Per recipe, seed and arm: a fresh trainer at the recipe's initial weights takes iteration 0 (the same rollout for
every arm of a seed) with fidelity and landing logged (``log.fidelity_every: 1``, ``log.landing: true``), then
samples iteration 1's rollout (the same noise for every arm) and scores it. What each arm's update did is
then read three ways against the reference's (exact on the same steps):

* the instruments a run logs: the gradient's cosine (fidelity), the AdamW step's cosine and sign agreement,
  the velocity's change on the micro-batch's states (``jagg.plugins.landing``);
* the outcome they should predict: the mean |reward - reference's reward| per sample of iteration 1;
* the yardstick: the cosine between the reference's gradients from two independent rollouts (two seeds) at
  the same weights, i.e. how much a single GRPO gradient moves with its rollout.

The Spearman correlation across arms (means over seeds) of each instrument's distance (1 - a cosine, or a
relative error) with the reward
distance says which instrument ranks the arms as their next-iteration rewards do.

    python experiments/landing.py [--recipes authors ...] [--seeds 40 41 42] [--quick]
    -> results/landing.csv (one row per recipe x seed x arm), results/landing.md (+ .meta.json)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
from pathlib import Path

import numpy as np
import torch

from jagg.common import (
    atomic_write_text,
    command_line,
    markdown_table,
    run_metadata,
    set_threads,
    write_table,
)
from jagg.config import TINY_RUN, load_config
from jagg.loop.components import build_components
from jagg.loop.trainer import Trainer
from jagg.plugins.base import Plugin

EVAL = ["reward.eval=[pref]", "log.save_eval_state=false", "log.eval_every=0"]
BLOCKS = ["backward.strategy=exact", "algorithm.exact_steps=structure"]
RANDOM = lambda c, d="fixed": [*BLOCKS, f"train.control_cosine={c}", f"train.control_direction={d}"]  # noqa: E731
STRUCTURED = lambda kind, dial: [*BLOCKS, f"train.control_structure={kind}", f"train.control_dial={dial}"]  # noqa: E731
RECIPES: dict[str, tuple[str, dict[str, list[str]]]] = {
    "authors": (
        "configs/world/curves_flux_authors.yaml",
        {
            "exact_blocks": BLOCKS,
            "jagg": ["backward.strategy=jagg"],
            "jagg_index": ["backward.strategy=jagg_index"],
            "endpoints": ["backward.strategy=endpoints"],
            "knots6": ["backward.strategy=knots", "backward.knots=6"],
            "control_0.95": RANDOM(0.95),
            "control_0.8": RANDOM(0.8),
            "control_fresh_0.8": RANDOM(0.8, "fresh"),
            "reweight_0.5": STRUCTURED("reweight", 0.5),
            "reweight_1.0": STRUCTURED("reweight", 1.0),
            "toward_endpoints_0.25": STRUCTURED("toward_endpoints", 0.25),
            "toward_endpoints_0.5": STRUCTURED("toward_endpoints", 0.5),
        },
    ),
    "mixgrpo": (
        "configs/world/curves_flux_mixgrpo.yaml",
        {"exact": ["backward.strategy=exact"], "jagg": ["backward.strategy=jagg"]},
    ),
    "every_step": (
        "configs/world/curves_flux_every_step.yaml",
        {"exact": ["backward.strategy=exact"], "knots4": ["backward.strategy=knots", "backward.knots=4"]},
    ),
    "dancegrpo": (
        "configs/world/curves_flux_dancegrpo.yaml",
        {"exact": ["backward.strategy=exact"], "jagg": ["backward.strategy=jagg"]},
    ),
}
# every instrument a run logs at a fidelity iteration; a cosine or agreement is read as 1 - value, an error as is
INSTRUMENTS = (
    "fidelity_cosine",
    "fidelity_rel_err",
    "landing_step_cosine",
    "landing_sign_agreement",
    "landing_tensor_cosine_min",
    "landing_tensor_cosine_median",
    "landing_function_cosine",
    "landing_function_rel_err",
)


def distance(name: str, values):
    """An instrument as a distance from the reference (0 for the reference itself)."""
    return values if name.endswith("rel_err") else 1 - values


class GradientTap(Plugin):
    """Keeps the gradient each optimizer step receives (flat, float64): the yardstick's input."""

    name = "gradient_tap"

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def before_step(self, view, pending) -> None:
        if view is not None:
            self.grads.append(torch.cat([p.grad.detach().double().flatten() for p in view.params]))


def one_arm(
    config: str, overrides: list[str], seed: int, run_dir: Path
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(iteration 0's metrics row, iteration 1's per-sample rewards, the gradient of the first step)."""
    cfg = load_config(
        config,
        [
            *overrides,
            f"train.seed={seed}",
            "log.fidelity_every=1",
            "log.landing=true",
            f"log.run_dir={run_dir}",
        ],
    )
    print(f"[landing] {run_dir.parent.name} {run_dir.name}", flush=True)
    trainer = Trainer(cfg, build_components(cfg), run_dir)
    tap = GradientTap()
    trainer.plugins.append(tap)  # last: sees the gradient the optimizer receives
    weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.params)).hexdigest()
    row = trainer.train_iteration(0) | {"initial_weights": weights[:16]}
    trainer.iteration = 1
    return row, trainer.rollout(1).rewards.double(), tap.grads[0]


def measure(recipe: str, seeds: list[int], extra: list[str], runs: Path) -> list[dict]:
    config, arms = RECIPES[recipe]
    ref = next(iter(arms))
    rows, grads = [], {}
    for seed in seeds:
        out = {
            a: one_arm(config, [*EVAL, *o, *extra], seed, runs / recipe / f"{a}_seed{seed}")
            for a, o in arms.items()
        }
        grads[seed] = out[ref][2]
        for arm, (row, rewards, _) in out.items():
            rows.append(
                {"recipe": recipe, "seed": seed, "arm": arm, "reference": ref}
                | {k: row.get(k, float("nan")) for k in INSTRUMENTS}
                | {
                    "next_reward_mean": rewards.mean().item(),
                    "next_reward_abs_diff": (rewards - out[ref][1]).abs().mean().item(),
                    "initial_weights": row["initial_weights"],
                }
            )
    if len({r["initial_weights"] for r in rows}) != 1:
        raise SystemExit(f"{recipe}: the seeds start from different weights; the yardstick needs the same")
    for a, b in itertools.combinations(seeds, 2):  # the yardstick: two rollouts, same weights
        cos = torch.nn.functional.cosine_similarity(grads[a], grads[b], dim=0).item()
        rows.append(
            {
                "recipe": recipe,
                "seed": f"{a}-{b}",
                "arm": "yardstick",
                "reference": ref,
                "fidelity_cosine": cos,
            }
        )
    return rows


def spearman(x, y) -> float:
    """Spearman's rank correlation in float64, tied values sharing their mean rank (``scipy.stats.spearmanr``):
    two controls' fidelities differ by 1e-10, which a float32 cast ties (issue 56: 0.79 for 0.80)."""
    from scipy.stats import spearmanr

    return float(spearmanr(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)).statistic)


N_BOOT = 2000  # bootstrap resamples of the seeds


def spearman_interval(d, instrument: str, reference: str, n_boot: int = N_BOOT, level: float = 0.95):
    """The Spearman of ``instrument``'s distance with the next-iteration reward distance across the arms
    (means over seeds), and its percentile bootstrap interval over seeds: the seeds drawn with replacement,
    every arm's mean taken over the same draw (the arms of a seed share its rollout). Returns (rho, lo, hi)."""
    arms = d[(d.arm != "yardstick") & (d.arm != reference)]
    per_seed = {
        k: g.set_index("arm")[[instrument, "next_reward_abs_diff"]].astype(float)
        for k, g in arms.groupby("seed")
    }
    seeds = sorted(per_seed)

    def rho(draw) -> float:
        m = sum(per_seed[k] for k in draw) / len(draw)
        return spearman(distance(instrument, m[instrument]), m.next_reward_abs_diff)

    rng = np.random.default_rng(0)
    boots = [rho([seeds[i] for i in rng.integers(len(seeds), size=len(seeds))]) for _ in range(n_boot)]
    lo, hi = np.nanpercentile(boots, [50 * (1 - level), 50 * (1 + level)])
    return rho(seeds), float(lo), float(hi)


def render(csv: Path) -> str:
    import pandas as pd

    df = pd.read_csv(csv)
    lines = [
        "# Where one update lands (experiments/landing.py)",
        "",
        "Means over seeds. Instruments: cosine of the gradient handed to the optimizer (fidelity), of the AdamW "
        "step, the steps' sign agreement, and the cosine of the velocity's change on the micro-batch's states, "
        "each to the reference's. Outcome: mean |reward - reference's| per sample on iteration 1's rollout "
        "(same noise). Yardstick: the reference's gradients from two seeds' rollouts at the same weights.",
        "",
    ]
    for recipe, d in df.groupby("recipe", sort=False):
        shown = [k for k in INSTRUMENTS if k in d]
        arms = d[d.arm != "yardstick"].groupby("arm", sort=False)[[*shown, "next_reward_abs_diff"]].mean()
        yard = d[d.arm == "yardstick"].fidelity_cosine
        lines += [f"## {recipe} (reference {d.reference.iloc[0]})", ""]
        lines.append(markdown_table(arms.reset_index()))
        lines += [
            "",
            f"Yardstick (gradient cosine between two independent rollouts): {yard.mean():.3f} "
            f"(pairs: {', '.join(f'{v:.3f}' for v in yard)}).",
            "",
        ]
        others = arms.drop(index=d.reference.iloc[0])
        if len(others) >= 3:
            n = d[d.arm != "yardstick"].seed.nunique()
            lines.append(
                "Spearman across arms of each instrument's distance (1 - cosine or agreement; a relative error "
                f"as is) with the next-iteration reward distance, [95% percentile bootstrap over the {n} seeds, "
                f"{N_BOOT} draws]:"
            )
            for k in [k for k in INSTRUMENTS if k in others]:  # a CSV of fewer instruments (an older run)
                rho, lo, hi = spearman_interval(d, k, d.reference.iloc[0])
                lines.append(f"- {k}: {rho:+.2f} [{lo:+.2f}, {hi:+.2f}]")
            lines.append("")
    return "\n".join(lines)


# What this driver rewrites:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/landing*",)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[40, 41, 42])
    ap.add_argument("--out", default="results/landing.csv")
    ap.add_argument("--runs", default="runs/landing")
    ap.add_argument("--quick", action="store_true", help="tiny runs, seconds (tests)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    set_threads(1)
    extra = [*(TINY_RUN if args.quick else []), *args.overrides]
    rows = [r for recipe in args.recipes for r in measure(recipe, args.seeds, extra, Path(args.runs))]
    out = Path(args.out)
    meta = run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/landing.py", argv),
        seeds=args.seeds,
        recipes={r: RECIPES[r][0] for r in args.recipes},
        overrides=extra,
    )
    write_table(rows, out, meta)
    atomic_write_text(out.with_suffix(".md"), render(out))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
