"""Reward curves under a committed protocol: every arm (strategies and a positive control) vs exact, one battery.

The protocol (``experiments/curves_protocol.yaml``, committed before the runs it governs) fixes the recipes,
the arms, the paired seeds, alpha, one primary metric per recipe, the secondary metrics and an absolute
equivalence margin per metric. Each (recipe, arm, seed) is one ``python -m jagg.train`` run; a seed fixes the
prompts, the initial noise and the SDE noise of the first rollout for every arm, so the comparison with exact
is paired by seed. Runs go two at a time (one torch thread each); an interrupted one resumes; a line per
finished run reports the time and an ETA. Each run's per-iteration metrics land in
``results/<protocol's folder>/<recipe>/<arm>_seed<k>.csv`` as soon as it and exact's run of its seed are done,
with the command and the SHA that trained it; a later session reuses a CSV written by the same command (run
directories are not committed). The analysis reads only those files and the protocol:

* per metric, every arm against exact (``battery``): paired difference with its 95% t interval, TOST at the
  margin, one-sided "worse than exact" t-test, the exact sign-flip test (one-sided and two-sided) and the
  minimum detectable difference from the paired SD; Holm over the secondary metrics of an arm;
* the positive control (``train.control_cosine``: the exact gradient mixed with one fixed random direction at
  a set cosine) must be detected on the primary metric, else the recipe's design cannot discriminate and no
  equivalence is claimed;
* each arm's attribute gain over the base model by three judges (``attr``, ``attr_judge``, the non-learned
  ``attr_geom``), claimed only where the geometric judge and a learned one agree;
* seconds per iteration and per update, what the auto calibration cost next to what it saved;
* from protocol version 4: the pre-registered contrast (and in a pilot the seeds it and each control need),
  each arm's fidelity to exact's update and divergence from exact's run, and the dose-response table and
  figure that place each arm on the controls' cosine scale (``jagg.stats.located_cosine``).

    python experiments/curves.py [--protocol experiments/curves_protocol_v4.yaml] [--pilot] [--long]
        [--recipes R ...] [--seeds N] [--arms exact jagg ...] [--quick] [override ...]
    -> results/<folder>/<recipe>/*.csv, results/<folder>/summary.md, paper_figures/reward_curves_<recipe>.png
       (folder: the protocol's ``results``, "curves" for version 3's file; ``_pilot`` with --pilot)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from fnmatch import fnmatch
from pathlib import Path

import torch
import yaml

import equal_cost
from jagg.common import (
    GENERATED,
    SeedStream,
    atomic_write_text,
    command_line,
    generator,
    run_metadata,
    set_threads,
    tree_state,
    write_table,
)
from jagg.config import load_config
from jagg.engine.algorithms import ALGORITHMS
from jagg.engine.routing import BACKWARD_STRATEGIES
from jagg.plugins.eval_state import paired_divergence
from jagg.stats import (
    area_under_curve,
    holm,
    located_cosine,
    minimum_detectable_difference,
    one_sided_above,
    one_sided_below,
    paired_interval,
    sign_flip_test,
    tost,
)
from jagg.world.pretrained import REPORTS as WORLD_REPORTS
from jagg.world.pretrained import world_build
from plotting import figure_footer, save_figure

PROTOCOL = Path(__file__).with_name("curves_protocol.yaml")
SUMMARIES = {"end": 0, "auc": 1}  # a run's two summaries of an eval metric, as per_run stores them
ATTRIBUTE_JUDGES = ("eval_attr_mean", "eval_attr_judge_mean", "eval_attr_geom_mean")
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


# --------------------------------------------------------------------------- protocol
def mixes_control(proto: dict, arm: str) -> bool:
    """Whether ``arm`` mixes a control direction into its gradient (``train.control_cosine``): a positive
    control, of the reference or of another arm."""
    return any(o.startswith("train.control_cosine=") for o in proto["arms"].get(arm, []))


def load_protocol(path: Path = PROTOCOL, long: bool = False, pilot: bool = False) -> dict:
    """The protocol as a dict; ``long`` merges its ``long`` section (more seeds, more recipes), ``pilot``
    narrows it to its ``pilot`` section's seeds and arms. Arms whose strategy the engine does not register
    (``jagg_index`` before it exists) are dropped."""
    proto = yaml.safe_load(Path(path).read_text())
    if long:
        proto["seeds"] = proto["long"]["seeds"]
        proto["recipes"] = {**proto["recipes"], **proto["long"]["recipes"]}
    proto["is_pilot"] = pilot
    if pilot:  # the pilot may have run arms retired since, against a reference of its own
        proto["arms"] = {**proto["arms"], **proto.get("retired_arms", {})}
        proto.update({k: proto["pilot"][k] for k in ("reference", "baselines") if k in proto["pilot"]})
        proto["seeds"] = proto["pilot"]["seeds"]
        # the pilot's controls are its arms that mix a control direction into exact's gradient, retired ones
        # included (v4's pilot ran control_0.8 / 0.5, which amendment 1 replaced with control_blocks_*)
        proto["control_arms"] = [a for a in proto["pilot"]["arms"] if mixes_control(proto, a)]
        proto.pop("design_controls", None)  # named among the later arms: the pilot's check reads its own
        for spec in proto["recipes"].values():  # the pilot's seeds replace a recipe's own
            spec.pop("seeds", None)
        for where in (proto, *proto["recipes"].values()):  # a recipe may name its own arms and controls
            if "arms" in where:
                where["arms"] = {a: o for a, o in where["arms"].items() if a in proto["pilot"]["arms"]}
            if "control_arms" in where:
                where["control_arms"] = [a for a in where["control_arms"] if a in proto["pilot"]["arms"]]
    proto["arms"] = {
        name: overrides
        for name, overrides in proto["arms"].items()
        if all(
            o.split("=", 1)[1] in BACKWARD_STRATEGIES for o in overrides if o.startswith("backward.strategy=")
        )
    }
    return proto


def recipe_protocol(proto: dict, name: str) -> dict:
    """The protocol as one recipe sees it: its own ``arms``, ``control_arms``, ``contrast``, ``note`` and
    ``seeds`` where it names them (a recipe whose reference, arms or sizing differ from the others'), the
    protocol's otherwise. An ``equal_cost`` recipe's arms carry their length and evaluations
    (``equal_cost_overrides``), except while its timing is measured (``proto["timing"]``)."""
    spec = proto["recipes"].get(name, {})
    own = ("arms", "control_arms", "contrast", "contrasts", "note", "seeds", "reference", "baselines")
    own += ("staged_arms", "design_controls")
    view = {**proto, **{k: spec[k] for k in own if k in spec}}
    timed = set((spec.get("equal_cost") or {}).get("seconds_per_iteration") or {})
    if timed and timed >= set(view["arms"]) and not proto.get("timing"):  # else main() refuses the runs
        view["arms"] = {
            a: [*o, *equal_cost_overrides(spec["equal_cost"], a)] for a, o in view["arms"].items()
        }
    return view


def equal_cost_overrides(ec: dict, arm: str) -> list[str]:
    """An arm's share of an equal budget (issue 39): the budget is ``budget_iterations`` of the ``budget_arm``
    at its measured seconds per training iteration (``seconds_per_iteration``: the timing run's medians,
    recorded in the protocol before the runs); each arm trains as many whole iterations as fit in it and is
    evaluated after the same ``evaluations`` fractions of it (rounded to iterations), checkpointed at each; an
    arm named in ``iterations`` trains that many instead (a per-iteration reference, not at equal cost).
    With ``instruments_per_evaluation`` the measuring plug-ins (fidelity, landing) fire at the checkpoint
    cadence too: a fixed iteration cadence would measure an arm of 80 iterations 20 times and exact 6, spending
    most of a cheap arm's run on measurement (they change nothing in training: tests/test_fidelity.py)."""
    secs = ec["seconds_per_iteration"]
    n = (ec.get("iterations") or {}).get(arm) or int(
        ec["budget_iterations"] * secs[ec["budget_arm"]] // secs[arm]
    )
    at = sorted({round(n * k / ec["evaluations"]) for k in range(ec["evaluations"] + 1)})
    every = max(1, round(n / ec["evaluations"]))
    cadence = [f"log.fidelity_every={every}"] if ec.get("instruments_per_evaluation") else []
    return [
        f"train.iterations={n}",
        "log.eval_every=0",
        f"log.eval_at=[{','.join(map(str, at))}]",
        f"log.checkpoint_every={every}",
        *cadence,
    ]


# the timing run of an equal-cost recipe: training only, as the analysis runs train (no evaluation, no
# instrument, no checkpoint: each would add its own time to the iterations it measures)
TIMING = [
    "log.eval_every=0",
    "log.eval_at=[]",
    "log.fidelity_every=0",
    "log.landing=false",
    "log.checkpoint_every=0",
    "log.save_eval_state=false",
]


def iteration_timing(runs: dict[str, Path], skip: int) -> list[dict]:
    """Per arm: the median (and spread) of its training iterations' wall-clock in its timing run, the first
    ``skip`` left out (warm-up), and its backward passes per iteration."""
    import numpy as np

    out = []
    for arm, run_dir in runs.items():
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        t = np.array(
            [r["time_iteration_s"] for r in rows if r["iteration"] > skip and "time_iteration_s" in r]
        )
        passes = float(np.median([r["backward_passes"] for r in rows if "backward_passes" in r]))
        q1, med, q3 = np.percentile(t, [25, 50, 75])
        out.append(
            {"arm": arm, "n": len(t), "median_s": med, "q1_s": q1, "q3_s": q3, "backward_passes": passes}
        )
    return out


def reference(proto: dict) -> str:
    """The arm every other arm is compared with: the protocol's ``reference`` (default ``exact``). It trains the
    same steps as every arm but the declared ``baselines`` (``tests/test_protocol_steps.py``)."""
    return proto.get("reference", "exact")


def contrasts(view: dict) -> list[dict]:
    """The recipe's pre-registered contrasts: its ``contrasts`` list, or its one ``contrast``."""
    return list(view.get("contrasts") or ([view["contrast"]] if view.get("contrast") else []))


def arm_seeds(proto: dict, name: str) -> dict[str, list[int]]:
    """The seeds each arm of a recipe trains: every arm the recipe's ``seeds``; the two arms of each
    pre-registered contrast also its ``seeds``, and the reference and the ``staged_arms`` those of every
    contrast (a contrast needs more seeds than the dose-response and fidelity, which are measured on every
    arm). ``first_seeds: N`` (--seeds, --quick) keeps the first N of ``seeds`` and no extra ones; a pilot has
    none."""
    view = recipe_protocol(proto, name)
    first = proto.get("first_seeds")
    extra_of: dict[str, list[int]] = {}
    if first is None and not proto.get("is_pilot"):
        every = [k for c in contrasts(view) for k in c.get("seeds", [])]
        for arm in (reference(view), *view.get("staged_arms", [])):
            extra_of[arm] = every
        for c in contrasts(view):
            for arm in (c["better"], c["worse"]):
                extra_of[arm] = [*extra_of.get(arm, []), *c.get("seeds", [])]
    return {
        arm: list(view["seeds"][:first]) + sorted(set(extra_of.get(arm, [])) - set(view["seeds"]))
        for arm in view["arms"]
    }


def recipe_jobs(proto: dict, name: str) -> list[tuple[str, int]]:
    """The recipe's (arm, seed) runs, seed-major: every arm of a seed before the next seed, the seeds every arm
    trains before the contrast's extra ones, so that an interrupted design is still a paired one."""
    seeds = arm_seeds(proto, name)
    common = set.intersection(*(set(ks) for ks in seeds.values()))
    return sorted(
        ((a, k) for a, ks in seeds.items() for k in ks), key=lambda ak: (ak[1] not in common, ak[1])
    )


def trained_steps_of(config: str, overrides: list[str], seed: int, iterations: int | None = None) -> list:
    """The trained steps per sample of every training iteration of one arm, drawn as the trainer's rollout
    draws them (``Sampler``: the iteration's window, then the steps per sample from the same generator). The
    prompt and noise draws the rollout makes in between are left out: no arm override changes them, so the
    replay compares arms without building a model (``tests/test_protocol_steps.py`` checks the trainer agrees)."""
    cfg = load_config(config, overrides)
    algorithm = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
    batch = cfg.train.prompts_per_iter * cfg.train.images_per_prompt
    out = []
    for it in range(cfg.train.iterations if iterations is None else iterations):
        gen = generator(seed, SeedStream.ROLLOUT, it)
        kinds = algorithm.step_kinds(cfg.sampling.num_steps, gen, iteration=it)
        out.append(algorithm.trained_steps(list(kinds), batch, gen))
    return out


def step_mismatches(proto: dict, name: str, seed: int = 0, iterations: int | None = None) -> dict[str, str]:
    """Arms of recipe ``name`` that train other steps than its reference at some iteration, with where, and
    declared ``baselines`` that train the SAME steps (a stale declaration); empty when the design compares
    what it says. A quality comparison must train the same steps in every arm (issue 43: protocol v4's exact
    arm trained random single steps where every other arm trained blocks)."""
    view, spec = recipe_protocol(proto, name), proto["recipes"][name]
    common = list(spec.get("overrides", []))
    ref = reference(view)
    steps = {
        arm: trained_steps_of(spec["config"], common + list(o), seed, iterations)
        for arm, o in view["arms"].items()
    }
    problems = {}
    for arm, mine in steps.items():
        # over the iterations both train: an equal-cost arm runs as many as its budget buys, others fewer
        shared = zip(mine, steps[ref], strict=False)
        differs = next((it for it, (a, b) in enumerate(shared) if not torch.equal(a, b)), None)
        declared = arm in view.get("baselines", {})
        if differs is not None and not declared:
            problems[arm] = (
                f"trains other steps than {ref} from iteration {differs} (not a declared baseline)"
            )
        if differs is None and declared:
            problems[arm] = f"declared a baseline with other steps, but trains the steps of {ref}"
    return problems


def protocol_sha(path: Path = PROTOCOL) -> str:
    """Git SHA of the last commit that changed the protocol file, suffixed "-modified" if it differs now."""
    root = path.resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    sha = git("log", "-1", "--format=%H", "--", path.name) or "uncommitted"
    return sha + ("-modified" if git("status", "--porcelain", "--", path.name) else "")


def metric_specs(recipe: dict) -> list[dict]:
    """The recipe's primary metric first (role "primary"), then its secondary ones (role "secondary")."""
    return [{**recipe["primary"], "role": "primary"}] + [
        {**m, "role": "secondary"} for m in recipe["secondary"]
    ]


# --------------------------------------------------------------------------- running
def train_command(config: str, overrides: list[str], seed: int, run_dir: Path, extra: list[str]) -> list[str]:
    """The ``python -m jagg.train`` command of one (arm, seed)."""
    return [
        sys.executable,
        "-m",
        "jagg.train",
        "--config",
        config,
        *overrides,
        f"train.seed={seed}",
        f"log.run_dir={run_dir}",
        *extra,
    ]


def run_one(
    config: str, overrides: list[str], seed: int, run_dir: Path, extra: list[str]
) -> tuple[Path, float | None]:
    """Train one (arm, seed); reuse a finished run, resume an interrupted one. Returns (dir, seconds it ran),
    seconds None for a reused run."""
    cmd = train_command(config, overrides, seed, run_dir, extra)
    # `done` records the command: a finished run is reused only for the same config, overrides and seed (a
    # changed protocol or recipe reruns it instead of silently reusing the old run)
    stamp = " ".join(cmd[1:]) + "\n"
    if (run_dir / "done").is_file() and (run_dir / "done").read_text() == stamp:
        return run_dir, None
    if (run_dir / "done").is_file():
        (run_dir / "done").unlink()  # another command's run: --overwrite below replaces it
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    cmd.append("--resume" if (run_dir / "checkpoint").is_dir() else "--overwrite")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, text=True, env=env)
        # wait4: this child's own CPU seconds (another run finishing meanwhile is not counted)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read()[-2000:]}")
    with open(run_dir / CPU_SECONDS, "a") as f:  # one line per attempt: a resumed run adds its own
        f.write(f"{usage.ru_utime + usage.ru_stime:.1f}\n")
    (run_dir / "done").write_text(stamp)
    return run_dir, time.time() - started


