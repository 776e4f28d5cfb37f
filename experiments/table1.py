"""Table 1: wall-clock per training iteration, exact vs JAGG vs the endpoints ablation, side by side.

For every backbone x algorithm, one trainer samples a rollout per iteration and then runs the update once per
strategy on that same rollout, the strategy order rotating between iterations, each from the rollout's
weights (``jagg.loop.timing.time_settings``: every strategy's update is the one a training iteration would run,
stored outputs valid). Reported per strategy: median seconds per iteration and
per phase (sampling, reward, update; forward and backward inside the update), forward/backward passes per
sample, peak memory held by autograd for backward, the reduction vs exact, and the reduction predicted by pass
counting from the measured per-pass costs (forward with grad and backward from the exact update, forward
without grad from the rollout). A second table sweeps W and jagg_frac.

A third section times the JAGG authors' own recipe (configs/world/<backbone>_dancegrpo_authors.yaml, DanceGRPO
on both world backbones: 21 steps, 5 blocks of W = 4, 3 random blocks trained per sample, gradient
checkpointing on) on shared rollouts: its exact baseline, the authors' method (step-index weights, sequential
endpoints, no stored outputs, W + 2 forwards per block), the same with t-weights and this repository's default
(batched + stored outputs) with both weight rules; and, interleaved with them, the exact baseline and the
authors' method with checkpointing off, as the published script runs (docs/references.md#the-jagg-authors-code).

A fourth times SD3.5-M's Flow-GRPO recipe (configs/paper/sd3/sd35m_flowgrpo.yaml) with Table 1's strategies on a
tiny random-init SD3 pipeline of the real classes (the world has no SD3 backbone; ``jagg.loop.timing.SD3_TIMING``
says what is kept and what changed), at every scale.

A fifth (world scale) times the video world's tiny Wan with every step trained, T = 10 and 20: exact, JAGG and
shared knots (``VIDEO``).

    python experiments/table1.py [--scale world|paper] [--iterations N] [--quick]
                                 [--only paper|authors|practitioners|sd3|video]
    -> results/table1.csv, results/table1.md, results/table1.tex, results/table1_sweep.csv,
       results/table1_authors.csv, results/table1_practitioners.csv / .md, results/table1_sd3.csv,
       results/table1_video.csv / .md
       (``--only X`` re-runs that section alone and re-renders the rest from their CSVs)
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
from jagg.config import TINY_RUN, load_config
from jagg.engine.knots import Knots
from jagg.engine.profiling import SavedActivationMeter
from jagg.engine.routing import BackwardSetting, GroupCost, Routing
from jagg.loop.components import build_components
from jagg.loop.timing import (
    AUTHORS_BATCH,
    AUTHORS_SETUPS,
    QUICK,
    SD3_SETUP,
    TIMING_SETUPS,
    sd3_timing_config,
    time_settings,
    timing_config,
    update_with,
)
from jagg.loop.trainer import Trainer
from jagg.scale.tiny_pipeline import write_tiny_sd3_run
from jagg.world import World
from jagg.world.pretrained import REPORTS as WORLD_REPORTS
from jagg.world.pretrained import world_build
from plotting import figure_footer, save_figure, world_scale

SETUPS = TIMING_SETUPS
# The paper (arXiv 2607.17572), Table 1: reduction of wall-clock per training step (DanceGRPO) / update phase
# (Flow-GRPO-Fast).
PAPER = {
    ("flux", "dancegrpo"): "-18.2% per step (279 s -> 228 s)",
    ("qwenimage", "dancegrpo"): "-17.3% per step (835 s -> 691 s)",
    ("flux", "flowgrpo_fast"): "-29.9% to -30.0% update phase",
    ("qwenimage", "flowgrpo_fast"): "-29.9% to -30.0% update phase",
}


def _setting(strategy: str, w: int, frac: float, **how) -> BackwardSetting:
    """Groups of ``w`` on ``strategy`` (the leading ``frac``), run ``how`` (``BackwardSetting``'s graph_mode,
    stored_outputs, endpoint_signals; its defaults where not given)."""
    return BackwardSetting(routing=Routing(strategy=strategy, group_size=w, jagg_frac=frac), **how)


def strategies_for(cfg, algo: str) -> list[BackwardSetting]:
    """Exact, the paper-literal JAGG (joint endpoints, every step forwarded), this repository's default
    (batched endpoints + stored rollout outputs), the other modes, the endpoints ablation; and for DanceGRPO
    the same JAGG pair at W = 4, the group size the paper's per-step numbers fit (see the README)."""
    w, f = cfg.backward.group_size, cfg.backward.jagg_frac
    rows = [
        _setting("exact", w, f),
        _setting("jagg", w, f, graph_mode="joint", stored_outputs=False),
        _setting("jagg", w, f, graph_mode="batched", stored_outputs=True),
        _setting("jagg", w, f, graph_mode="batched", stored_outputs=False),
        _setting("jagg", w, f, graph_mode="sequential", stored_outputs=True),
        _setting("endpoints", w, f, graph_mode="batched", stored_outputs=True),
    ]
    if algo == "dancegrpo":
        rows += [
            _setting("jagg", 4, f, graph_mode="joint", stored_outputs=False),
            _setting("jagg", 4, f, graph_mode="batched", stored_outputs=True),
        ]
    return rows


