"""Video rewards that need no model of their own: any image reward averaged over frames, and a temporal term.

Videos are (B, 3, F, H, W) in [0, 1], the layout of diffusers' Wan VAE output (``jagg.scale.pipelines``) and of
the video world (``jagg.world.video``).

    PerFrameReward  ``mean_f reward(frame f, prompt of frame f)``: the frames of B videos scored as B x F images
                    in one call. ``frame_prompts`` maps a video prompt to its frames' prompts; by default every
                    frame gets the video's prompt, which is how a real image reward (HPSv2.1, PickScore,
                    CLIPScore, ImageReward, HPSv3, JPEG) scores a real video: registered as ``per_frame``
                    (``reward.kwargs.per_frame: {reward: hpsv2}``). The video world maps its prompts to the
                    image world's instead (``jagg.world.video_rewards``: ``frames_pref`` ...).
    temporal        ``1 - mean_f mean_pixels |x_{f+1} - x_f|`` in [0, 1]: VBench's temporal flickering score
                    (Vchitect/VBench@00c4b29, vbench/temporal_flickering.py:34-38, ``(255 - MAE) / 255`` on
                    uint8 frames; here on [0, 1] floats). 1 exactly on a constant clip; it drops with every
                    change between consecutive frames, motion included, so on its own it rewards standing still
                    (VBench applies it to static videos only): weight it beside a reward that asks for the
                    motion (``video_pref`` on the world). It is blind to the direction of time (a reversed clip
                    scores the same) but not to the order of frames (a shuffled moving clip scores lower).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from jagg.rewards import Reward, build_reward, register_reward


def check_video(videos: Tensor, prompts: list[str]) -> None:
    """ValueError unless ``videos`` is (B, 3, F, H, W) with B = len(prompts)."""
    if videos.ndim != 5 or videos.shape[1] != 3 or videos.shape[0] != len(prompts):
        raise ValueError(f"videos must be (B, 3, F, H, W) with B = {len(prompts)}, got {tuple(videos.shape)}")


class PerFrameReward:
    """``reward(videos (B, 3, F, H, W), prompts) -> (B,)``: the mean over frames of an image reward."""

    def __init__(self, reward: Reward, frame_prompts: Callable[[str], list[str]] | None = None) -> None:
        self.reward, self.frame_prompts = reward, frame_prompts

    @torch.no_grad()
    def __call__(self, videos: Tensor, prompts: list[str]) -> Tensor:
        check_video(videos, prompts)
        b, _, f, h, w = videos.shape
        frames = videos.permute(0, 2, 1, 3, 4).reshape(b * f, 3, h, w)  # video-major: row b * F + f
        if self.frame_prompts is None:
            per_frame = [p for p in prompts for _ in range(f)]
        else:
            per_frame = [q for p in prompts for q in self.frame_prompts(p)]
            if len(per_frame) != b * f:
                raise ValueError(f"frame_prompts gave {len(per_frame)} prompts for {b} videos of {f} frames")
        return self.reward(frames, per_frame).cpu().view(b, f).mean(1)  # the image reward's dtype


def temporal_consistency(videos: Tensor) -> Tensor:
    """(B,): ``1 - mean |x_{f+1} - x_f|`` over consecutive frames and pixels (module docstring), in the videos'
    floating dtype."""
    x = videos.detach()
    x = (x if x.is_floating_point() else x.float()).clamp(0, 1)
    return (1 - (x[:, :, 1:] - x[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4))).cpu()


class TemporalConsistency:
    """The registered ``temporal`` reward: ``temporal_consistency``; prompts are not read."""

    @torch.no_grad()
    def __call__(self, videos: Tensor, prompts: list[str]) -> Tensor:
        check_video(videos, prompts)
        return temporal_consistency(videos).float()


@register_reward("temporal")
def temporal_reward(device: torch.device | str | None = None) -> TemporalConsistency:
    """VBench-style temporal consistency of a video, weight-free (the real path and the world alike)."""
    return TemporalConsistency()


@register_reward("per_frame")
def per_frame_reward(
    reward: str = "jpeg", reward_kwargs: dict | None = None, device: torch.device | str | None = None
) -> PerFrameReward:
    """Any registered image reward (``reward``, built with ``reward_kwargs`` on ``device``) averaged over the
    frames of a video, every frame scored against the video's prompt: the real-model path for video."""
    return PerFrameReward(build_reward(reward, device=device, **(reward_kwargs or {})))
