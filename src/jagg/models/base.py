"""Shared pieces of the backbone adapters: text conditioning, 2x2 latent packing, the adapter base, and
``Components``, what a model source (the world, tiny, pretrained weights) hands to the training loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor, nn


@dataclass
class TextCond:
    """Encoded prompts for a batch. Fields a backbone does not use stay None.

    embeds: (B, L, D) token embeddings (T5 for Flux, Qwen2.5-VL for Qwen-Image, the world's text tower).
    mask:   (B, L) 1 for real tokens (Qwen-Image attends with it).
    pooled: (B, P) pooled embedding (Flux's CLIP-L vector).
    neg_embeds / neg_mask / neg_pooled: the negative prompt for true classifier-free guidance (Qwen-Image;
    SD3 also uses its pooled vector).
    """

    embeds: Tensor
    mask: Tensor | None = None
    pooled: Tensor | None = None
    neg_embeds: Tensor | None = None
    neg_mask: Tensor | None = None
    neg_pooled: Tensor | None = None

    def _map(self, fn) -> TextCond:
        return replace(
            self,
            **{f.name: fn(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None},
        )

    def select(self, idx) -> TextCond:
        """Rows ``idx`` of every field (an index tensor, list or slice)."""
        return self._map(lambda t: t[idx])

    def to(self, device=None, dtype=None) -> TextCond:
        """Move to ``device``; cast floating fields to ``dtype`` (masks keep their dtype)."""
        return self._map(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else None))

    def tile(self, k: int) -> TextCond:
        """Every field stacked ``k`` times along the batch: rows [cond; cond; ...] (k * B rows)."""
        return self if k == 1 else self._map(lambda t: torch.cat([t] * k))

    @property
    def batch_size(self) -> int:
        return self.embeds.shape[0]


def pack_2x2(z: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): the 2x2 patch packing of the Flux / Qwen-Image pipelines."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (B, H/2, W/2, C, 2, 2)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: Tensor, height: int, width: int) -> Tensor:
    """(B, H/2 * W/2, 4C) -> (B, C, H, W); inverse of ``pack_2x2``."""
    b, _, d = tokens.shape
    c = d // 4
    z = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)  # (B, C, H/2, 2, W/2, 2)
    return z.reshape(b, c, height, width)


class Backbone(nn.Module):
    """A diffusers transformer seen as a velocity field v(z, t | cond) on (B, C, H, W) latents.

    Subclasses implement ``_forward_tokens(tokens, t, cond, h, w)`` on packed tokens.
    """

    transformer_cls: type[nn.Module]

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    @classmethod
    def from_config(cls, config: dict, seed: int = 0) -> Backbone:
        """Random-init transformer of the real class from a config dict (deterministic in ``seed``)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(cls.transformer_cls.from_config(config))

    @property
    def latent_channels(self) -> int:
        """Channels C of the unpacked latent the model predicts."""
        return self.transformer.config.in_channels // 4

    @property
    def networks(self) -> tuple[nn.Module, ...]:
        """The transformers the velocity is made of, each adapted, checkpointed and sharded alike
        (``jagg.scale.placement``): this one; Wan2.2-A14B's two experts (``WanBackbone``)."""
        return (self.transformer,)

    def velocity(self, z: Tensor, t: Tensor | float, cond: TextCond) -> Tensor:
        """Model output v(z, t | cond) in z's layout (B, C, H, W). ``t`` is sigma in [0, 1], scalar or (B,).

        ``z`` may hold k * B rows for a conditioning of B rows (the batched JAGG endpoint forward stacks
        [z_0; z_{W-1}]); the conditioning is then tiled k times.
        """
        b, _, h, w = z.shape
        cond = self.conditioning_for(b, cond)
        param = next(self.transformer.parameters())
        timestep = torch.as_tensor(t, dtype=param.dtype, device=z.device).expand(b)
        out = self._forward_tokens(pack_2x2(z.to(param.dtype)), timestep, cond, h, w)
        return unpack_2x2(out, h, w).to(z.dtype)

    @staticmethod
    def conditioning_for(rows: int, cond: TextCond) -> TextCond:
        """The conditioning of a latent batch of ``rows`` rows: ``cond`` itself, or ``cond`` tiled k times where
        ``rows`` = k * B (the batched endpoint forward); a ValueError where ``rows`` is no multiple of B. Every
        adapter's ``velocity`` goes through here."""
        if rows == cond.batch_size:
            return cond
        if rows % cond.batch_size:
            raise ValueError(
                f"latent batch {rows} is not a multiple of the conditioning batch {cond.batch_size}"
            )
        return cond.tile(rows // cond.batch_size)

    @property
    def expert_boundaries(self) -> tuple[float, ...]:
        """The sigmas at which the velocity switches network (a step at sigma >= b is on the noisier side): ()
        for one network; Wan2.2-A14B's two experts override it."""
        return ()

    def bind(self, cond: TextCond, *, autocast: torch.dtype | None = None) -> BoundVelocity:
        """``velocity(z, t)`` with the conditioning fixed: the callable the backward strategies take, and the one
        every caller builds (the trainer's rollouts and updates included), so that none drops the backbone's
        ``expert_boundaries``. ``autocast``: each call under ``torch.autocast`` to that dtype on the latents'
        device (the trainer's bf16 precision); None enters no autocast (an outer one still applies)."""
        return BoundVelocity(self, cond, autocast)

    def _forward_tokens(self, tokens: Tensor, timestep: Tensor, cond: TextCond, h: int, w: int) -> Tensor:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class BoundVelocity:
    """``backbone.velocity(z, t, cond)`` as ``velocity(z, t)`` (in z's dtype, under ``autocast`` where given),
    carrying the backbone's ``expert_boundaries`` so the engine keeps knots and groups from straddling a switch of
    network (``jagg.engine.knots``)."""

    backbone: Backbone
    cond: TextCond
    autocast: torch.dtype | None = None

    def __call__(self, z: Tensor, t: Tensor | float) -> Tensor:
        t = t.to(z.device) if torch.is_tensor(t) else t
        cast = torch.autocast(z.device.type, self.autocast) if self.autocast else contextlib.nullcontext()
        with cast:
            out = self.backbone.velocity(z, t, self.cond)
        return out.to(z.dtype)

    @property
    def expert_boundaries(self) -> tuple[float, ...]:
        return self.backbone.expert_boundaries


@dataclass
class Components:
    """Everything model-specific the loop needs; built by ``jagg.loop.components.build_components``."""

    backbone: Backbone
    text_encoder: object  # .encode_prompts(list[str]) -> TextCond
    decode: Callable[[Tensor], Tensor]  # latents -> images (B, 3, H, W) in [0, 1]
    train_prompts: list[str]
    eval_prompts: list[str]
    latent_shape: tuple[int, ...]  # (C, H, W); Wan's video (C, F, H, W)
    sigmas: Tensor | None = None  # (S + 1,) schedule; None = shifted linear from the config
    eval_sigmas: Tensor | None = None