def update_cost_checked(trainer: Trainer, s: BackwardSetting, row: dict) -> GroupCost:
    """The cost model's counts for one update (``BackwardSetting.update_cost``: stored outputs only before the
    first optimizer step), checked against what the update measured."""
    train = trainer.cfg.train
    total = s.update_cost(
        row["T"],
        micro_batches=-(-row["n"] // train.train_batch_size),
        grad_accum=train.grad_accum,
        batch=train.train_batch_size,
    )
    for k in ("forward_passes", "forward_passes_with_grad", "backward_passes", "backward_calls"):
        if getattr(total, k) != row[k]:
            raise AssertionError(f"{s.key}: cost model {k}={getattr(total, k)} but the update did {row[k]}")
    return total


def peak_activation_mb(trainer: Trainer, s: BackwardSetting) -> float:
    ro = trainer.rollout(0, SeedStream.MEMORY)
    with SavedActivationMeter() as meter:
        update_with(trainer, ro, s)
    return meter.peak_mb


def _paper_label(setup: tuple[str, str], s: BackwardSetting, default_frac: float) -> str:
    """The paper's number beside the paper-literal JAGG rows (joint endpoints at the config's jagg_frac)."""
    literal = s.routing.strategy == "jagg" and s.mode == "joint" and s.routing.jagg_frac == default_frac
    return PAPER.get(setup, "") if literal else ""


def summarise(
    setup: tuple[str, str], trainer: Trainer, rows: dict[str, list[dict]], strategies, paper_label=None
) -> list[dict]:
    """Medians per strategy, reductions vs exact, and the pass-counting prediction (``paper_label(s)``: the
    paper column of a setting; default ``_paper_label``)."""

    def med(key: str, k: str) -> float:
        return statistics.median(r[k] for r in rows[key])

    exact = strategies[0].key
    r0 = rows[exact][0]
    default_frac = trainer.cfg.backward.jagg_frac
    n_roll_fwd = (len(trainer.sigmas) - 1) * -(-r0["n"] // trainer.cfg.train.train_batch_size)
    f_grad = med(exact, "time_forward_s") / r0["forward_passes"]
    bwd = med(exact, "time_backward_s") / r0["backward_passes"]
    f_nograd = med(exact, "time_sample_s") / n_roll_fwd
    other = med(exact, "time_update_s") - med(exact, "time_forward_s") - med(exact, "time_backward_s")
    rollout = med(exact, "time_sample_s") + med(exact, "time_reward_s")
    out = []
    for s in strategies:
        key, r = s.key, rows[s.key][0]
        cost = update_cost_checked(trainer, s, r)
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
                strategy=s.routing.strategy,
                mode=s.mode,
                W=s.routing.group_size,
                jagg_frac=s.routing.jagg_frac,
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
                paper=paper_label(s) if paper_label else _paper_label(setup, s, default_frac),
                iterations=len(rows[key]),
                n=r["n"],
                T=r["T"],
                pass_fwd_grad_s=f_grad,
                pass_fwd_nograd_s=f_nograd,
                pass_bwd_s=bwd,
            )
        )
    return out


# --------------------------------------------------------------------------- the authors' recipe
# The paper's per-step reduction for the DanceGRPO setup of each backbone (Table 1), beside the authors' method.
AUTHORS_PAPER = {
    "flux": "-18.2% per step (279 s -> 228 s)",
    "qwenimage": "-17.3% per step (835 s -> 691 s)",
}


def authors_settings(cfg) -> list[tuple[str, BackwardSetting]]:
    """(reading, setting) of the authors' recipe's rows, all on its blocks of W = ``cfg.backward.group_size``
    with every trained block aggregated: the exact baseline (the recipe's 12 single steps cost what the 3
    blocks' 12 steps cost per step), the authors' method and its t-weight twin (sequential, no stored outputs,
    W + 2 forwards per block), our sequential backward without the 2 extra forwards, and this repository's
    default (batched + stored outputs) with both weight rules."""
    w = cfg.backward.group_size
    authors = dict(graph_mode="sequential", stored_outputs=False)
    ours = dict(graph_mode="batched", stored_outputs=True)
    return [
        ("exact baseline", _setting("exact", w, 1.0)),
        ("authors' method", _setting("jagg_index", w, 1.0, **authors, endpoint_signals="nograd")),
        ("authors' method, t-weights", _setting("jagg", w, 1.0, **authors, endpoint_signals="nograd")),
        ("authors' backward, endpoint signals from the graphs", _setting("jagg_index", w, 1.0, **authors)),
        ("this repository's default, index weights", _setting("jagg_index", w, 1.0, **ours)),
        ("this repository's default, t-weights", _setting("jagg", w, 1.0, **ours)),
    ]


