"""JPEG (in)compressibility, the weight-free rewards of DDPO (Black et al. 2023, "Training Diffusion Models
with Reinforcement Learning").

reward = -(JPEG size in kB) at quality 95 for ``jpeg`` (compressibility), +size for ``jpeg_incompressibility``.
Images (B, 3, H, W) in [0, 1] are quantised to uint8 RGB before encoding, as DDPO does via PIL.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from jagg.rewards import register_reward


@torch.no_grad()
def jpeg_kilobytes(images: Tensor, quality: int = 95) -> Tensor:
    """(B,) float32: size of each image encoded as JPEG at ``quality``, in kB."""
    arr = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    arr = arr.permute(0, 2, 3, 1).numpy()  # (B, H, W, 3)
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(img)).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegReward:
    """``sign * kB``; sign = -1 rewards compressible images, +1 incompressible ones. Prompts are ignored."""

    def __init__(self, sign: float = -1.0, quality: int = 95) -> None:
        self.sign, self.quality = sign, quality

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        return self.sign * jpeg_kilobytes(images, self.quality)


@register_reward("jpeg")
def jpeg_compressibility(quality: int = 95, device: torch.device | str | None = None) -> JpegReward:
    """Smaller JPEG files score higher; PIL encodes on the CPU whatever ``device`` is."""
    return JpegReward(-1.0, quality)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95, device: torch.device | str | None = None) -> JpegReward:
    """Larger JPEG files score higher; PIL encodes on the CPU whatever ``device`` is."""
    return JpegReward(+1.0, quality)
