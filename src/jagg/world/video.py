"""The moving-shapes video world: the image world's objects moving along the path the prompt names.

A prompt names one object and a direction, e.g. "a red circle moving right" or "a blue triangle moving up".
The object travels in a straight line between two of the image world's named positions (``scene.POSITIONS``):

    right  left -> right        left   right -> left        up  bottom -> top        down  top -> bottom

A clip is ``frames`` frames (default 4) at the image world's size (16x16), laid out as video tensors are
here and in diffusers' Wan VAE output, (B, 3, F, H, W) in [0, 1]. Frame f puts the object's centre at
``start + (end - start) f / (F - 1)``; start and end each get the image world's position jitter, and the
colour, size, rotation and background of a clip are drawn once (the object keeps its looks while it moves).
Each object is drawn by the image world's anti-aliased mask (``scene._alpha_mask``), so one frame of a clip is
an image of the image world's kind. Deterministic in the seed (numpy ``default_rng(seed)``, as ``World.render``).

Held-out split: the combinations with (colour + shape + motion) index sum divisible by 6 (12 of 72), as the image
world's: every colour-shape, colour-motion and shape-motion pair still occurs in training.

``frame_prompts`` maps a video prompt to the image-world prompt of each frame (the named position nearest the
object's path at that frame), which is how the per-frame image rewards score a clip of this world
(``jagg.world.video_rewards``). The world has its own text encoder, preference model and tiny Wan
(``jagg.world.pretrained.VIDEO_ARTEFACTS``); the image world's artefacts are untouched by it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from jagg.world.scene import BACKGROUND, PALETTE, POSITIONS, WorldConfig, _alpha_mask, prompt_of

# direction word -> (start, end) named positions of scene.POSITIONS
MOTIONS: dict[str, tuple[str, str]] = {
    "right": ("left", "right"),
    "left": ("right", "left"),
    "up": ("bottom", "top"),
    "down": ("top", "bottom"),
}
# unit direction (x right, y down, image convention) of each motion word
DIRECTIONS: dict[str, tuple[float, float]] = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
_PROMPT_RE = re.compile(r"^an? (\w+) (\w+) moving (\w+)$")


class VideoAttributes(NamedTuple):
    """What one clip shows."""

    color: str
    shape: str
    motion: str


@dataclass(frozen=True)
class VideoWorldConfig:
    """Frames and motions of a clip; colours, shapes, size and jitter are the image world's (``image``)."""

    frames: int = 4
    motions: tuple[str, ...] = ("right", "left", "up", "down")
    image: WorldConfig = field(default_factory=WorldConfig)

    def __post_init__(self) -> None:
        if self.frames < 2:
            raise ValueError(f"frames must be >= 2 (a clip that moves), got {self.frames}")
        unknown = [m for m in self.motions if m not in MOTIONS]
        if unknown:
            raise ValueError(f"unknown motions {unknown}; known: {sorted(MOTIONS)}")
        missing = {p for m in self.motions for p in MOTIONS[m]} - set(self.image.positions)
        if missing:
            raise ValueError(f"motions need the positions {sorted(missing)} in the image world")


def video_prompt_of(color: str, shape: str, motion: str) -> str:
    """The canonical prompt: "a red circle moving right", "an orange square moving up"."""
    article = "an" if color[0] in "aeiou" else "a"
    return f"{article} {color} {shape} moving {motion}"