def _pass_units(cost: GroupCost, rollout_fwd: int, micro_batches: int, ckpt: bool) -> tuple[float, float]:
    """(update, iteration) in forwards per micro-batch by the issue's counting: a forward 1, a backward 2,
    plus 1 recompute under gradient checkpointing; the rollout ``rollout_fwd`` forwards."""
    update = (cost.forward_passes + cost.backward_passes * (3 if ckpt else 2)) / micro_batches
    return update, update + rollout_fwd


def _authors_rows(setup, trainer: Trainer, settings, iterations: int, eta) -> list[dict]:
    """Time ``settings`` with gradient checkpointing on and the first two (exact, the authors' method) with
    it off, all interleaved on the same rollouts; per checkpointing state, rows with the reading, the
    pass-counting reduction (``_pass_units``), the update speed-up over the authors' method, the paper."""
    transformer = trainer.backbone.transformer
    switch = {
        True: transformer.enable_gradient_checkpointing,
        False: transformer.disable_gradient_checkpointing,
    }
    runs = [(s, True) for _, s in settings] + [(s, False) for _, s in settings[:2]]
    timed = time_settings(
        trainer,
        [s for s, _ in runs],
        iterations,
        eta,
        variants=[(f"ckpt={ckpt}|", switch[ckpt]) for _, ckpt in runs],
    )
    out = []
    for ckpt, chosen in ((True, settings), (False, settings[:2])):
        switch[ckpt]()  # also for the activation peak ``summarise`` measures
        bsettings = [s for _, s in chosen]
        rows = summarise(
            setup,
            trainer,
            {s.key: timed[f"ckpt={ckpt}|{s.key}"] for s in bsettings},
            bsettings,
            paper_label=lambda s: AUTHORS_PAPER[setup[0]] if s == settings[1][1] else "",
        )
        out += _authors_columns(trainer, chosen, rows, ckpt)
    switch[trainer.cfg.model.gradient_checkpointing]()
    return out


def _authors_columns(trainer: Trainer, settings, rows: list[dict], ckpt: bool) -> list[dict]:
    """``rows`` (one per setting, the exact baseline first, the authors' method second) with the reading,
    checkpointing, endpoint-signal source, the pass-unit reductions and the speed-up over the authors'."""
    units = {}
    for (reading, s), row in zip(settings, rows, strict=True):
        micro = -(-row["n"] // trainer.cfg.train.train_batch_size)
        cost = s.update_cost(
            int(row["T"]),
            micro_batches=micro,
            grad_accum=trainer.cfg.train.grad_accum,
            batch=trainer.cfg.train.train_batch_size,
        )
        units[reading] = _pass_units(cost, len(trainer.sigmas) - 1, micro, ckpt)
        row.update(reading=reading, checkpointing=ckpt, endpoint_signals=s.endpoint_signals)
    ex_update, ex_iter = units[settings[0][0]]
    for (reading, _), row in zip(settings, rows, strict=True):
        upd, it = units[reading]
        row["units_reduction_update_pct"] = 100 * (1 - upd / ex_update)
        row["units_reduction_iter_pct"] = 100 * (1 - it / ex_iter)
        row["update_speedup_vs_authors"] = rows[1]["update_s"] / row["update_s"]
    return rows


TABLE1_COLS = [
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


def _provenance(meta: dict) -> str:
    return (
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}, seed {meta['seed']}, "
        f"{meta['iterations']} timed iterations per setup, strategies interleaved on the same rollouts."
    )


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Table 1: wall-clock per training iteration (medians; reductions vs exact, positive = faster)",
        "",
        _provenance(meta),
        f"Command: `{meta['command']}`",
        "",
        *_markdown_rows(TABLE1_COLS, rows),
    ]
    return "\n".join(lines) + "\n"


def sd3_markdown(rows: list[dict], meta: dict) -> str:
    """The SD3 section of table1.md: what the tiny SD3 run keeps of the recipe (from its config), its rows."""
    c, v = meta["config"], meta["versions"]
    m, s, a, t = c["model"], c["sampling"], c["algorithm"], c["train"]
    lines = [
        "## SD3.5-M's Flow-GRPO recipe on a tiny random-init SD3 (configs/paper/sd3/sd35m_flowgrpo.yaml)",
        "",
        f"{_provenance(meta)} diffusers {v.get('diffusers', '?')}, transformers {v.get('transformers', '?')}. "
        f"Command: `{meta['command']}`",
        "",
        "A tiny SD3 pipeline of the real classes (`jagg.scale.tiny_pipeline`: SD3Transformer2DModel of 2 joint "
        "blocks, hidden 32; CLIP-L, CLIP-G and T5 text encoders; VAE), random init (the world has no SD3 "
        f"backbone). The recipe's true CFG {m['true_cfg_scale']:g} with the empty negative prompt (one "
        f"transformer call of 2B rows), {s['num_steps']} steps of the scheduler's schedule, the "
        f"{a['sde_kind']} SDE on every step, KL {a['kl_beta']:g} (a reference forward per trained step in every "
        f"row), clip range {a['clip_range']:g}, LoRA r{m['lora_rank']} on the attention projections; "
        f"{t['prompts_per_iter']} prompts x {t['images_per_prompt']} images in micro-batches of "
        f"{t['train_batch_size']}, {t['precision']}, gradient checkpointing {m['gradient_checkpointing']}, "
        f"{s['latent_size']} x {s['latent_size']} latents, JPEG for PickScore (`jagg.loop.timing.SD3_TIMING`). "
        "Timings of a random-init model measure the passes, not the model's quality.",
        "",
        *_markdown_rows(TABLE1_COLS, rows),
    ]
    return "\n".join(lines) + "\n"


