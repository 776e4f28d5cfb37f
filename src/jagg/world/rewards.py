"""Project-trained rewards of the embedded world (stand-ins for the paper's reward models).

    clip  alignment, CLIPScore analogue: cosine(image, prompt) of a tiny contrastive model   (~[-1, 1])
    pref  preference, HPSv2.1 / PickScore analogue: Bradley-Terry score of a model trained on
          (faithful clean render > degraded variant) pairs; penalises the noisy-background hack     (logit)
    attr  GenEval analogue: 1 if the attribute classifier reads the prompt's colour, shape and position
          exactly, else 0                                                                          ({0, 1})
    attr_judge  eval only: exact attribute match read by an independent judge (``AttrJudge``: another
          architecture, seed and augmentation, trained on renders degraded by the generators); the
          held-out check on ``attr``, refused as a training reward (``jagg.rewards.EVAL_ONLY``)   ({0, 1})
    attr_geom  eval only: exact attribute match read from the renderer's geometry (``jagg.world.geometry``:
          nearest palette colour, coverage centroid, angular harmonics); no weights, a judge of another
          kind than the two learned ones                                                          ({0, 1})
    render_match  eval only: 1 - the RMS pixel distance to the nearest of ``RENDER_BANK`` clean renders of the
          sample's own prompt (``RenderMatchReward``); no weights, a quality judge no policy trains on   ([0, 1])
    attr_soft  the same classifier's probability of the prompt's colour x shape x position: a dense training
          signal (every image of a group is ranked, not only right / wrong); ``attr`` stays the metric ([0, 1])

All follow the registry interface: ``reward(images (B,3,H,W) in [0,1], prompts) -> (B,) float32``, no grad.
The registered factories load the weights cached by ``make pretrain`` (``jagg.world.pretrained``); they enter
``jagg.rewards.REWARDS`` when this module is imported (``jagg.loop.rewards`` does). They are the one way to
build these rewards (``jagg.world.build.world_rewards`` calls them too).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from jagg.rewards import register_reward
from jagg.world.geometry import attribute_match
from jagg.world.models import AttrClassifier, AttrJudge, PreferenceModel, TinyCLIP
from jagg.world.pretrained import load_module
from jagg.world.scene import World
from jagg.world.text import WordTokenizer


class _WorldReward:
    """Shared input checks and prompt tokenisation."""

    def __init__(self, model: torch.nn.Module, world: World) -> None:
        self.model = model.requires_grad_(False).eval()
        self.world = world
        self.tokenizer = WordTokenizer(world.words)

    def _images(self, images: Tensor, prompts: list[str]) -> Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        if images.shape[-2:] != (self.world.size, self.world.size):
            raise ValueError(f"world rewards expect {self.world.size}x{self.world.size} images")
        return images.detach().float().cpu().clamp(0, 1)


class ClipReward(_WorldReward):
    """Cosine similarity of image and prompt embeddings."""

    model: TinyCLIP

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        x = self._images(images, prompts)
        return (self.model.encode_image(x) * self.model.encode_text(*self.tokenizer(prompts))).sum(-1)


class PrefReward(_WorldReward):
    """Preference-model score (higher = preferred)."""

    model: PreferenceModel

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.model(self._images(images, prompts), *self.tokenizer(prompts)).float()


class AttrReward(_WorldReward):
    """Exact attribute match (0/1), or the probability of the prompt's attributes when ``soft``."""

    model: AttrClassifier | AttrJudge

    def __init__(self, model: AttrClassifier | AttrJudge, world: World, soft: bool = False) -> None:
        super().__init__(model, world)
        self.soft = soft

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        labels = self.world.labels(prompts)  # (B, 3)
        logits = self.model(self._images(images, prompts))
        if self.soft:
            logp = sum(lg.log_softmax(-1).gather(1, labels[:, k : k + 1]) for k, lg in enumerate(logits))
            return logp.squeeze(1).exp()
        pred = torch.stack([lg.argmax(-1) for lg in logits], dim=-1)
        return pred.eq(labels).all(-1).float()


def _load(name: str, cache_dir: str | Path | None):
    return load_module(name, Path(cache_dir) if cache_dir else None), World()


# Every reward factory takes ``device`` (the run's); the world's judges are a few thousand parameters and score
# on the CPU, where the decoded images are, so they accept it and stay there.
Device = torch.device | str | None


