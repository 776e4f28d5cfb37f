"""Real text encoders, VAE decoders and a prompt-embedding cache for FLUX.1-dev, Qwen-Image, SD3.5 and Wan.

They implement the two interfaces the trainer needs (``jagg.models.Components``):
    text_encoder.encode_prompts(list[str]) -> TextCond
    decode(latents (B, 16, h, w)) -> images (B, 3, 8h, 8w) float in [0, 1]
Prompt encoding calls diffusers' own ``FluxPipeline.encode_prompt`` (CLIP-L pooled vector + T5 token
embeddings padded to ``max_sequence_length``) and ``QwenImagePipeline.encode_prompt`` (Qwen2.5-VL last hidden
state under the pipeline's chat template, template tokens dropped, variable length with a mask), on pipeline
objects that hold only the text encoders. Decoding follows the last lines of the pipelines' ``__call__``:
Flux  z / scaling_factor + shift_factor -> AutoencoderKL.decode;
Qwen  z * latents_std + latents_mean on a frame axis (B, 16, 1, h, w) -> AutoencoderKLQwenImage.decode -> frame 0.
The adapters work on unpacked (B, 16, h, w) latents, so the pipelines' 2x2 unpacking is not needed here.

``CachedTextEncoder`` stores one embedding per distinct prompt (in memory, bounded, or as files in a
directory shared by all ranks) so the text encoders can be freed after ``precompute`` (DanceGRPO also
precomputes its Flux embeddings to disk).
"""

from __future__ import annotations

import gc
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg.models import TextCond


# --------------------------------------------------------------------------- text encoders
def _frozen(module: nn.Module, device: torch.device) -> nn.Module:
    return module.to(device).eval().requires_grad_(False)


class PipelineTextEncoder:
    """What the four text encoders share: a diffusers pipeline that holds only the text encoders (frozen, on
    ``device``), prompts encoded up to ``max_sequence_length`` tokens into a ``TextCond`` on the CPU (``_encode``,
    each pipeline's own ``encode_prompt``), and the negative prompt (true CFG), when given, encoded once and
    attached to every row."""

    def __init__(
        self, pipe, device: torch.device, max_sequence_length: int, negative_prompt: str | None
    ) -> None:
        self.pipe, self.device, self.max_sequence_length = pipe, device, max_sequence_length
        self.negative = self._encode([negative_prompt]) if negative_prompt is not None else None

    def _encode(self, prompts: list[str]) -> TextCond:
        raise NotImplementedError

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> TextCond:
        cond = self._encode(list(prompts))
        if self.negative is not None:
            n, neg = len(prompts), self.negative
            cond.neg_embeds = neg.embeds.expand(n, -1, -1)
            cond.neg_mask = None if neg.mask is None else neg.mask.expand(n, -1)
            cond.neg_pooled = None if neg.pooled is None else neg.pooled.expand(n, -1)
        return cond


class FluxTextEncoder(PipelineTextEncoder):
    """CLIP-L (pooled) + T5 (tokens) through ``FluxPipeline.encode_prompt``; no negative prompt."""

    def __init__(
        self, clip, clip_tokenizer, t5, t5_tokenizer, *, max_sequence_length: int = 512, device=None
    ):
        from diffusers import FluxPipeline

        device = torch.device(device or "cpu")
        pipe = FluxPipeline(
            scheduler=None,
            vae=None,
            text_encoder=_frozen(clip, device),
            tokenizer=clip_tokenizer,
            text_encoder_2=_frozen(t5, device),
            tokenizer_2=t5_tokenizer,
            transformer=None,
        )
        super().__init__(pipe, device, max_sequence_length, None)

    def _encode(self, prompts: list[str]) -> TextCond:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return TextCond(embeds=embeds.cpu(), pooled=pooled.cpu())  # (B, L, 4096), (B, 768)


