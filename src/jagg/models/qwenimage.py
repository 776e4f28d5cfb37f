"""Qwen-Image adapter (diffusers ``QwenImageTransformer2DModel``): packed latents, text masks,
``img_shapes`` and true classifier-free guidance with norm rescaling.

Follows diffusers' ``QwenImagePipeline``: timestep = sigma; with ``true_cfg_scale > 1`` and a negative prompt,
v = v_neg + s (v_cond - v_neg), rescaled per token to the norm of v_cond.
"""

from __future__ import annotations

import torch
from diffusers import QwenImageTransformer2DModel
from torch import Tensor

from jagg.models.base import Backbone, TextCond


def tiny_qwenimage_config(latent_channels: int = 16, **overrides) -> dict:
    """A ~100k-parameter config of the real Qwen-Image class (docs/decisions.md)."""
    cfg = dict(
        patch_size=2,
        in_channels=4 * latent_channels,
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    cfg.update(overrides)
    return cfg


class QwenImageBackbone(Backbone):
    """Qwen-Image transformer as ``velocity(z, t)``; true CFG when ``true_cfg_scale > 1``."""

    transformer_cls = QwenImageTransformer2DModel

    def __init__(self, transformer: QwenImageTransformer2DModel, true_cfg_scale: float = 1.0) -> None:
        super().__init__(transformer)
        self.true_cfg_scale = true_cfg_scale

    def _run(self, tokens: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor | None, h: int, w: int):
        b = tokens.shape[0]
        if mask is None:
            mask = torch.ones(embeds.shape[:2], device=tokens.device, dtype=torch.long)
        return self.transformer(
            hidden_states=tokens,  # (B, N, 4C)
            encoder_hidden_states=embeds.to(tokens.dtype),  # (B, L, D)
            encoder_hidden_states_mask=mask,  # (B, L)
            timestep=timestep,  # (B,) sigma in [0, 1]
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]

    def _forward_tokens(self, tokens: Tensor, timestep: Tensor, cond: TextCond, h: int, w: int) -> Tensor:
        v = self._run(tokens, timestep, cond.embeds, cond.mask, h, w)
        if self.true_cfg_scale <= 1 or cond.neg_embeds is None:
            return v
        v_neg = self._run(tokens, timestep, cond.neg_embeds, cond.neg_mask, h, w)
        comb = v_neg + self.true_cfg_scale * (v - v_neg)
        # Rescale each token's prediction to the conditional norm (QwenImagePipeline).
        return comb * (v.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
