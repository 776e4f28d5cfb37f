"""What measured routing chooses on each world backbone and algorithm, and what it saves against jagg_frac 0.6.

For every Table 1 setup (the same world configs, step structures and batch as ``experiments/table1.py``) one
trainer calibrates with ``backward.jagg_frac=auto`` and ``backward.group_size=auto`` (candidates
``backward.group_sizes``) on one rollout, exactly as a training run does at iteration 0, then times, on the same
rollouts and interleaved (``jagg.loop.timing.time_settings``): the exact baseline, JAGG with the paper's routing
(W = 3, jagg_frac 0.6) and JAGG with the measured routing and W, both in the engine's default mode (batched
endpoints + stored rollout outputs). Reported per setup: the cosines of every candidate W, the chosen W and
routing, backward passes per sample, median update seconds, the speed-ups, the calibration's seconds, and how
many iterations of the saving vs jagg_frac 0.6 pay for one calibration.

    python experiments/routing.py [--iterations 6] [--quick]   (make routing)
    -> results/routing.csv, results/routing.md
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from jagg.engine.routing import Routing
from jagg.loop.components import build_components
from jagg.loop.timing import QUICK, TIMING_SETUPS, time_settings, timing_config
from jagg.loop.trainer import Trainer
from jagg.world.pretrained import REPORTS as WORLD_REPORTS

AUTO = ["backward.jagg_frac=auto", "backward.group_size=auto"]


def measure(
    setup: tuple[str, str],
    extra: list[str],
    iterations: int,
    quick: bool = False,
    progress: ProgressETA | None = None,
) -> dict:
    backbone, algo = setup
    cfg = timing_config(setup, quick=quick, overrides=[*extra, *AUTO])
    trainer = Trainer(cfg, build_components(cfg), run_dir=Path("runs/routing"))
    cal = trainer.calibrate(trainer.rollout(0, SeedStream.WARMUP))
    strategies = [
        cfg.backward.setting(Routing(strategy="exact", group_size=3, jagg_frac=0.6)),
        cfg.backward.setting(Routing(strategy="jagg", group_size=3, jagg_frac=0.6)),
        trainer.setting,  # the measured routing and W
    ]
    rows = time_settings(trainer, strategies, iterations, progress)
    keys = [s.key for s in strategies]
    med = {k: statistics.median(r["time_update_s"] for r in rows[k]) for k in keys}
    bwd = {k: rows[k][0]["backward_passes"] * cfg.train.train_batch_size / rows[k][0]["n"] for k in keys}
    exact, paper, auto = keys
    saved = med[paper] - med[auto]
    return dict(
        backbone=backbone,
        algorithm=algo,
        trained_steps=rows[exact][0]["T"],
        candidates=json.dumps(
            {w: [round(c, 4) for c in v["cosines"]] for w, v in cal["calibration_by_group_size"].items()}
        ),
        chosen_W=cal["group_size"],
        routing=json.dumps(cal["routing"]),
        bwd_exact=bwd[exact],
        bwd_frac06=bwd[paper],
        bwd_auto=bwd[auto],
        update_s_exact=med[exact],
        update_s_frac06=med[paper],
        update_s_auto=med[auto],
        speedup_auto_vs_frac06=med[paper] / med[auto],
        speedup_auto_vs_exact=med[exact] / med[auto],
        calibrate_s=cal["time_calibrate_s"],
        iterations_to_repay=cal["time_calibrate_s"] / saved if saved > 0 else float("nan"),
        min_cosine=cfg.backward.min_cosine,
        iterations=iterations,
    )


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Measured routing (`backward.jagg_frac: auto`, `backward.group_size: auto`) on the world backbones",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}; "
        f"{rows[0]['iterations']} timed iterations per setup, strategies interleaved on the same rollouts "
        f"(medians); min_cosine {rows[0]['min_cosine']}. Command: `{meta['command']}`",
        "",
        "Cosine of each group's JAGG gradient to its exact gradient, per candidate W (groups in trajectory "
        "order), measured on one micro-batch of one rollout:",
        "",
        "| backbone | algorithm | trained steps | cosines per candidate W | chosen W | routing |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cands = "; ".join(f"W={w}: {c}" for w, c in json.loads(r["candidates"]).items())
        lines.append(
            f"| {r['backbone']} | {r['algorithm']} | {r['trained_steps']} | {cands} | {r['chosen_W']} | "
            f"{', '.join(json.loads(r['routing']))} |"
        )
    lines += [
        "",
        "Update phase (median seconds per iteration) and backward passes per sample; exact, JAGG at the paper's "
        "W = 3 / jagg_frac 0.6, JAGG with the measured routing (default mode: batched + stored outputs):",
        "",
        "| backbone | algorithm | bwd / sample: exact, 0.6, auto | update s: exact, 0.6, auto | auto vs 0.6 "
        "| auto vs exact | calibration s | iterations to repay |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        repay = r["iterations_to_repay"]
        same = r["bwd_auto"] == r["bwd_frac06"]
        lines.append(
            f"| {r['backbone']} | {r['algorithm']} | {r['bwd_exact']:g}, {r['bwd_frac06']:g}, {r['bwd_auto']:g} | "
            f"{r['update_s_exact']:.3f}, {r['update_s_frac06']:.3f}, {r['update_s_auto']:.3f} | "
            f"{r['speedup_auto_vs_frac06']:.2f}x | {r['speedup_auto_vs_exact']:.2f}x | {r['calibrate_s']:.2f} | "
            + ("- (same passes as 0.6)" if same else f"{repay:.1f}" if repay == repay else "never")
            + " |"
        )
    lines += [
        "",
        "Iterations to repay = calibration seconds / update seconds saved per iteration vs jagg_frac 0.6 (where "
        "the routing differs); a run calibrates once per `backward.calibrate_every` (default 25) iterations. "
        "Where auto routes like 0.6 its only effect is the calibration's cost, the price of having checked.",
    ]
    return "\n".join(lines) + "\n"


def render(csv: Path) -> None:
    import pandas as pd

    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    atomic_write_text(csv.with_suffix(".md"), to_markdown(pd.read_csv(csv).to_dict("records"), meta))


# What make routing rewrites, and make pretrain's reports of the world it runs first:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/routing*", *WORLD_REPORTS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default="results/routing.csv")
    ap.add_argument("--quick", action="store_true", help="tiny random-init models, seconds (tests)")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every setup")
    args = ap.parse_args(argv)
    set_threads(1)
    iterations = 1 if args.quick else args.iterations
    eta = ProgressETA(len(TIMING_SETUPS) * iterations, "routing")
    rows = [measure(setup, args.overrides, iterations, args.quick, eta) for setup in TIMING_SETUPS]
    meta = run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/routing.py", argv),
        config=[f"configs/world/{b}_{a}.yaml" for b, a in TIMING_SETUPS],
        overrides=(QUICK if args.quick else []) + args.overrides,
        seed=0,
    )
    out = Path(args.out)
    write_table(rows, out, meta)
    render(out)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