CPU_SECONDS = "cpu_seconds"  # a run directory's CPU seconds, one line per attempt (run_one)


def cpu_seconds(run_dir: Path) -> float | None:
    """The CPU seconds a run's attempts took (``run_one``), None where none was recorded. An attempt killed
    together with this process (a session's end) records nothing, so a resumed run's total is a lower bound."""
    path = run_dir / CPU_SECONDS
    return sum(float(x) for x in path.read_text().split()) if path.is_file() else None


def run_all(jobs: list[tuple], n_parallel: int, finished=lambda key, run_dir: None) -> dict:
    """Run every job ``(key, config, overrides, seed, run_dir, extra)``; print a line per finished run with
    its time and the ETA (wall-clock per newly run job so far, parallel runs included, x jobs left), and call
    ``finished(key, run_dir)`` for each."""
    t0, done, fresh, dirs = time.time(), 0, 0, {}
    with ThreadPoolExecutor(n_parallel) as pool:
        futures = {pool.submit(run_one, *job[1:]): job[0] for job in jobs}
        for fut in as_completed(futures):
            key = futures[fut]
            dirs[key], seconds = fut.result()
            finished(key, dirs[key])
            done, fresh = done + 1, fresh + (seconds is not None)
            elapsed = time.time() - t0
            # wall time per newly run job (runs in parallel) x jobs left
            eta = elapsed / fresh * (len(jobs) - done) if fresh else 0.0
            took = "reused" if seconds is None else f"{seconds:.0f} s"
            print(
                f"[{done}/{len(jobs)}] {' '.join(map(str, key))}: {took}; elapsed {elapsed / 60:.1f} min, "
                f"ETA {eta / 60:.1f} min",
                flush=True,
            )
    return dirs


