"""Backbone adapters: a diffusers DiT plus its conditioning -> ``velocity(z, t)`` on unpacked latents.

Every adapter takes latents in the natural layout (B, C, H, W) (Wan: (B, C, F, H, W)) and times sigma in [0, 1] (scalar or (B,)),
packs them the way its pipeline does, runs the transformer and unpacks the prediction. The SDE math and the
backward strategies therefore never see a model-specific layout. The same adapter class serves the tiny
random-init models of the tests, the embedded-default world models and the real Flux / Qwen-Image / SD3.5 / Wan weights;
only the transformer's config (or checkpoint) differs. ``Components`` is what a model source provides to the
loop (backbone, text encoder, decoder, prompts, schedules).

Layer: beside the engine and the rewards; from the package it may import only ``jagg.errors`` and
``jagg.common``. ``jagg.config.BACKBONE_NAMES`` names the keys of ``BACKBONES`` without importing diffusers.
"""

from __future__ import annotations

from jagg.models.base import Backbone, BoundVelocity, Components, TextCond, pack_2x2, unpack_2x2
from jagg.models.flux import FluxBackbone, tiny_flux_config
from jagg.models.qwenimage import QwenImageBackbone, tiny_qwenimage_config
from jagg.models.sd3 import SD3Backbone, tiny_sd3_config
from jagg.models.wan import WanBackbone, tiny_wan_config

# name -> (adapter class, tiny-config factory). The registry the CLI and configs refer to.
BACKBONES: dict[str, type[Backbone]] = {
    "flux": FluxBackbone,
    "qwenimage": QwenImageBackbone,
    "sd3": SD3Backbone,
    "wan": WanBackbone,
}
TINY_CONFIGS = {
    "flux": tiny_flux_config,
    "qwenimage": tiny_qwenimage_config,
    "sd3": tiny_sd3_config,
    "wan": tiny_wan_config,
}


def build_tiny_backbone(name: str, seed: int = 0, **overrides) -> Backbone:
    """A random-init backbone of the real diffusers class with a tiny config (tests, benchmarks)."""
    if name not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {name!r}")
    return BACKBONES[name].from_config(TINY_CONFIGS[name](**overrides), seed=seed)


__all__ = [
    "BACKBONES",
    "Backbone",
    "BoundVelocity",
    "Components",
    "FluxBackbone",
    "QwenImageBackbone",
    "SD3Backbone",
    "TextCond",
    "WanBackbone",
    "build_tiny_backbone",
    "pack_2x2",
    "tiny_flux_config",
    "tiny_qwenimage_config",
    "tiny_sd3_config",
    "tiny_wan_config",
    "unpack_2x2",
]
