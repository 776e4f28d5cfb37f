"""Embedded-world rewards (clip, pref, attr) and JPEG compressibility: interface, registry, cache errors.

Random-init or few-step models only; `make pretrain` is not needed.
"""

from __future__ import annotations

import math

import pytest
import torch

from jagg.rewards import REWARDS, build_reward, build_rewards
from jagg.rewards.jpeg import jpeg_kilobytes
from jagg.world import ArtefactError
from jagg.world.models import AttrClassifier, AttrJudge
from jagg.world.pretrained import new_module
from jagg.world.rewards import AttrReward, ClipReward, PrefReward
from jagg.world.text import WordTokenizer
from jagg.world.train import (
    EvalJudgeTrainConfig,
    JudgeTrainConfig,
    agreement,
    generator_degrade,
    train_attr_judge,
    train_attributes,
    train_preference,
)


@pytest.fixture(scope="module")
def batch(world):
    prompts = world.prompts[::9]  # 8 prompts
    return world.render(prompts, seed=0), prompts


def _rewards(world):
    torch.manual_seed(0)
    return {
        "clip": ClipReward(new_module("clip", world), world),
        "pref": PrefReward(new_module("pref", world), world),
        "attr": AttrReward(new_module("attr", world), world),
        "attr_soft": AttrReward(new_module("attr", world), world, soft=True),
        "attr_judge": AttrReward(new_module("attr_judge", world), world),
        "jpeg": build_reward("jpeg"),
    }


@pytest.mark.parametrize("name", ["clip", "pref", "attr", "attr_soft", "attr_judge", "jpeg"])
def test_reward_interface_on_a_batch(world, batch, name):
    reward = _rewards(world)[name]
    images, prompts = batch
    images = images.clone().requires_grad_(True)
    score = reward(images, prompts)
    assert score.shape == (len(prompts),) and score.dtype == torch.float32
    assert not score.requires_grad and torch.isfinite(score).all()
    assert torch.equal(score, reward(images, prompts))  # deterministic
    if name in ("attr", "attr_judge"):
        assert set(score.tolist()) <= {0.0, 1.0}
    if name in ("clip", "attr_soft"):
        assert score.abs().max() <= 1 + 1e-5
    with pytest.raises(ValueError):
        reward(images, prompts[:-1])


def test_jpeg_prefers_flat_images():
    flat = torch.full((1, 3, 16, 16), 0.5)
    noisy = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert jpeg_kilobytes(noisy) > jpeg_kilobytes(flat)
    assert build_reward("jpeg")(flat, ["x"]) > build_reward("jpeg")(noisy, ["x"])
    assert build_reward("jpeg_incompressibility")(noisy, ["x"]) > 0


def test_registry_has_world_rewards_and_weighted_sum(tmp_path, world, batch):
    # registered by importing jagg.rewards.jpeg and jagg.world.rewards (above)
    assert {"clip", "pref", "attr", "attr_soft", "attr_judge", "jpeg"} <= set(REWARDS)
    for name in ("pref", "attr_soft", "attr_judge"):
        with pytest.raises(ArtefactError, match="run `make pretrain`"):
            build_reward(name, cache_dir=tmp_path)
    total = build_rewards({"jpeg": 2.0})
    images, prompts = batch
    assert torch.allclose(total(images, prompts), 2 * total.scores["jpeg"])


def test_few_step_judges_learn_something(world):
    """Seconds-scale training: the attribute head beats chance, the preference model ranks pairs."""
    cfg = JudgeTrainConfig(steps=40, batch=48, per_prompt=3, pairs=360, lr=3e-3)
    attr, stats = train_attributes(world, cfg)
    images = world.render(world.prompts, seed=123)
    acc = AttrReward(attr, world, soft=True)(images, world.prompts).mean().item()
    assert acc > 1 / 72 and stats["final_loss"] < math.log(72)  # below the uniform-guess loss
    pref, stats = train_preference(world, WordTokenizer(world.words), cfg)
    assert stats["final_loss"] < math.log(2) + math.log(
        72
    )  # below constant scores: BT log 2 + InfoNCE log 72


class _Oracle:
    """A 'backbone' whose velocity is the exact rectified-flow velocity toward known clean latents x0:
    v = (z - x0) / sigma. Euler integration from any sigma0 to 0 then lands exactly on x0."""

    def __init__(self, x0):
        self.x0 = x0

    def velocity(self, z, sigma, cond):
        return (z - self.x0[: len(z)]) / sigma.view(-1, 1, 1, 1)


class _Text:
    def encode_prompts(self, prompts):
        return None


def test_generator_degrade_is_sdedit_back_to_the_clean_image_for_an_exact_velocity(world):
    """With the exact velocity the SDEdit round trip (noise to sigma0, Euler back to 0) returns the render."""
    prompt = world.prompts[5]
    images = world.render([prompt], seed=1).repeat(6, 1, 1, 1)
    oracle = _Oracle(world.encode(images))
    out = generator_degrade([oracle], _Text(), world, images, [prompt] * 6, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, images, atol=1e-5, rtol=0)


def test_eval_judge_is_independent_of_the_training_classifier(world):
    """Another architecture (CoordConv input, 5x5 then 3x3 convolutions: no convolution kernel shaped like one
    of ``attr``'s), and a seconds-scale run on clean + generator-degraded renders learns something."""
    judge, attr = new_module("attr_judge", world), new_module("attr", world)
    assert isinstance(judge, AttrJudge) and isinstance(attr, AttrClassifier)
    assert judge.features[0].in_channels == 5  # RGB + two coordinate channels
    kernels = lambda m: {tuple(p.shape) for p in m.parameters() if p.ndim == 4}  # noqa: E731
    assert not (kernels(judge) & kernels(attr))
    cfg = EvalJudgeTrainConfig(steps=40, batch=48, per_prompt=1, lr=3e-3, seed=3)
    images = world.render(world.prompts, seed=60_000 + cfg.seed)  # the renders train_attr_judge degrades
    model, stats = train_attr_judge(world, [_Oracle(world.encode(images))], _Text(), cfg)
    assert stats["final_loss"] < math.log(72)  # below guessing every head: log 6 + log 3 + log 4
    assert model.predict(images).shape == (72, 3)


def test_agreement_and_kappa():
    a = torch.tensor([1, 1, 0, 0, 1, 0, 1, 0])
    assert agreement(a, a) == {"n": 8, "agree": 1.0, "kappa": 1.0}
    flipped = agreement(a, 1 - a)
    assert flipped["agree"] == 0.0 and flipped["kappa"] == pytest.approx(-1.0)
    half = agreement(a, torch.tensor([1, 0, 1, 0, 1, 0, 1, 0]))
    assert half["agree"] == 0.75 and half["kappa"] == pytest.approx(0.5)


def test_every_registered_factory_takes_a_device():
    """``jagg.loop.rewards`` passes every reward the run's device (no signature inspection there): each
    factory of the filled registry must accept ``device`` by name (or forward keywords to a class that does)."""
    import inspect

    import jagg.loop.rewards  # noqa: F401  (fills the registry)

    for name, factory in REWARDS.items():
        params = inspect.signature(factory).parameters
        takes = "device" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        assert takes, name
    reward = jagg.loop.rewards.build_run_reward("jpeg", {}, torch.device("cpu"))
    assert reward(torch.zeros(1, 3, 8, 8), ["x"]).shape == (1,)
