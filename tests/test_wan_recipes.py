"""The Wan recipes against their references (issue 55): each reference's frame reduction of an image reward, and
the one rule for which expert a step of Wan2.2-A14B runs on, shared by the model and the knots planner."""

from __future__ import annotations

import pytest
import torch

from jagg.common import expert_side
from jagg.engine.knots import Knots, expert_segments
from jagg.engine.sde import shifted_linear_sigmas
from jagg.errors import ConfigError
from jagg.loop.rewards import check_frame_reduction  # fills the registry (jpeg)
from jagg.rewards import build_reward
from jagg.rewards.video import FrameReduction, PerFrameReward

F = 9


class FrameScores:
    """An image reward whose score of a frame is a known number: row r of the (B x F', 3, H, W) batch is the
    frame's mean pixel, and every frame of the test videos is constant, so the scores are the pixel values."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, images, prompts):
        assert images.ndim == 4 and len(prompts) == images.shape[0]
        self.seen += images.shape[0]
        return images.double().mean(dim=(1, 2, 3))


def videos(values: torch.Tensor) -> torch.Tensor:
    """(B, F) values -> (B, 3, F, 4, 4) videos whose frame f is the constant values[b, f]."""
    b, f = values.shape
    return values.double()[:, None, :, None, None].expand(b, 3, f, 4, 4).clone()


def test_reducers_follow_their_references_on_known_frame_scores():
    """Independent computations of each reference's formula on random frame scores (float64)."""
    g = torch.Generator().manual_seed(0)
    s = torch.rand(3, F, generator=g, dtype=torch.float64)
    x, prompts = videos(s), ["a", "b", "c"]
    # Flow-Factory: the mean over every frame
    mean = PerFrameReward(FrameScores())(x, prompts)
    torch.testing.assert_close(mean, s.mean(1), rtol=0, atol=1e-15)
    # Flash-GRPO: sort descending, sum(top int(l * 0.3)) / int(l * 0.3): int(2.7) = 2 of 9
    top = PerFrameReward(FrameScores(), reduction=FrameReduction("top_fraction", fraction=0.3))(x, prompts)
    ref = [sum(sorted(row.tolist(), reverse=True)[: int(F * 0.3)]) / int(F * 0.3) for row in s]
    torch.testing.assert_close(top, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-15)
    # verl-omni: frames [::4] = 0, 4, 8, each x 0.1, averaged; only those frames are scored
    reward = FrameScores()
    every = PerFrameReward(reward, reduction=FrameReduction("stride", stride=4, scale=0.1))(x, prompts)
    ref = [sum(0.1 * row[i].item() for i in (0, 4, 8)) / 3 for row in s]
    torch.testing.assert_close(every, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-15)
    assert reward.seen == 3 * 3
    assert (top - mean).abs().min() > 1e-3 and (every - 0.1 * mean).abs().min() > 1e-4  # the rules differ


def test_per_frame_reducer_from_config_kwargs_and_bad_values():
    """The registered reward takes the reducer by name (JPEG: weight-free); bad values name the key."""
    x = torch.rand(2, 3, 5, 16, 16, generator=torch.Generator().manual_seed(1))
    plain = build_reward("per_frame", reward="jpeg")(x, ["a", "b"])
    top = build_reward("per_frame", reward="jpeg", reducer="top_fraction", fraction=0.4)(x, ["a", "b"])
    assert bool((top >= plain).all()) and not torch.equal(top, plain)

    for kwargs, key in (
        ({"reducer": "median"}, "reward.kwargs.per_frame.reducer must be one of"),
        (
            {"reducer": "top_fraction", "fraction": 1.5},
            "reward.kwargs.per_frame.fraction must be a number in",
        ),
        ({"fraction": "0.3"}, "reward.kwargs.per_frame.fraction must be a number in (0, 1], got '0.3'"),
        ({"scale": -0.1}, "reward.kwargs.per_frame.scale must be a number > 0"),
        ({"reducer": "stride", "stride": 0}, "reward.kwargs.per_frame.stride must be an integer >= 1"),
        ({"stirde": 4}, "reward.kwargs.per_frame.stirde: unknown key"),
    ):
        with pytest.raises(ConfigError) as err:
            check_frame_reduction(kwargs)
        assert str(err.value).startswith(key), str(err.value)


# --------------------------------------------------------------------------- the expert switch (Wan2.2-A14B)
SIGMA_3 = 0.8749999999999999  # A14B's 10-step shift-3 schedule, step 3, float64


def test_expert_side_decides_on_the_float32_timestep():
    """sigma_3 is below 0.875 in float64 and equal to it in float32; WanPipeline compares the float32 timestep
    875 >= 875: the high-noise side. The float32 number just below 0.875 is on the low-noise side."""
    sig = shifted_linear_sigmas(10, 3.0)
    assert sig.dtype == torch.float64 and float(sig[3]) == SIGMA_3 and SIGMA_3 < 0.875
    below = torch.nextafter(torch.tensor(0.875, dtype=torch.float32), torch.tensor(0.0))
    assert expert_side(torch.tensor(SIGMA_3, dtype=torch.float64), (0.875,)).item() == 1
    assert expert_side(torch.tensor(SIGMA_3, dtype=torch.float32), (0.875,)).item() == 1
    assert expert_side(below, (0.875,)).item() == 0
    assert expert_side(sig, (0.875,)).tolist() == [1, 1, 1, 1] + [0] * 7  # 11 times: the last is 0


