"""Real preference / alignment rewards: HPSv2.1, PickScore, CLIPScore (docs/references.md).

All three are CLIP models scoring cos(image embedding, text embedding), with different weights and scales:
    hpsv2      open_clip ViT-H-14 + HPS_v2.1_compressed.pt (hub repo xswu/HPSv2); reward = cos (~0.25-0.37).
               Built as the ``hpsv2`` package does internally (open_clip model, then the checkpoint's
               ``state_dict``), without that package: its 1.2.0 wheel is broken (missing BPE vocab, old pins).
               Preprocessed as hpsv2's validation transform (``ResizeMaxSize``: longest side to 224, zero
               padding to a square); tests/test_hpsv2_reference.py checks the scores against hpsv2 itself.
    pickscore  transformers CLIPModel yuvalkirstain/PickScore_v1, tokenizer of laion/CLIP-ViT-H-14-laion2B-s32B-b79K.
               ``scale="cosine"`` (default): cos, as DanceGRPO (~0.22); ``scale="flow_grpo"``: logit_scale * cos / 26,
               as Flow-GRPO (~0.85); ``scale="logit"``: logit_scale * cos, the PickScore paper's score (~22).
    clipscore  openai/clip-vit-large-patch14; 100 * cos / 30 as Flow-GRPO (bounded by 100/30 in absolute value).

Departures from the references, all deliberate:
    * Preprocessing runs as torch ops on the decoded (B, 3, H, W) tensor in [0, 1] (no PIL round trip, no uint8
      quantisation). PickScore / CLIPScore: bicubic resize of the short side with antialiasing, centre crop, clamp
      to [0, 1], CLIP mean/std; the references go through PIL, so scores differ in the ~3rd decimal. HPSv2:
      hpsv2's own tensor transform (``hps_preprocess``), equal to it on the same pixels.
    * Text is always padded to the model's context length (77), which makes scores independent of the batch.
    * CLIPScore uses the constant 100 rather than the model's ``logit_scale.exp()`` (equal for CLIP-L).
Every reward is also constructible from an already-built model + tokenizer (``from_model``), which is how the
tests run the same preprocessing and scoring code on tiny random-init models offline.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg.errors import WeightsUnavailableError
from jagg.rewards import register_reward
from jagg.scale.hub import hub_file, load_or_explain, unavailable_message

# OpenAI CLIP normalisation; also used by the laion ViT-H-14 (HPSv2, PickScore processor) and CLIP-L.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_preprocess(images: Tensor, size: int, mean=CLIP_MEAN, std=CLIP_STD) -> Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 3, size, size) normalised CLIP input.

    Short side resized to ``size`` (bicubic, antialias), centre crop, clamp, (x - mean) / std: the
    ``CLIPImageProcessor`` / open_clip validation transform, as tensor ops.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
    x = images.float()
    h, w = x.shape[-2:]
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    x = x[:, :, top : top + size, left : left + size].clamp(0, 1)  # (B, 3, size, size)
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - m) / s


def clip_bpe_tokenizer(context_length: int = 77):
    """A real CLIP BPE tokenizer (transformers ``CLIPTokenizer``) built offline from open_clip's bundled vocab.

    Same vocabulary and merges as openai/clip-vit-large-patch14 and the laion ViT-H-14 (49,408 tokens,
    bos 49406, eos 49407). transformers 5 takes ``vocab=`` / ``merges=``; ``vocab_file=`` is silently ignored.
    """
    import open_clip
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]  # the merge list open_clip uses
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok.model_max_length = context_length
    return tok


def hps_preprocess(images: Tensor, size: int, mean=CLIP_MEAN, std=CLIP_STD) -> Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 3, size, size): hpsv2's validation transform as batched tensor ops.

    ``hpsv2/src/open_clip/transform.py`` (``image_transform(..., light_augmentation=True)`` after ``ToTensor``):
    ``ResizeMaxSize`` scales the longest side to ``size`` (bicubic with antialiasing, no clamp) and zero-pads
    the short side symmetrically (extra pixel right / bottom), then ``MaskAwareNormalize`` applies mean / std.
    An image already ``size`` on its longest side is left as is there (a non-square one then fails in the ViT);
    here it is padded.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
    x = images.float()
    h, w = x.shape[-2:]
    scale = size / max(h, w)
    if scale != 1.0:
        h, w = round(h * scale), round(w * scale)
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    pad_h, pad_w = size - h, size - w
    x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))  # zeros: black, as hpsv2
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - m) / s


class _ClipReward:
    """Shared batching / device / no-grad plumbing. Subclasses implement ``_embed(pixels, prompts)``."""

    name = "clip"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Callable,
        image_size: int,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
        mean=CLIP_MEAN,
        std=CLIP_STD,
    ) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.image_size, self.batch_size = int(image_size), int(batch_size)
        self.mean, self.std = mean, std

    def _embed(self, pixels: Tensor, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(B, 3, S, S) normalised pixels, B prompts -> unnormalised image and text embeddings (B, D)."""
        raise NotImplementedError

    def _preprocess(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> (B, 3, S, S) model input (CLIP's short-side resize and centre crop)."""
        return clip_preprocess(images, self.image_size, self.mean, self.std)

    def _scale(self, cos: Tensor) -> Tensor:
        return cos

    @torch.no_grad()
    def cosine(self, images: Tensor, prompts: list[str]) -> Tensor:
        """(B,) float32 cosine between image and prompt embeddings, computed in chunks of ``batch_size``."""
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        out = []
        for i in range(0, len(prompts), self.batch_size):
            chunk = images[i : i + self.batch_size].to(self.device)
            pixels = self._preprocess(chunk).to(self.dtype)
            img, txt = self._embed(pixels, list(prompts[i : i + self.batch_size]))
            out.append(F.cosine_similarity(img.float(), txt.float(), dim=-1))  # (b,)
        return torch.cat(out)

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        """``reward(images (B,3,H,W) in [0,1], prompts) -> (B,) float32`` on the images' device."""
        return self._scale(self.cosine(images, prompts)).float().to(images.device)


# --------------------------------------------------------------------------- HPSv2.1
def load_hps_state_dict(path: str, weights_only: bool = True) -> dict[str, Tensor]:
    """The open_clip state dict inside an HPS checkpoint (``{"state_dict": ...}`` or bare; DDP prefix removed).

    ``weights_only=True`` refuses arbitrary pickled objects; pass False only for a checkpoint you trust.
    """
    ckpt = torch.load(path, map_location="cpu", weights_only=weights_only)
    sd = ckpt.get("state_dict", ckpt) if isinstance(ckpt, dict) else ckpt
    return {k.removeprefix("module."): v for k, v in sd.items()}


@register_reward("hpsv2")
class HPSv2Reward(_ClipReward):
    """HPSv2.1 (Wu et al. 2023, github.com/tgxs002/HPSv2): cos(image, text) of an open_clip ViT-H-14.

    ``checkpoint``: hub repo id (file ``filename`` inside it), a local directory holding that file, or the
    local .pt file itself. ``arch``: the open_clip model name the checkpoint belongs to.
    """

    name = "hpsv2"

    def __init__(
        self,
        checkpoint: str = "xswu/HPSv2",
        filename: str = "HPS_v2.1_compressed.pt",
        arch: str = "ViT-H-14",
        weights_only: bool = True,
        **kwargs,
    ) -> None:
        import open_clip

        if os.path.isfile(os.path.expanduser(checkpoint)):
            path = os.path.expanduser(checkpoint)
        else:
            path = hub_file(checkpoint, filename, what="HPSv2.1 reward checkpoint")
        model = open_clip.create_model(arch, pretrained=None)  # random init; the checkpoint has every weight
        model.load_state_dict(load_hps_state_dict(path, weights_only))
        self._init_from(model, open_clip.get_tokenizer(arch), **kwargs)

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Callable, **kwargs) -> HPSv2Reward:
        """Wrap an already-built open_clip ``CLIP`` and its tokenizer (``tokenizer(list[str]) -> (B, 77)``)."""
        self = cls.__new__(cls)
        self._init_from(model, tokenizer, **kwargs)
        return self

    def _init_from(self, model: nn.Module, tokenizer: Callable, **kwargs) -> None:
        size = model.visual.image_size
        size = size[0] if isinstance(size, tuple | list) else size
        mean = getattr(model.visual, "image_mean", None) or CLIP_MEAN
        std = getattr(model.visual, "image_std", None) or CLIP_STD
        super().__init__(model, tokenizer, size, mean=mean, std=std, **kwargs)

    def _preprocess(self, images: Tensor) -> Tensor:
        return hps_preprocess(images, self.image_size, self.mean, self.std)

    def _embed(self, pixels: Tensor, prompts: list[str]) -> tuple[Tensor, Tensor]:
        tokens = self.tokenizer(prompts).to(self.device)  # (B, 77)
        return self.model.encode_image(pixels), self.model.encode_text(tokens)


# --------------------------------------------------------------------------- transformers CLIP models
def _load_hf_clip(model_id: str, tokenizer_id: str, what: str):
    from transformers import AutoTokenizer, CLIPModel

    model = load_or_explain(
        lambda p, local: CLIPModel.from_pretrained(p, local_files_only=local), model_id, what=f"{what} model"
    )
    tokenizer = load_or_explain(
        lambda p, local: AutoTokenizer.from_pretrained(p, local_files_only=local),
        tokenizer_id,
        what=f"{what} tokenizer",
    )
    return model, tokenizer


def _features(out) -> Tensor:
    """transformers 5 returns a ModelOutput (projected embedding in ``pooler_output``); 4.x a tensor."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


class _HFClipReward(_ClipReward):
    """A transformers ``CLIPModel`` + tokenizer; text padded to the model's context length."""

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer: Callable, **kwargs):
        """Wrap an already-built ``CLIPModel`` and a CLIP tokenizer (e.g. ``clip_bpe_tokenizer()``)."""
        self = cls.__new__(cls)
        self._init_from(model, tokenizer, **kwargs)
        return self

    def _init_from(self, model: nn.Module, tokenizer: Callable, **kwargs) -> None:
        self.context_length = model.config.text_config.max_position_embeddings
        super().__init__(model, tokenizer, model.config.vision_config.image_size, **kwargs)

    def _embed(self, pixels: Tensor, prompts: list[str]) -> tuple[Tensor, Tensor]:
        tok = self.tokenizer(
            prompts,
            padding="max_length",
            truncation=True,
            max_length=self.context_length,
            return_tensors="pt",
        ).to(self.device)
        img = _features(self.model.get_image_features(pixel_values=pixels))
        txt = _features(
            self.model.get_text_features(input_ids=tok.input_ids, attention_mask=tok.attention_mask)
        )
        return img, txt


