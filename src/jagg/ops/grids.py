"""Sample grids: (B, 3, H, W) images in [0, 1] -> one PNG, and where each image lands in it.

``grid_cell`` and the ``GRID_*`` constants are the one geometry shared by ``save_grid`` and by reports that
draw on a saved grid (``experiments/world_rl_report.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

GRID_COLS, GRID_PAD, GRID_ZOOM = 8, 2, 4  # save_grid layout: images per row, padding px, nearest upscaling


def grid_cell(i: int, h: int, w: int, ncol: int = GRID_COLS) -> tuple[int, int]:
    """Top-left (y, x) of image ``i`` (h x w) in a ``save_grid`` canvas, before the zoom."""
    r, q = divmod(i, ncol)
    return r * (h + GRID_PAD) + 1, q * (w + GRID_PAD) + 1


def save_grid(images: Tensor, path: Path, nrow: int = GRID_COLS) -> None:
    """Save (B, 3, H, W) images (or (B, 3, F, H, W) videos, frames side by side) in [0, 1] as one PNG grid
    (GRID_PAD px padding, GRID_ZOOM x nearest zoom)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid_array(images, nrow)).save(path)


def grid_array(images: Tensor, nrow: int = GRID_COLS) -> np.ndarray:
    """The ``save_grid`` picture of (B, 3, H, W) images in [0, 1] as an (H', W', 3) uint8 array (the trackers
    log it as the sample grid). A video (B, 3, F, H, W) is one cell per video, its frames side by side."""
    from PIL import Image

    if images.ndim == 5:
        b, c, f, h, w = images.shape
        images = images.permute(0, 1, 3, 2, 4).reshape(b, c, h, f * w)
    b, c, h, w = images.shape
    ncol = min(nrow, b)
    nrows = math.ceil(b / ncol)
    grid = torch.ones(c, nrows * (h + GRID_PAD), ncol * (w + GRID_PAD))
    for i in range(b):
        y, x = grid_cell(i, h, w, ncol)
        grid[:, y : y + h, x : x + w] = images[i]
    arr = (grid.permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    z = GRID_ZOOM
    return np.asarray(Image.fromarray(arr).resize((arr.shape[1] * z, arr.shape[0] * z), Image.NEAREST))