def collect(
    run_dir: Path, strategy: str, seed: int, exact_dir: Path | None = None, by_evaluation: bool = False
) -> list[dict]:
    """metrics.jsonl rows with strategy, seed, cumulative wall-clock, the per-sample agreement of the two
    attribute judges at every evaluation (from ``samples/eval_*.json``) and, where both runs saved their
    evaluated state, the paired divergence from ``exact_dir``'s run (``paired_divergence``; ``by_evaluation``:
    paired by the evaluations' order, as an equal-cost recipe's arms are evaluated at the same fractions of
    the budget after different iterations)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = exact_dir is not None and any((exact_dir / "samples").glob("eval_*.rank*.pt"))
    divergence = paired_divergence(run_dir, exact_dir, by_evaluation) if saved else {}
    clock = 0.0
    for r in rows:
        clock += r.get("time_iteration_s", 0.0)
        r.update(strategy=strategy, seed=seed, wall_clock_s=clock)
        for key in ("calibration_cosines", "routing", "fidelity_group_cosines"):  # keep a CSV cell readable
            if key in r:
                r[key] = json.dumps(r[key])
        if any(k.startswith("eval_") for k in r):  # an evaluation row
            r.update(divergence.get(r["iteration"], {}))
        per = run_dir / "samples" / f"eval_{r['iteration']:05d}.json"
        if per.is_file() and "eval_attr_judge_mean" in r:
            s = json.loads(per.read_text())
            a, j = s["attr"], s["attr_judge"]
            r["judges_agree"] = sum(x == y for x, y in zip(a, j, strict=True)) / len(a)
    return rows


# --------------------------------------------------------------------------- analysis (results/ only)
def load(recipe_dir: Path, proto: dict | None = None):
    """Every run's CSV of a recipe; with ``proto``, only its arms (a results directory may also hold runs of
    arms that the protocol does not name, which its analysis must not read), and a run's divergence only where
    it was measured from the protocol's reference (meta ``divergence_from``; exact before the key existed). A
    run trained on another world build than the reference's run of its seed is left out (a paired difference
    across builds is not one); ``df.attrs["other_build"]`` lists those runs."""
    import pandas as pd

    frames, builds = [], {}
    for path in sorted(recipe_dir.glob("*_seed*.csv")):
        frame = pd.read_csv(path)
        meta_path = path.with_suffix(".meta.json")
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if proto is not None and meta.get("divergence_from", "exact") != reference(proto):
            frame = frame.drop(columns=[c for c in frame if c.startswith("div_")])  # not this reference's
        if len(frame):
            builds[(frame.strategy.iloc[0], int(frame.seed.iloc[0]))] = json.dumps(meta.get("world_build"))
        frames.append(frame)
    df = pd.concat(frames, ignore_index=True)
    if proto is None:
        return df
    ref = reference(proto)
    other = sorted(
        (a, k) for (a, k), b in builds.items() if a != ref and (ref, k) in builds and b != builds[(ref, k)]
    )
    keep = (
        df.strategy.isin(list(proto["arms"])) & ~pd.Series(list(zip(df.strategy, df.seed))).isin(other).values
    )
    df = df[keep]
    df.attrs["other_build"] = [f"{a}_seed{k}" for a, k in other if a in proto["arms"]]
    return df


def per_run(df, metrics: list[str] | None = None) -> dict:
    """{(arm, seed): {metric: (last value, area under the curve)}} over the evaluation rows, and the base
    model's value per seed (iteration 0: the same model for every arm; the evaluation noise is the seed's, so a
    gain over the base is paired by seed too)."""
    metrics = [m for m in metrics or [] if m in df] or [c for c in df.columns if c.startswith("eval_")]
    out: dict = {}
    for (arm, seed), e in df.groupby(["strategy", "seed"]):
        ev = e.dropna(subset=[metrics[0]]).sort_values("iteration")
        out[(arm, int(seed))] = {
            m: (float(ev[m].iloc[-1]), area_under_curve(ev.iteration, ev[m])) for m in metrics
        }
    base = df[df.iteration == 0].dropna(subset=[metrics[0]]).groupby("seed")[metrics].mean()
    return {"runs": out, "base": {int(k): row.to_dict() for k, row in base.iterrows()}, "metrics": metrics}


def gains(stats: dict, arm: str, metric: str, k: int = 0) -> list[float]:
    """Per seed: the arm's value (k = 0: end, 1: AUC) minus the base model's on that seed."""
    runs, base = stats["runs"], stats["base"]
    return [v[metric][k] - base[s][metric] for (a, s), v in sorted(runs.items()) if a == arm]


def paired_diffs(runs: dict, arm: str, metric: str, k: int, reference: str = "exact") -> list[float]:
    """arm - reference (k = 0: end, 1: AUC) per seed, over the seeds both have (sorted)."""
    seeds = sorted(s for a, s in runs if a == arm and (reference, s) in runs)
    return [runs[(arm, s)][metric][k] - runs[(reference, s)][metric][k] for s in seeds]


def battery(d: list[float], margin: float, alpha: float, power: float) -> dict:
    """The protocol's tests of one paired difference d = arm - reference (higher is better for every metric):
    the interval, TOST, one-sided 'worse' and 'better' by t and sign flip, both tests two-sided, the MDD."""
    import numpy as np

    sd = float(np.std(d, ddof=1))
    return {
        "ci": paired_interval(d, 1 - alpha),
        "tost": tost(d, margin, alpha).p,
        "worse_t": one_sided_below(d),
        "worse_flip": sign_flip_test(d, "less"),
        "better_t": one_sided_below([-x for x in d]),
        "better_flip": sign_flip_test(d, "greater"),
        "flip_two_sided": sign_flip_test(d, "two-sided"),
        "t_two_sided": min(1.0, 2 * min(one_sided_below(d), one_sided_below([-x for x in d]))),
        "mdd": minimum_detectable_difference(sd, len(d), alpha, power),
    }


TESTS = ("tost", "worse_t", "worse_flip", "better_t", "better_flip")  # the battery's p-values Holm adjusts


def analyse(
    stats: dict, arms: list[str], specs: list[dict], alpha: float, power: float, ref: str = "exact"
) -> list[dict]:
    """One row per (metric spec, arm != the reference ``ref``): the battery, Holm-adjusted over the arm's
    secondary specs."""
    rows = []
    for arm in (a for a in arms if a != ref):
        mine = []
        for spec in specs:
            if spec["metric"] not in stats["metrics"]:
                continue
            d = paired_diffs(stats["runs"], arm, spec["metric"], 0 if spec["summary"] == "end" else 1, ref)
            if len(d) >= 2:
                mine.append({"arm": arm, **spec, "n": len(d), **battery(d, spec["margin"], alpha, power)})
        secondary = [r for r in mine if r["role"] == "secondary"]
        for test in TESTS:
            for r, adj in zip(secondary, holm([r[test] for r in secondary]), strict=True):
                r[test + "_adj"] = adj
        for r in mine:
            if r["role"] == "primary":
                r.update({test + "_adj": r[test] for test in TESTS})
        rows += mine
    return rows


def control_detected(rows: list[dict], control_arms: list[str], alpha: float) -> dict[tuple, dict[str, bool]]:
    """Per (metric, summary), per positive-control arm: worse than the reference by the t-test AND the
    sign-flip test (Holm-adjusted on a secondary metric, as its verdict reads). A control detected on one
    metric says nothing of the design's power on another, so each metric's equivalence is gated by its own."""
    out: dict[tuple, dict[str, bool]] = {}
    for r in (r for r in rows if r["arm"] in control_arms):
        worse = r["worse_t_adj"] < alpha and r["worse_flip_adj"] < alpha
        # a control with no row on a metric where another has one (too few seeds yet) is not detected there
        out.setdefault((r["metric"], r["summary"]), dict.fromkeys(control_arms, False))[r["arm"]] = worse
    return out


def design_controls(proto: dict) -> list[str]:
    """The controls the design check reads: the protocol's ``design_controls`` where it names them (v4's
    amendment 2: the two controls trained on every seed of the contrast; the others, at fewer seeds, are its
    dose-response and keep their own verdicts), else every control arm. Each must be a control arm."""
    named = proto.get("control_arms", [])
    chosen = proto.get("design_controls", named)
    if not set(chosen) <= set(named):
        raise ValueError(
            f"design_controls {sorted(set(chosen) - set(named))} are not in control_arms {named}"
        )
    return list(chosen)


def primary_controls(detected: dict[tuple, dict[str, bool]], rows: list[dict]) -> dict[str, bool]:
    """The controls' detection on the primary metric (``control_detected``), the design check's."""
    key = next(((r["metric"], r["summary"]) for r in rows if r["role"] == "primary"), None)
    return detected.get(key, {})


def verdict(
    r: dict, alpha: float, controls: dict[str, bool], control_arms: list[str], ref: str = "exact"
) -> str:
    """The row's reading under the protocol (worse / better / equivalent / no claim), Holm-adjusted p for
    secondary; ``controls``: the controls' detection on this row's metric (``control_detected``). Worse and
    better each need the one-sided t-test and the sign-flip test; equivalence also a control detected on the
    same metric (a claim of no difference needs a design shown to see one there)."""
    worse = r["worse_t_adj"] < alpha and r["worse_flip_adj"] < alpha
    if r["arm"] in control_arms:
        return "positive control " + (f"detected (worse than {ref})" if worse else "NOT detected")
    if worse:
        return f"worse than {ref}"
    detected = bool(controls) and all(controls.values())
    if r["better_t_adj"] < alpha and r["better_flip_adj"] < alpha:
        # better by less than the margin is also equivalent, where the design could tell
        return f"better than {ref}" + (", within the margin" if r["tost_adj"] < alpha and detected else "")
    if r["tost_adj"] < alpha:
        if detected:
            return "equivalent within the margin"
        if not controls:
            return "TOST passed, NO claim: no positive control ran"
        return "TOST passed, NO claim: the design does not detect the positive control on this metric"
    if r["mdd"] > r["margin"]:
        return "no difference shown; underpowered (MDD > margin)"
    return "no difference shown, equivalence not shown"


def battery_table(
    rows: list[dict],
    alpha: float,
    controls: dict[tuple, dict[str, bool]],
    control_arms: list[str],
    ref: str = "exact",
    baselines: dict | None = None,
) -> list[str]:
    """Markdown: every row of ``analyse`` with its p-values (Holm-adjusted in brackets for secondary) and its
    verdict under the controls of its own metric (``control_detected``); a declared baseline's arm is marked
    (it trains other steps than ``ref``: its difference is end to end)."""
    lines = [
        f"| metric | summary | role | margin | MDD | arm | n | paired diff to {ref} [95% CI] | TOST p | "
        "worse t p | worse sign-flip p | two-sided t p | two-sided sign-flip p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def p(r: dict, test: str) -> str:
        return f"{r[test]:.3f}" + (f" ({r[test + '_adj']:.3f})" if r["role"] == "secondary" else "")

    for r in rows:
        lines.append(
            f"| {r['metric'][5:-5]} | {r['summary']} | {r['role']} | {r['margin']:.3f} | {r['mdd']:.3f} | "
            f"{r['arm']}{' (baseline, other steps)' if r['arm'] in (baselines or {}) else ''} | {r['n']} | "
            f"{r['ci']} | {p(r, 'tost')} | {p(r, 'worse_t')} | {p(r, 'worse_flip')} | {r['t_two_sided']:.3f} | "
            f"{r['flip_two_sided']:.3f} | "
            f"{verdict(r, alpha, controls.get((r['metric'], r['summary']), {}), control_arms, ref)} |"
        )
    return lines


def judge_table(stats: dict, df, arms: list[str]) -> list[str]:
    """Markdown: each arm's attribute gain over the base model at the last evaluation by every judge present
    (95% CI over seeds), how often attr and attr_judge agreed on the samples of the last evaluation, and the
    verdict. With the geometric judge: a gain needs attr_geom AND a learned judge above 0 (judges of different
    kinds agree); without it, attr confirmed by attr_judge."""
    names = [m for m in ATTRIBUTE_JUDGES if m in stats["metrics"]]
    if len(names) < 2:
        return []
    # each run's own last evaluation: an equal-cost recipe's arms end at different iterations (the recipe's
    # last iteration alone read only the longest arm's runs and left every other arm's agreement nan)
    judged = df.dropna(subset=["judges_agree"]) if "judges_agree" in df else df.iloc[:0]
    last = judged.sort_values("iteration").groupby(["strategy", "seed"]).tail(1)
    head = " | ".join(f"{m[5:-5]} gain [95% CI]" for m in names)
    lines = [
        f"| arm | {head} | attr / attr_judge agree (last eval) | verdict |",
        "|" + "---|" * (len(names) + 3),
    ]
    for arm in arms:
        cis = {m: paired_interval(gains(stats, arm, m)) for m in names}
        up = {m: ci.lo > 0 for m, ci in cis.items()}
        agree = last[last.strategy == arm].judges_agree.mean()  # nan where no run saved its judges' samples
        learned = up["eval_attr_mean"] or up.get("eval_attr_judge_mean", False)
        if "eval_attr_geom_mean" in up:
            if up["eval_attr_geom_mean"] and learned:
                verdict_ = "attribute gain: the geometric judge and a learned judge agree"
            elif learned:
                verdict_ = "a learned judge rose, NOT confirmed by the geometric judge"
            elif up["eval_attr_geom_mean"]:
                verdict_ = "only the geometric judge saw a gain"
            else:
                verdict_ = "no attribute gain shown"
        elif up["eval_attr_mean"] and up["eval_attr_judge_mean"]:
            verdict_ = "attribute gain, confirmed by the eval-only judge"
        elif up["eval_attr_mean"]:
            verdict_ = "attr rose, NOT confirmed by the eval-only judge"
        elif up["eval_attr_judge_mean"]:
            verdict_ = "the eval-only judge saw a gain, the training classifier did not"
        else:
            verdict_ = "no attribute gain shown"
        lines.append(f"| {arm} | {' | '.join(str(cis[m]) for m in names)} | {agree:.3f} | {verdict_} |")
    return lines


def timing_table(df, strategies: list[str]) -> list[str]:
    """Markdown: median seconds per iteration and per update, the update's speed-up over exact (ratio of
    medians), total seconds per run, and the calibration's total cost (measured routing or placement) next to the
    update time the arm saved relative to exact."""
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
        # measured routing's cost (auto, jagg_auto, knots' placement); 0 for an arm that never calibrates
        cal = e.groupby("seed").time_calibrate_s.sum().mean() if "time_calibrate_s" in e else 0.0
        base = totals.get("exact", {})
        shared = [s for s in totals[strategy].index if s in base]  # seeds both arms ran (on one build)
        saved = np.mean([base[s] - totals[strategy][s] for s in shared]) if shared else float("nan")
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


def recipe_meta(recipe_dir: Path) -> dict:
    """The first run's meta, its ``git_sha`` replaced by every distinct SHA that trained the recipe's runs
    (per-run CSVs record the code that ran them, which can differ between sessions) and its ``overrides`` by
    those every run shares (an arm's own overrides are the protocol's)."""
    metas = [json.loads(p.read_text()) for p in sorted(recipe_dir.glob("*.meta.json"))]
    shared = [o for o in metas[0]["overrides"] if all(o in m["overrides"] for m in metas)]
    return {
        **metas[0],
        "git_sha": ", ".join(sorted({m["git_sha"] for m in metas})),
        "hardware": "; ".join(sorted({m["hardware"] for m in metas})),
        "overrides": shared,
        "world_builds": world_builds(metas),
        "cpu": cpu_total(metas),
    }


def cpu_total(metas: list[dict]) -> str:
    """The runs' total CPU seconds (every attempt, ``run_one``), as hours with how many runs recorded them."""
    cpu = [m["cpu_seconds"] for m in metas if m.get("cpu_seconds") is not None]
    return f"CPU time {sum(cpu) / 3600:.1f} h over {len(cpu)} of {len(metas)} runs" if cpu else ""


