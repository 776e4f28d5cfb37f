"""Tiny random-init pipeline folders of the real classes, for ``model.source=pretrained`` without the hub.

``save_tiny_wan_pipeline`` writes a Wan-AI ``-Diffusers`` layout (one expert, or Wan2.2-A14B's two).
``save_tiny_sd3_pipeline`` writes SD3.5-M's layout (transformer, scheduler, VAE, CLIP-L / CLIP-G / T5 text encoders
and tokenizers), each part saved with ``save_pretrained`` and loaded back through the real code path
(``jagg.scale.pretrained.build_pretrained_components``): the SD3 tests and Table 1's SD3 section
(experiments/table1.py) run on it. CLIP gets the real CLIP BPE (open_clip's bundled vocab); T5 a tiny byte-level
BPE trained on the given prompts (``tiny_bpe``: the real vocabulary needs the hub).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from jagg.common import atomic_write_text
from jagg.models import build_tiny_backbone, tiny_flux_config
from jagg.scale.rewards import clip_bpe_tokenizer

# A ~60M-parameter random-init Flux transformer (diffusers' FluxTransformer2DModel kwargs): the world's tiny Flux
# widened to 768 (6 heads x 128), still 2 double-stream + 2 single-stream blocks with text / pooled widths of 32.
# fp32: 240 MB in full. The size at which checkpoints are measured (experiments/checkpoint_bench.py) and tested
# on 2 ranks (tests/test_distributed_checkpoint.py).
MEDIUM_FLUX = tiny_flux_config(attention_head_dim=128, num_attention_heads=6, axes_dims_rope=(16, 56, 56))


def tiny_bpe(texts: Sequence[str], special_tokens: Sequence[str] = ("<pad>", "</s>"), **kwargs):
    """A 300-token byte-level BPE (transformers ``PreTrainedTokenizerFast``) trained on ``texts``; ``<pad>`` and
    ``</s>`` are the pad and eos tokens, ``special_tokens`` lists them first; ``kwargs`` go to the tokenizer
    (``model_max_length``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", **kwargs)


def save_tiny_sd3_pipeline(root: str | Path, prompts: Sequence[str]) -> None:
    """A tiny SD3 pipeline folder in SD3.5-M's layout at ``root``, deterministic (the global RNG is left as it
    was): the tiny transformer (``tiny_sd3_config``: text width 32, pooled 32), SD3.5-M's scheduler config (shift
    3), a one-level VAE (latent factor 1, 16 channels, SD3's scaling / shift factors), CLIP-L and CLIP-G of
    hidden 16 (their token embeddings side by side fill T5's 32, projections 16 + 16 = the pooled 32) and a
    T5 of d_model 32 = the transformer's joint_attention_dim, its tokenizer trained on ``prompts``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    root = Path(root)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_tiny_backbone("sd3", seed=1).transformer.save_pretrained(root / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(root / "scheduler")
        AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            block_out_channels=(8,),
            latent_channels=16,
            norm_num_groups=4,
            scaling_factor=1.5305,
            shift_factor=0.0609,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).save_pretrained(root / "vae")
        for i, sub in enumerate(("", "_2")):
            clip = dict(vocab_size=49408, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
            clip |= dict(num_attention_heads=2, projection_dim=16)
            torch.manual_seed(10 + i)
            CLIPTextModelWithProjection(CLIPTextConfig(**clip)).save_pretrained(root / f"text_encoder{sub}")
            clip_bpe_tokenizer().save_pretrained(root / f"tokenizer{sub}")
        t5 = T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
        T5EncoderModel(t5).save_pretrained(root / "text_encoder_3")
        tiny_bpe(prompts).save_pretrained(root / "tokenizer_3")


def save_tiny_wan_pipeline(
    root: str | Path, prompts: Sequence[str], *, boundary_ratio: float | None = None, expand_timesteps=False
) -> None:
    """A tiny Wan pipeline folder in the Wan-AI ``-Diffusers`` layout at ``root``, written by ``WanPipeline``'s own
    ``save_pretrained`` (model_index.json included), deterministic (the global RNG is left as it was): the tiny
    transformer (``tiny_wan_config``: 4 latent channels, text width 32), with ``boundary_ratio`` a second expert
    as Wan2.2-A14B, a one-level Wan VAE (4 channels, 8x spatial / 4x temporal factors as configured), a UMT5 of
    d_model 32 and a tokenizer trained on ``prompts``. The scheduler saved is Euler with shift 3 (the hub's is
    UniPC; the loader does not read it for Wan)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from jagg.models import WanBackbone, tiny_wan_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        bb = WanBackbone.from_config(tiny_wan_config(), seed=1, boundary_ratio=boundary_ratio)
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1],
            num_res_blocks=1,
            temperal_downsample=[False],
            latents_mean=[0.1, -0.1, 0.2, 0.0],
            latents_std=[1.5, 0.8, 1.2, 1.0],
        )
        torch.manual_seed(10)
        umt5 = UMT5EncoderModel(
            UMT5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
        )
        WanPipeline(
            tokenizer=tiny_bpe(prompts),
            text_encoder=umt5,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            transformer=bb.transformer,
            transformer_2=bb.transformer_2,
            boundary_ratio=boundary_ratio,
            expand_timesteps=expand_timesteps,
        ).save_pretrained(root)


def write_tiny_sd3_run(root: str | Path, prompts: Sequence[str]) -> tuple[Path, Path]:
    """``save_tiny_sd3_pipeline`` at ``root``/sd3 and ``prompts`` at ``root``/prompts.txt (one a line, what
    ``data.train_prompts`` reads): (pipeline folder, prompts file), for ``jagg.config.tiny_pipeline_overrides``."""
    root = Path(root)
    save_tiny_sd3_pipeline(root / "sd3", prompts)
    atomic_write_text(root / "prompts.txt", "\n".join(prompts) + "\n")
    return root / "sd3", root / "prompts.txt"
