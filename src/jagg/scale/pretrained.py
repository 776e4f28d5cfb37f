"""Real FLUX.1-dev / Qwen-Image / SD3.5 / Wan transformers (and their scheduler configs) in the adapter classes.

A diffusers pipeline repo stores the DiT under ``transformer/`` and the schedule under ``scheduler/``:
    transformer = FluxTransformer2DModel.from_pretrained(repo, subfolder="transformer", torch_dtype=bf16)
(diffusers' FluxPipeline / QwenImagePipeline load it the same way). ``load_backbone`` wraps it in the same
``FluxBackbone`` / ``QwenImageBackbone`` the tiny test models use; ``load_scheduler_config`` returns the dict
``jagg.engine.sde.diffusers_sigmas`` turns into a schedule. Both accept a hub id or a local directory (a pipeline
snapshot, or a bare transformer directory with its config.json) and fail fast offline (``jagg.scale.hub``).
Text encoders and the VAE are not loaded here.
"""

from __future__ import annotations

import importlib
import os

import torch

from jagg.config import Config, ModelConfig
from jagg.distributed import DistInfo
from jagg.engine.sde import diffusers_sigmas
from jagg.errors import ConfigError
from jagg.models import BACKBONES, Backbone, Components
from jagg.scale.hub import load_or_explain
from jagg.scale.pipelines import (
    CachedTextEncoder,
    FluxTextEncoder,
    QwenImageTextEncoder,
    SD3TextEncoder,
    VaeDecoder,
    WanTextEncoder,
)
from jagg.scale.placement import weights_dtype
from jagg.scale.prompts import load_prompts

# name -> default hub id (the paper's backbones)
PRETRAINED_IDS = {
    "flux": "black-forest-labs/FLUX.1-dev",
    "qwenimage": "Qwen/Qwen-Image",
    "sd3": "stabilityai/stable-diffusion-3.5-medium",  # Flow-GRPO's SD3.5-M
    # Wan2.1-T2V-1.3B; Wan-AI/Wan2.2-TI2V-5B-Diffusers and Wan-AI/Wan2.2-T2V-A14B-Diffusers by model.path
    "wan": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
}
_HOW = {
    "flux": "FLUX.1-dev is gated: accept its licence on the hub before downloading.",
    "sd3": "Stable Diffusion 3.5 is gated: accept its licence on the hub before downloading.",
}


def _subfolder(path: str, sub: str) -> str | None:
    """``sub`` for a pipeline layout; None when ``path`` is a local bare-model directory."""
    if os.path.isdir(path) and not os.path.isdir(os.path.join(path, sub)):
        return None
    return sub


def load_transformer(
    name: str,
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    meta: bool = False,
    subfolder: str = "transformer",
):
    """The real diffusers transformer class of backbone ``name`` with pretrained weights in ``dtype`` (from the
    pipeline's ``subfolder``: ``transformer_2`` is Wan2.2-A14B's low-noise expert).

    ``meta=True``: the same architecture (its ``config.json`` only) on the meta device, no weights read: what
    ranks other than 0 build under FSDP2 (``jagg.scale.distributed.shard_from_rank0`` sends them their
    shards of rank 0's weights). Weights load with ``low_cpu_mem_usage`` (no random init first).
    """
    if name not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {name!r}")
    cls = BACKBONES[name].transformer_cls
    repo = name_or_path or PRETRAINED_IDS[name]

    def load(p: str, local: bool):
        sub = _subfolder(p, subfolder)
        if meta:
            config = cls.load_config(p, subfolder=sub, local_files_only=local)
            with torch.device("meta"):
                return cls.from_config(config).to(dtype)
        return cls.from_pretrained(
            p, subfolder=sub, torch_dtype=dtype, local_files_only=local, low_cpu_mem_usage=True
        )

    what = f"{name} {subfolder} " + ("config" if meta else "weights")
    return load_or_explain(load, repo, what=what, how=_HOW.get(name, ""))