PICKSCORE_SCALES = ("cosine", "flow_grpo", "logit")


@register_reward("pickscore")
class PickScoreReward(_HFClipReward):
    """PickScore (Kirstain et al. 2023): CLIP-H fine-tuned on Pick-a-Pic preferences.

    ``scale``: "cosine" (DanceGRPO, default), "flow_grpo" (logit_scale * cos / 26, Flow-GRPO's
    ``PickScoreScorer``) or "logit" (logit_scale * cos, the PickScore model card).
    """

    name = "pickscore"

    def __init__(
        self,
        model: str = "yuvalkirstain/PickScore_v1",
        processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        scale: str = "cosine",
        **kwargs,
    ) -> None:
        _check_scale(scale)
        clip, tok = _load_hf_clip(model, processor, "PickScore reward")
        self._init_from(clip, tok, scale=scale, **kwargs)

    def _init_from(self, model: nn.Module, tokenizer: Callable, scale: str = "cosine", **kwargs) -> None:
        _check_scale(scale)
        self.scale = scale
        super()._init_from(model, tokenizer, **kwargs)

    def _scale(self, cos: Tensor) -> Tensor:
        if self.scale == "cosine":
            return cos
        logit = self.model.logit_scale.exp().float().to(cos.device) * cos
        return logit / 26 if self.scale == "flow_grpo" else logit


def _check_scale(scale: str) -> None:
    if scale not in PICKSCORE_SCALES:
        raise ValueError(f"pickscore scale must be one of {PICKSCORE_SCALES}, got {scale!r}")


@register_reward("clipscore")
class CLIPScoreReward(_HFClipReward):
    """CLIPScore with OpenAI CLIP ViT-L/14: 100 * cos / 30, as Flow-GRPO's ``ClipScorer``."""

    name = "clipscore"

    def __init__(self, model: str = "openai/clip-vit-large-patch14", tokenizer: str | None = None, **kwargs):
        clip, tok = _load_hf_clip(model, tokenizer or model, "CLIPScore reward")
        self._init_from(clip, tok, **kwargs)

    def _scale(self, cos: Tensor) -> Tensor:
        return 100.0 * cos / 30.0


__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "CLIPScoreReward",
    "HPSv2Reward",
    "PICKSCORE_SCALES",
    "PickScoreReward",
    "WeightsUnavailableError",
    "clip_bpe_tokenizer",
    "clip_preprocess",
    "hps_preprocess",
    "load_hps_state_dict",
    "unavailable_message",
]