def _markdown_rows(cols: list[tuple[str, str]], rows: list[dict]) -> list[str]:
    """A Markdown table: the header of ``cols`` (name, format) and one formatted line per row."""
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(f.format(r[c]) for c, f in cols) + " |" for r in rows]


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


def sweep_strategies(cfg) -> list[BackwardSetting]:
    ws = sorted({2, 3, 4, cfg.backward.group_size})
    return [_setting("exact", 2, 0.0)] + [_setting("jagg", w, f) for w in ws for f in (0.6, 1.0)]


def _timed_setup(setup: tuple[str, str], cfg, iterations: int, eta) -> tuple[Trainer, list[dict]]:
    """The trainer of ``cfg`` and the summarised rows of ``strategies_for`` timed on its shared rollouts."""
    trainer = Trainer(cfg, build_components(cfg), run_dir=Path("runs/table1"))
    strategies = strategies_for(cfg, setup[1])
    return trainer, summarise(setup, trainer, time_settings(trainer, strategies, iterations, eta), strategies)


def _paper_section(args, argv, eta) -> None:
    """Table 1's own setups and the W / jagg_frac sweep -> ``args.out`` and table1_sweep.csv."""
    rows, sweep_rows, cfg = [], [], None
    for backbone, algo in SETUPS:
        cfg = timing_config((backbone, algo), scale=args.scale, quick=args.quick, overrides=args.overrides)
        trainer, timed_rows = _timed_setup((backbone, algo), cfg, args.iterations, eta)
        rows += timed_rows
        print(to_markdown(timed_rows, _meta(args, argv, cfg)).split("\n", 6)[-1], flush=True)
        if (backbone, algo) == SETUPS[0]:
            sweep = sweep_strategies(cfg)
            timed = time_settings(trainer, sweep, args.sweep_iterations, eta)
            sweep_rows += summarise((backbone, algo), trainer, timed, sweep)
    meta = _meta(args, argv, cfg)
    out = Path(args.out)
    write_table(rows, out, meta)
    write_table(sweep_rows, out.with_name("table1_sweep.csv"), meta)


def _authors_section(args, argv, eta) -> None:
    """The authors' recipe per backbone with a config for it at this scale -> table1_authors.csv: the rows
    of ``authors_settings`` with checkpointing on and the exact baseline and the authors' method with it off,
    all interleaved on the same rollouts (``_authors_rows``)."""
    rows, cfg = [], None
    for setup in AUTHORS_SETUPS:
        if not Path(f"configs/{args.scale}/{setup[0]}_{setup[1]}_authors.yaml").is_file():
            continue
        # the rollout keeps its outputs so that the default rows can read them; each row's setting says
        # whether it does (the authors' rows do not)
        keep = ["backward.stored_outputs=true", *args.overrides]
        cfg = timing_config(setup, scale=args.scale, quick=args.quick, overrides=keep, authors=True)
        trainer = Trainer(cfg, build_components(cfg), run_dir=Path("runs/table1"))
        settings = authors_settings(cfg)
        rows += _authors_rows(setup, trainer, settings, args.iterations, eta)
        print(authors_markdown(rows, _meta(args, argv, cfg)).split("\n", 8)[-1], flush=True)
    write_table(rows, Path(args.out).with_name("table1_authors.csv"), _meta(args, argv, cfg))


def _sd3_section(args, argv, eta) -> None:
    """SD3.5-M's Flow-GRPO recipe on a tiny random-init SD3 pipeline (``sd3_timing_config``, written under
    runs/table1/sd3 with the world's train prompts), Table 1's strategies on shared rollouts -> table1_sd3.csv."""
    pipeline, prompts = write_tiny_sd3_run(Path("runs/table1/sd3"), World().train_prompts)
    cfg = sd3_timing_config(pipeline, prompts, quick=args.quick, overrides=args.overrides)
    _, rows = _timed_setup(SD3_SETUP, cfg, args.iterations, eta)
    meta = _meta(args, argv, cfg)
    print(sd3_markdown(rows, meta), flush=True)
    write_table(rows, Path(args.out).with_name("table1_sd3.csv"), meta)