def load_backbone(
    name: str,
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    gradient_checkpointing: bool = False,
    device: str | torch.device | None = None,
    meta: bool = False,
    **adapter_kwargs,
) -> Backbone:
    """``FluxBackbone`` / ``QwenImageBackbone`` around the pretrained transformer (``meta``: see
    ``load_transformer``).

    ``adapter_kwargs`` go to the adapter (``guidance_scale`` for Flux, ``true_cfg_scale`` for Qwen-Image).
    Gradient checkpointing is diffusers' own (per transformer block); it gives bit-identical gradients.
    """
    transformer = load_transformer(name, name_or_path, dtype=dtype, meta=meta)
    if name == "wan":  # the pipeline's model_index.json says whether there is a second expert and where
        adapter_kwargs = {**adapter_kwargs, **wan_pipeline_kwargs(name_or_path or PRETRAINED_IDS[name])}
        if adapter_kwargs["boundary_ratio"] is not None:
            expert = load_transformer(name, name_or_path, dtype=dtype, meta=meta, subfolder="transformer_2")
            adapter_kwargs["transformer_2"] = expert
    backbone = BACKBONES[name](transformer, **adapter_kwargs)
    if gradient_checkpointing:
        set_gradient_checkpointing(backbone)
    return backbone.to(device) if device is not None else backbone


def wan_pipeline_kwargs(name_or_path: str) -> dict:
    """``boundary_ratio`` (Wan2.2-A14B: 0.875, its two experts; else None) and ``expand_timesteps`` (Wan2.2-TI2V-5B)
    from a Wan pipeline's ``model_index.json``, where ``WanPipeline`` reads them. A bare transformer folder has
    none: one expert."""
    from diffusers import DiffusionPipeline

    def load(p: str, local: bool) -> dict:
        if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "model_index.json")):
            return {}
        return dict(DiffusionPipeline.load_config(p, local_files_only=local))

    index = load_or_explain(load, name_or_path, what="wan pipeline model_index.json")
    has_second = (index.get("transformer_2") or [None])[0] is not None
    ratio = index.get("boundary_ratio") if has_second else None
    return {"boundary_ratio": ratio, "expand_timesteps": bool(index.get("expand_timesteps", False))}


