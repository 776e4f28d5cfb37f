"""The dry-run plan against the simulated 8-GPU node (``experiments/plan_check.py``), every paper config.

Slow (~3 minutes on 2 cores): fake tensors on a fake 8-rank process group, two or three reduced depths per
config (``plan_check.REDUCED``), extrapolated to the full depth. Run in its own process: it initialises a
(fake) default process group.
Which terms are held to 15% and why the others are not: results/plan_check.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jagg.config import paper_config_paths

ROOT = Path(__file__).resolve().parents[1]
# SD3.5-M's fp32 frozen base is planned but not seen by the simulation (results/plan_check.md, "A regression,
# open"): an expected failure, strict, so that a fix shows
SD3_FP32_BASE = pytest.mark.xfail(strict=True, reason="fp32 frozen base not seen by the simulated node")
CONFIGS = [
    pytest.param(str(p), marks=SD3_FP32_BASE) if p.stem == "sd35m_flowgrpo" else str(p)
    for p in paper_config_paths(ROOT)
]
TOLERANCE = 0.15
# (plan term, simulated FSDPMemTracker categories) held to TOLERANCE in every config
TERMS = {
    "weights (sharded)": ("SHARDED_PARAM", "BUFFER"),
    "AdamW moments": ("OPT",),  # the EMA copy is not simulated (plan_check.EMA_TERM)
}


@pytest.fixture(scope="module")
def plan_check():
    sys.path.insert(0, str(ROOT / "experiments"))
    import plan_check as module

    return module


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: Path(p).stem)
def test_plan_within_15_percent_of_the_simulated_node(plan_check, path: str) -> None:
    from jagg.config import load_config

    cfg = load_config(path)
    if plan_check.not_simulated(cfg):  # Wan2.2-A14B: two experts cannot be placed yet
        pytest.skip(plan_check.not_simulated(cfg))
    runs = plan_check.simulate_runs(cfg)
    phases = plan_check.phase_extrapolations(cfg, runs)
    sim = phases["update"]
    plan = plan_check.plan_terms(cfg)
    # at the reduced depths the update peaks highest (at full depth the step may: the rows below)
    assert max(runs[-1]["phase_peaks"], key=runs[-1]["phase_peaks"].get) == "update"
    for term, kinds in TERMS.items():
        simulated = sum(sim.get(k, 0.0) for k in kinds)
        if term == "weights (sharded)" and not cfg.model.shard_frozen_base:
            # the replicated frozen base is a plain parameter FSDP2 ignores; the tracker counts it as ACT
            # (results/plan_check.md: flux_flowgrpo_fast 0.08 GiB weights, 26.7 GiB activations), so the
            # weights are held to 15% together with the activations
            simulated += sim.get("ACT", 0.0) + sim.get("TEMP", 0.0)
            assert plan[term] + plan["activations"] == pytest.approx(simulated, rel=TOLERANCE), term
            continue
        assert plan[term] == pytest.approx(simulated, rel=TOLERANCE), term
    # the foreach step's temporaries (OPT inside the step minus the update's), extrapolated to full depth
    temporaries = phases["step"]["OPT"] - phases["update"]["OPT"]
    assert plan[plan_check.STEP_TERM] == pytest.approx(temporaries, rel=TOLERANCE), "step temporaries"
    if plan_check.true_cfg(cfg):  # one unsharded gradient per block held (counted as TEMP by the tracker)
        held = (
            plan["unsharded block gradients"]
            - plan_check.plan_terms(load_config(path, ["model.true_cfg_scale=1.0"]))[
                "unsharded block gradients"
            ]
        )
        assert plan_check.held_cfg_gradients(cfg, runs) == pytest.approx(held, rel=TOLERANCE), "true CFG"
    if cfg.model.lora_rank == 0:  # full fine-tuning: every sharded gradient exists at the peak (3+ groups)
        assert plan["gradients (sharded)"] == pytest.approx(sim["SHARDED_GRAD"], rel=TOLERANCE)
    if cfg.model.lora_rank > 0:  # the plan's activation bound dominates the small LoRA totals (md: 20-22%)
        return
    update = sum(plan[k] for k in plan_check.UPDATE_TERMS)
    assert update == pytest.approx(sim["Total"], rel=TOLERANCE), "plan transformer + update activations"
    step = sum(plan[k] for k in plan_check.RESIDENT) + plan[plan_check.STEP_TERM]
    assert step == pytest.approx(phases["step"]["Total"], rel=TOLERANCE), "plan resident + step temporaries"
