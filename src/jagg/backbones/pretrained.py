"""Real FLUX.1-dev / Qwen-Image transformers (and their scheduler configs) in the adapter classes.

A diffusers pipeline repo stores the DiT under ``transformer/`` and the schedule under ``scheduler/``:
    transformer = FluxTransformer2DModel.from_pretrained(repo, subfolder="transformer", torch_dtype=bf16)
(diffusers' FluxPipeline / QwenImagePipeline load it the same way). ``load_backbone`` wraps it in the same
``FluxBackbone`` / ``QwenImageBackbone`` the tiny test models use; ``load_scheduler_config`` returns the dict
``jagg.sde.diffusers_sigmas`` turns into a schedule. Both accept a hub id or a local directory (a pipeline
snapshot, or a bare transformer directory with its config.json) and fail fast offline (``jagg.hub``).
Text encoders and the VAE are not loaded here.
"""

from __future__ import annotations

import os

import torch

from jagg.backbones import BACKBONES, Backbone
from jagg.hub import load_or_explain

# name -> default hub id (the paper's backbones)
PRETRAINED_IDS = {"flux": "black-forest-labs/FLUX.1-dev", "qwenimage": "Qwen/Qwen-Image"}
_HOW = "FLUX.1-dev is gated: accept its licence on the hub before downloading."


def _subfolder(path: str, sub: str) -> str | None:
    """``sub`` for a pipeline layout; None when ``path`` is a local bare-model directory."""
    if os.path.isdir(path) and not os.path.isdir(os.path.join(path, sub)):
        return None
    return sub


def load_transformer(name: str, name_or_path: str | None = None, *, dtype: torch.dtype = torch.bfloat16):
    """The real diffusers transformer class of backbone ``name`` with pretrained weights in ``dtype``."""
    if name not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {name!r}")
    cls = BACKBONES[name].transformer_cls
    repo = name_or_path or PRETRAINED_IDS[name]

    def load(p: str, local: bool):
        sub = _subfolder(p, "transformer")
        return cls.from_pretrained(p, subfolder=sub, torch_dtype=dtype, local_files_only=local)

    return load_or_explain(load, repo, what=f"{name} transformer weights", how=_HOW if name == "flux" else "")


def load_backbone(
    name: str,
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    gradient_checkpointing: bool = False,
    device: str | torch.device | None = None,
    **adapter_kwargs,
) -> Backbone:
    """``FluxBackbone`` / ``QwenImageBackbone`` around the pretrained transformer.

    ``adapter_kwargs`` go to the adapter (``guidance_scale`` for Flux, ``true_cfg_scale`` for Qwen-Image).
    Gradient checkpointing is diffusers' own (per transformer block); it gives bit-identical gradients.
    """
    transformer = load_transformer(name, name_or_path, dtype=dtype)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    backbone = BACKBONES[name](transformer, **adapter_kwargs)
    return backbone.to(device) if device is not None else backbone


def load_scheduler_config(name_or_path: str) -> dict:
    """The ``FlowMatchEulerDiscreteScheduler`` config dict of a pipeline repo (its ``scheduler/`` folder).

    Pass the result to ``jagg.sde.diffusers_sigmas(config, num_steps, image_seq_len)``. Also accepts a hub
    short name "flux" / "qwenimage" for the paper's models.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    repo = PRETRAINED_IDS.get(name_or_path, name_or_path)

    def load(p: str, local: bool) -> dict:
        sub = _subfolder(p, "scheduler")
        return dict(FlowMatchEulerDiscreteScheduler.load_config(p, subfolder=sub, local_files_only=local))

    return load_or_explain(load, repo, what="scheduler config")


def set_gradient_checkpointing(backbone: Backbone, enabled: bool = True) -> None:
    """Switch diffusers' per-block gradient checkpointing of the backbone's transformer on or off."""
    if enabled:
        backbone.transformer.enable_gradient_checkpointing()
    else:
        backbone.transformer.disable_gradient_checkpointing()