def load_scheduler_config(name_or_path: str) -> dict:
    """The ``FlowMatchEulerDiscreteScheduler`` config dict of a pipeline repo (its ``scheduler/`` folder).

    Pass the result to ``jagg.engine.sde.diffusers_sigmas(config, num_steps, image_seq_len)``. Also accepts a hub
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
    for transformer in (backbone.transformer, getattr(backbone, "transformer_2", None)):
        if transformer is None:
            continue
        if enabled:
            transformer.enable_gradient_checkpointing()
        else:
            transformer.disable_gradient_checkpointing()


# --------------------------------------------------------------------------- whole pipelines
# pipeline subfolder -> (module, class) of the text encoders / tokenizers / VAE, as in the diffusers
# model_index.json of FLUX.1-dev and Qwen-Image. Tokenizers load through AutoTokenizer.
PIPELINE_PARTS = {
    "flux": {
        "text_encoder": ("transformers", "CLIPTextModel"),
        "tokenizer": ("transformers", "AutoTokenizer"),
        "text_encoder_2": ("transformers", "T5EncoderModel"),
        "tokenizer_2": ("transformers", "AutoTokenizer"),
        "vae": ("diffusers", "AutoencoderKL"),
    },
    "qwenimage": {
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "AutoTokenizer"),
        "vae": ("diffusers", "AutoencoderKLQwenImage"),
    },
    "sd3": {  # stable-diffusion-3.5-medium's model_index.json
        "text_encoder": ("transformers", "CLIPTextModelWithProjection"),
        "tokenizer": ("transformers", "AutoTokenizer"),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
        "tokenizer_2": ("transformers", "AutoTokenizer"),
        "text_encoder_3": ("transformers", "T5EncoderModel"),
        "tokenizer_3": ("transformers", "AutoTokenizer"),
        "vae": ("diffusers", "AutoencoderKL"),
    },
    "wan": {  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers' (and Wan2.2's) model_index.json
        "text_encoder": ("transformers", "UMT5EncoderModel"),
        "tokenizer": ("transformers", "AutoTokenizer"),
        "vae": ("diffusers", "AutoencoderKLWan"),
    },
}


def part_class(name: str, sub: str) -> type:
    """The class of pipeline component ``sub`` of backbone ``name`` (``PIPELINE_PARTS``)."""
    module, cls_name = PIPELINE_PARTS[name][sub]
    return getattr(importlib.import_module(module), cls_name)


def load_part(name: str, sub: str, name_or_path: str | None = None, *, dtype: torch.dtype = torch.bfloat16):
    """One pipeline component (``sub`` of ``PIPELINE_PARTS[name]``) from a hub id or a local pipeline folder."""
    cls = part_class(name, sub)
    repo = name_or_path or PRETRAINED_IDS[name]

    def load(p: str, local: bool):
        kw = {} if sub.startswith("tokenizer") else {"torch_dtype": dtype}
        return cls.from_pretrained(p, subfolder=sub, local_files_only=local, **kw)

    return load_or_explain(load, repo, what=f"{name} {sub}", how=_HOW.get(name, ""))


def load_text_encoder(cfg: Config, device: torch.device, dtype: torch.dtype):
    """The backbone's real text encoder(s) as ``encode_prompts(list[str]) -> TextCond``."""
    m = cfg.model
    part = lambda sub: load_part(m.backbone, sub, m.path, dtype=dtype)  # noqa: E731
    if m.backbone == "flux":
        return FluxTextEncoder(
            part("text_encoder"),
            part("tokenizer"),
            part("text_encoder_2"),
            part("tokenizer_2"),
            max_sequence_length=m.max_sequence_length,
            device=device,
        )
    if m.backbone == "sd3":
        return SD3TextEncoder(
            *(part(sub) for sub in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")),
            part("text_encoder_3"),
            part("tokenizer_3"),
            max_sequence_length=m.max_sequence_length,
            negative_prompt=m.negative_prompt if m.true_cfg_scale > 1 else None,
            device=device,
        )
    if m.backbone == "wan":
        return WanTextEncoder(
            part("text_encoder"),
            part("tokenizer"),
            max_sequence_length=m.max_sequence_length,
            negative_prompt=m.negative_prompt if m.true_cfg_scale > 1 else None,
            device=device,
        )
    return QwenImageTextEncoder(
        part("text_encoder"),
        part("tokenizer"),
        max_sequence_length=m.max_sequence_length,
        negative_prompt=m.negative_prompt if m.true_cfg_scale > 1 else None,
        device=device,
    )


def pretrained_schedules(cfg: Config) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(train, eval) sigmas from the pipeline's scheduler (``sampling.schedule=scheduler``), else (None, None)
    so the trainer uses the shifted linear schedule. Image sequence length = (latent_size / 2)^2 tokens."""
    s = cfg.sampling
    if s.schedule != "scheduler":
        return None, None
    sched = load_scheduler_config(cfg.model.path or cfg.model.backbone)
    if cfg.model.backbone == "sd3":
        return sd3_sigmas(sched, s.num_steps), sd3_sigmas(sched, s.eval_num_steps)
    seq_len = (s.latent_size // 2) * ((s.latent_width or s.latent_size) // 2)
    return diffusers_sigmas(sched, s.num_steps, seq_len), diffusers_sigmas(sched, s.eval_num_steps, seq_len)


def sd3_sigmas(scheduler_config: dict, num_steps: int, dtype=torch.float64) -> torch.Tensor:
    """Sigmas (S + 1,) of ``StableDiffusion3Pipeline``: ``scheduler.set_timesteps(num_steps)`` without a sigma list
    (timesteps evenly spaced from sigma_max to the shifted sigma_min, then shifted by ``shift``, 3.0 for
    SD3.5-M; no dynamic shift), as Flow-GRPO's ``pipeline_with_logprob`` through ``retrieve_timesteps``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    sched.set_timesteps(num_steps)
    return sched.sigmas.to(dtype)


def adapter_kwargs(m: ModelConfig) -> dict:
    """The backbone adapter's guidance arguments from ``model`` (the loader's and ``make plan-check``'s)."""
    return {
        "flux": {"guidance_scale": m.guidance_scale},  # embedded guidance
        "qwenimage": {"true_cfg_scale": m.true_cfg_scale},
        "sd3": {"guidance_scale": m.true_cfg_scale},  # true CFG (SD3Backbone)
        # true CFG; Wan2.2-A14B's low-noise expert has its own scale (WanPipeline's guidance_scale_2)
        "wan": {"guidance_scale": m.true_cfg_scale, "guidance_scale_2": m.true_cfg_scale_2},
    }[m.backbone]


def load_dtype(cfg: Config, part: str = "text_encoder") -> torch.dtype:
    """The dtype a pipeline part is loaded in: the text encoders in ``train.precision``'s, the transformer and
    the VAE in the frozen base's (``weights_dtype``: fp32 with ``model.base_dtype: fp32``). The weights check
    compares the checkpoints' stored dtypes with it."""
    if part in ("transformer", "vae"):
        return weights_dtype(cfg)
    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


def precompute_embeddings(text, prompts: list[str], info: DistInfo) -> int:
    """Every prompt's embedding in ``text``'s cache before the encoders are freed; returns how many this rank
    encoded. Rank r of the job encodes every world_size-th prompt; then, on several nodes, rank l of each node
    encodes every local_world_size-th prompt its node's cache still lacks: nothing when ``data.embedding_cache``
    is shared by every node, the other nodes' shares when it is a node-local disk (there each node holds every
    prompt, else a rank that needs another node's prompt would find the encoders released)."""
    done = text.precompute(prompts, info.rank, info.world_size)
    info.barrier()
    if text.cache_dir is not None and info.nodes > 1:
        done += text.precompute(prompts, info.local_rank, info.local_world_size)
        info.barrier()
    return done


def latent_shape(cfg: Config, channels: int) -> tuple[int, ...]:
    """(C, H, W) of one sample's latent, Wan's video (C, F, H, W) with F = ``sampling.latent_frames``; W is
    ``sampling.latent_width`` where set (non-square), else H = ``sampling.latent_size``."""
    s = cfg.sampling
    width = s.latent_width or s.latent_size
    if cfg.model.backbone == "wan":
        return (channels, s.latent_frames, s.latent_size, width)
    return (channels, s.latent_size, width)


def build_pretrained_components(cfg: Config) -> Components:
    """Components of a real FLUX.1-dev / Qwen-Image run (``model.source=pretrained``).

    Weights load in bf16 when ``train.precision=bf16`` (else fp32), the transformer and the VAE in fp32 with
    ``model.base_dtype: fp32``; text encoders and VAE go to the training
    device, the transformer stays on CPU for the trainer to place (and shard). Under several processes only
    rank 0 reads the transformer's weights; the other ranks build it on the meta device and receive their
    shards from rank 0 when the trainer shards it (``jagg.scale.placement``). With
    ``data.precompute_embeddings`` every train/eval prompt is encoded first (rank-strided into
    ``data.embedding_cache`` when set) and the text encoders are freed.
    """
    m, d, t = cfg.model, cfg.data, cfg.train
    device = torch.device("cuda" if t.device == "auto" and torch.cuda.is_available() else t.device)
    dtype = load_dtype(cfg)  # the text encoders'
    weights = load_dtype(cfg, "transformer")  # and the VAE's: fp32 with model.base_dtype=fp32
    info = DistInfo.current()
    backbone = load_backbone(m.backbone, m.path, dtype=weights, meta=not info.is_main, **adapter_kwargs(m))
    decoder = VaeDecoder(load_part(m.backbone, "vae", m.path, dtype=weights), device=device)
    if decoder.vae.config.get("latent_channels", decoder.vae.config.get("z_dim")) != backbone.latent_channels:
        raise ConfigError(f"model.path={m.path}: VAE latent channels do not match the transformer's")
    namespace = (
        f"{m.backbone}|{m.path}|{m.max_sequence_length}|{m.negative_prompt if m.true_cfg_scale > 1 else ''}"
    )
    text = CachedTextEncoder(
        load_text_encoder(cfg, device, dtype), cache_dir=d.embedding_cache, namespace=namespace
    )
    train = load_prompts(d.train_prompts, limit=d.train_limit)
    evals = load_prompts(d.eval_prompts, limit=d.eval_limit)
    if d.precompute_embeddings:
        precompute_embeddings(text, list(train.prompts) + list(evals.prompts), info)
        text.release()
    sigmas, eval_sigmas = pretrained_schedules(cfg)
    return Components(
        backbone=backbone,
        text_encoder=text,
        decode=decoder,
        train_prompts=list(train.prompts),
        eval_prompts=list(evals.prompts),
        latent_shape=latent_shape(cfg, backbone.latent_channels),
        sigmas=sigmas,
        eval_sigmas=eval_sigmas,
    )
