"""Every protocol compares arms that train the same steps (issue 43), except declared baselines.

Protocol v4's `exact` arm trained the JAGG authors' random single steps while every other arm trained blocks,
so its "against exact" results compared step structures. ``curves.step_mismatches`` replays the trainer's
step draws for every arm of every recipe of every protocol, and ``curves.py`` refuses a design it flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import curves  # noqa: E402

PROTOCOLS = sorted(Path(__file__).resolve().parents[1].glob("experiments/curves_protocol*.yaml"))


def designs():
    """(protocol file, long, pilot, recipe) for every design a protocol file can run."""
    for path in PROTOCOLS:
        raw = yaml.safe_load(path.read_text())
        for long in [False, True] if "long" in raw else [False]:
            for pilot in [False, True] if "seeds" in raw.get("pilot", {}) else [False]:
                proto = curves.load_protocol(path, long=long, pilot=pilot)
                for recipe in proto["recipes"]:
                    yield pytest.param(path, long, pilot, recipe, id=f"{path.stem}-{recipe}-{long=}-{pilot=}")


@pytest.mark.parametrize(("path", "long", "pilot", "recipe"), list(designs()))
@pytest.mark.parametrize("seed", [0, 41])
def test_every_arm_trains_the_references_steps_unless_a_declared_baseline(path, long, pilot, recipe, seed):
    proto = curves.load_protocol(path, long=long, pilot=pilot)
    assert curves.step_mismatches(proto, recipe, seed=seed) == {}


def test_the_check_catches_v4s_exact_arm_without_its_declaration():
    """The control: protocol v4 as registered (reference exact on random single steps, no baselines) is flagged
    on every arm that trains blocks, and an undeclared arm with the authors' baseline is flagged against the
    re-based reference."""
    registered = curves.load_protocol(Path("experiments/curves_protocol_v4.yaml"))
    for key in ("reference", "baselines"):
        registered.pop(key)
    flagged = curves.step_mismatches(registered, "authors", iterations=2)
    assert {"jagg", "jagg_index", "endpoints", "knots", "exact_blocks"} <= set(flagged)
    rebased = curves.load_protocol(Path("experiments/curves_protocol_v4.yaml"))
    rebased["baselines"] = {}
    assert set(curves.step_mismatches(rebased, "authors", iterations=2)) == {"exact"}


def test_a_stale_baseline_declaration_is_flagged():
    proto = curves.load_protocol(Path("experiments/curves_protocol_v4.yaml"))
    proto["baselines"] = {**proto["baselines"], "jagg": "claims other steps"}
    assert set(curves.step_mismatches(proto, "authors", iterations=2)) == {"jagg"}


def test_the_trainer_trains_what_the_replay_compares(tmp_path):
    """The replay starts each iteration's step draw without the prompt and noise draws before it (no arm
    override changes them), so it compares arms rather than reproducing the trainer's indices. The trainer
    agrees with what it compares: on the authors' structure, exact on blocks trains jagg's steps at every
    iteration, the authors' exact baseline others."""
    from jagg.config import TINY_RUN, load_config
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    def trained(*overrides: str) -> list[torch.Tensor]:
        cfg = load_config(
            "configs/world/flux_dancegrpo_authors.yaml", [*TINY_RUN, f"log.run_dir={tmp_path}", *overrides]
        )
        trainer = Trainer(cfg, build_components(cfg), tmp_path)
        return [trainer.rollout(it).trained for it in range(2)]

    jagg = trained("backward.strategy=jagg")
    blocks = trained("backward.strategy=exact", "algorithm.exact_steps=structure")
    authors = trained("backward.strategy=exact", "algorithm.exact_steps=random_singles")
    assert all(torch.equal(a, b) for a, b in zip(jagg, blocks, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(jagg, authors, strict=True))


def test_a_divergence_measured_from_another_reference_is_not_read(tmp_path):
    """Runs written before amendment 1 measured their divergence from the authors' exact; the re-based analysis
    (reference exact_blocks) must not read it as a divergence from exact_blocks."""
    import json

    import pandas as pd

    row = {"iteration": 24, "strategy": "jagg", "seed": 40, "div_weights_rel": 0.3, "eval_pref_mean": 1.0}
    for name, origin in (("jagg_seed40", None), ("exact_blocks_seed40", "exact_blocks")):
        pd.DataFrame([row | {"strategy": name.rsplit("_seed", 1)[0]}]).to_csv(tmp_path / f"{name}.csv")
        meta = {} if origin is None else {"divergence_from": origin}
        (tmp_path / f"{name}.meta.json").write_text(json.dumps(meta))
    proto = {"reference": "exact_blocks", "arms": {"jagg": [], "exact_blocks": []}}
    df = curves.load(tmp_path, proto).set_index("strategy")
    assert pd.isna(df.loc["jagg", "div_weights_rel"]) and df.loc["exact_blocks", "div_weights_rel"] == 0.3
    assert curves.load(tmp_path, proto | {"reference": "exact"}).div_weights_rel.notna().sum() == 1


def test_landing_driver_quick(tmp_path):
    """experiments/landing.py on tiny runs: the reference lands on itself, the other arm is measured, the
    yardstick compares two seeds' gradients at the same weights."""
    import pandas as pd

    import landing

    out = tmp_path / "landing.csv"
    landing.main(
        [
            "--quick",
            "--recipes",
            "every_step",
            "--seeds",
            "1",
            "2",
            "--out",
            str(out),
            "--runs",
            str(tmp_path),
        ]
    )
    df = pd.read_csv(out)
    ref = df[df.arm == "exact"]
    assert (
        len(ref) == 2 and (ref.landing_step_cosine > 1 - 1e-6).all() and (ref.next_reward_abs_diff == 0).all()
    )
    knots = df[df.arm == "knots4"]
    assert len(knots) == 2 and knots.landing_step_cosine.notna().all() and (knots.fidelity_cosine < 1).all()
    (yard,) = df[df.arm == "yardstick"].fidelity_cosine
    assert -1 <= yard < 0.999  # two rollouts' gradients differ
    assert "Yardstick" in out.with_suffix(".md").read_text()


def test_a_run_on_another_world_build_than_the_references_is_left_out(tmp_path):
    """v4's seeds 40-42 ran on an unrecorded build: paired with exact_blocks on the recorded one they would give
    differences across builds. The analysis leaves them out and lists them."""
    import json

    import pandas as pd

    runs = {
        ("exact_blocks", 40): {"a": "1"},
        ("jagg", 40): None,
        ("jagg", 43): {"a": "1"},
        ("exact_blocks", 43): {"a": "1"},
    }
    for (arm, seed), build in runs.items():
        pd.DataFrame([{"iteration": 0, "strategy": arm, "seed": seed, "eval_pref_mean": 1.0}]).to_csv(
            tmp_path / f"{arm}_seed{seed}.csv"
        )
        meta = {"divergence_from": "exact_blocks"} | ({} if build is None else {"world_build": build})
        (tmp_path / f"{arm}_seed{seed}.meta.json").write_text(json.dumps(meta))
    df = curves.load(tmp_path, {"reference": "exact_blocks", "arms": {"jagg": [], "exact_blocks": []}})
    assert set(zip(df.strategy, df.seed)) == {("exact_blocks", 40), ("exact_blocks", 43), ("jagg", 43)}
    assert df.attrs["other_build"] == ["jagg_seed40"]


WINDOW = Path("experiments/curves_protocol_window.yaml")


def _arm(name: str):
    """(config, the arm's algorithm, its config) of the amendment's every_step recipe."""
    from jagg.config import load_config
    from jagg.engine.algorithms import ALGORITHMS

    proto = curves.load_protocol(WINDOW)
    spec = proto["recipes"]["every_step"]
    cfg = load_config(spec["config"], [*spec["overrides"], *spec["arms"][name]])
    return spec, ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward), cfg


