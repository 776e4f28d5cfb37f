"""Wan adapter (diffusers ``WanTransformer3DModel``): video latents (B, C, F, H, W), true CFG, two experts.

Follows diffusers 0.42.1 ``WanPipeline.__call__`` (src/diffusers/pipelines/wan/pipeline_wan.py, the denoising
loop):
    * the transformer patchifies the (B, C, F, H, W) latent itself (``patch_size`` (1, 2, 2)): no packing here. A
      4-D (B, C, H, W) latent is one frame (F = 1), so the image-shaped tests and tools run on it unchanged;
    * timestep = 1000 sigma in float32, the scheduler's float32 ``timesteps`` whatever the transformer's dtype
      (as ``SD3Backbone``); with ``expand_timesteps`` (Wan2.2-TI2V-5B's pipeline flag) one timestep per latent
      token, (B, F H/2 W/2), all equal for text-to-video;
    * classifier-free guidance with separate conditional and unconditional calls, ``v = u + g (c - u)``; the
      unconditional call runs without autograd (its gradient would be dropped anyway: Flow-GRPO's
      ``noise_pred_uncond.detach()``, as ``SD3Backbone``), which also keeps its activations out of memory;
    * Wan2.2-A14B is two networks: ``transformer`` (high noise) serves timesteps >= ``boundary_ratio`` x 1000,
      ``transformer_2`` (low noise) the rest, each with its own guidance scale (``guidance_scale_2``). Rows of
      one call may sit on both sides (a stacked knot forward): each expert then runs on its own rows.
      ``expert_boundaries`` declares the switch in sigma, so knots can be placed not to straddle it
      (``jagg.engine.knots.Knots``).
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from torch import Tensor

from jagg.common import NUM_TRAIN_TIMESTEPS, expert_side
from jagg.models.base import Backbone, TextCond


def tiny_wan_config(latent_channels: int = 4, **overrides) -> dict:
    """A ~38k-parameter config of the real Wan class (two blocks, 2 heads of 16; text width 32)."""
    cfg = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=latent_channels,
        out_channels=latent_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )
    cfg.update(overrides)
    return cfg


class WanBackbone(Backbone):
    """Wan transformer(s) as ``velocity(z, t)`` on (B, C, F, H, W) (or one-frame (B, C, H, W)) latents.

    ``guidance_scale`` > 1 with a negative conditioning: true CFG. ``transformer_2`` and ``boundary_ratio``:
    Wan2.2-A14B's low-noise expert and where it takes over (both or neither).
    """

    transformer_cls = WanTransformer3DModel

    def __init__(
        self,
        transformer: WanTransformer3DModel,
        guidance_scale: float = 1.0,
        *,
        transformer_2: WanTransformer3DModel | None = None,
        boundary_ratio: float | None = None,
        guidance_scale_2: float | None = None,
        expand_timesteps: bool = False,
    ) -> None:
        super().__init__(transformer)
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError(
                "a second Wan expert needs a boundary_ratio, and a boundary_ratio a second expert"
            )
        if boundary_ratio is not None and not 0 < boundary_ratio < 1:
            raise ValueError(f"boundary_ratio must lie in (0, 1), got {boundary_ratio}")
        self.transformer_2 = transformer_2
        self.boundary_ratio = boundary_ratio
        self.guidance_scale = guidance_scale
        self.guidance_scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        self.expand_timesteps = expand_timesteps

    @classmethod
    def from_config(cls, config: dict, seed: int = 0, *, boundary_ratio: float | None = None, **kwargs):
        """Random-init transformer(s) of the real class (deterministic in ``seed``); with ``boundary_ratio``, a
        second expert of the same config from ``seed + 1`` (different weights), as Wan2.2-A14B."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            high = cls.transformer_cls.from_config(config)
            low = None
            if boundary_ratio is not None:
                torch.manual_seed(seed + 1)
                low = cls.transformer_cls.from_config(config)
        return cls(high, transformer_2=low, boundary_ratio=boundary_ratio, **kwargs)

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels  # unpacked: the transformer patchifies

    @property
    def networks(self) -> tuple[WanTransformer3DModel, ...]:
        """The high-noise expert, and the low-noise one where there are two."""
        return (self.transformer,) if self.transformer_2 is None else (self.transformer, self.transformer_2)

    @property
    def expert_boundaries(self) -> tuple[float, ...]:
        """The sigmas at which the velocity switches network (sigma >= b: the high-noise side); () for one."""
        return () if self.boundary_ratio is None else (self.boundary_ratio,)

    def high_noise(self, sigma: Tensor) -> Tensor:
        """(B,) bool: rows at times ``sigma`` the first (high-noise) expert serves, by ``jagg.common.expert_side``
        (the rule the knots planner uses: ``1000 float32(sigma) >= 1000 boundary_ratio`` on the float32
        timesteps, as ``WanPipeline``); all True with one expert."""
        return expert_side(sigma, self.expert_boundaries) == len(self.expert_boundaries)

    def _call(self, model, x: Tensor, timestep: Tensor, embeds: Tensor) -> Tensor:
        if self.expand_timesteps:  # Wan2.2-TI2V: one timestep per token after the (1, 2, 2) patching
            p_t, p_h, p_w = model.config.patch_size
            tokens = (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
            timestep = timestep[:, None].expand(-1, tokens)
        return model(
            hidden_states=x,  # (B, C, F, H, W)
            timestep=timestep,  # (B,) or (B, N): 1000 sigma, float32
            encoder_hidden_states=embeds.to(x.dtype),  # (B, L, D)
            return_dict=False,
        )[0]

    def _guided(self, model, scale: float, x: Tensor, timestep: Tensor, cond: TextCond) -> Tensor:
        v = self._call(model, x, timestep, cond.embeds)
        if scale == 1 or cond.neg_embeds is None:
            return v
        with torch.no_grad():  # Flow-GRPO detaches the unconditional branch; no graph is kept for it
            uncond = self._call(model, x, timestep, cond.neg_embeds)
        return uncond + scale * (v - uncond)

    def velocity(self, z: Tensor, t: Tensor | float, cond: TextCond) -> Tensor:
        """v(z, t | cond) on (B, C, F, H, W) or (B, C, H, W); ``t`` is sigma in [0, 1] (scalar or (B,)); rows of
        ``z`` may be k times the conditioning's (the batched endpoint forward; ``Backbone.conditioning_for``)."""
        if z.ndim not in (4, 5):
            raise ValueError(f"Wan latents must be (B, C, F, H, W) or (B, C, H, W), got {tuple(z.shape)}")
        b = z.shape[0]
        cond = self.conditioning_for(b, cond)
        param = next(self.transformer.parameters())
        x = (z if z.ndim == 5 else z[:, :, None]).to(param.dtype)
        # the scheduler's float32 sigmas x 1000 in float32, bit for bit its ``timesteps``
        timestep = (torch.as_tensor(t, dtype=torch.float32, device=z.device) * NUM_TRAIN_TIMESTEPS).expand(b)
        high = self.high_noise(torch.as_tensor(t, device=z.device).expand(b))
        if bool(high.all()):
            out = self._guided(self.transformer, self.guidance_scale, x, timestep, cond)
        elif not bool(high.any()):
            out = self._guided(self.transformer_2, self.guidance_scale_2, x, timestep, cond)
        else:  # rows on both sides of the switch: each expert on its own rows, put back in place
            rows_h, rows_l = high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)
            v_h = self._guided(
                self.transformer, self.guidance_scale, x[rows_h], timestep[rows_h], cond.select(rows_h)
            )
            v_l = self._guided(
                self.transformer_2, self.guidance_scale_2, x[rows_l], timestep[rows_l], cond.select(rows_l)
            )
            out = torch.zeros(x.shape, dtype=v_h.dtype, device=v_h.device)
            out = out.index_copy(0, rows_h, v_h).index_copy(0, rows_l, v_l)
        return (out if z.ndim == 5 else out[:, :, 0]).to(z.dtype)