def world_builds(metas: list[dict]) -> str:
    """Which seeds ran on which build of the world (its backbone's weights named by their sha256), or ''
    where no run recorded one. Arms are compared within a seed, which shares one build."""
    seeds: dict[str, set] = {}
    for m in metas:
        build = m.get("world_build")
        name = (
            (build.get("flux") or json.dumps(build, sort_keys=True))
            if build
            else "not recorded (an earlier build)"
        )
        # older metas (version 3) list all the protocol's seeds under "seed"; the run's own is in its run.json
        seed = m["seed"] if isinstance(m["seed"], int) else m["run_json"]["train"]["seed"]
        seeds.setdefault(name, set()).add(seed)
    if list(seeds) == ["not recorded (an earlier build)"]:
        return ""
    return "world build (flux weights' sha256) by seed: " + "; ".join(
        f"{', '.join(map(str, sorted(ks)))}: {b}" for b, ks in sorted(seeds.items(), key=lambda x: min(x[1]))
    )


def recipe_stats(df, specs: list[dict]) -> dict:
    """per_run over the recipe's metrics and the attribute judges present (all eval metrics without specs)."""
    named = list(dict.fromkeys([s["metric"] for s in specs] + [m for m in ATTRIBUTE_JUDGES if m in df]))
    return per_run(df, named or None)


def recipe_section(name: str, recipe_dir: Path, df, proto: dict) -> str:
    """One recipe of summary.md: the design, the positive-control check, the battery, judges, time."""
    meta = recipe_meta(recipe_dir)
    alpha, power, controls_named = proto["alpha"], proto["power"], proto.get("control_arms", [])
    ref = reference(proto)
    paired = df[df.seed.isin(df[df.strategy == ref].seed)].groupby("strategy").seed.nunique()
    # an arm enters the statistics once it has 2 seeds paired with the reference (1 gives no interval)
    arms = [a for a in proto["arms"] if paired.get(a, 0) >= 2]
    specs = metric_specs(proto["recipes"][name]) if name in proto["recipes"] else []
    stats = recipe_stats(df, specs)
    seeds = sorted(int(s) for s in df.seed.unique())
    last_it = int(df.dropna(subset=[stats["metrics"][0]]).iteration.max())
    base = ", ".join(
        f"{m[5:-5]} {sum(b[m] for b in stats['base'].values()) / len(stats['base']):.3f}"
        for m in stats["metrics"]
    )
    # an equal-cost recipe's arms end at different iterations
    ec = proto["recipes"].get(name, {}).get("equal_cost")
    rows = analyse(stats, arms, specs, alpha, power, ref)
    detected = control_detected(rows, design_controls(proto), alpha)
    controls = primary_controls(detected, rows)
    if not controls:
        design = (
            f"No positive control of {ref} ran: the battery's power is unknown and NO equivalence is claimed."
        )
        # a control of another arm (the window amendment's window2_control_0.8) is read in its own contrast
        others = [a for a in arms if mixes_control(proto, a) and a not in controls_named]
        if others:
            design += f" {', '.join(others)} degrades another arm's gradient: see its contrast below."
    elif all(controls.values()):
        design = (
            f"The positive control ({', '.join(controls)}) is detected on the primary metric: equivalence "
            "verdicts on it count; on a secondary metric one counts only where the control is detected on that "
            "metric too (its rows below)."
        )
    else:
        design = (
            f"The positive control ({', '.join(a for a, ok in controls.items() if not ok)}) is NOT detected on "
            "the primary metric: this design cannot discriminate a gradient of that quality from exact there, and "
            "NO equivalence claim is made on it (a passed TOST below is reported as 'no claim'; on a secondary "
            "metric one counts only where every control is detected on that metric)."
        )
    if design_controls(proto) != controls_named:
        design += (
            f" The design check reads {', '.join(design_controls(proto))} (the protocol's `design_controls`); "
            "the other controls keep their own verdicts below."
        )
    if proto.get("note"):
        design += f" {proto['note'].strip()}"
    if df.attrs.get("other_build"):
        design += (
            f" Left out, trained on another world build than {ref}'s run of their seed (to be rerun): "
            + ", ".join(df.attrs["other_build"])
            + "."
        )
    by_arm = arm_seeds(proto, name)
    plan = {(a, k) for a, ks in by_arm.items() for k in ks}
    planned, missing = sorted({k for _, k in plan}), plan - set(stats["runs"])
    if seeds != planned or missing:
        waiting = sorted(set(df.strategy) - set(arms))
        design += (
            f" NOTE: these runs' seeds {seeds} are not the protocol's {planned}"
            + (f" ({len(missing)} of its runs missing)" if missing else "")
            + (
                f"; left out until they have 2 seeds paired with {ref}: {', '.join(waiting)}"
                if waiting
                else ""
            )
            + "; this is not (yet) the analysis under the protocol."
        )
    staged = set(planned) - set.intersection(*(set(ks) for ks in by_arm.values()))
    seeding = "paired: the same seeds for every arm" + (
        f"; seeds {sorted(staged)} only for "
        + ", ".join(sorted(a for a, ks in by_arm.items() if staged <= set(ks)))
        if staged
        else ""
    )
    lines = [
        f"## {name}",
        "",
        f"Config `{meta['config']}` {' '.join(meta['overrides'])}; git {meta['git_sha']}; {meta['hardware']}; "
        f"torch {meta['versions']['torch']}; seeds {seeds} ({seeding}); "
        + (f"{meta['world_builds']}; " if meta["world_builds"] else "")
        + (
            f"{meta['cpu']} (one thread each, evaluations and instruments included); "
            if meta.get("cpu")
            else ""
        )
        + f"{last_it} iterations{' (the longest run)' if ec else ''}. Base model (iteration 0, mean over "
        f"the seeds' evaluation noise): {base}.",
        "",
        f"**Design check.** {design}",
        "",
        f"### Every arm against {ref} (the protocol's battery)",
        "",
        (
            "End = each run's last evaluation, at the end of its budget"
            if ec
            else f"End = the last evaluation (iteration {last_it})"
        )
        + "; auc = the mean level over all evaluations. Margins are "
        f"the protocol's (absolute). MDD = the smallest true difference a paired t-test detects with power "
        f"{power} at alpha {alpha} given this arm's paired SD and n. Secondary rows: Holm-adjusted p in "
        "brackets (family = the arm's secondary metrics); verdicts use them. 'Worse' needs the t-test and the "
        "sign-flip test. A 95% interval containing 0 means no difference was detected, not that there is none.",
        "",
        *battery_table(rows, alpha, detected, controls_named, ref, proto.get("baselines")),
        "",
    ]
    judge = judge_table(stats, df, arms)
    if judge:
        lines += [
            "### Attribute gain by judges of different kinds",
            "",
            "Gain over the base model at the last evaluation, 95% interval over seeds. `attr` trains the "
            "policy (DanceGRPO), `attr_judge` is a learned eval-only judge, `attr_geom` reads the renderer's "
            "geometry (no weights). A gain is reported only where `attr_geom` and a learned judge agree.",
            "",
            *judge,
            "",
        ]
    lines += (
        (equal_cost.section_lines(df, stats, proto, ec) if ec else [])
        + (equal_cost.drift_lines(df, stats, ec, arms) if ec else [])
        + goal_lines(stats, proto, name, detected)
        + contrast_lines(stats, proto)
        + share_lines(stats, proto["recipes"].get(name, {}).get("share"))
        + descriptive_lines(df, stats, proto["recipes"].get(name, {}).get("descriptive"))
        + sizing_lines(stats, proto, specs)
        + fidelity_lines(df, arms)
        + dose_lines(df, stats, proto, arms, specs)
    )
    lines += [
        "### Time (wall-clock includes two runs sharing 2 cores)",
        "",
        "Which runs share the cores differs by arm, so these ratios are not a benchmark: a control runs exact's "
        "backward, and its distance from 1.00x is what the pairing alone does. `make table1` measures speed side "
        "by side.",
        "",
        *timing_table(df, arms),
        "",
        *routing_lines(df),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- version 4's instruments
def seeds_needed(sd: float, effect: float, alpha: float, power: float) -> int | str:
    """The fewest paired seeds whose one-sided t-test detects ``effect`` with ``power`` at ``alpha`` given the
    paired SD ``sd`` (">200" beyond)."""
    fits = (
        n for n in range(3, 201) if minimum_detectable_difference(sd, n, alpha, power, "greater") <= effect
    )
    return next(fits, ">200")


def _p(p: float) -> str:
    """A p-value to four decimals, or in scientific notation below 1e-4 (where four decimals read 0.0000)."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def goal_lines(stats: dict, proto: dict, name: str, detected: dict[tuple, dict[str, bool]]) -> list[str]:
    """The recipe's ``goal`` (an equal-cost recipe's non-inferiority reading, ``equal_cost.goal_lines``),
    claimed only where the controls are detected on the goal's own metric (``control_detected``)."""
    goal = proto["recipes"].get(name, {}).get("goal")
    if not goal or goal["metric"] not in stats["metrics"]:
        return []
    d = paired_diffs(
        stats["runs"], goal["arm"], goal["metric"], SUMMARIES[goal["summary"]], goal["reference"]
    )
    if len(d) < 2:
        return []
    controls = detected.get((goal["metric"], goal["summary"]), {})
    control = all(controls.values()) if controls else None
    return equal_cost.goal_lines(
        d, goal, proto["alpha"], proto["power"], control, proto.get("is_pilot", False)
    )