class VideoWorld:
    """Prompts, parsing, deterministic clip rendering and the pixel-space latent codec of the video world."""

    def __init__(self, config: VideoWorldConfig | None = None) -> None:
        self.config = config or VideoWorldConfig()
        c, ic = self.config, self.config.image
        self.size, self.frames, self.latent_channels = ic.size, c.frames, 3
        combos = [
            (ci, si, mi)
            for ci in range(len(ic.colors))
            for si in range(len(ic.shapes))
            for mi in range(len(c.motions))
        ]
        self.prompts = [video_prompt_of(ic.colors[ci], ic.shapes[si], c.motions[mi]) for ci, si, mi in combos]
        held = [(ci + si + mi) % ic.heldout_mod == 0 for ci, si, mi in combos]
        self.heldout_prompts = [p for p, h in zip(self.prompts, held, strict=True) if h]
        self.train_prompts = [p for p, h in zip(self.prompts, held, strict=True) if not h]
        self.prompt_index = {p: i for i, p in enumerate(self.prompts)}
        self.words = sorted({w for p in self.prompts for w in p.split()})

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, H, W) of one clip's latent (pixel space)."""
        return (self.latent_channels, self.frames, self.size, self.size)

    # ------------------------------------------------------------------ prompts
    def parse(self, prompt: str) -> VideoAttributes:
        """ "a red circle moving right" -> VideoAttributes("red", "circle", "right"); ValueError if not here."""
        m = _PROMPT_RE.match(prompt.strip().lower())
        c, ic = self.config, self.config.image
        if not m or m.group(1) not in ic.colors or m.group(2) not in ic.shapes or m.group(3) not in c.motions:
            raise ValueError(
                f"prompt {prompt!r} is not in the video world; expected 'a(n) <colour> <shape> moving "
                f"<motion>' with colours {ic.colors}, shapes {ic.shapes}, motions {c.motions}"
            )
        return VideoAttributes(m.group(1), m.group(2), m.group(3))

    def path(self, motion: str) -> list[tuple[float, float]]:
        """The object's centre (x, y), fractions of the side, at each frame of an unjittered clip."""
        (x0, y0), (x1, y1) = (POSITIONS[p] for p in MOTIONS[motion])
        n = self.frames - 1
        return [(x0 + (x1 - x0) * f / n, y0 + (y1 - y0) * f / n) for f in range(self.frames)]

    def frame_prompts(self, prompt: str) -> list[str]:
        """The image-world prompt of each frame: the named position nearest the path's point at that frame.

        With an even number of frames no path point is equidistant from two positions; with an odd number the
        middle frame sits at the centre, equidistant from all four, and the first of the world's positions
        nearest it is taken (ties go to ``image.positions`` order)."""
        a = self.parse(prompt)
        positions = self.config.image.positions
        return [
            prompt_of(
                a.color,
                a.shape,
                min(positions, key=lambda p: math.hypot(POSITIONS[p][0] - x, POSITIONS[p][1] - y)),
            )
            for x, y in self.path(a.motion)
        ]

    # ------------------------------------------------------------------ rendering
    def render(self, prompts: list[str], seed: int) -> Tensor:
        """(B, 3, F, H, W) float32 in [0, 1]; a pure function of (prompts, seed)."""
        return self.render_attributes([self.parse(p) for p in prompts], np.random.default_rng(seed))[0]

    def render_attributes(
        self, attrs: list[VideoAttributes | None], rng: np.random.Generator, still: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Render explicit attributes (None = empty clip) with jitter drawn from ``rng``; ``still`` keeps each
        object at its start point in every frame (the "no motion" clip of the preference pairs).

        Returns clips (B, 3, F, H, W), alpha masks (B, 1, F, H, W) and backgrounds (B, 3, 1, 1, 1). Per clip the
        draws are, in order: background (3), jitter (6: start dx dy, end dx dy, scale, angle), colour (3).
        """
        ic, s, n = self.config.image, self.size, self.frames
        clips, alphas, bgs = [], [], []
        for a in attrs:
            bg = np.asarray(BACKGROUND, np.float32) + rng.uniform(-0.03, 0.03, 3).astype(np.float32)
            jit = rng.uniform(-1.0, 1.0, 6)
            col_jit = rng.uniform(-ic.jitter_color, ic.jitter_color, 3).astype(np.float32)
            if a is None:
                alpha = np.zeros((n, s, s), np.float32)
                col = bg
            else:
                (x0, y0), (x1, y1) = (POSITIONS[p] for p in MOTIONS[a.motion])
                x0, y0 = x0 + ic.jitter_pos * jit[0], y0 + ic.jitter_pos * jit[1]
                x1, y1 = x1 + ic.jitter_pos * jit[2], y1 + ic.jitter_pos * jit[3]
                if still:
                    x1, y1 = x0, y0
                r = ic.radius * s * (1 + ic.jitter_scale * jit[4])
                angle = ic.jitter_angle * jit[5]
                alpha = np.stack(
                    [
                        _alpha_mask(
                            a.shape,
                            (x0 + (x1 - x0) * f / (n - 1)) * s,
                            (y0 + (y1 - y0) * f / (n - 1)) * s,
                            r,
                            angle,
                            s,
                        )
                        for f in range(n)
                    ]
                )
                col = np.clip(np.asarray(PALETTE[a.color], np.float32) + col_jit, 0, 1)
            alpha_t = torch.from_numpy(alpha)[None]  # (1, F, H, W)
            bg_t = torch.from_numpy(bg).view(3, 1, 1, 1)
            clips.append(bg_t * (1 - alpha_t) + torch.from_numpy(col).view(3, 1, 1, 1) * alpha_t)
            alphas.append(alpha_t)
            bgs.append(bg_t)
        return torch.stack(clips), torch.stack(alphas), torch.stack(bgs)

    # ------------------------------------------------------------------ latent codec (pixel space)
    def encode(self, clips: Tensor) -> Tensor:
        """Clips in [0, 1] -> latents 2x - 1 in [-1, 1], (B, 3, F, H, W)."""
        return clips * 2 - 1

    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> clips clamp((z + 1) / 2, 0, 1), (B, 3, F, H, W)."""
        return ((latents + 1) / 2).clamp(0, 1)
