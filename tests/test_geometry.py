"""The non-learned geometric attribute judge (jagg.world.geometry, reward ``attr_geom``): exact on clean
renders, wrong where the image is wrong, eval-only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jagg.config import load_config
from jagg.errors import ConfigError
from jagg.loop.rewards import REWARDS  # fills the registry
from jagg.rewards import EVAL_ONLY
from jagg.world.geometry import H3_TRIANGLE, H4_SQUARE, MIN_ALPHA, attribute_match, harmonics, read_attributes
from jagg.world.scene import PALETTE, Attributes, World, WorldConfig


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_exact_on_clean_renders_of_every_prompt(seed):
    world = World()
    prompts = world.prompts * 3  # 216 renders, fresh jitter per image
    images = world.render(prompts, seed=seed)
    assert read_attributes(images, world) == [world.parse(p) for p in prompts]
    assert attribute_match(images, prompts, world).sum().item() == len(prompts)


def test_shape_thresholds_lie_between_the_classes_on_clean_renders():
    """The margins behind H3_TRIANGLE / H4_SQUARE: every class's harmonic range on 720 clean renders."""
    world = World()
    prompts = world.prompts * 10
    images = world.render(prompts, seed=11)
    h3, h4 = {}, {}
    for img, p in zip(images, prompts, strict=True):
        attrs = world.parse(p)
        bg = img.flatten(1).median(1).values
        d = torch.tensor(PALETTE[attrs.color]) - bg
        alpha = ((img.permute(1, 2, 0) - bg) @ d / (d @ d)).clamp(0, 1)
        alpha = torch.where(alpha < MIN_ALPHA, torch.zeros_like(alpha), alpha)
        _, _, a3, a4 = harmonics(alpha)
        h3.setdefault(attrs.shape, []).append(a3)
        h4.setdefault(attrs.shape, []).append(a4)
    assert min(h3["triangle"]) > H3_TRIANGLE + 0.3 and max(h3["circle"] + h3["square"]) < H3_TRIANGLE - 0.05
    assert min(h4["square"]) > H4_SQUARE + 0.1 and max(h4["circle"]) < H4_SQUARE - 0.05


def test_wrong_images_score_zero():
    world = World()
    prompt = "a red circle on the left"
    rng = np.random.default_rng(0)
    for other in (
        Attributes("blue", "circle", "left"),
        Attributes("red", "square", "left"),
        Attributes("red", "circle", "right"),
    ):
        img = world.render_attributes([other], rng)[0]
        assert attribute_match(img, [prompt], world).item() == 0.0
        assert read_attributes(img, world) == [other]
    empty = world.render_attributes([None], rng)[0]
    assert attribute_match(empty, [prompt], world).item() == 0.0


def test_registered_eval_only_and_refused_as_a_training_reward():
    reward = REWARDS["attr_geom"]()
    world = World()
    images = world.render(world.prompts[:4], seed=0)
    score = reward(images, world.prompts[:4])
    assert score.dtype == torch.float32 and score.tolist() == [1.0] * 4
    assert "attr_geom" in EVAL_ONLY
    with pytest.raises(ConfigError, match="attr_geom is an eval-only judge"):
        load_config(None, ["reward.weights={attr_geom: 1.0}"])
    with pytest.raises(ValueError, match="reads shapes"):
        read_attributes(images, World(WorldConfig(shapes=("circle", "diamond"))))
