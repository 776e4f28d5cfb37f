"""The weight-free quality judge ``render_match`` (jagg.world.rewards.RenderMatchReward, issue 56): 1 - the RMS
pixel distance to the nearest clean render of the sample's own prompt, checked against a distance computed
here in numpy from renders drawn independently of the judge's bank."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from jagg.config import load_config
from jagg.errors import ConfigError
from jagg.rewards import EVAL_ONLY, REWARDS
from jagg.world.rewards import RENDER_BANK
from jagg.world.scene import World


def _by_hand(image: torch.Tensor, prompt: str, world: World) -> float:
    """1 - min over the prompt's bank (re-drawn here from its CRC-32 seed) of the RMS distance, in numpy."""
    rng = np.random.default_rng(zlib.crc32(prompt.encode()))
    bank = world.render_attributes([world.parse(prompt)] * RENDER_BANK, rng)[0].numpy().astype(np.float64)
    x = image.numpy().astype(np.float64)
    return 1 - min(float(np.sqrt(((b - x) ** 2).mean())) for b in bank)


def test_render_match_scores_the_nearest_clean_render_of_the_own_prompt():
    judge, world = REWARDS["render_match"](), World()
    prompts = world.heldout_prompts[:3]
    clean = world.render(prompts, seed=123)  # not a bank member: another draw of the jitter
    score = judge(clean, prompts)
    assert score.dtype == torch.float32 and score.shape == (3,)
    assert score.tolist() == pytest.approx([_by_hand(x, p, world) for x, p in zip(clean, prompts)], abs=1e-6)
    # a faithful render beats the same image judged as another prompt, and itself under pixel noise
    wrong = [world.prompts[(world.prompts.index(p) + 1) % len(world.prompts)] for p in prompts]
    assert (score > judge(clean, wrong)).all()
    noisy = (clean + 0.1 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert (score > judge(noisy, prompts)).all()
    # a bank member is its own nearest render; the bank is the prompt's, whatever instance draws it
    member = REWARDS["render_match"]().renders(prompts[0])[:1].view(1, *clean.shape[1:]).float()
    assert judge(member, prompts[:1]).item() == pytest.approx(1.0, abs=1e-6)


def test_render_match_is_eval_only():
    assert "render_match" in EVAL_ONLY
    with pytest.raises(ConfigError, match="render_match is an eval-only judge"):
        load_config(None, ["reward.weights={render_match: 1.0}"])
    load_config(None, ["reward.eval=[pref, render_match]"])  # allowed as an evaluation reward


def test_judge_resolution_reports_the_seed_sd_and_its_conservative_mdd():
    import math
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import judge_resolution
    from jagg.stats import minimum_detectable_difference

    rows = [
        {
            "seed": s,
            "images_per_prompt": 16,
            "eval_render_match_mean": 0.9 + 0.01 * (s % 2),
            "eval_pref_mean": 11.0,
        }
        for s in range(10)
    ]
    md = judge_resolution.render(rows)
    line = next(x for x in md.splitlines() if x.startswith("| render_match | 16 |"))
    sd = float(np.std([0.9 + 0.01 * (s % 2) for s in range(10)], ddof=1))
    mdd10 = minimum_detectable_difference(math.sqrt(2) * sd, 10, 0.05, 0.8, "greater")
    assert line.split(" | ")[4] == f"{sd:.4f}" and line.split(" | ")[6] == f"{mdd10:.4f} |"
