"""Video rewards that need no model of their own: any image reward averaged over frames, and a temporal term.

Videos are (B, 3, F, H, W) in [0, 1], the layout of diffusers' Wan VAE output (``jagg.scale.pipelines``) and of
the video world (``jagg.world.video``).

    PerFrameReward  ``mean_f reward(frame f, prompt of frame f)``: the frames of B videos scored as B x F images
                    in one call. ``frame_prompts`` maps a video prompt to its frames' prompts; by default every
                    frame gets the video's prompt, which is how a real image reward (HPSv2.1, PickScore,
                    CLIPScore, ImageReward, HPSv3, JPEG) scores a real video: registered as ``per_frame``
                    (``reward.kwargs.per_frame: {reward: hpsv2}``). The video world maps its prompts to the
                    image world's instead (``jagg.world.video_rewards``: ``frames_pref`` ...).
    FrameReduction  how a video's frame scores become its score, one named reducer per reference recipe
                    (``reward.kwargs.per_frame.reducer``):
                      mean          every frame, averaged: Flow-Factory (X-GenGroup/Flow-Factory@a0b2bc5,
                                    src/flow_factory/rewards/pick_score.py:86-116, ``_compute_video_scores``)
                      top_fraction  the best ``int(fraction * F)`` frames averaged (fraction 0.3): Flash-GRPO
                                    (Shredded-Pork/Flash-GRPO@8cfc973, flow_grpo/rewards.py:139-143,
                                    ``video_hpsv3_remote``: sort descending, ``sum(top) / int(l * 0.3)``)
                      stride        frames 0, s, 2s, ... (stride 4) averaged: verl-omni (verl-project/verl-omni
                                    @a1139ba, verl_omni/utils/reward_score/hpsv3_reward.py:387-408, 426-435,
                                    ``frame_interval`` 4)
                    and ``scale`` multiplies the result (verl-omni's ``reward_scale`` 0.1, hpsv3_reward.py:418,
                    433). Only the frames a reducer reads are scored (stride scores F / s of them).
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
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.rewards import Reward, build_reward, register_reward


def check_video(videos: Tensor, prompts: list[str]) -> None:
    """ValueError unless ``videos`` is (B, 3, F, H, W) with B = len(prompts)."""
    if videos.ndim != 5 or videos.shape[1] != 3 or videos.shape[0] != len(prompts):
        raise ValueError(f"videos must be (B, 3, F, H, W) with B = {len(prompts)}, got {tuple(videos.shape)}")


FRAME_REDUCERS = ("mean", "top_fraction", "stride")


@dataclass(frozen=True)
class FrameReduction:
    """A video's score from its frames' scores (module docstring): ``reducer`` names the rule, ``fraction``
    (top_fraction) and ``stride`` (stride) are its parameters, ``scale`` multiplies the result. ValueError naming
    the kwarg and its allowed range on bad values."""

    reducer: str = "mean"
    fraction: float = 0.3
    stride: int = 4
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.reducer not in FRAME_REDUCERS:
            raise ValueError(f"reducer must be one of {list(FRAME_REDUCERS)}, got {self.reducer!r}")
        if (
            isinstance(self.fraction, bool)
            or not isinstance(self.fraction, int | float)
            or not 0 < self.fraction <= 1
        ):
            raise ValueError(f"fraction must be a number in (0, 1], got {self.fraction!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, int | float) or not self.scale > 0:
            raise ValueError(f"scale must be a number > 0, got {self.scale!r}")
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or self.stride < 1:
            raise ValueError(f"stride must be an integer >= 1, got {self.stride!r}")

    def frames(self, f: int) -> list[int]:
        """The frames of an F-frame video the reducer reads (only these are scored)."""
        return list(range(0, f, self.stride)) if self.reducer == "stride" else list(range(f))

    def __call__(self, scores: Tensor) -> Tensor:
        """(B, F') scores of the frames ``frames`` chose -> (B,)."""
        if self.reducer == "top_fraction":
            # Flash-GRPO's int(l * 0.3) frames; at least one where a short clip would have none (theirs divides
            # by zero below 4 frames)
            k = max(1, int(scores.shape[1] * self.fraction))
            scores = scores.sort(dim=1, descending=True).values[:, :k]
        return scores.mean(1) * self.scale


class PerFrameReward:
    """``reward(videos (B, 3, F, H, W), prompts) -> (B,)``: an image reward over a video's frames, reduced by
    ``reduction`` (default: the mean over every frame)."""

    def __init__(
        self,
        reward: Reward,
        frame_prompts: Callable[[str], list[str]] | None = None,
        reduction: FrameReduction = FrameReduction(),
    ) -> None:
        self.reward, self.frame_prompts, self.reduction = reward, frame_prompts, reduction

    @torch.no_grad()
    def __call__(self, videos: Tensor, prompts: list[str]) -> Tensor:
        check_video(videos, prompts)
        b, _, f, h, w = videos.shape
        keep = self.reduction.frames(f)
        n = len(keep)
        frames = (
            videos[:, :, keep].permute(0, 2, 1, 3, 4).reshape(b * n, 3, h, w)
        )  # video-major: row b * n + i
        if self.frame_prompts is None:
            per_frame = [p for p in prompts for _ in range(n)]
        else:
            every = [self.frame_prompts(p) for p in prompts]
            if sum(len(q) for q in every) != b * f:
                raise ValueError(
                    f"frame_prompts gave {sum(map(len, every))} prompts for {b} videos of {f} frames"
                )
            per_frame = [q[i] for q in every for i in keep]
        return self.reduction(self.reward(frames, per_frame).cpu().view(b, n))  # the image reward's dtype


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
    reward: str = "jpeg",
    reward_kwargs: dict | None = None,
    device: torch.device | str | None = None,
    **reduction,
) -> PerFrameReward:
    """Any registered image reward (``reward``, built with ``reward_kwargs`` on ``device``) over the frames of a
    video, every frame scored against the video's prompt, reduced by ``FrameReduction(**reduction)``
    (``reducer``, ``fraction``, ``stride``, ``scale``; default the mean of every frame): the real-model path for
    video."""
    unknown = sorted(set(reduction) - set(FrameReduction.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"unknown per_frame kwarg {unknown[0]!r}; known: reward, reward_kwargs, {FRAME_KWARGS}"
        )
    how = FrameReduction(**reduction)  # before the image reward's weights load
    return PerFrameReward(build_reward(reward, device=device, **(reward_kwargs or {})), reduction=how)


FRAME_KWARGS = ", ".join(FrameReduction.__dataclass_fields__)