def test_planner_and_model_put_every_step_on_the_same_expert():
    """The 9 trained steps of wan22_a14b_flowfactory_knots.yaml: the model runs steps 0-3 on the high-noise
    expert (its velocity at sigma_3 is the high expert's), the planner cuts after step 3, so the 4 knots are
    [0, 3, 4, 8] and no interval crosses the switch (before: [0, 2, 3, 8], with [3, 8] crossing it)."""
    from jagg.models import TextCond, WanBackbone, tiny_wan_config

    sig = shifted_linear_sigmas(10, 3.0)[:9]
    bb = WanBackbone.from_config(tiny_wan_config(), seed=1, boundary_ratio=0.875).double()
    high = bb.high_noise(sig)
    assert high.tolist() == [True] * 4 + [False] * 5
    assert expert_segments(sig, bb.expert_boundaries) == [range(4), range(4, 9)]
    assert Knots(count=4, placement="low_noise").positions(sig, bb.expert_boundaries) == (0, 3, 4, 8)
    g = torch.Generator().manual_seed(2)
    cond = TextCond(embeds=torch.randn(1, 5, 32, generator=g, dtype=torch.float64), mask=torch.ones(1, 5))
    z = torch.randn(1, 4, 2, 4, 4, generator=g, dtype=torch.float64)
    with torch.no_grad():
        v = bb.velocity(z, float(sig[3]), cond)
        t = torch.full((1,), 875.0)
        v_high = bb._call(bb.transformer, z, t, cond.embeds)
        v_low = bb._call(bb.transformer_2, z, t, cond.embeds)
    torch.testing.assert_close(v, v_high, rtol=0, atol=0)
    assert (v - v_low).abs().max() > 1e-3


@pytest.mark.parametrize(
    "name, steps, knots",
    [("wan22_a14b_flowfactory_knots", 9, (0, 3, 4, 8)), ("wan22_a14b_flowfactory", 1, (0,))],
    ids=["knots", "window1"],
)
def test_the_trainers_update_plans_each_expert_apart(tmp_path, monkeypatch, name, steps, knots):
    """Through the trainer (``Trainer.velocity``, the velocity every update hands the backward), on a tiny
    two-expert folder: the velocity declares A14B's switch, and the update plans the knots config's 9 trained
    steps at [0, 3, 4, 8] and the recipe's window of one step as a plain step.

    Before, ``Trainer.velocity`` was a plain closure declaring no switch: the engine tests, on the backbone's
    bound velocity, passed while training planned [0, 4, 7, 8], whose interval [0, 4] crosses the switch at
    sigma 0.875. With the switch declared, the window of one crashed in ``expert_segments``."""
    from helpers import build_trainer
    from jagg.config import load_config, tiny_pipeline_overrides
    from jagg.engine.routing import BackwardSetting
    from jagg.engine.strategies import expert_boundaries
    from jagg.scale.tiny_pipeline import save_tiny_wan_pipeline

    prompts = ["a red ball", "a blue cube"]
    save_tiny_wan_pipeline(tmp_path / "wan2", prompts, boundary_ratio=0.875)
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    cfg = load_config(
        f"configs/paper/wan/{name}.yaml",
        [
            *tiny_pipeline_overrides(tmp_path / "wan2", tmp_path / "prompts.txt"),
            "reward.weights={per_frame: 1.0}",
            "reward.eval=[per_frame]",
            "reward.kwargs={per_frame: {reward: jpeg}}",
            *("train.precision=fp32", "model.gradient_checkpointing=false"),
            *("sampling.latent_size=4", "sampling.latent_frames=2", "optim.ema_decay=0"),
            *("train.prompts_per_iter=1", "train.images_per_prompt=2", "train.train_batch_size=2"),
            *("train.grad_accum=1", f"log.run_dir={tmp_path / 'run'}"),
        ],
    )
    trainer = build_trainer(cfg)
    assert expert_boundaries(trainer.velocity(trainer.comp.text_encoder.encode_prompts(prompts))) == (0.875,)
    plans = []
    plan = BackwardSetting.plan
    monkeypatch.setattr(BackwardSetting, "plan", lambda self, *a: plans.append(plan(self, *a)) or plans[-1])
    ro = trainer.rollout(0)
    assert ro.trained.shape == (2, steps)  # Flow-GRPO: int(0.99 x 10) trained steps; the recipe: one
    row = trainer.update(ro)
    assert [p.knots for p in plans] == [knots] and torch.isfinite(torch.tensor(row["loss"]))
