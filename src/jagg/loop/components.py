"""The composition root: build the model-specific parts of a run (backbone, text encoder, decoder, prompts).

model.source = world       the embedded default, pretrained by `make pretrain` (cache/world/): the image world's
                           Flux / Qwen-Image, or the video world's tiny Wan (model.backbone=wan)
model.source = tiny        random-init models of the same classes and sizes (tests, smoke runs)
model.source = pretrained  real Flux / Qwen-Image weights by hub id or local path (paper scale)

``check_config`` completes ``jagg.config.validate`` with the checks that need the full registries (reward
names); the CLI calls it right after loading the config, before anything is written.
"""

from __future__ import annotations

import torch

from jagg.config import Config
from jagg.errors import ConfigError
from jagg.loop.rewards import check_reward_names, check_sample_kind
from jagg.models import Components
from jagg.scale.pretrained import build_pretrained_components
from jagg.world import World, load_pretrained
from jagg.world.pretrained import VIDEO_BACKBONE_NAMES, new_module, text_encoder_from_clip
from jagg.world.video import VideoWorld


def check_config(cfg: Config) -> None:
    """The checks ``jagg.config.validate`` leaves to this layer (reward names, image rewards for images and video
    rewards for videos); ``ConfigError`` naming the key."""
    check_reward_names(cfg)
    check_sample_kind(cfg)


def _world_components(cfg: Config, pretrained: bool) -> Components:
    """The image world's Flux / Qwen-Image, or with ``model.backbone=wan`` the video world's tiny Wan."""
    video = cfg.model.backbone in VIDEO_BACKBONE_NAMES
    world = VideoWorld() if video else World()
    size = world.size
    if cfg.sampling.latent_size != size:
        raise ConfigError(
            f"sampling.latent_size must equal the world image size {size} for model.source={cfg.model.source}"
        )
    if video and cfg.sampling.latent_frames != world.frames:
        raise ConfigError(
            f"sampling.latent_frames must equal the video world's {world.frames} frames for "
            f"model.source={cfg.model.source}, got {cfg.sampling.latent_frames}"
        )
    if pretrained:
        backbone, text_encoder = load_pretrained(cfg.model.backbone)
    else:
        with torch.random.fork_rng(devices=[]):  # random init, deterministic in the seed
            torch.manual_seed(cfg.train.seed)
            backbone = new_module(cfg.model.backbone, world).requires_grad_(True)
            encoder = "video_text_encoder" if video else "text_encoder"
            text_encoder = text_encoder_from_clip(new_module(encoder, world), world)
    return Components(
        backbone=backbone,
        text_encoder=text_encoder,
        decode=world.decode,
        train_prompts=list(world.train_prompts),
        eval_prompts=list(world.heldout_prompts),
        latent_shape=world.latent_shape,
    )


def build_components(cfg: Config) -> Components:
    """Components for ``cfg.model.source``; raises ConfigError / ArtefactError with a clear message."""
    check_config(cfg)
    src = cfg.model.source
    if src in ("world", "tiny"):
        return _world_components(cfg, pretrained=src == "world")
    return build_pretrained_components(cfg)