# The cached artefacts (``make pretrain``) each world reward loads: ``jagg.loop.rewards.check_run_rewards`` checks
# them before a run writes anything; a test builds every world reward against an empty cache and compares.
REWARD_ARTEFACTS: dict[str, tuple[str, ...]] = {
    "clip": ("clip",),
    "pref": ("pref",),
    "attr": ("attr",),
    "attr_soft": ("attr",),
    "attr_judge": ("attr_judge",),
}


@register_reward("clip")
def clip_reward(cache_dir: str | Path | None = None, device: Device = None) -> ClipReward:
    """Embedded-world CLIPScore analogue (needs ``make pretrain``); on the CPU (see ``Device``)."""
    return ClipReward(*_load("clip", cache_dir))


@register_reward("pref")
def pref_reward(cache_dir: str | Path | None = None, device: Device = None) -> PrefReward:
    """Embedded-world preference reward, HPSv2.1 / PickScore analogue (needs ``make pretrain``); on the CPU."""
    return PrefReward(*_load("pref", cache_dir))


@register_reward("attr")
def attr_reward(cache_dir: str | Path | None = None, soft: bool = False, device: Device = None) -> AttrReward:
    """Embedded-world GenEval-style exact attribute accuracy (needs ``make pretrain``); on the CPU."""
    model, world = _load("attr", cache_dir)
    return AttrReward(model, world, soft=soft)


@register_reward("attr_soft")
def attr_soft_reward(cache_dir: str | Path | None = None, device: Device = None) -> AttrReward:
    """Embedded-world soft attribute score: probability of the prompt's colour x shape x position (CPU)."""
    return attr_reward(cache_dir, soft=True)


@register_reward("attr_judge")
def attr_judge_reward(cache_dir: str | Path | None = None, device: Device = None) -> AttrReward:
    """Eval-only exact attribute match by the independent ``AttrJudge`` (needs ``make pretrain``); CPU."""
    return AttrReward(*_load("attr_judge", cache_dir))


class GeometryReward:
    """Exact attribute match (0/1) by the non-learned geometric reading (``jagg.world.geometry``)."""

    def __init__(self, world: World) -> None:
        self.world = world

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            raise ValueError(
                f"images must be (B, 3, H, W) with B = {len(prompts)}, got {tuple(images.shape)}"
            )
        return attribute_match(images, prompts, self.world)


@register_reward("attr_geom")
def attr_geom_reward(device: torch.device | None = None) -> GeometryReward:
    """Eval-only exact attribute match read from the render's geometry (no weights, no ``make pretrain``);
    it runs on the CPU whatever ``device`` is, like the world's other judges."""
    return GeometryReward(World())


RENDER_BANK = (
    256  # clean renders per prompt: the jitter's 5 continuous draws, enough that the nearest is close
)


class RenderMatchReward:
    """1 - the RMS pixel distance from each sample to the nearest clean render of its own prompt (issue 56).

    The world draws every training image from ``World.render`` (jittered position, size, angle, colour and
    background), so a faithful sample lies near one of them; a degraded, off-prompt or hacked one does not.
    Each prompt's bank is ``RENDER_BANK`` renders from a generator seeded by the prompt's CRC-32: the same
    bank on every run and machine, drawn lazily. No weights, nothing learned, never a training reward."""

    def __init__(self, world: World, bank: int = RENDER_BANK) -> None:
        self.world, self.bank = world, bank
        self._renders: dict[str, Tensor] = {}

    def renders(self, prompt: str) -> Tensor:
        """(bank, 3 H W) flat clean renders of ``prompt``."""
        if prompt not in self._renders:
            rng = np.random.default_rng(zlib.crc32(prompt.encode()))
            attrs = [self.world.parse(prompt)] * self.bank
            self._renders[prompt] = self.world.render_attributes(attrs, rng)[0].flatten(1).double()
        return self._renders[prompt]

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            raise ValueError(
                f"images must be (B, 3, H, W) with B = {len(prompts)}, got {tuple(images.shape)}"
            )
        flat = images.detach().cpu().double().clamp(0, 1).flatten(1)
        rms = [
            ((self.renders(p) - x).pow(2).mean(1).min()).sqrt() for x, p in zip(flat, prompts, strict=True)
        ]
        return (1 - torch.stack(rms)).float()


@register_reward("render_match")
def render_match_reward(device: torch.device | None = None) -> RenderMatchReward:
    """Eval-only: closeness to the nearest clean render of the sample's own prompt (no weights, no
    ``make pretrain``); on the CPU whatever ``device`` is, like the world's other judges."""
    return RenderMatchReward(World())
