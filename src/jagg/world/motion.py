"""A non-learned motion judge for the video world: read the object's path from the clip's own geometry.

No weights, eval-only (rewards ``motion_geom`` and ``video_geom``), like the image world's ``attr_geom``
(``jagg.world.geometry``), whose colour and shape rules it applies to a clip (B, 3, F, H, W):

    colour    one per clip: ``geometry.palette_coverage`` on every pixel of every frame (the background is the
              clip's median, the object's colour the palette colour explaining the most pixel energy)
    coverage  that colour's alpha per pixel and frame; alpha < ``MIN_ALPHA`` counts as 0; a frame with no
              coverage left means no object is followed (motion None)
    path      the coverage centroid of each frame, in fractions of the side
    motion    the least-squares line through the centroids against the frame index gives the travel
              (slope x (F - 1)); the motion is the world's direction (``video.DIRECTIONS``) closest in angle to
              it when the travel is at least ``MIN_TRAVEL`` of the side, within ``MAX_ANGLE`` degrees of that
              direction, and no frame-to-frame step goes back along it by more than ``MAX_BACKSTEP`` (a clip
              whose frames are shuffled does not move the way it travels); else None (standing still,
              off-axis or jumping back and forth)
    shape     the harmonics of the coverage (``geometry.harmonics``) averaged over frames, with the image
              judge's thresholds

A clean clip travels 0.44 of the side (0.36 to 0.52 with the position jitter), at most 13 degrees off its
axis, monotonically: the margins to the thresholds are wide (``tests/test_video_world.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from jagg.world.geometry import H3_TRIANGLE, H4_SQUARE, MIN_ALPHA, SHAPES_READ, harmonics, palette_coverage
from jagg.world.scene import PALETTE
from jagg.world.video import DIRECTIONS, VideoWorld

MIN_TRAVEL = 0.2  # fraction of the side: less is standing still (a clean clip travels 0.36-0.52)
MAX_ANGLE = 30.0  # degrees between the travel and the direction it is read as (a clean clip: < 13)
MAX_BACKSTEP = 0.03  # fraction of the side a frame step may go back along the direction (half a pixel at 16)


class ClipReading(NamedTuple):
    """What the judge reads from one clip; ``motion`` is None where the clip shows no clear motion."""

    color: str
    shape: str
    motion: str | None


def read_clips(clips: Tensor, world: VideoWorld) -> list[ClipReading | None]:
    """Per clip (B, 3, F, H, W) in [0, 1]: colour, shape and motion its pixels show (None: no object found).
    Rules in the module docstring; tensor arithmetic on CPU, no weights."""
    if clips.ndim != 5 or clips.shape[1] != 3:
        raise ValueError(f"clips must be (B, 3, F, H, W), got {tuple(clips.shape)}")
    if set(world.config.image.shapes) - set(SHAPES_READ):
        raise ValueError(
            f"the motion judge reads shapes {SHAPES_READ}, the world has {world.config.image.shapes}"
        )
    names = list(world.config.image.colors)
    ref = torch.tensor([PALETTE[c] for c in names], dtype=torch.float32)  # (K, 3)
    x = clips.detach().float().cpu().clamp(0, 1)
    _, _, f, h, w = x.shape
    out: list[ClipReading | None] = []
    for clip in x:
        alphas, explained = palette_coverage(clip.permute(1, 2, 3, 0).reshape(-1, 3), ref)
        k = int(explained.argmax())
        alpha = alphas[:, k].reshape(f, h, w)
        alpha = torch.where(alpha < MIN_ALPHA, torch.zeros_like(alpha), alpha)
        covered = alpha.sum((1, 2)) > 0  # (F,)
        if explained[k] <= 0 or not bool(covered.any()):  # nothing departs from the background
            out.append(None)
            continue
        reads = [harmonics(a) for a in alpha[covered]]  # (cx, cy, h3, h4) per covered frame
        h3, h4 = (sum(r[i] for r in reads) / len(reads) for i in (2, 3))
        shape = "triangle" if h3 > H3_TRIANGLE else "square" if h4 > H4_SQUARE else "circle"
        motion = None
        if bool(covered.all()):  # a frame without the object leaves no path to follow
            path = torch.tensor([(cx / w, cy / h) for cx, cy, _, _ in reads], dtype=torch.float64)  # (F, 2)
            motion = read_motion(path, world.config.motions)
        out.append(ClipReading(names[k], shape, motion))
    return out


def read_motion(path: Tensor, motions: tuple[str, ...]) -> str | None:
    """Which of ``motions`` a centroid path (F, 2) (fractions of the side, x right, y down) shows, or None."""
    f = path.shape[0]
    t = torch.arange(f, dtype=path.dtype) - (f - 1) / 2
    travel = (
        (t[:, None] * (path - path.mean(0))).sum(0) / (t * t).sum() * (f - 1)
    )  # least-squares slope x (F-1)
    length = float(travel.norm())
    if length < MIN_TRAVEL:
        return None
    unit = {m: torch.tensor(DIRECTIONS[m], dtype=path.dtype) for m in motions}
    best = max(unit, key=lambda m: float(travel @ unit[m]))
    if float(travel @ unit[best]) / length < math.cos(math.radians(MAX_ANGLE)):
        return None
    steps = (path[1:] - path[:-1]) @ unit[best]  # (F - 1,) progress along the direction per frame
    return best if float(steps.min()) >= -MAX_BACKSTEP else None


def motion_match(clips: Tensor, prompts: list[str], world: VideoWorld) -> Tensor:
    """(B,) float32: 1 where the clip's read motion is the prompt's, else 0 (colour and shape not asked)."""
    read = read_clips(clips, world)
    return torch.tensor(
        [
            float(r is not None and r.motion == world.parse(p).motion)
            for r, p in zip(read, prompts, strict=True)
        ]
    )


def clip_match(clips: Tensor, prompts: list[str], world: VideoWorld) -> Tensor:
    """(B,) float32: 1 where colour, shape and motion read from the clip all equal the prompt's, else 0."""
    read = read_clips(clips, world)
    return torch.tensor([float(r == world.parse(p)) for r, p in zip(read, prompts, strict=True)])