# --------------------------------------------------------------------------- where practitioners train
# (name, world config, overrides, routings): the backward settings timed on each setup's own rollouts. The window of
# MixGRPO is one group of 4; the full trajectory trains all 20 usable steps of a 21-step schedule; DanceGRPO's
# 12 of 20 with the exact backward is what a user runs today (same seed: the same prompts, noise and SDE draws as
# the full trajectory's rollouts, only the trained steps differ); Flow-GRPO-Fast with a window of 2 saves nothing.
PRACTITIONERS = [
    (
        "MixGRPO, window of 4",
        "flux_mixgrpo",
        [],
        [
            Routing(strategy="exact", group_size=2),
            Routing(strategy="jagg", group_size=4, jagg_frac=1.0),
            Knots(count=3, placement="low_noise"),
        ],
    ),
    (
        "full trajectory, 20 of 20",
        "flux_dancegrpo_knots",
        [],
        [
            Routing(strategy="exact", group_size=2),
            Routing(strategy="jagg", group_size=4, jagg_frac=1.0),
            Knots(count=4, placement="low_noise"),
            Knots(count=6, placement="low_noise"),
        ],
    ),
    (
        "DanceGRPO, 12 of 20",
        "flux_dancegrpo_knots",
        ["algorithm.timestep_fraction=0.6"],
        [Routing(strategy="exact", group_size=2)],
    ),
    (
        "Flow-GRPO-Fast, window of 2",
        "flux_flowgrpo_fast",
        ["algorithm.sde_window_size=2", "algorithm.sde_window_range=[0, 3]"],
        [Routing(strategy="exact", group_size=2), Routing(strategy="jagg", group_size=2, jagg_frac=1.0)],
    ),
]
BASELINE_TODAY = "DanceGRPO, 12 of 20"


def _timed_setups(setups: list[tuple], args, eta, quick: list[str]) -> tuple[list[dict], object]:
    """Each (name, world config, overrides, routings) setup with its settings interleaved on its own rollouts:
    medians of rollout, update and iteration, backward passes per sample (checked against the cost model), and
    update / iteration relative to the setup's exact row. Returns the rows and the last setup's config."""
    rows, cfg = [], None
    for name, config, overrides, routings in setups:
        cfg = load_config(
            f"configs/world/{config}.yaml", [*AUTHORS_BATCH, *overrides, *quick, *args.overrides]
        )
        trainer = Trainer(cfg, build_components(cfg), run_dir=Path("runs/table1"))
        settings = [cfg.backward.setting(r) for r in routings]
        for s, timed in time_settings(trainer, settings, args.iterations, eta).items():
            setting = next(x for x in settings if x.key == s)
            update_cost_checked(trainer, setting, timed[0])  # the counts the cost model predicts
            med = {
                k: statistics.median(r[k] for r in timed)
                for k in ("time_sample_s", "time_reward_s", "time_update_s")
            }
            rollout = med["time_sample_s"] + med["time_reward_s"]
            rows.append(
                dict(
                    setup=name,
                    setting=setting.label
                    if setting.routing.strategy == "exact"
                    else f"{setting.routing.label}/{setting.mode}",
                    T=timed[0]["T"],
                    bwd_per_sample=timed[0]["backward_passes_per_sample"],
                    rollout_s=rollout,
                    update_s=med["time_update_s"],
                    iter_s=rollout + med["time_update_s"],
                    iterations=len(timed),
                )
            )
    for r in rows:
        exact = next(x for x in rows if x["setup"] == r["setup"] and x["setting"] == "exact")
        r["update_vs_exact"] = r["update_s"] / exact["update_s"]
        r["iter_vs_exact"] = r["iter_s"] / exact["iter_s"]
    return rows, cfg


def _practitioners_section(args, argv, eta) -> None:
    """Each setup of ``PRACTITIONERS`` (world scale only) -> table1_practitioners.csv / .md, with each row's
    iteration relative to DanceGRPO's 12 of 20 exact steps, what a user runs today."""
    quick = [*QUICK, "sampling.num_steps=9", "sampling.eval_num_steps=9"] if args.quick else []
    rows, cfg = _timed_setups(PRACTITIONERS, args, eta, quick)
    today = next(x for x in rows if x["setup"] == BASELINE_TODAY)
    for r in rows:
        r["iter_vs_dancegrpo_12_of_20"] = r["iter_s"] / today["iter_s"]
    out = Path(args.out).with_name("table1_practitioners.csv")
    meta = _meta(args, argv, cfg)
    write_table(rows, out, meta)
    atomic_write_text(out.with_suffix(".md"), practitioners_markdown(rows, meta))


# --------------------------------------------------------------------------- video (issue 42)
# The video world's tiny Wan (configs/world/wan_video.yaml: moving-shape clips, 4 frames of 16 x 16) with every
# step trained, at T = 10 and T = 20 (an 11- and a 21-step schedule), the world setups' batch without KL (as every
# timed setup here). JAGG's W and the knots' K are the video cosine study's (make knots: results/knots_video.md).
def _video_setup(t: int, routings: list) -> tuple:
    """One ``_timed_setups`` setup: the video world with all of its T usable steps trained (a (T + 1)-step schedule)."""
    steps = [
        f"sampling.num_steps={t + 1}",
        f"sampling.eval_num_steps={t + 1}",
        "algorithm.timestep_fraction=1.0",
    ]
    return (f"video, {t} of {t} steps", "wan_video", steps, routings)