def share_lines(stats: dict, spec: dict | None) -> list[str]:
    """The recipe's pre-registered ``share`` (``equal_cost.share_lines``) at its summary (end or auc)."""
    return equal_cost.share_lines(stats, spec, SUMMARIES[spec["summary"]]) if spec else []


def contrast_lines(stats: dict, proto: dict) -> list[str]:
    """Each pre-registered contrast (``contrast`` or ``contrasts``: better - worse, one-sided, paired by seed)
    and its power."""
    return [line for c in contrasts(proto) for line in one_contrast_lines(stats, proto, c)]


def one_contrast_lines(stats: dict, proto: dict, c: dict) -> list[str]:
    """The contrast ``c``'s interval, its two one-sided tests (both must pass) and their power."""
    if c["metric"] not in stats["metrics"]:
        return []
    d = paired_diffs(stats["runs"], c["better"], c["metric"], SUMMARIES[c["summary"]], c["worse"])
    if len(d) < 2:
        return []
    # the power reported is that of the test that judged it: the effect its seeds detect at the paired SD seen
    test = one_sided_above(d, proto["alpha"], proto["power"])
    planned = len(set(proto["seeds"]) | set(c.get("seeds", [])))
    # the test is pre-registered at its planned seeds: a look at fewer is not the test (stopping early on a
    # small p would inflate the error rate), so it carries no verdict
    if proto.get("is_pilot"):  # a pilot sizes the test on other seeds: its look is not the test
        verdict = "the pilot's look (it sizes the test), NOT the test: no verdict"
    elif len(d) >= planned:
        verdict = (
            f"**{'shown' if test.passed else 'not shown'}** at alpha {proto['alpha']} (both tests must pass)"
        )
    else:
        verdict = (
            f"an interim look at {len(d)} of the {planned} pre-registered seeds, NOT the test: no verdict"
        )
    return [
        f"### Pre-registered contrast: {c['better']} - {c['worse']} ({c['metric'][5:-5]}, {c['summary']})",
        "",
        f"{paired_interval(d)} over {len(d)} seeds; one-sided ({c['better']} better) t-test p = {_p(test.p_t)}, "
        f"sign-flip p = {_p(test.p_flip)}: {verdict}. Paired SD {test.sd:.3f}: {len(d)} seeds detect a true "
        f"difference of {test.mdd:.3f} with power {proto['power']} (one-sided t-test at alpha {proto['alpha']}).",
        "",
    ]


def descriptive_lines(df, stats: dict, specs: list[dict] | None) -> list[str]:
    """The recipe's ``descriptive`` contrasts (registered as descriptions: intervals, no test): better - worse
    paired by seed at the ``summary`` (end / auc) or, with ``summary: per_iteration``, at every iteration both
    evaluated (``equal_cost.per_iteration_lines``), on each of its ``metrics``; under 2 paired seeds, left out."""
    lines: list[str] = []
    for c in specs or []:
        metrics = [m for m in c["metrics"] if m in stats["metrics"]]
        if not metrics:
            continue
        if c["summary"] == "per_iteration":
            lines += equal_cost.per_iteration_lines(df, c, metrics)
            continue
        diffs = {
            m: paired_diffs(stats["runs"], c["better"], m, SUMMARIES[c["summary"]], c["worse"])
            for m in metrics
        }
        if len(diffs[metrics[0]]) < 2:
            continue
        cells = [f"{m[5:-5]} {paired_interval(d)} (n {len(d)})" for m, d in diffs.items()]
        lines += [f"- **{c['better']} - {c['worse']}** ({c['summary']}): " + "; ".join(cells), ""]
    if not lines:
        return []
    return [
        "### Reported descriptively (registered without a test)",
        "",
        "Paired differences with their 95% t interval over seeds; no test, no verdict: the protocol registers "
        "these as descriptions.",
        "",
        *lines,
    ]


def sizing_lines(stats: dict, proto: dict, specs: list[dict]) -> list[str]:
    """A pilot's sizing, power ``power`` at one-sided ``alpha`` (paired t-test): the seeds the contrast needs at
    its pilot effect, 0.05 and 0.10, and those that detect each control's pilot cost on each metric of
    ``specs`` (no multiplicity correction: a sizing, not a test)."""
    if not proto.get("is_pilot"):
        return []
    import numpy as np

    alpha, power = proto["alpha"], proto["power"]
    lines = [f"### Sizing (pilot), power {power} at one-sided alpha {alpha}, paired t-test", ""]
    runs = stats["runs"]
    for c in (c for c in contrasts(proto) if c["metric"] in stats["metrics"]):
        d = paired_diffs(runs, c["better"], c["metric"], SUMMARIES[c["summary"]], c["worse"])
        if len(d) < 2:
            continue
        sd = float(np.std(d, ddof=1))
        effects = sorted({abs(float(np.mean(d))), 0.05, 0.1} - {0.0})
        lines.append(
            f"- the contrast {c['better']} - {c['worse']}: paired SD {sd:.4f}; seeds by true effect: "
            + ", ".join(f"{e:.3f}: {seeds_needed(sd, e, alpha, power)}" for e in effects)
        )
    for spec in [m for m in specs if m["metric"] in stats["metrics"]]:
        for arm in proto.get("control_arms", []):
            # exact - control: > 0 where the control costs
            dc = paired_diffs(runs, reference(proto), spec["metric"], SUMMARIES[spec["summary"]], arm)
            if len(dc) < 2:
                continue
            sd_c, cost = float(np.std(dc, ddof=1)), float(np.mean(dc))
            n = (
                seeds_needed(sd_c, cost, alpha, power)
                if cost > 0
                else "not detectable (no cost in the pilot)"
            )
            lines.append(
                f"- detecting {arm} on {spec['metric'][5:-5]} ({spec['summary']}, {spec['role']}): "
                f"pilot cost {cost:+.4f}, paired SD {sd_c:.4f}; seeds: {n}"
            )
    return lines + [""] if len(lines) > 2 else []


