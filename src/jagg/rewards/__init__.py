"""Reward registry: every reward maps (images, prompts) -> one score per image, batched, without grad.

Interface (shared by the embedded-default rewards and the real HPSv2.1 / PickScore / CLIPScore):
    reward(images, prompts) -> Tensor (B,) float32
    images: (B, 3, H, W) float in [0, 1] (decoded RGB); prompts: list of B strings.
Rewards register themselves with ``@register_reward("name")`` when their module is imported; every factory
takes ``device=None`` (the run's device, passed by ``jagg.loop.rewards``; a reward may ignore it and score on
the CPU);
``build_rewards({"a": 1.0, "b": 0.5})`` returns a weighted sum that also reports each component.

Layer: beside the engine and the model adapters; from the package it may import only ``jagg.errors`` and
``jagg.common``. Registered in this package: ``jpeg`` (``jagg.rewards.jpeg``), the video rewards ``temporal`` and
``per_frame`` (``jagg.rewards.video``: videos are (B, 3, F, H, W)). The embedded world's rewards
(``jagg.world.rewards``) and the real ones (``jagg.scale.rewards``) live in the layers above and register
when imported; the loop's composition root (``jagg.loop.rewards``) imports all three.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from jagg.errors import require


class Reward(Protocol):
    """Anything callable as ``reward(images (B,3,H,W) in [0,1], prompts) -> (B,) float32``."""

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor: ...


REWARDS: dict[str, Callable[..., Reward]] = {}
# Held-out judges: allowed in ``reward.eval``, refused in ``reward.weights`` (a metric the policy trains on is
# no longer independent evidence of quality).
EVAL_ONLY = frozenset({"attr_judge", "attr_geom", "render_match", "motion_geom", "video_geom"})
# The rewards that score videos (B, 3, F, H, W) (``jagg.rewards.video``, ``jagg.world.video_rewards``): the only
# ones a Wan run may name (its samples are videos); an image reward scores a video through ``per_frame``.
VIDEO_REWARDS = frozenset(
    {"temporal", "per_frame", "video_pref", "frames_pref", "frames_clip", "frames_attr", "frames_attr_soft"}
    | {"motion_geom", "video_geom"}
)


@dataclass(kw_only=True)
class RewardConfig:
    """The ``reward:`` section: the training rewards' weights, the evaluation's rewards and their constructor
    kwargs. Its checks need no reward imported; the names are checked against ``REWARDS`` by the loop's
    composition root (``jagg.loop.components.check_config``), where every reward has registered."""

    weights: dict[str, float] = field(default_factory=lambda: {"pref": 1.0})
    eval: list[str] = field(default_factory=lambda: ["pref", "clip", "attr"])
    kwargs: dict[str, dict] = field(default_factory=dict)  # reward name -> constructor kwargs

    def validate(self) -> None:
        """``ConfigError`` naming the key and what is allowed."""
        require(bool(self.weights), "reward.weights must name at least one reward")
        trained_on = sorted(EVAL_ONLY & set(self.weights))
        require(
            not trained_on,
            f"reward.weights: {', '.join(trained_on)} is an eval-only judge (allowed in reward.eval only): "
            "a metric the policy trains on is no longer an independent check",
        )
        extra = sorted(set(self.kwargs) - set(self.weights) - set(self.eval))
        require(
            not extra, f"reward.kwargs: {extra[0] if extra else ''!r} is not a reward in reward.weights/eval"
        )


def register_reward(name: str):
    """Class/function decorator adding a reward factory to ``REWARDS`` under ``name``."""

    def deco(factory):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        REWARDS[name] = factory
        return factory

    return deco


def build_reward(name: str, **kwargs) -> Reward:
    """Instantiate a registered reward by name (clear error listing the known names)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return REWARDS[name](**kwargs)


class WeightedRewards:
    """Weighted sum of several rewards; ``scores`` keeps the last per-reward scores for logging."""

    def __init__(self, rewards: dict[str, Reward], weights: dict[str, float]) -> None:
        self.rewards, self.weights = rewards, weights
        self.scores: dict[str, Tensor] = {}

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        self.scores = {}
        for name, fn in self.rewards.items():
            score = fn(images, prompts).float().cpu()
            self.scores[name] = score
            total += self.weights[name] * score
        return total


def build_rewards(weights: dict[str, float], kwargs: dict[str, dict] | None = None) -> WeightedRewards:
    """``{"pref": 1.0, "clip": 0.5}`` -> a ``WeightedRewards`` over freshly built rewards."""
    kwargs = kwargs or {}
    return WeightedRewards({n: build_reward(n, **kwargs.get(n, {})) for n in weights}, dict(weights))