VIDEO = [
    _video_setup(
        10,
        [
            Routing(strategy="exact", group_size=2),
            Routing(strategy="jagg", group_size=5, jagg_frac=1.0),
            Knots(count=3, placement="low_noise"),
        ],
    ),
    _video_setup(
        20,
        [
            Routing(strategy="exact", group_size=2),
            Routing(strategy="jagg", group_size=4, jagg_frac=1.0),
            Knots(count=3, placement="low_noise"),
            Knots(count=4, placement="low_noise"),
        ],
    ),
]
# quick: the tiny random-init Wan scored by the weight-free temporal term, the schedules cut to 5 and 7 steps
VIDEO_QUICK = [*TINY_RUN, "reward.weights={temporal: 1.0}", "reward.eval=[temporal]"]


def _video_section(args, argv, eta) -> None:
    """The ``VIDEO`` setups (world scale only) -> table1_video.csv / .md."""
    setups = VIDEO
    if args.quick:  # 4 and 6 trained steps (every plan still fits: K <= 4)
        setups = [_video_setup(t, routings) for t, (*_, routings) in zip((4, 6), VIDEO, strict=True)]
    rows, cfg = _timed_setups(setups, args, eta, VIDEO_QUICK if args.quick else [])
    out = Path(args.out).with_name("table1_video.csv")
    meta = _meta(args, argv, cfg)
    write_table(rows, out, meta)
    atomic_write_text(out.with_suffix(".md"), video_markdown(rows, meta))


# (row key, header) of every ``_timed_setups`` table
TIMED_SETUP_COLS = [
    ("setup", "setup"),
    ("setting", "backward"),
    ("T", "trained steps"),
    ("bwd_per_sample", "bwd passes / sample"),
    ("rollout_s", "rollout s"),
    ("update_s", "update s"),
    ("iter_s", "iteration s"),
    ("update_vs_exact", "update / exact"),
    ("iter_vs_exact", "iteration / exact"),
]


def _timed_setup_table(rows: list[dict], cols: list[tuple[str, str]] = TIMED_SETUP_COLS) -> list[str]:
    """A Markdown table of ``_timed_setups`` rows: floats to 2 decimals, the rest as they are."""
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(fmt(r[k]) for k, _ in cols) + " |" for r in rows]


def practitioners_markdown(rows: list[dict], meta: dict) -> str:
    cols = [*TIMED_SETUP_COLS, ("iter_vs_dancegrpo_12_of_20", "iteration / DanceGRPO 12-of-20 exact")]
    head = [
        "# Table 1, where practitioners train (medians; each setup's settings interleaved on its own rollouts)",
        "",
        f"git {meta.get('git_sha', '?')[:7]}, {meta.get('hardware', '?')}; `python experiments/table1.py --only practitioners`",
        "",
    ]
    return "\n".join(head + _timed_setup_table(rows, cols)) + "\n"


