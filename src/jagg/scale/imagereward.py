"""ImageReward (Xu et al. 2023, github.com/THUDM/ImageReward): a BLIP image-text encoder with an MLP head.

What ``ImageReward.score`` does (``ImageReward/ImageReward.py`` @ c1392c6, docs/references.md), on the
transformers BLIP classes instead of the package's own copy of BLIP:
    image   resize of the short side to 224 (bicubic), centre crop, CLIP mean / std (``clip_preprocess``)
    text    ``bert-base-uncased`` with ``[DEC]`` and ``[ENC]`` added (``blip.init_tokenizer``), padded to 35 tokens
    model   ViT-L/16 (``blip.visual_encoder``) -> every patch token; a BERT-base text encoder that cross-attends
            to them (``blip.text_encoder``, ``med_config.json``); the [CLS] output through the 5-layer MLP
    score   ``(mlp - 0.16717362830052426) / 1.0333394966054072`` (~N(0, 1) on their validation set)

The package itself is not a dependency: its BLIP copy imports timm and fairscale and the transformers 4
``modeling_utils`` helpers that transformers 5 moved. transformers' ``BlipVisionModel`` / ``BlipTextModel``
are the same networks (BLIP's ViT with pre-norm blocks and a final LayerNorm, eps 1e-6; ``med.py``'s BERT with
cross-attention, whose parameter names transformers kept); ``convert_imagereward_state_dict`` renames the
checkpoint's keys and the load is strict, so a missing or unexpected weight is an error.

The weights: ``THUDM/ImageReward`` (``ImageReward.pt``, ``med_config.json``), a local directory holding both, or
the ``.pt`` file with ``med_config`` as a path; the tokenizer ``bert-base-uncased`` (hub id or local path).
Offline without them: ``WeightsUnavailableError`` naming what is missing (``jagg.scale.hub``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import torch
from torch import Tensor, nn

from jagg.rewards import register_reward
from jagg.scale.hub import hub_file, load_or_explain
from jagg.scale.rewards import CLIP_MEAN, CLIP_STD, clip_preprocess

# ImageReward/ImageReward.py : ImageReward.__init__ (the score's normalisation) and ImageReward.score (text length)
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
IMAGEREWARD_MAX_LENGTH = 35
# med_config.json of THUDM/ImageReward (BLIP's BERT-base with cross-attention; the copy in ImageReward's
# train/src/config/ has these values)
MED_CONFIG = dict(
    hidden_act="gelu",
    hidden_size=768,
    initializer_range=0.02,
    intermediate_size=3072,
    layer_norm_eps=1e-12,
    max_position_embeddings=512,
    num_attention_heads=12,
    num_hidden_layers=12,
    pad_token_id=0,
    vocab_size=30524,
    encoder_width=768,
    add_cross_attention=True,
)
# ImageReward/models/BLIP/blip.py : create_vit("large", 224): ViT-L/16
VIT_LARGE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=224,
    patch_size=16,
    layer_norm_eps=1e-6,
)


class ImageRewardModel(nn.Module):
    """BLIP ViT + cross-attending BERT + ImageReward's MLP head: ``(pixels, ids, mask) -> (B,)`` raw head output."""

    def __init__(self, vision_config, text_config) -> None:
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        super().__init__()
        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        width = text_config.hidden_size
        # ImageReward/ImageReward.py : MLP (dropouts at indices 1, 3, 5; no activations: their ReLUs are commented out)
        self.mlp = nn.Sequential(
            nn.Linear(width, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    @classmethod
    def from_med_config(cls, med_config: dict, vision: dict | None = None) -> ImageRewardModel:
        """Random-init model from ``med_config.json``'s BERT keys and a ViT config (default ViT-L/16 at 224)."""
        from transformers import BlipTextConfig, BlipVisionConfig

        vision_config = BlipVisionConfig(**(vision or VIT_LARGE))
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "layer_norm_eps",
            "hidden_act",
            "pad_token_id",
            "initializer_range",
        )
        text_config = BlipTextConfig(
            **{k: med_config[k] for k in keys if k in med_config},
            encoder_hidden_size=vision_config.hidden_size,  # blip_pretrain: encoder_width = vision_width
        )
        return cls(vision_config, text_config)

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image = self.vision_model(pixel_values=pixels).last_hidden_state  # (B, 1 + patches, Dv)
        image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image,
            encoder_attention_mask=image_mask,
        ).last_hidden_state  # (B, L, Dt)
        return self.mlp(text[:, 0, :].float()).squeeze(-1)


