"""Stable Diffusion 3 / 3.5 adapter (diffusers ``SD3Transformer2DModel``): unpacked latents, true CFG.

Follows diffusers' ``StableDiffusion3Pipeline.__call__`` and Flow-GRPO's SD3 trainer (``scripts/train_sd3.py`` :
``compute_log_prob``, yifan123/flow_grpo @ ac4c86e; docs/references.md):
    * the transformer patchifies the (B, 16, H, W) latent itself (``patch_size`` 2): no 2x2 packing here;
    * timestep = 1000 sigma in float32, as the pipeline passes the scheduler's float32 ``timesteps``
      (``timestep = t.expand(...)``) whatever the transformer's dtype: not rounded to bf16 (913.35, not 916; Flux
      and Qwen-Image do round, as their pipelines and transformers do); pooled CLIP-L + CLIP-G projection;
    * classifier-free guidance with the negative prompt in the same batch: ``v = u + g (c - u)``. Under autograd
      the unconditional half is detached, as Flow-GRPO's ``noise_pred_uncond.detach()``: the gradient flows
      through the conditional branch only (g times it). Without a negative conditioning (or g = 1), one
      conditional call.
"""

from __future__ import annotations

import torch
from diffusers import SD3Transformer2DModel
from torch import Tensor

from jagg.models.base import Backbone, TextCond


def tiny_sd3_config(latent_channels: int = 16, **overrides) -> dict:
    """A tiny config of the real SD3 class (two joint blocks, 2 heads of 16; text width 32)."""
    cfg = dict(
        sample_size=32,
        patch_size=2,
        in_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        out_channels=latent_channels,
        pos_embed_max_size=16,
    )
    cfg.update(overrides)
    return cfg


class SD3Backbone(Backbone):
    """SD3 transformer as ``velocity(z, t)``; ``guidance_scale`` > 1 with a negative conditioning: true CFG."""

    transformer_cls = SD3Transformer2DModel

    def __init__(self, transformer: SD3Transformer2DModel, guidance_scale: float = 1.0) -> None:
        super().__init__(transformer)
        self.guidance_scale = guidance_scale

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels  # unpacked: the transformer patchifies

    def _call(self, z: Tensor, timestep: Tensor, embeds: Tensor, pooled: Tensor) -> Tensor:
        return self.transformer(
            hidden_states=z,  # (B, C, H, W)
            encoder_hidden_states=embeds.to(z.dtype),  # (B, L, D)
            pooled_projections=pooled.to(z.dtype),  # (B, P)
            timestep=timestep,  # (B,) 1000 sigma, float32
            return_dict=False,
        )[0]

    def velocity(self, z: Tensor, t: Tensor | float, cond: TextCond) -> Tensor:
        """v(z, t | cond) on (B, C, H, W); ``t`` is sigma in [0, 1] (scalar or (B,)); rows of ``z`` may be k
        times the conditioning's (the batched endpoint forward; ``Backbone.conditioning_for``)."""
        b = z.shape[0]
        cond = self.conditioning_for(b, cond)
        param = next(self.transformer.parameters())
        x = z.to(param.dtype)
        # the scheduler's float32 sigmas x 1000 in float32, bit for bit its ``timesteps``
        timestep = (torch.as_tensor(t, dtype=torch.float32, device=z.device) * 1000).expand(b)
        pooled = cond.pooled if cond.pooled is not None else cond.embeds.mean(dim=1)
        if self.guidance_scale == 1 or cond.neg_embeds is None:
            return self._call(x, timestep, cond.embeds, pooled).to(z.dtype)
        neg_pooled = cond.neg_pooled if cond.neg_pooled is not None else cond.neg_embeds.mean(dim=1)
        if cond.neg_embeds.shape[1] != cond.embeds.shape[1]:
            raise ValueError("SD3 CFG: the negative and positive embeddings must have the same length")
        out = self._call(
            torch.cat([x, x]),
            torch.cat([timestep, timestep]),
            torch.cat([cond.neg_embeds, cond.embeds]),
            torch.cat([neg_pooled, pooled]),
        )
        uncond, text = out.chunk(2)
        uncond = uncond.detach()  # Flow-GRPO: no gradient through the unconditional branch
        return (uncond + self.guidance_scale * (text - uncond)).to(z.dtype)
