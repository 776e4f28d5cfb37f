"""How finely the weight-free judge ``render_match`` resolves a difference (issue 56), measured cheaply on the
base model: the equal-cost recipe's initial weights evaluated under each seed's evaluation noise, 12 held-out
prompts x ``--images`` per prompt, with held-out pref beside it.

The seed-to-seed SD of an evaluation's mean bounds the paired SD of two arms' difference from above by
sqrt(2) x SD where their evaluation noise were independent (paired arms share it, so the real paired SD is
smaller); the minimum detectable difference at n seeds (one-sided paired t-test, power 0.8, alpha 0.05) is
read at that bound, so "resolves 0.02" here is conservative.

    python experiments/judge_resolution.py [--seeds 950 ... 959] [--images 4 16]
    -> results/judge_resolution.csv (one row per seed x images per prompt), results/judge_resolution.md
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.config import load_config
from jagg.loop.components import build_components
from jagg.loop.trainer import Trainer
from jagg.stats import minimum_detectable_difference

CONFIG = "configs/world/curves_flux_every_step.yaml"
METRICS = ("eval_render_match_mean", "eval_pref_mean")


def base_evaluation(seed: int, images: int, run_dir: Path) -> dict:
    """The base model's evaluation row (iteration 0) under seed ``seed``'s evaluation noise."""
    cfg = load_config(
        CONFIG,
        [
            "reward.eval=[pref, render_match]",
            f"log.eval_images_per_prompt={images}",
            f"train.seed={seed}",
            f"log.run_dir={run_dir}",
        ],
    )
    row, _, _ = Trainer(cfg, build_components(cfg), run_dir).evaluate(0)
    return {"seed": seed, "images_per_prompt": images, "samples": 12 * images} | {m: row[m] for m in METRICS}


def render(rows: list[dict], alpha: float = 0.05, power: float = 0.8) -> str:
    lines = [
        "# Resolution of the weight-free judge (experiments/judge_resolution.py)",
        "",
        f"Base model of `{CONFIG}`, evaluated under each seed's evaluation noise (12 held-out prompts). SD: over "
        "seeds of the evaluation's mean. MDD: the smallest difference a one-sided paired t-test detects with "
        f"power {power} at alpha {alpha} at n seeds, at the paired SD's upper bound sqrt(2) x SD (paired arms "
        "share the evaluation noise, so the real one is smaller).",
        "",
        "| metric | images per prompt | seeds | mean | SD over seeds | MDD at 6 seeds | MDD at 10 seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        for k in sorted({r["images_per_prompt"] for r in rows}):
            v = np.array([r[m] for r in rows if r["images_per_prompt"] == k])
            sd = float(np.std(v, ddof=1))
            mdd = [
                minimum_detectable_difference(math.sqrt(2) * sd, n, alpha, power, "greater") for n in (6, 10)
            ]
            lines.append(
                f"| {m[5:-5]} | {k} | {len(v)} | {v.mean():.4f} | {sd:.4f} | {mdd[0]:.4f} | {mdd[1]:.4f} |"
            )
    return "\n".join(lines + [""])


# What this driver rewrites:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/judge_resolution*",)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=list(range(950, 960)))
    ap.add_argument("--images", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--out", default="results/judge_resolution.csv")
    args = ap.parse_args(argv)
    set_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [base_evaluation(s, k, Path(tmp) / f"s{s}_k{k}") for k in args.images for s in args.seeds]
    out = Path(args.out)
    meta = run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/judge_resolution.py", argv),
        seeds=args.seeds,
        config=CONFIG,
    )
    write_table(rows, out, meta)
    atomic_write_text(out.with_suffix(".md"), render(rows))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