def fidelity_lines(df, arms: list[str]) -> list[str]:
    """Per arm: the mean cosine of the gradient it hands to the optimizer to exact's on the same micro-batches
    (log.fidelity_every; after a control's degradation, before clipping), its relative error, where the update
    lands (log.landing: the optimizer step's and the velocity change's cosine to exact's) and the paired
    divergence from exact's run at each run's last evaluation, mean [95% CI] over seeds."""
    if "fidelity_cosine" not in df:
        return []
    names = ("fidelity_cosine", "fidelity_rel_err", "landing_step_cosine", "landing_function_cosine")
    cols = [c for c in (*names, "div_weights_rel", "div_samples_rel") if c in df]
    divs = [c for c in cols if c.startswith("div_")]
    # each run's last evaluation (an equal-cost recipe's arms end after different iterations)
    last = df.dropna(subset=divs[:1]).sort_values("iteration").groupby(["strategy", "seed"]).tail(1)
    lines = [
        "### Fidelity to exact and divergence from exact's run",
        "",
        "fidelity: the cosine (relative error) of the gradient each arm hands to the optimizer (AdamW) to exact's "
        "on the same rollout and weights, mean over the logged iterations; "
        + (
            "landing: the same for the optimizer step that gradient makes and for the velocity change it "
            "causes on the trained states; "
            if any(c.startswith("landing_") for c in cols)
            else ""
        )
        + "divergence: ||theta - theta_exact|| / ||theta_exact - theta_0|| and the same for the held-out "
        "samples, at the last evaluation. Mean [95% CI] over seeds.",
        "",
        "| arm | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for arm in arms:
        cells = []
        for c in cols:
            src = last if c in divs else df
            per_seed = src[src.strategy == arm].dropna(subset=[c]).groupby("seed")[c].mean()
            cells.append(str(paired_interval(list(per_seed))) if len(per_seed) >= 2 else "-")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines + [""]


def control_scale(proto: dict) -> dict[str, dict[float, str]]:
    """The dose-response scales: ``{direction: {cosine: control arm}}`` from the control arms' overrides."""
    scales: dict[str, dict[float, str]] = {}
    for arm in proto.get("control_arms", []):
        o = dict(x.split("=", 1) for x in proto["arms"].get(arm, []))
        if "train.control_cosine" in o:
            direction = o.get("train.control_direction", "fixed")
            scales.setdefault(direction, {})[float(o["train.control_cosine"])] = arm
    return scales


def dose_metric_names(proto: dict) -> tuple[list[str], list[str]]:
    """The protocol's ``dose_metrics`` split into those an arm is placed by and the fidelity ones dropped: a
    control's fidelity is its cosine by construction, so locating an arm on the controls' scale by its
    fidelity reads its fidelity back as a cosine (circular). Fidelity itself is reported by fidelity_lines."""
    names = proto.get("dose_metrics", [])
    return [n for n in names if not n.startswith("fidelity_")], [
        n for n in names if n.startswith("fidelity_")
    ]


def dose_worse(name: str) -> int:
    """The side of a worse effect for a dose metric, as jagg.stats.dose_location takes it: +1 (higher is worse)
    for a divergence or a relative error, -1 (lower is worse) for a reward's paired difference and a cosine."""
    return 1 if name.startswith("div_") or name.split(":")[0].endswith("_rel_err") else -1


def dose_values(df, stats: dict, name: str) -> dict[tuple[str, int], float]:
    """One number per (arm, seed) for a dose metric ``metric:summary`` (end / auc of an eval metric or a
    divergence, the training reward's mean over the last quarter of iterations, a fidelity's mean)."""
    metric, summary = name.split(":")
    if summary in ("end", "auc") and metric in stats["metrics"]:
        return {key: v[metric][0 if summary == "end" else 1] for key, v in stats["runs"].items()}
    if metric not in df:
        return {}
    out = {}
    for (arm, seed), e in df.dropna(subset=[metric]).groupby(["strategy", "seed"]):
        e = e.sort_values("iteration")
        if summary == "last_quarter":
            e = e[e.iteration > e.iteration.max() * 3 / 4]
        out[(arm, int(seed))] = float(e[metric].iloc[-1] if summary == "end" else e[metric].mean())
    return out


def dose_effects(df, stats: dict, name: str, ref: str = "exact"):
    """For a dose metric, ``(seeds_of, effect, reference)``: ``seeds_of(arm)`` the seeds where the arm's effect
    is defined; ``effect(arm, seeds)`` its per-seed effect, a paired difference to exact's run of the seed,
    except for divergence and fidelity, which are already relative to exact and taken raw; ``reference``
    exact's own effect (0, or 1 for a fidelity)."""
    values = dose_values(df, stats, name)
    paired = not name.startswith(("div_", "fidelity_"))

    def seeds_of(arm: str) -> set[int]:
        return {s for a, s in values if a == arm and (not paired or (ref, s) in values)}

    def effect(arm: str, seeds) -> list[float]:
        return [values[(arm, s)] - (values[(ref, s)] if paired else 0.0) for s in sorted(seeds)]

    return seeds_of, effect, 0.0 if paired or name.startswith("div_") else 1.0


def dose_lines(df, stats: dict, proto: dict, arms: list[str], specs: list[dict]) -> list[str]:
    """The dose-response table: per dose metric, each control's effect [95% CI] and each other arm located on
    the fixed-direction and the fresh-direction scale ("behaves like a cosine-c gradient", bootstrap 95%
    interval over seeds). Effects are paired differences to exact, except divergence, which is already
    relative to exact (its own value: 0). A fidelity dose metric is dropped, with a line that says why
    (dose_metric_names)."""
    scales, (names, dropped) = control_scale(proto), dose_metric_names(proto)
    if not scales or not names:
        return []
    ref, skip = reference(proto), {*proto.get("control_arms", []), *proto.get("baselines", {})}
    others = [a for a in arms if a != ref and a not in skip]  # a baseline trains other steps: not placed
    head = [f"{arm} ({d})" for d, sc in scales.items() for arm in sc.values()]
    lines = [
        "### Dose-response: every arm on the controls' cosine scale",
        "",
        f"Reference: `{ref}`, called exact below. "
        "Control columns: the effect (paired difference to exact; raw for divergence), mean [95% CI]. Arm "
        "columns: the cosine c at which a control (direction fixed per run / fresh per step) has the arm's "
        "effect, by linear interpolation from cosine 1 (exact) down; a bound where the effect lies beyond the "
        "scale, by the side it lies on: `>=1.00 (beyond exact)` better than exact's (a higher reward, a lower "
        "divergence), `<=` worse than the weakest control's. Bootstrap 95% intervals over the seeds the arm and "
        "the scale's controls share, resampled jointly for scale and arm.",
        "",
        *(
            [
                f"Not placed: {', '.join(dropped)} (pre-registered as a dose metric). A control's fidelity is its "
                "cosine by construction, so placing an arm by its fidelity would read the fidelity back as a "
                "cosine (circular); fidelity is reported in the fidelity table above.",
                "",
            ]
            if dropped
            else []
        ),
        "| metric | " + " | ".join(head + [f"{a} on {d}" for a in others for d in scales]) + " |",
        "|---|" + "---|" * (len(head) + len(others) * len(scales)),
    ]
    for name in names:
        seeds_of, effect, own = dose_effects(df, stats, name, ref)
        cells = [
            str(paired_interval(effect(a, seeds_of(a)))) if len(seeds_of(a)) >= 2 else "-"
            for sc in scales.values()
            for a in sc.values()
        ]
        for arm in others:
            for sc in scales.values():
                common = seeds_of(arm).intersection(*(seeds_of(a) for a in sc.values()))  # joint bootstrap
                curve = {c: effect(a, common) for c, a in sc.items()}
                located = (
                    located_cosine(curve, effect(arm, common), own, worse=dose_worse(name), name=ref)
                    if len(common) >= 2
                    else "-"
                )
                cells.append(str(located))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot_dose(name: str, df, stats: dict, proto: dict, png: Path, meta: dict) -> None:
    """Per dose metric: each scale's mean effect against the control's cosine (cosine 1: exact's), and every
    other arm's mean effect as a horizontal line; the effects are dose_lines' (one computation, dose_effects).
    Nothing without a scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scales, names = control_scale(proto), dose_metric_names(proto)[0]  # no fidelity: see dose_metric_names
    ref, skip = reference(proto), {*proto.get("control_arms", []), *proto.get("baselines", {})}
    arms = [a for a in df.strategy.unique() if a != ref and a not in skip]
    if not scales or not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], names, strict=True):
        seeds_of, effect, own = dose_effects(df, stats, metric, ref)

        def mean_effect(arm: str) -> float:
            return float(np.mean(effect(arm, seeds_of(arm)))) if seeds_of(arm) else float("nan")

        for direction, sc in scales.items():
            xs = [1.0, *sorted(sc, reverse=True)]
            ax.plot(
                xs, [own] + [mean_effect(sc[c]) for c in xs[1:]], marker="o", label=f"control ({direction})"
            )
        for arm in arms:
            ax.axhline(mean_effect(arm), ls="--", lw=1, color=f"C{2 + arms.index(arm)}", label=arm)
        ax.set(title=metric, xlabel="control cosine")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{name}: dose-response (means over seeds; effects vs {ref})", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    figure_footer(fig, meta, f"world, seeds {sorted(int(k) for k in df.seed.unique())}")
    save_figure(fig, png, 75)


def plot(name: str, df, png: Path, arms: list[str], meta: dict) -> None:
    """Mean over seeds +- one standard error, vs iteration and vs wall-clock seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in ("reward_mean", "eval_pref_mean", "eval_clip_mean", *ATTRIBUTE_JUDGES) if m in df]
    fig, axes = plt.subplots(2, len(metrics), figsize=(3.4 * len(metrics), 6.2), squeeze=False)
    # one colour per arm across panels (tab10 repeats after 10 arms; version 4 has 11)
    colour = dict(zip(arms, plt.get_cmap("tab10" if len(arms) <= 10 else "tab20").colors, strict=False))
    for col, m in enumerate(metrics):
        d = df.dropna(subset=[m])
        for strategy in (a for a in arms if a in set(d.strategy)):
            g = d[d.strategy == strategy].groupby("iteration")
            mean, se = g[m].mean(), g[m].sem().fillna(0)
            clock = g.wall_clock_s.mean()
            for row, x in ((0, mean.index), (1, clock.values)):
                ax = axes[row][col]
                style = dict(color=colour[strategy], marker="o" if m != "reward_mean" else None, ms=3)
                ax.plot(x, mean.values, label=strategy, **style)
                ax.fill_between(x, (mean - se).values, (mean + se).values, alpha=0.15, color=colour[strategy])
        axes[0][col].set(title=m.replace("_mean", "").replace("eval_", "held-out "), xlabel="iteration")
        axes[1][col].set(xlabel="wall-clock s (mean over seeds)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{name}: mean over seeds +- 1 SE", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    figure_footer(fig, meta, f"world, seeds {sorted(int(k) for k in df.seed.unique())}")
    save_figure(fig, png, 75)


def render(
    csv_dir: Path, figures: Path, proto_path: Path = PROTOCOL, long: bool = False, pilot: bool = False
) -> None:
    """summary.md and one figure per recipe (``reward_curves_<recipe>.png``) from the CSVs and the protocol."""
    proto = load_protocol(proto_path, long, pilot)
    recipes = sorted(p for p in csv_dir.iterdir() if p.is_dir() and any(p.glob("*_seed*.csv")))
    md = (
        "# Reward curves\n\n"
        f"Generated by experiments/curves.py from `{csv_dir.name}/<recipe>/*.csv` (beside this file) under the "
        f"protocol `{proto_path.name}` (experiments/, protocol_version {proto['protocol_version']}, git "
        f"{protocol_sha(proto_path)}), which fixes the arms, seeds, metrics, margins and tests. Every arm is "
        f"trained with the same seeds, so each run is paired with the reference's run of the same seed (`"
        f"{reference(proto)}`: the same trained steps as every arm but the declared baselines"
        f"{', ' + ', '.join(proto['baselines']) if proto.get('baselines') else ''}). `jagg` = the "
        "paper's routing (the recipe's W and jagg_frac), `auto` = measured routing (`backward.jagg_frac: auto`), "
        "`endpoints` and `uniform` the two ablations, `jagg_index` the authors' index rule where registered; "
        "`control_<c>` is the positive control: the exact gradient mixed with one random direction fixed per "
        "run, at cosine c to the exact one (`train.control_cosine`); `control_fresh_<c>` draws that direction "
        "afresh at every step (`train.control_direction: fresh`); `control_blocks_*` the same on exact trained "
        "on the same blocks (`algorithm.exact_steps: structure`).\n\n"
    )
    seen = {r: recipe_protocol(proto, r.name) for r in recipes}
    frames = {r: load(r, seen[r]) for r in recipes}
    md += "\n".join(recipe_section(r.name, r, df, seen[r]) for r, df in frames.items())
    atomic_write_text(csv_dir / "summary.md", md)
    for r, df in frames.items():
        meta = recipe_meta(r)
        plot(r.name, df, figures / f"reward_curves_{r.name}.png", list(seen[r]["arms"]), meta)
        recipes_named = seen[r]["recipes"]
        stats = recipe_stats(df, metric_specs(recipes_named[r.name]) if r.name in recipes_named else [])
        plot_dose(r.name, df, stats, seen[r], figures / f"dose_response_{r.name}.png", meta)
        if recipes_named.get(r.name, {}).get("equal_cost"):
            ec = recipes_named[r.name]["equal_cost"]
            equal_cost.plot(r.name, df, seen[r], figures / f"equal_cost_{r.name}.png", meta, ec)


def pilot_report(
    run_root: Path,
    metric: str,
    alpha: float,
    power: float,
    control: str | None = None,
    iteration: int | None = None,
) -> str:
    """The pilot's numbers (runs under ``run_root``/<arm>_seed<k>/): per seed exact's gain over the base model
    and the control's paired difference at the evaluation of ``iteration`` (default the last), their mean and
    SD, and the MDD per n."""
    import numpy as np

    def last(arm: str, seed: int) -> tuple[float, float]:
        rows = [
            json.loads(x) for x in (run_root / f"{arm}_seed{seed}" / "metrics.jsonl").read_text().splitlines()
        ]
        ev = [r for r in rows if metric in r]
        at = [r for r in ev if r["iteration"] == iteration] if iteration is not None else ev[-1:]
        if not at:
            raise SystemExit(f"{run_root}/{arm}_seed{seed}: no evaluation at iteration {iteration}")
        return ev[0][metric], at[0][metric]

    if control is None:  # the one control arm the pilot ran (control_<cosine>)
        names = sorted({p.name.rsplit("_seed", 1)[0] for p in run_root.glob("control_*_seed*")})
        if len(names) != 1:
            raise SystemExit(
                f"{run_root}: expected one control arm (control_<cosine>_seed<k>), found {names}"
            )
        control = names[0]
    seeds = sorted(
        int(p.name.split("seed")[1]) for p in run_root.glob(f"{control}_seed*") if (p / "done").is_file()
    )
    seeds = [k for k in seeds if (run_root / f"exact_seed{k}" / "done").is_file()]
    gain = [last("exact", k)[1] - last("exact", k)[0] for k in seeds]
    diff = [last(control, k)[1] - last("exact", k)[1] for k in seeds]
    sd = float(np.std(diff, ddof=1))
    mdd = {n: minimum_detectable_difference(sd, n, alpha, power, "less") for n in (3, 6, 8, 10, 12, 16)}
    return (
        f"iteration {iteration if iteration is not None else 'last'}; seeds {seeds}; exact gain {np.mean(gain):+.3f} (per seed {', '.join(f'{g:+.3f}' for g in gain)}); "
        f"{control} - exact {np.mean(diff):+.3f} (per seed {', '.join(f'{d:+.3f}' for d in diff)}), paired SD "
        f"{sd:.3f}; one-sided MDD (alpha {alpha}, power {power}) by n: "
        + ", ".join(f"{n}: {m:.3f}" for n, m in mdd.items())
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", default=str(PROTOCOL))
    ap.add_argument("--long", action="store_true", help="the protocol's long design (make curves-long)")
    ap.add_argument("--recipes", nargs="+", default=None, help="default: every recipe of the protocol")
    ap.add_argument("--seeds", type=int, default=None, help="the first N of the protocol's seeds")
    ap.add_argument("--arms", "--strategies", nargs="+", default=None, help="default: every arm")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--runs", default="runs/curves")
    ap.add_argument(
        "--out",
        default=None,
        help="default results/curves (version 3's protocol) or results/curves_v<N>, _pilot / _quick added",
    )
    ap.add_argument("--figures", default="paper_figures")
    ap.add_argument("--quick", action="store_true", help="a few iterations, two seeds (QUICK=1: a smoke run)")
    ap.add_argument(
        "--pilot-report", default=None, help="print the pilot's numbers from these run dirs, exit"
    )
    ap.add_argument(
        "--pilot-iteration",
        type=int,
        default=None,
        help="--pilot-report at this evaluation (default the last)",
    )
    ap.add_argument("--pilot", action="store_true", help="the protocol's pilot (its seeds and arms) + sizing")
    ap.add_argument(
        "--timing", action="store_true", help="measure the equal-cost recipes' seconds per iteration, exit"
    )
    ap.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run from a tree with uncommitted changes; each run's diff is stored beside its CSV",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    set_threads(1)  # this process only orchestrates; each run uses one thread
    proto_path = Path(args.protocol)
    proto = load_protocol(proto_path, args.long, args.pilot)
    if args.pilot_report:
        print(
            pilot_report(
                Path(args.pilot_report),
                "eval_pref_mean",
                proto["alpha"],
                proto["power"],
                iteration=args.pilot_iteration,
            )
        )
        return
    named = {a for r in proto["recipes"] for a in recipe_protocol(proto, r)["arms"]}
    unknown = sorted(set(args.arms or []) - named) + sorted(set(args.recipes or []) - set(proto["recipes"]))
    if unknown:
        raise SystemExit(
            f"not in the protocol {proto_path.name}: {unknown}; arms {sorted(named)}, "
            f"recipes {list(proto['recipes'])} (--long adds the long recipes)"
        )
    extra = (QUICK if args.quick else []) + args.overrides
    suffix = "_quick" if args.quick else ""
    proto["first_seeds"] = (
        min(args.seeds or 99, 2 if args.quick else 99) if args.seeds or args.quick else None
    )
    recipes = {r: proto["recipes"][r] for r in (args.recipes or proto["recipes"])}
    if args.timing:  # before the seeds exist: the timing sizes the runs they will be drawn for
        print(
            measure_timing(proto, proto_path, recipes, Path(args.runs + suffix), args.jobs, argv, args.arms)
        )
        return
    untimed = [
        r
        for r, spec in recipes.items()
        if "equal_cost" in spec
        and not set(spec["arms"]) <= set(spec["equal_cost"].get("seconds_per_iteration") or {})
    ]
    if untimed:  # exit 2: a protocol not ready for its runs, nothing written
        print(
            f"{proto_path.name}: recipe {untimed[0]}: equal_cost.seconds_per_iteration does not record every arm; run "
            "--timing first and commit its medians to the protocol before any run it sizes",
            file=sys.stderr,
        )
        raise SystemExit(2)
    for r in recipes:
        if len(arm_seeds(proto, r)[reference(recipe_protocol(proto, r))]) < 2:
            raise SystemExit(
                f"{proto_path.name}: recipe {r}: --seeds and the protocol's seeds must give >= 2 seeds (the "
                f"comparisons are paired over seeds), got {arm_seeds(proto, r)['exact']}"
            )
    mismatched = {r: step_mismatches(proto, r, iterations=3) for r in recipes}
    if any(mismatched.values()):
        for r, problems in mismatched.items():
            for arm, why in problems.items():
                print(f"{proto_path.name}: recipe {r}: arm {arm} {why}", file=sys.stderr)
        raise SystemExit(2)
    runs = Path(args.runs + suffix)
    out = Path(args.out or f"results/{default_out(proto_path, args.pilot)}{suffix}")
    jobs = [
        (
            (r, a, k),
            spec["config"],
            recipe_protocol(proto, r)["arms"][a],
            k,
            runs / r / f"{a}_seed{k}",
            spec.get("overrides", []) + extra,
        )
        for r, spec in recipes.items()
        for a, k in recipe_jobs(proto, r)
        if args.arms is None or a in args.arms
    ]
    refs = {r: reference(recipe_protocol(proto, r)) for r in recipes}
    run_and_record(
        jobs,
        out,
        proto_path,
        argv,
        args.jobs,
        refs,
        dirty_diff(out, args.allow_dirty or args.quick),
        frozenset(r for r, spec in recipes.items() if "equal_cost" in spec),
    )
    # a protocol's ``figures`` folder keeps its recipes' figures apart from another protocol's of the same name
    sub = proto.get("figures", "")
    figures = Path(args.figures) / sub / ("quick" if args.quick else "") / ("pilot" if args.pilot else "")
    render(out, figures, proto_path, args.long, args.pilot)
    print((out / "summary.md").read_text())
    print(f"wrote {out}/<recipe>/*.csv, {out}/summary.md, {figures}/reward_curves_<recipe>.png")


def measure_timing(
    proto: dict,
    proto_path: Path,
    recipes: dict,
    runs: Path,
    n_parallel: int,
    argv,
    arms: list[str] | None = None,
) -> str:
    """An equal-cost recipe's timing run (``equal_cost: timing``: seed, iterations, warm-up left out): every
    arm (or those of ``arms``: an amendment times its new arms beside a yardstick) trains only, ``n_parallel``
    at a time as the analysis runs do; writes ``results/<results>_timing/
    timing.{csv,md}`` with each arm's median seconds per iteration, which the protocol then records (its
    ``seconds_per_iteration``) before any run it sizes. Returns the markdown."""
    proto["timing"] = True
    out = Path(f"results/{proto['results']}_timing")
    rows, lines = [], []
    for r, spec in recipes.items():
        ec = spec.get("equal_cost")
        if not ec:
            continue
        t, view = ec["timing"], recipe_protocol(proto, r)
        timed = {a: o for a, o in view["arms"].items() if arms is None or a in arms}
        common = [*spec.get("overrides", []), *TIMING, f"train.iterations={t['iterations']}"]
        jobs = [
            ((r, a, t["seed"]), spec["config"], o, t["seed"], runs / "timing" / r / a, common)
            for a, o in timed.items()
        ]
        dirs = run_all(jobs, n_parallel)
        mine = iteration_timing({a: dirs[(r, a, t["seed"])] for a in timed}, t["skip"])
        # the budget arm's median in this run, else its recorded one (an amendment's run without it)
        ref = next((x["median_s"] for x in mine if x["arm"] == ec["budget_arm"]), None)
        budget = ec["budget_iterations"] * (ref or ec["seconds_per_iteration"][ec["budget_arm"]])
        lines += [
            f"## {r}",
            "",
            f"`{spec['config']}` {' '.join(common)}, seed {t['seed']}, iterations {t['skip'] + 1}-{t['iterations']}"
            f" ({n_parallel} runs at a time). Budget: {ec['budget_iterations']} iterations of "
            f"{ec['budget_arm']} = {budget:.0f} s of training.",
            "",
            "| arm | median s / iteration [IQR] | backward passes / iteration | iterations in the budget |",
            "|---|---|---|---|",
            *(
                f"| {x['arm']} | {x['median_s']:.2f} [{x['q1_s']:.2f}, {x['q3_s']:.2f}] | "
                f"{x['backward_passes']:.0f} | {int(budget // x['median_s'])} |"
                for x in mine
            ),
            "",
        ]
        rows += [{"recipe": r, **x} for x in mine]
    meta = run_metadata(
        outputs=outputs(out),
        command=command_line("experiments/curves.py", argv),
        protocol=f"{proto_path.name} @ {protocol_sha(proto_path)}",
        world_build=world_build(),
    )
    write_table(rows, out / "timing.csv", meta)
    text = "\n".join([f"# Timing of {proto_path.name}'s equal-cost recipes", "", *lines])
    atomic_write_text(out / "timing.md", text)
    return text


def default_out(proto_path: Path, pilot: bool) -> str:
    """The protocol's ``results`` folder name (results/curves for versions 2-3, which predate the key), plus
    ``_pilot`` for its pilot."""
    return yaml.safe_load(proto_path.read_text()).get("results", "curves") + ("_pilot" if pilot else "")


def outputs(out: Path) -> tuple[str, ...]:
    """What a protocol run rewrites (pathspec globs, ``jagg.common.tree_state``): its results folder ``out``
    and figures, and make pretrain's reports of the world it runs first; left out of every record's dirty check."""
    figures = ("paper_figures/reward_curves_*", "paper_figures/dose_response_*")
    mine = () if out.is_absolute() else (f"{out.as_posix().rstrip('/')}/**",)  # outside: not in the tree
    return (*mine, *figures, *WORLD_REPORTS)


def tree_changes(out: Path) -> str:
    """What the working tree changes from the commit it records (``git status --porcelain``) in the code: the
    protocol's own results folder ``out`` (a resumed protocol finds its earlier CSVs there, uncommitted) and
    every generated artefact (``jagg.common.GENERATED``: another protocol's results running beside this one,
    make pretrain's reports) are left out; no run reads them, and each record names them by blob id."""
    status = subprocess.run(
        ["git", "status", "--porcelain"], capture_output=True, text=True, check=True
    ).stdout
    mine = out.as_posix().rstrip("/") + "/"
    return "".join(
        line + "\n"
        for line in status.splitlines()
        if not line[3:].startswith(mine) and not any(fnmatch(line[3:], g) for g in GENERATED)
    )


def tree_diff(out: Path) -> str:
    """The diff of the working tree against HEAD (``jagg.common.tree_state``: generated results named by blob
    id, never stored), untracked files listed: stored with each run made from a dirty tree (``--allow-dirty``),
    so that the code that trained it can be rebuilt."""
    diff = tree_state(outputs(out))[1] or ""
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], capture_output=True, text=True, check=True
    ).stdout
    return diff + "".join(f"# untracked: {name}\n" for name in untracked.splitlines())