def video_markdown(rows: list[dict], meta: dict) -> str:
    """The video section: each setup's rows with update and iteration relative to its exact row."""
    t = meta["config"]["train"]
    head = [
        "## Table 1, video: the video world's tiny Wan, every step trained (medians; each setup's settings "
        "interleaved on its own rollouts)",
        "",
        f"{_provenance(meta)} Command: `{meta['command']}`",
        "",
        "configs/world/wan_video.yaml (WanTransformer3DModel, 752k parameters, clips of 4 frames of 16 x 16 in "
        f"pixel space), {t['prompts_per_iter']} prompts x {t['images_per_prompt']} clips per iteration in "
        f"micro-batches of {t['train_batch_size']}, no KL (as every timed setup). Knots K = 3 over T = 10 is "
        "the issue's goal: at most 0.5x exact's update at a gradient cosine of at least 0.97 "
        "(results/knots_video.md).",
        "",
    ]
    return "\n".join(head + _timed_setup_table(rows)) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="world", choices=["world", "paper"])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--sweep-iterations", type=int, default=3)
    ap.add_argument("--out", default="results/table1.csv")
    ap.add_argument("--figure", default="paper_figures/table1_update_reduction.png")
    ap.add_argument("--quick", action="store_true", help="tiny random-init models, seconds (tests)")
    ap.add_argument(
        "--only",
        choices=["paper", "authors", "practitioners", "sd3", "video"],
        help="run one section (the other's CSV, if there, is kept and re-rendered)",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every setup")
    args = ap.parse_args(argv)
    set_threads(1)
    if args.quick:
        args.iterations, args.sweep_iterations = 2, 1
    paper_steps = len(SETUPS) * args.iterations + args.sweep_iterations
    authors_steps = len(AUTHORS_SETUPS) * args.iterations
    world = args.scale == "world"
    sections = {
        "paper": paper_steps,
        "authors": authors_steps,
        "practitioners": len(PRACTITIONERS) * args.iterations if world else 0,
        "sd3": args.iterations,
        "video": len(VIDEO) * args.iterations if world else 0,
    }
    steps = sections.get(args.only, sum(sections.values()))
    eta = ProgressETA(steps, "table1")
    if args.only in (None, "paper"):
        _paper_section(args, argv, eta)
    if args.only in (None, "authors"):
        _authors_section(args, argv, eta)
    if args.only in (None, "practitioners") and world:
        _practitioners_section(args, argv, eta)
    if args.only in (None, "sd3"):
        _sd3_section(args, argv, eta)
    if args.only in (None, "video") and world:
        _video_section(args, argv, eta)
    out = Path(args.out)
    render(out, Path(args.figure))
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.tex')} and the CSVs beside them")


def render(csv: Path, png: Path) -> None:
    """Markdown, LaTeX and the figures from the CSVs and their metadata only (``make figures``)."""
    import pandas as pd

    sweep_csv = csv.with_name("table1_sweep.csv")
    authors_csv = csv.with_name("table1_authors.csv")
    sd3_csv = csv.with_name("table1_sd3.csv")
    rows, md, tex = [], "", ""
    if csv.is_file():
        meta = json.loads(csv.with_suffix(".meta.json").read_text())
        rows = pd.read_csv(csv).fillna("").to_dict("records")
        md, tex = to_markdown(rows, meta), to_latex(rows)
    if rows and sweep_csv.is_file():
        sweep = pd.read_csv(sweep_csv).fillna("").to_dict("records")
        md += "\n## W / jagg_frac sweep (first setup)\n\n" + to_markdown(sweep, meta).split("\n", 5)[-1]
    if authors_csv.is_file():
        authors = pd.read_csv(authors_csv).fillna("").to_dict("records")
        authors_meta = json.loads(authors_csv.with_suffix(".meta.json").read_text())
        md += "\n" + authors_markdown(authors, authors_meta)
        tex += "\n" + authors_latex(authors)
        render_authors(authors_csv, png.with_name("table1_authors.png"))
    if sd3_csv.is_file():
        sd3 = pd.read_csv(sd3_csv).fillna("").to_dict("records")
        md += "\n" + sd3_markdown(sd3, json.loads(sd3_csv.with_suffix(".meta.json").read_text()))
        tex += "\n" + to_latex(sd3)
    video_csv = csv.with_name("table1_video.csv")
    if video_csv.is_file():
        video = pd.read_csv(video_csv).to_dict("records")
        video_meta = json.loads(video_csv.with_suffix(".meta.json").read_text())
        atomic_write_text(video_csv.with_suffix(".md"), video_markdown(video, video_meta))
        md += "\n" + video_markdown(video, video_meta)
    atomic_write_text(csv.with_suffix(".md"), md)
    atomic_write_text(csv.with_suffix(".tex"), tex)
    if rows:
        plot(rows, png, meta, csv.parent)


AUTHORS_COLS = [
    ("backbone", "{}"),
    ("reading", "{}"),
    ("strategy", "{}"),
    ("mode", "{}"),
    ("checkpointing", "{}"),
    ("iter_s", "{:.2f}"),
    ("update_s", "{:.2f}"),
    ("fwd_per_sample", "{:g}"),
    ("bwd_per_sample", "{:g}"),
    ("reduction_iter_pct", "{:+.1f}%"),
    ("ideal_reduction_iter_pct", "{:+.1f}%"),
    ("units_reduction_iter_pct", "{:+.1f}%"),
    ("reduction_update_pct", "{:+.1f}%"),
    ("ideal_reduction_update_pct", "{:+.1f}%"),
    ("units_reduction_update_pct", "{:+.1f}%"),
    ("update_speedup_vs_authors", "{:.2f}x"),
    ("paper", "{}"),
]


def _pass_costs(rows: list[dict]) -> list[str]:
    """Per backbone the measured per-pass seconds (from each exact baseline) and the recompute cost of a
    backward pass under checkpointing (backward with it minus backward without)."""
    lines = []
    for backbone in dict.fromkeys(r["backbone"] for r in rows):
        exact = {
            r["checkpointing"]: r for r in rows if r["backbone"] == backbone and r["strategy"] == "exact"
        }
        on = exact.get(True)
        if on is None:
            continue
        line = (
            f"- {backbone}: forward with autograd {on['pass_fwd_grad_s'] * 1e3:.1f} ms, without "
            f"{on['pass_fwd_nograd_s'] * 1e3:.1f} ms, backward (recompute included) {on['pass_bwd_s'] * 1e3:.1f} ms"
        )
        if False in exact:
            recompute = on["pass_bwd_s"] - exact[False]["pass_bwd_s"]
            line += f"; without checkpointing backward {exact[False]['pass_bwd_s'] * 1e3:.1f} ms: recompute {recompute * 1e3:.1f} ms"
        lines.append(line + " per micro-batch pass")
    return lines


def authors_markdown(rows: list[dict], meta: dict) -> str:
    """The authors' recipe section of table1.md: the rows, what each prediction column means, pass costs."""
    lines = [
        "## The JAGG authors' recipe (configs/world/*_dancegrpo_authors.yaml), DanceGRPO on the world backbones",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}, seed {meta['seed']}, "
        f"{meta['iterations']} timed iterations per row, all rows of one backbone (checkpointing on and off) "
        f"interleaved on the same rollouts. Command: `{meta['command']}`",
        "",
        "21 steps, 20 usable cut into 5 blocks of W = 4, 3 random blocks trained per sample (12 steps); the exact "
        "baseline trains those 12 steps one by one (the cost of the recipe's 12 random single steps). `ideal`: "
        "the cost model's counts (`BackwardSetting.update_cost`) times the measured per-pass seconds below; `units`: the same "
        "counts in forwards (forward 1, backward 2, recompute 1 with checkpointing, rollout = number of sampling "
        "steps), the counting the paper's numbers were checked against (docs/references.md). Speed-up: the "
        "authors' method's update seconds over the row's.",
        "",
        *_pass_costs(rows),
        "",
        *_markdown_rows(AUTHORS_COLS, rows),
    ]
    return "\n".join(lines) + "\n"