# BLIP's ViT (``ImageReward/models/BLIP/vit.py``) -> transformers ``BlipVisionModel``
_VIT_RENAMES = (
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.fc(\d)\.", r"encoder.layers.\1.mlp.fc\2."),
    (r"^norm\.", "post_layernorm."),
)


def convert_imagereward_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """ImageReward.pt's keys (``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``) -> the keys of
    ``ImageRewardModel``. The BLIP parts the score does not use (``vision_proj``, ``text_proj``, the
    ``position_ids`` buffer) are dropped; a ViT key without a rule raises."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        key = key.removeprefix("module.")
        if key.startswith("blip.visual_encoder."):
            rest = key.removeprefix("blip.visual_encoder.")
            for pattern, repl in _VIT_RENAMES:
                new, n = re.subn(pattern, repl, rest)
                if n:
                    out["vision_model." + new] = value
                    break
            else:
                raise KeyError(f"ImageReward checkpoint: no rule for the ViT key {key!r}")
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            out["text_encoder." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            out["mlp." + key.removeprefix("mlp.layers.")] = value
    return out


def imagereward_tokenizer(name_or_path: str = "bert-base-uncased"):
    """``bert-base-uncased`` with BLIP's ``[DEC]`` bos and ``[ENC]`` tokens (``blip.init_tokenizer``): 30,524 ids."""
    from transformers import BertTokenizer

    tok = load_or_explain(
        lambda p, local: BertTokenizer.from_pretrained(p, local_files_only=local),
        name_or_path,
        what="ImageReward tokenizer",
    )
    return add_blip_tokens(tok)


def add_blip_tokens(tokenizer):
    """``tokenizer`` with BLIP's two extra tokens, added as ``blip.init_tokenizer`` does (in that order)."""
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


@register_reward("imagereward")
class ImageRewardReward:
    """ImageReward v1.0 as a reward: ``reward(images (B,3,H,W) in [0,1], prompts) -> (B,)`` (see the module doc).

    ``checkpoint``: hub repo id (files ``filename`` and ``med_config`` in it), a local directory holding both, or
    the ``.pt`` file (then ``med_config`` is a path). ``tokenizer``: hub id or local path of ``bert-base-uncased``.
    ``weights_only=False`` only for a checkpoint you trust (the published one is a plain state dict).
    ``vision``: ``BlipVisionConfig`` keys of the ViT (default ``VIT_LARGE``, ImageReward v1.0's ViT-L/16 at 224).
    """

    name = "imagereward"

    def __init__(
        self,
        checkpoint: str = "THUDM/ImageReward",
        filename: str = "ImageReward.pt",
        med_config: str = "med_config.json",
        tokenizer: str = "bert-base-uncased",
        weights_only: bool = True,
        vision: dict | None = None,
        **kwargs,
    ) -> None:
        ckpt = os.path.expanduser(checkpoint)
        if os.path.isfile(ckpt):
            path, config_path = ckpt, os.path.expanduser(med_config)
            if not os.path.isfile(config_path):
                config_path = os.path.join(os.path.dirname(ckpt), med_config)
        else:
            what = "ImageReward checkpoint"
            path = hub_file(checkpoint, filename, what=what)
            config_path = hub_file(checkpoint, med_config, what=f"{what} config")
        with open(config_path) as f:
            model = ImageRewardModel.from_med_config(json.load(f), vision)
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
        model.load_state_dict(convert_imagereward_state_dict(state.get("state_dict", state)))
        self._init_from(model, imagereward_tokenizer(tokenizer), **kwargs)

    @classmethod
    def from_model(cls, model: ImageRewardModel, tokenizer: Callable, **kwargs) -> ImageRewardReward:
        """Wrap an already-built ``ImageRewardModel`` and a BERT tokenizer with BLIP's tokens."""
        self = cls.__new__(cls)
        self._init_from(model, tokenizer, **kwargs)
        return self

    def _init_from(
        self,
        model: ImageRewardModel,
        tokenizer: Callable,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.model.mlp.float()  # their head runs on the float() [CLS] features
        self.tokenizer = tokenizer
        self.image_size = model.vision_model.config.image_size
        self.batch_size = int(batch_size)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        out = []
        for i in range(0, len(prompts), self.batch_size):
            chunk = images[i : i + self.batch_size].to(self.device)
            pixels = clip_preprocess(chunk, self.image_size, CLIP_MEAN, CLIP_STD).to(self.dtype)
            tok = self.tokenizer(
                list(prompts[i : i + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=IMAGEREWARD_MAX_LENGTH,
                return_tensors="pt",
            ).to(self.device)
            raw = self.model(pixels, tok.input_ids, tok.attention_mask)
            out.append((raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
        return torch.cat(out).float().to(images.device)
