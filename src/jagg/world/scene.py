"""The procedural compositional world: colours x shapes x positions, rendered with PIL.

A prompt names one object, e.g. "a red circle on the left" or "a blue triangle at the top". Renders are
drawn as an anti-aliased alpha mask (PIL at 4x supersampling, box-downsampled) and composited over a dark
background in torch, with small random jitter in position, size, rotation and colour. The true contents
of every image are known, which is what makes GenEval-style exact attribute checks possible
(GenEval, Ghosh et al. 2023, checks generated objects by rules; here the true contents are known exactly).

The generators work in pixel space: ``encode(images) = 2 * images - 1`` gives (B, 3, H, W) latents in
[-1, 1]; H and W are even so the Flux / Qwen-Image 2x2 packing applies directly.

Held-out split: the combinations with (colour + shape + position) index sum divisible by 6 (12 of 72 by
default). Every colour-shape, colour-position and shape-position pair still occurs in training, so held-out
prompts test composition, not unseen words.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

# RGB in [0, 1]; chosen to stay distinguishable at 16x16 on a dark background.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.86, 0.16, 0.16),
    "green": (0.16, 0.71, 0.24),
    "blue": (0.20, 0.35, 0.92),
    "yellow": (0.94, 0.86, 0.16),
    "purple": (0.62, 0.24, 0.80),
    "orange": (0.98, 0.55, 0.08),
    "white": (0.95, 0.95, 0.95),
    "pink": (0.98, 0.55, 0.75),
}
# Object centre (x, y) as fractions of the image side.
POSITIONS: dict[str, tuple[float, float]] = {
    "left": (0.28, 0.5),
    "right": (0.72, 0.5),
    "top": (0.5, 0.28),
    "bottom": (0.5, 0.72),
}
SHAPES = ("circle", "square", "triangle", "diamond")
BACKGROUND = (0.12, 0.12, 0.13)
_PROMPT_RE = re.compile(r"^an? (\w+) (\w+) (?:on|at) the (\w+)$")


class Attributes(NamedTuple):
    """What one image shows."""

    color: str
    shape: str
    position: str


@dataclass(frozen=True)
class WorldConfig:
    """Vocabulary and rendering parameters. The default is 6 colours x 3 shapes x 4 positions at 16x16."""

    size: int = 16
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
    shapes: tuple[str, ...] = ("circle", "square", "triangle")
    positions: tuple[str, ...] = ("left", "right", "top", "bottom")
    radius: float = 0.2  # object radius as a fraction of the side
    jitter_pos: float = 0.04  # max centre shift, fraction of the side
    jitter_scale: float = 0.1  # radius multiplied by U(1 - j, 1 + j)
    jitter_angle: float = 12.0  # degrees, squares / triangles / diamonds
    jitter_color: float = 0.05  # per-channel uniform colour jitter
    heldout_mod: int = 6  # held-out: (ci + si + pi) % heldout_mod == 0

    def __post_init__(self) -> None:
        if self.size % 2 or self.size < 8:
            raise ValueError(f"size must be even and >= 8 (2x2 packing), got {self.size}")
        for name, values, known in (
            ("colors", self.colors, PALETTE),
            ("shapes", self.shapes, SHAPES),
            ("positions", self.positions, POSITIONS),
        ):
            unknown = [v for v in values if v not in known]
            if unknown:
                raise ValueError(f"unknown {name} {unknown}; known: {sorted(known)}")


def prompt_of(color: str, shape: str, position: str) -> str:
    """The canonical prompt: "a red circle on the left", "an orange square at the top"."""
    article = "an" if color[0] in "aeiou" else "a"
    prep = "on" if position in ("left", "right") else "at"
    return f"{article} {color} {shape} {prep} the {position}"


def _alpha_mask(
    shape: str, cx: float, cy: float, r: float, angle: float, size: int, ss: int = 4
) -> np.ndarray:
    """Anti-aliased coverage (H, W) in [0, 1] of one shape; coordinates in output pixels."""
    img = Image.new("L", (size * ss, size * ss), 0)
    draw = ImageDraw.Draw(img)
    cx, cy, r = cx * ss, cy * ss, r * ss
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    else:
        # Regular polygons: (vertices, radius factor giving a similar area, base angle in degrees).
        n, k, base = {"square": (4, 1.2, 45.0), "triangle": (3, 1.35, -90.0), "diamond": (4, 1.25, 0.0)}[
            shape
        ]
        pts = []
        for i in range(n):
            a = math.radians(base + angle + 360.0 * i / n)
            rx = r * k * (0.75 if shape == "diamond" and i % 2 == 0 else 1.0)
            pts.append((cx + rx * math.cos(a), cy + r * k * math.sin(a)))
        draw.polygon(pts, fill=255)
    img = img.resize((size, size), Image.BOX)
    return np.asarray(img, dtype=np.float32) / 255.0


class World:
    """Prompts, attribute parsing, deterministic rendering and the pixel-space latent codec."""

    def __init__(self, config: WorldConfig | None = None) -> None:
        self.config = config or WorldConfig()
        c = self.config
        self.size = c.size
        self.latent_channels = 3
        combos = [
            (ci, si, pi)
            for ci in range(len(c.colors))
            for si in range(len(c.shapes))
            for pi in range(len(c.positions))
        ]
        self.prompts = [prompt_of(c.colors[ci], c.shapes[si], c.positions[pi]) for ci, si, pi in combos]
        held = [(ci + si + pi) % c.heldout_mod == 0 for ci, si, pi in combos]
        self.heldout_prompts = [p for p, h in zip(self.prompts, held, strict=True) if h]
        self.train_prompts = [p for p, h in zip(self.prompts, held, strict=True) if not h]
        self.prompt_index = {p: i for i, p in enumerate(self.prompts)}
        self.words = sorted({w for p in self.prompts for w in p.split()})

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one sample's latent (pixel space)."""
        return (self.latent_channels, self.size, self.size)

    # ------------------------------------------------------------------ attributes
    @property
    def num_classes(self) -> tuple[int, int, int]:
        """Number of colours, shapes and positions (the heads of the attribute classifier)."""
        c = self.config
        return len(c.colors), len(c.shapes), len(c.positions)

    def parse(self, prompt: str) -> Attributes:
        """ "a red circle on the left" -> Attributes("red", "circle", "left"); ValueError if not in the world."""
        m = _PROMPT_RE.match(prompt.strip().lower())
        c = self.config
        if not m or m.group(1) not in c.colors or m.group(2) not in c.shapes or m.group(3) not in c.positions:
            raise ValueError(
                f"prompt {prompt!r} is not in this world; expected 'a(n) <colour> <shape> on/at the <position>' "
                f"with colours {c.colors}, shapes {c.shapes}, positions {c.positions}"
            )
        return Attributes(m.group(1), m.group(2), m.group(3))

    def labels(self, prompts: list[str]) -> Tensor:
        """(B, 3) long: colour, shape and position indices of each prompt."""
        c = self.config
        rows = []
        for p in prompts:
            a = self.parse(p)
            rows.append([c.colors.index(a.color), c.shapes.index(a.shape), c.positions.index(a.position)])
        return torch.tensor(rows, dtype=torch.long)

    # ------------------------------------------------------------------ rendering
    def render(self, prompts: list[str], seed: int) -> Tensor:
        """(B, 3, H, W) float32 in [0, 1]; a pure function of (prompts, seed)."""
        return self.render_attributes([self.parse(p) for p in prompts], np.random.default_rng(seed))[0]

    def render_attributes(
        self, attrs: list[Attributes | None], rng: np.random.Generator
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Render explicit attributes (None = empty scene) with jitter drawn from ``rng``.

        Returns images (B, 3, H, W), alpha masks (B, 1, H, W) and backgrounds (B, 3, 1, 1), so callers
        can composite variants (e.g. noisy backgrounds) over the same object.
        """
        c, s = self.config, self.size
        images, alphas, bgs = [], [], []
        for a in attrs:
            bg = np.asarray(BACKGROUND, np.float32) + rng.uniform(-0.03, 0.03, 3).astype(np.float32)
            jit = rng.uniform(-1.0, 1.0, 5)  # dx, dy, scale, angle, (colour below)
            col_jit = rng.uniform(-c.jitter_color, c.jitter_color, 3).astype(np.float32)
            if a is None:
                alpha = np.zeros((s, s), np.float32)
                col = bg
            else:
                fx, fy = POSITIONS[a.position]
                cx = (fx + c.jitter_pos * jit[0]) * s
                cy = (fy + c.jitter_pos * jit[1]) * s
                r = c.radius * s * (1 + c.jitter_scale * jit[2])
                alpha = _alpha_mask(a.shape, cx, cy, r, c.jitter_angle * jit[3], s)
                col = np.clip(np.asarray(PALETTE[a.color], np.float32) + col_jit, 0, 1)
            alpha_t = torch.from_numpy(alpha)[None]  # (1, H, W)
            bg_t = torch.from_numpy(bg).view(3, 1, 1)
            images.append(bg_t * (1 - alpha_t) + torch.from_numpy(col).view(3, 1, 1) * alpha_t)
            alphas.append(alpha_t)
            bgs.append(bg_t)
        return torch.stack(images), torch.stack(alphas), torch.stack(bgs)

    # ------------------------------------------------------------------ latent codec (pixel space)
    def encode(self, images: Tensor) -> Tensor:
        """Images in [0, 1] -> latents 2x - 1 in [-1, 1], (B, 3, H, W)."""
        return images * 2 - 1

    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images clamp((z + 1) / 2, 0, 1), (B, 3, H, W)."""
        return ((latents + 1) / 2).clamp(0, 1)