def authors_latex(rows: list[dict]) -> str:
    body = [
        f"{r['backbone']} & {r['reading']} & {'on' if r['checkpointing'] else 'off'} & "
        f"{r['iter_s']:.2f} & {r['update_s']:.2f} & {r['reduction_iter_pct']:+.1f}\\% & "
        f"{r['ideal_reduction_iter_pct']:+.1f}\\% & {r['reduction_update_pct']:+.1f}\\% & "
        f"{r['update_speedup_vs_authors']:.2f} \\\\"
        for r in rows
    ]
    return (
        "\\begin{tabular}{lllrrrrrr}\n\\toprule\nbackbone & reading & ckpt & s/iter & update s & "
        "$\\Delta$iter & ideal $\\Delta$iter & $\\Delta$update & speed-up vs authors \\\\\n\\midrule\n"
        + "\n".join(body)
        + "\n\\bottomrule\n\\end{tabular}\n"
    )


def render_authors(csv: Path, png: Path) -> None:
    """Per backbone, the per-iteration and update-phase reductions of the authors' recipe rows vs their exact
    baseline: measured and predicted by the cost model, the paper's per-step number as a line."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = json.loads(csv.with_suffix(".meta.json").read_text())
    rows = pd.read_csv(csv).fillna("").to_dict("records")
    backbones = list(dict.fromkeys(r["backbone"] for r in rows))
    fig, axes = plt.subplots(2, len(backbones), figsize=(6.5 * len(backbones), 8), squeeze=False)
    for col, backbone in enumerate(backbones):
        sub = [r for r in rows if r["backbone"] == backbone and r["strategy"] != "exact"]
        labels = [
            r["reading"].replace(", ", "\n").replace("endpoint signals", "signals")
            + ("" if r["checkpointing"] else "\n(no checkpointing)")
            for r in sub
        ]
        x = list(range(len(sub)))
        for row, (what, measured, ideal) in enumerate(
            [
                ("per iteration", "reduction_iter_pct", "ideal_reduction_iter_pct"),
                ("update phase", "reduction_update_pct", "ideal_reduction_update_pct"),
            ]
        ):
            ax = axes[row][col]
            ax.bar([i - 0.2 for i in x], [r[measured] for r in sub], 0.4, label="measured")
            ax.bar(
                [i + 0.2 for i in x], [r[ideal] for r in sub], 0.4, label="cost model x measured pass costs"
            )
            if row == 0:
                pct = PAPER_PCT[(backbone, "dancegrpo")][0]
                ax.axhline(pct, color="k", lw=1.2)
                ax.text(
                    0.0, pct + 0.8, f"paper: -{pct}% per step", transform=ax.get_yaxis_transform(), fontsize=7
                )
            ax.axhline(0, color="k", lw=0.5)
            ax.set_xticks(x, labels, fontsize=6)
            ax.set_title(f"{backbone} DanceGRPO, authors' recipe: {what}", fontsize=9)
            ax.set_ylabel(f"{what} reduction vs exact (%)", fontsize=8)
            ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.99), fontsize=8, ncol=2)
    figure_footer(
        fig, meta, world_scale(csv.parent) + f", {meta.get('iterations', '?')} timed iterations per row"
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    save_figure(fig, png, dpi=100)


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
    graph mode, with the paper's number as a line."""
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
    save_figure(fig, png, dpi=100)


# What make table1 itself rewrites: its tables and figures, and make pretrain's reports of the world it trains
# first (the build is recorded by its own hash, world_build): left out of the meta's dirty check.
OUTPUTS = ("results/table1*", "paper_figures/table1*", *WORLD_REPORTS)


def _meta(args, argv, cfg) -> dict:
    return run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/table1.py", argv),
        seed=cfg.train.seed,
        iterations=args.iterations,
        config=cfg.to_dict(),
        scale=args.scale,
        world_build=world_build() if args.scale == "world" else None,
    )


if __name__ == "__main__":
    main()
