"""Rewards of the video world (clips (B, 3, F, H, W) in [0, 1]; ``jagg.world.video``).

    video_pref    preference, a VideoAlign / VideoScore analogue: the Bradley-Terry score of a model trained on
                  (faithful clean clip > degraded clip) pairs, the degradations including a wrong direction,
                  standing still, shuffled frames and flicker (``jagg.world.video_train``); needs
                  ``make pretrain``                                                                    (logit)
    frames_pref, frames_clip, frames_attr, frames_attr_soft
                  the image world's ``pref`` / ``clip`` / ``attr`` / ``attr_soft`` averaged over frames
                  (``jagg.rewards.video.PerFrameReward``), each frame scored against the image-world prompt
                  of where the object should be at that frame (``VideoWorld.frame_prompts``): they see colour,
                  shape and where each frame's object is, not the clip as a whole           (the image reward's)
    motion_geom   eval only: 1 if the motion read from the clip's geometry (``jagg.world.motion``, no weights)
                  is the prompt's                                                                      ({0, 1})
    video_geom    eval only: 1 if colour, shape and motion read from the geometry all match the prompt ({0, 1})

The weight-free ``temporal`` and the real-path ``per_frame`` live in ``jagg.rewards.video``. Why ``video_pref``
is trained, not composed from ``frames_pref`` and a motion check: the motion check would be the geometric judge,
which must stay independent of what the policy is trained on, and a composed reward would see neither shuffled
frames nor flicker; trained on pairs it is what the real video reward models are (docs/world.md's video section).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from jagg.rewards import register_reward
from jagg.rewards.video import PerFrameReward, check_video
from jagg.world.models import PreferenceModel
from jagg.world.motion import clip_match, motion_match
from jagg.world.pretrained import load_module
from jagg.world.rewards import REWARD_ARTEFACTS, attr_reward, clip_reward, pref_reward
from jagg.world.text import WordTokenizer
from jagg.world.video import VideoWorld

Device = torch.device | str | None  # accepted and ignored: the world's judges score on the CPU


class VideoPrefReward:
    """The video preference model's score of a clip for its prompt (higher = preferred)."""

    def __init__(self, model: PreferenceModel, world: VideoWorld) -> None:
        self.model, self.world = model.requires_grad_(False).eval(), world
        self.tokenizer = WordTokenizer(world.words)

    @torch.no_grad()
    def __call__(self, clips: Tensor, prompts: list[str]) -> Tensor:
        check_video(clips, prompts)
        w = self.world
        if tuple(clips.shape[2:]) != (w.frames, w.size, w.size):
            raise ValueError(
                f"video_pref expects {w.frames} frames of {w.size}x{w.size}, got {tuple(clips.shape)}"
            )
        return self.model(clips.detach().float().cpu().clamp(0, 1), *self.tokenizer(prompts)).float()


REWARD_ARTEFACTS.update(  # jagg.world.rewards.REWARD_ARTEFACTS: what each video world reward loads
    {
        "video_pref": ("video_pref",),
        "frames_pref": ("pref",),
        "frames_clip": ("clip",),
        "frames_attr": ("attr",),
        "frames_attr_soft": ("attr",),
    }
)


@register_reward("video_pref")
def video_pref_reward(cache_dir: str | Path | None = None, device: Device = None) -> VideoPrefReward:
    """The video world's preference reward (needs ``make pretrain``); on the CPU."""
    return VideoPrefReward(load_module("video_pref", Path(cache_dir) if cache_dir else None), VideoWorld())


def _frames(reward) -> PerFrameReward:
    return PerFrameReward(reward, frame_prompts=VideoWorld().frame_prompts)


@register_reward("frames_pref")
def frames_pref_reward(cache_dir: str | Path | None = None, device: Device = None) -> PerFrameReward:
    """The image world's ``pref`` averaged over a clip's frames (needs ``make pretrain``)."""
    return _frames(pref_reward(cache_dir))


@register_reward("frames_clip")
def frames_clip_reward(cache_dir: str | Path | None = None, device: Device = None) -> PerFrameReward:
    """The image world's ``clip`` averaged over a clip's frames (needs ``make pretrain``)."""
    return _frames(clip_reward(cache_dir))


@register_reward("frames_attr")
def frames_attr_reward(cache_dir: str | Path | None = None, device: Device = None) -> PerFrameReward:
    """The image world's ``attr`` (exact match per frame) averaged over frames (needs ``make pretrain``)."""
    return _frames(attr_reward(cache_dir))


@register_reward("frames_attr_soft")
def frames_attr_soft_reward(cache_dir: str | Path | None = None, device: Device = None) -> PerFrameReward:
    """The image world's ``attr_soft`` averaged over frames (needs ``make pretrain``)."""
    return _frames(attr_reward(cache_dir, soft=True))


class GeometryVideoReward:
    """Motion match (``full=False``) or colour + shape + motion match read by ``jagg.world.motion``."""

    def __init__(self, world: VideoWorld, full: bool) -> None:
        self.world, self.full = world, full

    @torch.no_grad()
    def __call__(self, clips: Tensor, prompts: list[str]) -> Tensor:
        check_video(clips, prompts)
        return (clip_match if self.full else motion_match)(clips, prompts, self.world)


@register_reward("motion_geom")
def motion_geom_reward(device: Device = None) -> GeometryVideoReward:
    """Eval-only: the prompt's motion read from the clip's geometry (no weights, no ``make pretrain``)."""
    return GeometryVideoReward(VideoWorld(), full=False)


@register_reward("video_geom")
def video_geom_reward(device: Device = None) -> GeometryVideoReward:
    """Eval-only: colour, shape and motion read from the clip's geometry all match the prompt (no weights)."""
    return GeometryVideoReward(VideoWorld(), full=True)