def dirty_diff(out: Path, allowed: bool) -> str | None:
    """None from a clean tree; from a dirty one the diff to store with every run where ``allowed`` (a quick
    smoke run, or ``--allow-dirty``), else exit 2: a protocol run must be rebuildable from its recorded SHA."""
    try:
        changes = tree_changes(out)
    except (OSError, subprocess.CalledProcessError):
        changes = "(not a git checkout: the code cannot be named by a commit)\n"
    if not changes:
        return None
    if not allowed:
        print(
            "curves.py: the working tree has uncommitted changes, so these runs could not be rebuilt from the "
            f"git SHA they record:\n{changes}commit them, or pass --allow-dirty to store the diff with every run",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        return tree_diff(out)
    except (OSError, subprocess.CalledProcessError):
        return changes


def run_and_record(
    jobs: list[tuple],
    out: Path,
    proto_path: Path,
    argv,
    n_parallel: int,
    refs: dict[str, str] | None = None,
    diff: str | None = None,
    equal_cost_recipes: frozenset[str] = frozenset(),
) -> None:
    """Run what ``out`` lacks and write each run's CSV as soon as it and the reference's run of its seed are
    done (``refs``: the reference arm per recipe, default exact). ``diff``: the uncommitted changes the runs
    are made with (``dirty_diff``), written beside each CSV as ``<arm>_seed<k>.diff``. The runs of
    ``equal_cost_recipes`` are compared with the reference's at the same evaluation, not the same iteration.

    ``out/<recipe>/<arm>_seed<k>.csv`` is the record a later session resumes from (run directories are not
    committed): a run whose CSV was written by the same command is not run again. A seed's arms are compared
    with each other, so they must share one build of the world (``world_build``: bitwise reproducible on one
    machine, not across CPUs): a seed still missing arms reruns those trained on another build, and the
    reference's run of a seed is (re)run whenever another arm of that seed runs, because the paired divergence
    reads its evaluated states. Each CSV's meta records the command, the git SHA of the code that trained it,
    the world build and, from a dirty tree, the diff it ran with.
    """
    by_key = {job[0]: job for job in jobs}
    refs = {r: (refs or {}).get(r, "exact") for r, _, _ in by_key}
    stamp = {key: " ".join(train_command(*job[1:])[1:]) for key, job in by_key.items()}
    build = world_build()  # the cache every run of this process loads

    paths = {(r, a, k): out / r / f"{a}_seed{k}.meta.json" for r, a, k in by_key}
    metas = {key: json.loads(p.read_text()) if p.is_file() else {} for key, p in paths.items()}

    def other_build(key: tuple) -> bool:  # a world run recorded on another build, or before builds were
        meta = metas[key]
        return (
            meta.get("run_json", {}).get("model", {}).get("source") == "world"
            and meta.get("world_build") != build
        )

    todo = {key for key in by_key if metas[key].get("run_command") != stamp[key]}
    unfinished = {(r, k) for r, _, k in todo}
    todo |= {key for key in by_key if (key[0], key[2]) in unfinished and other_build(key)}
    todo |= {(r, refs[r], k) for r, _, k in todo if (r, refs[r], k) in by_key}
    done: dict = {}

    def finished(key: tuple, run_dir: Path) -> None:
        done[key] = run_dir
        for r, a, k in [x for x in todo if x in done]:
            exact = done.get((r, refs[r], k))
            if exact is None:
                continue  # written once the reference's run of this seed is done
            todo.discard((r, a, k))
            job = by_key[(r, a, k)]
            run_json = json.loads((done[(r, a, k)] / "run.json").read_text())
            meta = run_metadata(
                outputs=outputs(out),
                command=command_line("experiments/curves.py", argv),
                run_command=stamp[(r, a, k)],
                config=job[1],
                overrides=[*job[2], *job[5]],
                seed=k,
                protocol=f"{proto_path.name} @ {protocol_sha(proto_path)}",
                # run.json records the build since it mattered; an older world run of this process loaded `build`
                world_build=run_json.get(
                    "world_build", build if run_json["config"]["model"]["source"] == "world" else None
                ),
                run_json=run_json["config"],
                tree_diff=None if diff is None else f"{a}_seed{k}.diff",
                divergence_from=refs[r],  # the run the paired divergence is measured from
                cpu_seconds=cpu_seconds(done[(r, a, k)]),
            )
            if diff is not None:
                atomic_write_text(out / r / f"{a}_seed{k}.diff", diff)
            rows = collect(done[(r, a, k)], a, k, exact, by_evaluation=r in equal_cost_recipes)
            write_table(rows, out / r / f"{a}_seed{k}.csv", meta)

    run_all([by_key[key] for key in by_key if key in todo], n_parallel, finished)


if __name__ == "__main__":
    main()
