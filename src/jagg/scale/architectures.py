"""The published architectures of the real models, for building them on the meta device without their files.

``KNOWN_CONFIGS``: ``transformer/config.json`` of FLUX.1-dev and Qwen-Image (diffusers layout), what the dry run,
``make plan-check`` and ``make gpu-check`` build when no local pipeline folder is given. ``AUX_MODELS``: every other
model a paper-scale run keeps (text encoders, VAEs, reward models), with its published parameter count;
``aux_params`` counts one on the meta device. ``TEXT_ENCODERS``: which of them each backbone encodes prompts with.
Numbers only: nothing here reads weights or reaches the hub.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# transformer/config.json of the paper's models (diffusers layout), for dry runs without the files.
KNOWN_CONFIGS = {
    "flux": dict(  # black-forest-labs/FLUX.1-dev, 11.9B parameters
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    "qwenimage": dict(  # Qwen/Qwen-Image, 20.4B parameters
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=60,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    ),
    "sd3": dict(  # stabilityai/stable-diffusion-3.5-medium (MMDiT-X), 2.24B parameters
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=24,
        attention_head_dim=64,
        num_attention_heads=24,
        joint_attention_dim=4096,
        caption_projection_dim=1536,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=384,
        dual_attention_layers=tuple(range(13)),
        qk_norm="rms_norm",
    ),
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json, 1.42B parameters (the other Wan models: KNOWN_WAN)
    "wan": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
}
VAE_SCALE = 8  # pixels per latent cell for both real VAEs (Wan2.2-TI2V-5B's: 16, ``KNOWN_WAN``)


@dataclass(frozen=True)
class WanModel:
    """One published Wan pipeline as the plan needs it: the transformer config (``transformer/config.json``), its
    experts (Wan2.2-A14B: two of the same config, ``boundary_ratio`` in model_index.json), its VAE (a key of
    ``AUX_MODELS``) and that VAE's pixels per latent cell, and whether it embeds one timestep per token
    (``expand_timesteps`` in model_index.json: Wan2.2-TI2V-5B)."""

    config: dict
    experts: int = 1
    boundary_ratio: float | None = None  # sigma where the low-noise expert takes over (two experts)
    expand_timesteps: bool = False
    vae: str = "wan_vae"
    vae_scale: int = 8


# The Wan pipelines by hub id (model.path); a local folder's own config.json wins (memory_model.transformer_config).
# Numbers from the repos' config.json files (the 14B one as diffusers' WanTransformer3DModel defaults, which are it)
KNOWN_WAN = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": WanModel(KNOWN_CONFIGS["wan"]),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": WanModel(  # 5.00B; expand_timesteps; the 48-channel Wan2.2 VAE, 16x
        dict(KNOWN_CONFIGS["wan"], num_attention_heads=24, ffn_dim=14336, in_channels=48, out_channels=48),
        vae="wan22_vae",
        vae_scale=16,
        expand_timesteps=True,
    ),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": WanModel(  # two experts of 14.29B each, boundary_ratio 0.875
        dict(KNOWN_CONFIGS["wan"], num_attention_heads=40, ffn_dim=13824, num_layers=40),
        experts=2,
        boundary_ratio=0.875,
    ),
}


def known_wan(path: str | None) -> WanModel:
    """The published Wan pipeline ``model.path`` names (its hub id, or a folder named like one), else
    Wan2.1-T2V-1.3B (the backbone's default id)."""
    name = str(path or "").rstrip("/").rsplit("/", 1)[-1]
    for repo, model in KNOWN_WAN.items():
        if name == repo.rsplit("/", 1)[-1]:
            return model
    return KNOWN_WAN["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]


# --------------------------------------------------------------------------- memory
# Models a paper-scale run keeps besides the transformer: (what, how to build it on the meta device, published
# parameter count). Architectures are the hub repos' config.json values (open_clip's bundled ViT-H-14 config for
# HPSv2.1); the published count is the fallback when a library cannot build one on the meta device.
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
CLIP_L_TEXT = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
)
CLIP_G_TEXT = dict(
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    projection_dim=1280,
    hidden_act="gelu",
)
CLIP_L_VISION = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, patch_size=14
)
CLIP_H_TEXT = dict(
    vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16
)
CLIP_H_VISION = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, patch_size=14
)
# The 7B language model of Qwen2-VL-7B (HPSv3's backbone, ``jagg.scale.hpsv3``) and of Qwen2.5-VL-7B (Qwen-Image's
# text encoder): the same values in Qwen/Qwen2-VL-7B-Instruct's and Qwen/Qwen2.5-VL-7B-Instruct's config.json
QWEN_VL_7B_TEXT = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
QWEN25_VL_7B = dict(
    text_config=dict(QWEN_VL_7B_TEXT),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584
    ),
    tie_word_embeddings=False,
)
# HPSv3's backbone (``jagg.scale.hpsv3``): Qwen/Qwen2-VL-7B-Instruct's config.json, for the dry-run plan's
# parameter count
QWEN2_VL_7B = dict(
    text_config=dict(QWEN_VL_7B_TEXT, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
    vision_config=dict(
        depth=32,
        embed_dim=1280,
        hidden_size=3584,
        num_heads=16,
        mlp_ratio=4,
        patch_size=14,
        spatial_merge_size=2,
    ),
    tie_word_embeddings=False,
)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (its other values are AutoencoderKLWan's defaults)
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    is_residual=True,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
)
FLUX_VAE = dict(
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def _build_aux(name: str):
    import transformers as tf

    if name == "t5_xxl":
        return tf.T5EncoderModel(tf.T5Config(feed_forward_proj="gated-gelu", **T5_XXL))
    if name == "clip_l_text":
        return tf.CLIPTextModel(tf.CLIPTextConfig(max_position_embeddings=77, **CLIP_L_TEXT))
    if name == "clip_g_text":
        return tf.CLIPTextModelWithProjection(tf.CLIPTextConfig(max_position_embeddings=77, **CLIP_G_TEXT))
    if name == "qwen25_vl_7b":
        return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(**QWEN25_VL_7B))
    if name == "hpsv2":
        return quiet_open_clip("ViT-H-14")
    if name in ("pickscore", "clipscore"):
        text, vision, proj = (
            (CLIP_H_TEXT, CLIP_H_VISION, 1024) if name == "pickscore" else (CLIP_L_TEXT, CLIP_L_VISION, 768)
        )
        return tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=proj))
    if name == "imagereward":
        from jagg.scale.imagereward import MED_CONFIG, ImageRewardModel

        return ImageRewardModel.from_med_config(MED_CONFIG)
    if name == "hpsv3":
        from jagg.scale.hpsv3 import hpsv3_model

        vocab = QWEN2_VL_7B["text_config"]["vocab_size"]  # + <|Reward|>
        return hpsv3_model(tf.Qwen2VLConfig(**QWEN2_VL_7B), vocab, vocab + 1)
    if name == "umt5_xxl":
        return tf.UMT5EncoderModel(tf.UMT5Config(feed_forward_proj="gated-gelu", **UMT5_XXL))
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

    if name in ("wan_vae", "wan22_vae"):  # Wan2.1's is AutoencoderKLWan's defaults
        return AutoencoderKLWan(**(WAN22_VAE if name == "wan22_vae" else {}))
    return AutoencoderKL(**FLUX_VAE) if name == "flux_vae" else AutoencoderKLQwenImage()  # its defaults


