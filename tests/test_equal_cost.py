"""The equal-cost protocol's arithmetic (issue 39): each arm's length and evaluations from one budget, the
timing table, several pre-registered contrasts, and the refusal to run before the timing is recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from jagg.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import curves  # noqa: E402

PROTOCOL = Path("experiments/curves_protocol_equal_cost.yaml")
SECONDS = {"exact": 14.0, "knots4": 8.0, "window2": 4.5}
EC = {"budget_arm": "exact", "budget_iterations": 24, "evaluations": 6, "seconds_per_iteration": SECONDS}


def iterations_of(overrides: list[str]) -> int:
    return int(next(o for o in overrides if o.startswith("train.iterations=")).split("=")[1])


@pytest.mark.parametrize("arm", list(SECONDS))
def test_each_arm_trains_the_whole_iterations_that_fit_in_the_budget(arm):
    budget = 24 * SECONDS["exact"]
    o = curves.equal_cost_overrides(EC, arm)
    n = iterations_of(o)
    assert n * SECONDS[arm] <= budget < (n + 1) * SECONDS[arm]
    at = yaml.safe_load(next(x for x in o if x.startswith("log.eval_at=")).split("=", 1)[1])
    # evaluations after the same fractions of every arm's budget: the base model, 1/6, ..., the end
    assert at[0] == 0 and at[-1] == n and len(at) == 7
    assert all(abs(i / n - k / 6) <= 0.5 / n for k, i in enumerate(at))
    assert "log.eval_every=0" in o


@pytest.mark.parametrize("arm", list(SECONDS))
def test_instruments_fire_about_as_often_in_every_arm(arm):
    """With ``instruments_per_evaluation`` the fidelity / landing cadence is the checkpoint cadence, so every
    arm is measured 6 or 7 times in its budget (iteration 0 included), however many iterations it runs."""
    o = curves.equal_cost_overrides({**EC, "instruments_per_evaluation": True}, arm)
    every = int(next(x for x in o if x.startswith("log.fidelity_every=")).split("=")[1])
    n = iterations_of(o)
    assert f"log.checkpoint_every={every}" in o and len(range(0, n, every)) in (6, 7)
    assert not any(x.startswith("log.fidelity_every") for x in curves.equal_cost_overrides(EC, arm))


def test_the_reference_runs_its_own_budget_and_a_cheaper_arm_more_iterations():
    assert iterations_of(curves.equal_cost_overrides(EC, "exact")) == 24
    assert iterations_of(curves.equal_cost_overrides(EC, "knots4")) == 42  # 336 s / 8 s
    assert iterations_of(curves.equal_cost_overrides(EC, "window2")) == 74  # 336 / 4.5 = 74.7


def test_every_arm_of_the_protocol_loads_with_its_budget():
    """The committed protocol's arms, given seconds per iteration, are valid configs whose evaluations fall
    inside their runs, and its arms train what it declares (the replay of tests/test_protocol_steps.py)."""
    proto = curves.load_protocol(PROTOCOL)
    spec = proto["recipes"]["every_step"]
    spec["equal_cost"]["seconds_per_iteration"] = {a: 5.0 + i for i, a in enumerate(spec["arms"])}
    view = curves.recipe_protocol(proto, "every_step")
    for arm, overrides in view["arms"].items():
        cfg = load_config(spec["config"], [*spec["overrides"], *overrides])
        assert cfg.log.eval_at[-1] == cfg.train.iterations, arm
    assert curves.step_mismatches(proto, "every_step", iterations=3) == {}
    # while timing, the arms are the protocol's own (no budget yet)
    proto["timing"] = True
    assert curves.recipe_protocol(proto, "every_step")["arms"] == spec["arms"]


def test_runs_are_refused_until_the_timing_is_recorded(tmp_path, capsys):
    proto = yaml.safe_load(PROTOCOL.read_text())  # the protocol as it stood at stage 1
    proto["recipes"]["every_step"]["equal_cost"]["seconds_per_iteration"] = {"exact": 16.0}
    stage1 = tmp_path / PROTOCOL.name
    stage1.write_text(yaml.safe_dump(proto))
    with pytest.raises(SystemExit) as e:
        curves.main(
            ["--protocol", str(stage1), "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "r")]
        )
    assert e.value.code == 2
    assert "seconds_per_iteration does not record every arm" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()


def test_iteration_timing_is_the_median_after_the_warm_up(tmp_path):
    rows = [
        {"iteration": i, "time_iteration_s": t, "backward_passes": 16}
        for i, t in enumerate([9, 30, 5, 6, 7, 100], 1)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (x,) = curves.iteration_timing({"knots4": tmp_path}, skip=2)
    assert x["n"] == 4 and x["median_s"] == 6.5 and x["backward_passes"] == 16


def test_several_contrasts_each_get_their_seeds_and_the_reference_all():
    proto = {
        "seeds": [1, 2],
        "arms": {"exact": [], "knots4": [], "window2": [], "dancegrpo12": [], "knots3": []},
        "recipes": {
            "r": {
                "contrasts": [
                    {"better": "knots4", "worse": "window2", "seeds": [3, 4]},
                    {"better": "knots4", "worse": "dancegrpo12", "seeds": [5]},
                ]
            }
        },
    }
    seeds = curves.arm_seeds(proto, "r")
    assert seeds == {
        "exact": [1, 2, 3, 4, 5],
        "knots4": [1, 2, 3, 4, 5],
        "window2": [1, 2, 3, 4],
        "dancegrpo12": [1, 2, 5],
        "knots3": [1, 2],
    }


def curve_rows(arm: str, seed: int, secs: float, passes: int, evals: dict[int, float]) -> list[dict]:
    """A run as curves.collect writes it: a training row per iteration (its seconds cumulated, its backward
    passes) and an evaluation row at each key of ``evals`` (iteration: held-out pref)."""
    rows = [{"strategy": arm, "seed": seed, "iteration": 0, "wall_clock_s": 0.0, "eval_pref_mean": evals[0]}]
    for i in range(1, max(evals) + 1):
        rows.append(
            {
                "strategy": arm,
                "seed": seed,
                "iteration": i,
                "wall_clock_s": i * secs,
                "backward_passes": passes,
            }
        )
        if i in evals:
            rows.append(
                {
                    "strategy": arm,
                    "seed": seed,
                    "iteration": i,
                    "wall_clock_s": i * secs,
                    "eval_pref_mean": evals[i],
                }
            )
    return rows


def equal_cost_frame():
    import pandas as pd

    import equal_cost

    rows = [
        *curve_rows("exact", 1, 10.0, 20, {0: 10.0, 2: 10.4, 4: 11.0}),
        *curve_rows("knots4", 1, 5.0, 8, {0: 10.0, 4: 10.9, 8: 11.1}),
        *curve_rows("window2", 1, 2.5, 2, {0: 10.0, 8: 10.2, 16: 10.3}),
        # seed 2: the reference gained nothing, so no arm has a target on it
        *curve_rows("exact", 2, 10.0, 20, {0: 10.0, 2: 9.9, 4: 9.8}),
        *curve_rows("knots4", 2, 5.0, 8, {0: 10.0, 4: 10.5, 8: 10.6}),
    ]
    df = pd.DataFrame(rows)
    return df, curves.per_run(df, ["eval_pref_mean"]), equal_cost


def test_time_to_eighty_percent_of_the_reference_gain_is_interpolated_in_training_seconds():
    df, stats, ec = equal_cost_frame()
    m = "eval_pref_mean"
    # exact: target 10.8 between 10.4 at 20 s and 11.0 at 40 s
    assert ec.time_to_share(df, stats, "exact", m, "exact") == {1: pytest.approx(20 + 0.4 / 0.6 * 20)}
    # knots4 crosses it between the base (0 s) and its evaluation after 20 s at 10.9
    assert ec.time_to_share(df, stats, "knots4", m, "exact") == {1: pytest.approx(0.8 / 0.9 * 20)}
    assert ec.time_to_share(df, stats, "window2", m, "exact") == {1: float("inf")}
    assert ec.median_time({1: float("inf")}) == "not reached (0/1)"
    assert ec.crossing([(0, 1.0), (5, 2.0)], 0.5) == 0  # reached at the start


def test_evaluations_carry_the_seconds_and_backward_passes_spent_before_them():
    df, _, ec = equal_cost_frame()
    e = ec.evaluations(df, "knots4", "eval_pref_mean")
    s1 = e[e.seed == 1]
    assert list(s1.iteration) == [0, 4, 8]
    assert list(s1.seconds) == [0.0, 20.0, 40.0] and list(s1.passes) == [0, 32, 64]


def test_the_summary_of_an_equal_cost_recipe_has_its_table_and_figure(tmp_path):
    df, stats, ec = equal_cost_frame()
    spec = {"budget_arm": "exact", "budget_iterations": 4, "evaluations": 2}
    spec["seconds_per_iteration"] = {"exact": 10.0, "knots4": 5.0, "window2": 2.5}
    view = {"arms": {"exact": [], "knots4": [], "window2": []}, "reference": "exact"}
    lines = ec.section_lines(df, stats, view, spec)
    row = next(x for x in lines if x.startswith("| knots4 |"))
    # 8 iterations, 5 s recorded, 40 s measured (median over seeds), 64 passes, gain (0.9+0.6)/2, 18 s (1/1)
    assert row.startswith("| knots4 | 8 | 5.00 | 40 | 64 | +0.850 (n 2) | 18 s (1/1) |")
    assert "40 s of training per run" in "\n".join(lines)
    ec.plot("every_step", df, view, tmp_path / "f.png", {"git_sha": "abc", "hardware": "cpu"})
    assert (tmp_path / "f.png").stat().st_size > 0


def test_the_training_clock_leaves_out_the_instruments_seconds():
    """The budget was timed without fidelity and landing; their shadow exact backward (logged inside an
    iteration's time) is not charged to the arm."""
    df, _, ec = equal_cost_frame()
    train = df.backward_passes.notna() & (df.strategy == "knots4")
    df.loc[train, "time_iteration_s"] = 6.5
    df.loc[train, "time_fidelity_s"] = 1.0
    df.loc[train & (df.iteration == 4), "time_landing_s"] = 0.5
    s1 = ec.evaluations(df, "knots4", "eval_pref_mean").query("seed == 1")
    assert list(s1.seconds) == [0.0, 4 * 5.5 - 0.5, 8 * 5.5 - 0.5]


def test_the_budget_clock_is_the_recorded_pace_not_the_measured_seconds():
    """Two runs share the cores, and which ones differs by arm: the time to 80% and the figure read the budget
    clock (iteration x the arm's recorded seconds per iteration), so a run slowed by its neighbour is not
    charged for it. Here knots4 measured 5 s per iteration and is recorded at 2.5 s."""
    df, stats, ec = equal_cost_frame()
    e = ec.evaluations(df, "knots4", "eval_pref_mean", recorded=2.5).query("seed == 1")
    assert list(e.budget) == [0.0, 10.0, 20.0] and list(e.seconds) == [0.0, 20.0, 40.0]
    # the target 10.8 is crossed 0.8 / 0.9 of the way to the evaluation after 4 iterations (10 s recorded)
    assert ec.time_to_share(df, stats, "knots4", "eval_pref_mean", "exact", 2.5) == {
        1: pytest.approx(0.8 / 0.9 * 10)
    }


def test_divergence_pairs_the_kth_evaluations_of_an_equal_cost_recipe(tmp_path):
    """Arms evaluated at the same fractions of a budget after different iterations: the run's k-th evaluation
    is compared with exact's k-th, keyed by the run's iteration; by iteration only the shared ones pair."""
    import torch

    from jagg.plugins.eval_state import paired_divergence

    def run(name: str, states: dict[int, float]) -> Path:
        for it, w in states.items():
            path = tmp_path / name / "samples" / f"eval_{it:05d}.rank0.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"images": torch.full((2,), w), "weights": [torch.full((3,), w)]}, path)
        return tmp_path / name

    exact = run("exact", {0: 0.0, 4: 1.0, 8: 2.0})
    arm = run("arm", {0: 0.0, 6: 1.5, 12: 2.0})
    paired = paired_divergence(arm, exact, by_evaluation=True)
    assert sorted(paired) == [0, 6, 12]
    assert paired[6]["div_weights_rel"] == pytest.approx(0.5) and paired[12]["div_samples_rel"] == 0.0
    assert sorted(paired_divergence(arm, exact)) == [0]  # by iteration: only the base is shared
    with pytest.raises(ValueError, match="same fractions"):
        paired_divergence(run("short", {0: 0.0, 6: 1.0}), exact, by_evaluation=True)


def test_fidelity_lines_read_each_runs_last_evaluation_and_the_landing():
    """An equal-cost arm ends after more iterations than exact: its divergence is read at its own last
    evaluation, not at the largest iteration of any arm (which would leave the shorter runs out)."""
    import pandas as pd

    rows = []
    for arm, last, div in (("exact", 4, 0.0), ("knots4", 8, 0.4), ("window2", 16, 1.2)):
        for seed in (1, 2):
            rows += [
                {
                    "strategy": arm,
                    "seed": seed,
                    "iteration": 1,
                    "fidelity_cosine": 1.0 if arm != "knots4" else 0.9,
                    "landing_step_cosine": 0.7 if arm == "knots4" else 1.0,
                },
                {
                    "strategy": arm,
                    "seed": seed,
                    "iteration": last // 2,
                    "div_weights_rel": div / 2 + seed / 100,
                },
                {"strategy": arm, "seed": seed, "iteration": last, "div_weights_rel": div + seed / 100},
            ]
    lines = curves.fidelity_lines(pd.DataFrame(rows), ["exact", "knots4", "window2"])
    assert "landing_step_cosine" in lines[4] and "div_weights_rel" in lines[4]
    row = {x.split(" | ")[0][2:]: x.split(" | ")[1:] for x in lines[6:9]}
    assert row["knots4"][0].startswith("+0.900") and row["knots4"][1].startswith("+0.700")
    assert row["knots4"][2].startswith("+0.415") and row["window2"][2].startswith("+1.215")


def test_the_goal_is_non_inferiority_and_needs_the_positive_control():
    """At equal cost a better arm meets 'within the margin': the tests are of mean(d) > -margin, so a clearly
    better arm passes where TOST would fail it, an arm clearly below the margin does not, and without a
    detected positive control a pass is no claim. Recomputed by hand: shifted t statistic and sign flips."""
    import numpy as np
    from scipy import stats as st

    import equal_cost

    goal = {"arm": "knots4", "reference": "exact", "metric": "eval_pref_mean", "margin": 0.05}
    better = [0.20, 0.35, 0.15, 0.30, 0.25, 0.40]
    text = "\n".join(equal_cost.goal_lines(better, goal, 0.05, 0.8, control=True))
    shifted = np.array(better) + 0.05
    p_t = st.ttest_1samp(shifted, 0.0, alternative="greater").pvalue
    assert f"t-test p = {p_t:.4f}" in text and "sign-flip p = 0.0156" in text  # 1 / 2^6
    assert "**reached**" in text
    assert "NO claim" in "\n".join(equal_cost.goal_lines(better, goal, 0.05, 0.8, control=False))
    below = [-0.30, -0.25, -0.40, -0.20, -0.35, -0.30]
    assert "**not shown**" in "\n".join(equal_cost.goal_lines(below, goal, 0.05, 0.8, control=True))
    assert "NOT the test" in "\n".join(equal_cost.goal_lines(better, goal, 0.05, 0.8, True, pilot=True))


def test_a_fixed_length_arm_trains_its_iterations_not_the_budgets():
    """exact45 (issue 56): exact's pace, knots4's 45 iterations, evaluated at the same fractions of them."""
    o = curves.equal_cost_overrides({**EC, "iterations": {"exact": 45}}, "exact")
    assert iterations_of(o) == 45 and "log.eval_at=[0,8,15,22,30,38,45]" in o
    assert iterations_of(curves.equal_cost_overrides(EC, "exact")) == 24


def test_drift_flags_an_arm_off_its_recorded_pace_and_recomputes_its_budget():
    """knots4 was recorded at 4.0 s and ran at 5.0 s (+25% > 15%): flagged; at the runs' own medians the
    budget (3 x exact's measured 10 s) buys it 6 iterations, where its curve reads 11.0 / 10.55 (linear between
    its evaluations after 4 and 8). window2 (2.4 recorded, 2.5 measured: +4%) is not flagged."""
    df, stats, ec = equal_cost_frame()
    spec = {"budget_arm": "exact", "budget_iterations": 3, "drift_tolerance": 0.15}
    spec["seconds_per_iteration"] = {"exact": 10.0, "knots4": 4.0, "window2": 2.4}
    rows = {r["arm"]: r for r in ec.drift_rows(df, spec, ["exact", "knots4", "window2"])}
    assert rows["knots4"]["measured_s"] == 5.0 and rows["knots4"]["drift"] == pytest.approx(0.25)
    assert rows["knots4"]["flagged"] and not rows["window2"]["flagged"] and not rows["exact"]["flagged"]
    assert rows["knots4"]["iterations_measured"] == 6 and rows["window2"]["iterations_measured"] == 12
    assert ec.value_at(df, "knots4", "eval_pref_mean", 6) == {1: pytest.approx(11.0), 2: pytest.approx(10.55)}
    line = next(x for x in ec.drift_lines(df, stats, spec, ["knots4"]) if x.startswith("| knots4"))
    assert "**yes**" in line and line.endswith("| 6 | +0.775 (n 2) |")
    assert ec.drift_lines(df, stats, {**spec, "drift_tolerance": None}, ["knots4"]) == []  # the original


def test_the_noise_share_is_a_ratio_of_paired_means_with_a_seed_bootstrap():
    import equal_cost

    m = "eval_pref_mean"
    runs = {}
    for s, (a, w, o) in enumerate([(3.0, 2.0, 1.0), (3.0, 2.5, 2.0), (4.0, 2.0, 1.0)]):
        runs |= {("window2", s): {m: (a, 0)}, ("dance", s): {m: (w, 0)}, ("knots4", s): {m: (o, 0)}}
    spec = {"arm": "window2", "without": "dance", "over": "knots4", "metric": m}
    value, lo, hi, n = equal_cost.share(runs, spec, 0)
    assert n == 3 and value == pytest.approx((1 + 0.5 + 2) / (2 + 1 + 3))
    assert lo < value < hi and lo >= 0.5 and hi <= 2 / 3 + 1e-12  # within the seeds' own ratios


def test_timing_runs_only_the_named_arms(tmp_path, monkeypatch):
    """--timing --arms: an amendment times its new arms beside a yardstick, not the whole recipe again."""
    ran = []

    def fake_run_all(jobs, n_parallel):
        ran.extend(job[0][1] for job in jobs)
        return {job[0]: tmp_path for job in jobs}

    monkeypatch.setattr(curves, "run_all", fake_run_all)
    monkeypatch.setattr(
        curves,
        "iteration_timing",
        lambda runs, skip: [
            dict(arm=a, n=8, median_s=5.0, q1_s=4.0, q3_s=6.0, backward_passes=8) for a in runs
        ],
    )
    monkeypatch.setattr(curves, "world_build", lambda: None)
    monkeypatch.chdir(tmp_path)
    window = Path(__file__).resolve().parents[1] / "experiments" / "curves_protocol_window.yaml"
    proto = curves.load_protocol(window)
    text = curves.measure_timing(
        proto, window, proto["recipes"], tmp_path / "r", 2, [], ["window2", "window2_dance"]
    )
    assert sorted(ran) == ["window2", "window2_dance"]
    assert "Budget: 24 iterations of exact = 392 s" in text  # exact not rerun: its recorded 16.32 s


def test_descriptive_contrasts_are_intervals_per_iteration_and_at_the_end_without_a_test():
    """The window amendment's descriptions: exact45 - knots4 at every iteration both evaluated (here knots4 -
    exact at 0 and 4: seed 1 10.9 - 11.0, seed 2 10.5 - 9.8), and arm - arm at the end (11.1 - 11.0,
    10.6 - 9.8); a pair with under 2 seeds (window2 ran one) is left out, and no line carries a verdict."""
    df, stats, ec = equal_cost_frame()
    m = "eval_pref_mean"
    d = ec.per_iteration_diffs(df, "knots4", "exact", m)
    assert sorted(d) == [0, 4] and d[0] == [0.0, 0.0] and d[4] == pytest.approx([-0.1, 0.7])
    specs = [
        {"better": "knots4", "worse": "exact", "metrics": [m], "summary": "per_iteration"},
        {"better": "knots4", "worse": "exact", "metrics": [m], "summary": "end"},
        {"better": "window2", "worse": "exact", "metrics": [m], "summary": "end"},
    ]
    lines = curves.descriptive_lines(df, stats, specs)
    text = "\n".join(lines)
    assert "| 4 | 2 | +0.300 [" in text and "| 8 |" not in text  # exact never evaluated at 8
    assert "- **knots4 - exact** (end): pref +0.450 [" in text and "(n 2)" in text
    assert "window2" not in text and "shown" not in text
    assert curves.descriptive_lines(df, stats, specs[2:]) == []


def test_the_window_protocol_registers_its_descriptions_over_its_own_arms():
    spec = curves.load_protocol(Path("experiments/curves_protocol_window.yaml"))["recipes"]["every_step"]
    pairs = {(c["better"], c["worse"], c["summary"]) for c in spec["descriptive"]}
    assert ("exact45", "knots4", "per_iteration") in pairs and len(pairs) == 3
    assert all({c["better"], c["worse"]} <= set(spec["arms"]) for c in spec["descriptive"])