class QwenImageTextEncoder(PipelineTextEncoder):
    """Qwen2.5-VL through ``QwenImagePipeline.encode_prompt``, with masks; the negative prompt when
    ``true_cfg_scale > 1``."""

    def __init__(
        self,
        text_encoder,
        tokenizer,
        *,
        max_sequence_length: int = 512,
        negative_prompt: str | None = None,
        device=None,
    ):
        from diffusers import QwenImagePipeline

        device = torch.device(device or "cpu")
        pipe = QwenImagePipeline(
            scheduler=None,
            vae=None,
            text_encoder=_frozen(text_encoder, device),
            tokenizer=tokenizer,
            transformer=None,
        )
        super().__init__(pipe, device, max_sequence_length, negative_prompt)

    def _encode(self, prompts: list[str]) -> TextCond:
        embeds, mask = self.pipe.encode_prompt(
            prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return TextCond(embeds=embeds.cpu(), mask=mask.cpu())  # (B, L, D), (B, L)


class SD3TextEncoder(PipelineTextEncoder):
    """CLIP-L + CLIP-G (pooled, and tokens beside T5's) + T5 through ``StableDiffusion3Pipeline.encode_prompt``;
    the negative prompt (Flow-GRPO encodes "") with its pooled vector."""

    def __init__(
        self,
        clip_l,
        clip_l_tokenizer,
        clip_g,
        clip_g_tokenizer,
        t5,
        t5_tokenizer,
        *,
        max_sequence_length: int = 256,
        negative_prompt: str | None = None,
        device=None,
    ):
        from diffusers import StableDiffusion3Pipeline

        device = torch.device(device or "cpu")
        pipe = StableDiffusion3Pipeline(
            transformer=None,
            scheduler=None,
            vae=None,
            text_encoder=_frozen(clip_l, device),
            tokenizer=clip_l_tokenizer,
            text_encoder_2=_frozen(clip_g, device),
            tokenizer_2=clip_g_tokenizer,
            text_encoder_3=_frozen(t5, device),
            tokenizer_3=t5_tokenizer,
        )
        super().__init__(pipe, device, max_sequence_length, negative_prompt)

    def _encode(self, prompts: list[str]) -> TextCond:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return TextCond(embeds=embeds.cpu(), pooled=pooled.cpu())  # (B, 77 + L, 4096), (B, 2048)


class WanTextEncoder(PipelineTextEncoder):
    """UMT5-XXL through ``WanPipeline.encode_prompt``: the last hidden state cut at each prompt's length and
    zero-padded to ``max_sequence_length`` (the transformer takes no mask); the negative prompt (true CFG)."""

    def __init__(
        self,
        umt5,
        tokenizer,
        *,
        max_sequence_length: int = 512,
        negative_prompt: str | None = None,
        device=None,
    ):
        from diffusers import WanPipeline

        device = torch.device(device or "cpu")
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=_frozen(umt5, device), vae=None, scheduler=None)
        super().__init__(pipe, device, max_sequence_length, negative_prompt)

    def _encode(self, prompts: list[str]) -> TextCond:
        embeds, _ = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return TextCond(embeds=embeds.cpu())  # (B, max_sequence_length, 4096)


# --------------------------------------------------------------------------- VAE decoders
class VaeDecoder:
    """``decode(latents (B, 16, h, w)) -> (B, 3, H, W) in [0, 1]``, in chunks, without grad.

    ``frame_axis``: Qwen-Image's video VAE takes (B, C, 1, h, w) and normalises with per-channel
    ``latents_mean`` / ``latents_std``; Flux's AutoencoderKL uses ``scaling_factor`` / ``shift_factor``. Wan's
    video VAE (the same normalisation, ``WanPipeline.__call__``'s last lines) decodes (B, C, F, h, w) video
    latents to (B, 3, 4 (F - 1) + 1, H, W) frames; a 4-D latent is one frame there too.
    """

    def __init__(self, vae: nn.Module, *, device=None, batch_size: int = 4) -> None:
        self.device = torch.device(device or "cpu")
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        self.batch_size = batch_size
        self.frame_axis = hasattr(vae.config, "latents_std") and hasattr(vae.config, "z_dim")

    @property
    def scale_factor(self) -> int:
        """Pixels per latent cell (8 for both real VAEs), as the pipelines compute ``vae_scale_factor``."""
        if self.vae.config.get("scale_factor_spatial"):  # Wan (16 for Wan2.2's patchified VAE)
            return self.vae.config.scale_factor_spatial
        if self.frame_axis:
            return 2 ** len(self.vae.temperal_downsample)
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def _unscale(self, z: Tensor) -> Tensor:
        cfg = self.vae.config
        if self.frame_axis:
            shape = (1, cfg.z_dim, 1, 1, 1)
            mean = torch.tensor(cfg.latents_mean, dtype=z.dtype, device=z.device).view(shape)
            std = torch.tensor(cfg.latents_std, dtype=z.dtype, device=z.device).view(shape)
            return (z if z.ndim == 5 else z[:, :, None]) * std + mean  # (B, C, F, h, w)
        return z / cfg.scaling_factor + (cfg.shift_factor or 0.0)

    @torch.no_grad()
    def __call__(self, latents: Tensor) -> Tensor:
        dtype = next(self.vae.parameters()).dtype
        out = []
        for i in range(0, latents.shape[0], self.batch_size):
            z = self._unscale(latents[i : i + self.batch_size].to(self.device, torch.float32))
            img = self.vae.decode(z.to(dtype), return_dict=False)[0]
            if self.frame_axis and latents.ndim == 4:
                img = img[:, :, 0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1).cpu())  # [-1, 1] -> [0, 1]
        return torch.cat(out)


# --------------------------------------------------------------------------- embedding cache
def _rows(cond: TextCond) -> list[TextCond]:
    """Split a batch into single-row conds, trimming masked padding (masks are prefixes of ones)."""
    out = []
    for i in range(cond.batch_size):
        row = cond.select(slice(i, i + 1))
        if row.mask is not None:
            n = int(row.mask.sum())
            row.embeds, row.mask = row.embeds[:, :n], row.mask[:, :n]
        if row.neg_mask is not None:
            n = int(row.neg_mask.sum())
            row.neg_embeds, row.neg_mask = row.neg_embeds[:, :n], row.neg_mask[:, :n]
        out.append(row._map(lambda t: t.clone()))
    return out