def quiet_open_clip(arch: str) -> torch.nn.Module:
    """open_clip's ``arch`` on the meta device, without its random-init warning.

    open_clip warns "No pretrained weights loaded ... initialized randomly" through the root logger, which also
    sets that logger up (``logging.basicConfig``) and doubles every later line of the CLI; here only the
    architecture is wanted. A handler on the root logger meanwhile prevents both."""
    import logging

    import open_clip

    quiet = logging.NullHandler()
    logging.root.addHandler(quiet)
    try:
        return open_clip.create_model(arch, pretrained=None, device="meta")
    finally:
        logging.root.removeHandler(quiet)


AUX_MODELS = {  # name -> (description, published parameter count)
    "t5_xxl": ("T5-XXL encoder (google/t5-v1_1-xxl)", 4.762e9),
    "clip_l_text": ("CLIP-L text (openai/clip-vit-large-patch14)", 123.1e6),
    "clip_g_text": ("CLIP-G text (SD3.5 text_encoder_2, with projection)", 694.7e6),
    "qwen25_vl_7b": ("Qwen2.5-VL-7B (with its vision tower)", 8.292e9),
    "flux_vae": ("FLUX.1-dev VAE", 83.8e6),
    "qwenimage_vae": ("Qwen-Image VAE", 126.9e6),
    # UMT5-XXL's encoder as Wan's text_encoder (google/umt5-xxl), counted from the architecture
    "umt5_xxl": ("UMT5-XXL encoder (Wan's text encoder)", 5.6809e9),
    "wan_vae": ("Wan2.1 VAE (also Wan2.2-A14B's)", 126.9e6),
    "wan22_vae": ("Wan2.2 VAE (TI2V-5B, 16x spatial), counted from vae/config.json", 704.7e6),
    "hpsv2": ("HPSv2.1: open_clip ViT-H-14", 986.1e6),
    "pickscore": ("PickScore: CLIP ViT-H-14", 986.1e6),
    "clipscore": ("CLIPScore: CLIP ViT-L/14", 427.6e6),
    # counted from the architecture (BLIP ViT-L/16 303.3M + BERT-base with cross-attention 142.0M + head)
    "imagereward": ("ImageReward: BLIP ViT-L/16 + BERT-base", 446.2e6),
    # Qwen2-VL-7B-Instruct as published (8,291,375,616) + one token embedding row / lm_head row + rm_head 3.7M
    "hpsv3": ("HPSv3: Qwen2-VL-7B", 8.2951e9),
}
TEXT_ENCODERS = {
    "flux": ("t5_xxl", "clip_l_text"),
    "qwenimage": ("qwen25_vl_7b",),
    "sd3": ("t5_xxl", "clip_l_text", "clip_g_text"),
    "wan": ("umt5_xxl",),
}
TRUE_CFG = ("qwenimage", "sd3")  # backbones whose model.true_cfg_scale > 1 doubles the transformer's work
# ... in two calls per velocity (Qwen-Image's pipeline); SD3 batches the negative prompt into one call of 2B rows
# (SD3Backbone, as StableDiffusion3Pipeline and Flow-GRPO): one all-gather per step, no gradient held between calls
CFG_TWO_CALLS = ("qwenimage",)
# Wan's true CFG: the unconditional call runs without autograd (WanBackbone), so it doubles neither activations nor
# held gradients, only the calls (and FSDP2's all-gathers) of every velocity
CFG_NO_GRAD_CALL = ("wan",)
_aux_cache: dict[str, int] = {}
_largest_cache: dict[str, int] = {}


def aux_largest_tensor(name: str) -> int:
    """Elements of ``AUX_MODELS[name]``'s largest parameter, counted on the meta device (a model loaded one tensor
    at a time stages no more than this on the host; 0 when the library cannot build it)."""
    if name not in _largest_cache:
        try:
            with torch.device("meta"):
                model = _build_aux(name)
            _largest_cache[name] = max(p.numel() for p in model.parameters())
        except Exception:  # a library too old / missing
            _largest_cache[name] = 0
    return _largest_cache[name]


def aux_params(name: str) -> int:
    """Parameters of ``AUX_MODELS[name]``, counted on the meta device (published count if that fails)."""
    if name not in _aux_cache:
        try:
            with torch.device("meta"):
                model = _build_aux(name)
            _aux_cache[name] = sum(p.numel() for p in model.parameters())
        except Exception:  # a library too old / missing: the published number
            _aux_cache[name] = int(AUX_MODELS[name][1])
    return _aux_cache[name]
