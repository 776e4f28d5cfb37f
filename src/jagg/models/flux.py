"""Flux adapter (diffusers ``FluxTransformer2DModel``): 2x2-packed latents, img/txt ids, embedded guidance.

Follows the conditioning of diffusers' ``FluxPipeline``: timestep = sigma, ``guidance`` a per-sample
tensor (FLUX.1-dev is guidance-distilled; 3.5 in DanceGRPO / Flow-GRPO), txt_ids all zeros, img_ids the
(0, row, col) grid of the packed latent.
"""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel
from torch import Tensor

from jagg.models.base import Backbone, TextCond


def flux_image_ids(h2: int, w2: int, device, dtype) -> Tensor:
    """(h2 * w2, 3) positional ids (0, row, col) of the packed image tokens."""
    ids = torch.zeros(h2, w2, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h2, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w2, device=device, dtype=dtype)[None, :]
    return ids.reshape(h2 * w2, 3)


def tiny_flux_config(latent_channels: int = 16, **overrides) -> dict:
    """A ~100k-parameter config of the real Flux class (docs/decisions.md)."""
    cfg = dict(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    cfg.update(overrides)
    return cfg


class FluxBackbone(Backbone):
    """Flux transformer as ``velocity(z, t)``; ``guidance_scale`` is the embedded (distilled) guidance."""

    transformer_cls = FluxTransformer2DModel

    def __init__(self, transformer: FluxTransformer2DModel, guidance_scale: float = 3.5) -> None:
        super().__init__(transformer)
        self.guidance_scale = guidance_scale

    def _forward_tokens(self, tokens: Tensor, timestep: Tensor, cond: TextCond, h: int, w: int) -> Tensor:
        b, dtype = tokens.shape[0], tokens.dtype
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=tokens.device, dtype=dtype)
        pooled = cond.pooled
        if pooled is None:  # the world's text tower has no separate pooled vector: use the token mean
            pooled = cond.embeds.mean(dim=1)
        return self.transformer(
            hidden_states=tokens,  # (B, N, 4C)
            encoder_hidden_states=cond.embeds.to(dtype),  # (B, L, D)
            pooled_projections=pooled.to(dtype),  # (B, P)
            timestep=timestep,  # (B,) sigma in [0, 1]
            img_ids=flux_image_ids(h // 2, w // 2, tokens.device, dtype),
            txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=tokens.device, dtype=dtype),
            guidance=guidance,
            return_dict=False,
        )[0]