def _kinds(name: str, seed: int = 950, it: int = 0) -> list[str]:
    from jagg.common import SeedStream, generator

    _, algorithm, cfg = _arm(name)
    kinds = algorithm.step_kinds(
        cfg.sampling.num_steps, generator(seed, SeedStream.ROLLOUT, it), iteration=it
    )
    return algorithm.sampling_kinds(kinds)


def test_the_amendments_arms_train_and_sample_what_their_names_say():
    """issue 56: window2_dance trains window2's window (same steps every iteration and seed) under the dance SDE
    on every step but the last; window10_knots2 and knots4_window_noise train steps 0-9 with the window's SDE
    there and the ODE elsewhere; knots4 trains all 20 steps."""
    spec = curves.load_protocol(WINDOW)["recipes"]["every_step"]
    steps = {
        a: curves.trained_steps_of(spec["config"], [*spec["overrides"], *o], 951, 6)
        for a, o in spec["arms"].items()
    }
    assert all(torch.equal(a, b) for a, b in zip(steps["window2_dance"], steps["window2"], strict=True))
    assert all(s.shape[1] == 2 and s[0, 0] < 9 and s[0, 1] == s[0, 0] + 1 for s in steps["window2"])
    for arm in ("window10_knots2", "knots4_window_noise"):
        assert all(torch.equal(s[0], torch.arange(10)) for s in steps[arm])
    assert all(torch.equal(s[0], torch.arange(20)) for s in steps["knots4"])
    assert _kinds("window2_dance") == ["dance"] * 20 + ["ode"]
    assert _kinds("window10_knots2") == ["flow_grpo"] * 10 + ["ode"] * 11
    assert _kinds("window2").count("flow_grpo") == 2  # the window's own rollout, untouched
    assert _arm("window2_dance")[2].algorithm.noise_level == 1.0 == _arm("exact")[2].algorithm.noise_level


def test_a_trained_ode_step_is_refused():
    """knots over all 20 steps with the SDE on steps 0-9 only would train ODE steps (no sampling density)."""
    from jagg.config import load_config
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.sde_steps=\[0, 10\] .*steps 0..19"):
        load_config(
            "configs/world/curves_flux_every_step.yaml",
            [
                "backward.strategy=knots",
                "backward.knots=4",
                "algorithm.sde_kind=flow_grpo",
                "algorithm.sde_steps=[0, 10]",
            ],
        )


def test_window10_jagg_is_window10_knots2s_plan():
    """Two knots over a window of 10 sit at its first and last step with the hat weights of t: JAGG's one group
    of W = 10 (its t-weights), so the amendment registers no window10_jagg arm."""
    from jagg.engine.knots import Knots
    from jagg.engine.sde import shifted_linear_sigmas
    from jagg.engine.strategies import jagg_weights

    cfg = _arm("window10_knots2")[2]
    sigma = shifted_linear_sigmas(cfg.sampling.num_steps)[:10]
    plan = Knots(count=cfg.backward.knots, placement=cfg.backward.placement).interpolation(sigma)
    assert plan.knots == (0, 9)
    assert torch.allclose(plan.weights, jagg_weights(sigma.double()))