def _pad_cat(tensors: list[Tensor]) -> Tensor:
    """Concatenate (1, L_i, ...) tensors along dim 0, zero-padding dim 1 to the longest."""
    n = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = [0, 0] * (t.ndim - 2) + [0, n - t.shape[1]]
        padded.append(F.pad(t, pad))
    return torch.cat(padded)


def collate(rows: list[TextCond]) -> TextCond:
    """Inverse of ``_rows``: one batch, padded to the longest prompt with mask zeros."""
    fields = {}
    for name in ("embeds", "mask", "pooled", "neg_embeds", "neg_mask", "neg_pooled"):
        vals = [getattr(r, name) for r in rows]
        if vals[0] is None:
            continue
        pooled = name in ("pooled", "neg_pooled")
        fields[name] = _pad_cat(vals) if vals[0].ndim >= 2 and not pooled else torch.cat(vals)
    return TextCond(**fields)


class CachedTextEncoder:
    """Per-prompt embedding cache around a text encoder (``encode_prompts`` compatible).

    ``cache_dir``: one ``<sha1>.pt`` file per prompt (key includes ``namespace``: model path and settings),
    shared by all ranks; otherwise an in-memory LRU of ``max_memory`` prompts. After ``release()`` the text
    encoder is freed and a prompt missing from the cache is an error.
    """

    def __init__(self, encoder, *, cache_dir: str | None = None, namespace: str = "", max_memory: int = 512):
        self.encoder = encoder
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.namespace = namespace
        self.max_memory = max_memory
        self.memory: OrderedDict[str, TextCond] = OrderedDict()
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    def _key(self, prompt: str) -> str:
        return hashlib.sha1(f"{self.namespace}\0{prompt}".encode()).hexdigest()

    def _get(self, prompt: str) -> TextCond | None:
        key = self._key(prompt)
        if key in self.memory:
            self.memory.move_to_end(key)
            return self.memory[key]
        if self.cache_dir and (self.cache_dir / f"{key}.pt").is_file():
            return TextCond(**torch.load(self.cache_dir / f"{key}.pt", weights_only=True))
        return None

    def _has(self, prompt: str) -> bool:
        """Whether ``prompt`` is cached, without reading it (a cache file is complete once it exists: ``_put``
        writes a temporary file and renames it)."""
        key = self._key(prompt)
        return key in self.memory or bool(self.cache_dir and (self.cache_dir / f"{key}.pt").is_file())

    def _put(self, prompt: str, row: TextCond) -> None:
        key = self._key(prompt)
        if self.cache_dir:
            tmp = self.cache_dir / f"{key}.pt.tmp{id(self)}"
            torch.save({k: v for k, v in vars(row).items() if v is not None}, tmp)
            tmp.replace(self.cache_dir / f"{key}.pt")
            return
        self.memory[key] = row
        while len(self.memory) > self.max_memory:
            self.memory.popitem(last=False)

    def _encode_missing(self, prompts: list[str], batch_size: int = 32) -> dict[str, TextCond]:
        if self.encoder is None:
            raise RuntimeError(
                f"prompt {prompts[0]!r} is not in the embedding cache and the text encoders were released "
                "(data.precompute_embeddings=true precomputes data.train_prompts and data.eval_prompts only)"
            )
        new = {}
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            for p, row in zip(chunk, _rows(self.encoder.encode_prompts(chunk)), strict=True):
                new[p] = row
                self._put(p, row)
        return new

    def encode_prompts(self, prompts: Sequence[str]) -> TextCond:
        found = {p: self._get(p) for p in dict.fromkeys(prompts)}
        missing = [p for p, row in found.items() if row is None]
        if missing:
            found.update(self._encode_missing(missing))
        return collate([found[p] for p in prompts])

    def precompute(self, prompts: Sequence[str], rank: int = 0, world_size: int = 1) -> int:
        """Encode every not-yet-cached prompt; with a cache directory rank r takes every world_size-th one
        (call ``barrier`` afterwards). Returns the number encoded here. Cached prompts are checked by their
        file's existence, not loaded (a resumed HPDv2 run on Qwen-Image would read ~43 GiB per rank)."""
        unique = list(dict.fromkeys(prompts))
        self.max_memory = max(self.max_memory, len(unique))  # in memory: keep every precomputed prompt
        if self.cache_dir:  # split before looking at the cache: the others write into it meanwhile
            unique = unique[rank::world_size]
        todo = [p for p in unique if not self._has(p)]
        if todo:
            self._encode_missing(todo)
        return len(todo)

    def release(self) -> None:
        """Free the text encoders (GPU memory included); later lookups must hit the cache."""
        self.encoder = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
