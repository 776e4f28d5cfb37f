"""HPSv3 (Ma et al. 2025, github.com/MizzenAI/HPSv3): Qwen2-VL-7B-Instruct with a reward head read at a special
``<|Reward|>`` token; the reward is the head's first output (mu of its (mu, sigma)).

What ``HPSv3RewardInferencer.reward`` does (``hpsv3/inference.py``, ``hpsv3/model/qwen2vl_trainer.py`` :
``Qwen2VLRewardModelBT``, ``hpsv3/train.py`` : ``create_model_and_processor``, ``hpsv3/config/HPSv3_7B.yaml``;
docs/references.md), on transformers' ``Qwen2VLForConditionalGeneration`` without the ``hpsv3`` package:
    image   resized to exactly 256 * 28 * 28 pixels on a 28-pixel grid (``min_pixels = max_pixels``; 448 x 448 for
            a square image), then the Qwen2-VL image processor (CLIP mean / std, 14-pixel patches, 2x2 merge)
    text    one user turn: the image, then ``INSTRUCTION.format(text_prompt=prompt)`` + ``PROMPT_WITH_SPECIAL_TOKEN``
            in Qwen2-VL's chat template with the generation prompt; ``<|Reward|>`` is an added special token
    model   the image embeddings scattered into the token embeddings, the language model run on them with the
            positions of a plain text sequence (their forward passes ``input_ids=None`` to the model, so the
            multimodal rotary index is never built: positions are ``cumsum(attention_mask) - 1``)
    head    ``rm_head`` (``ranknet``: Linear(H, 1024), ReLU, Dropout, Linear(1024, 16), ReLU, Linear(16, 2)) in
            float32 on the hidden state at ``<|Reward|>``; reward = output 0 (mu)

Not the ``hpsv3`` package: it pins trl / deepspeed / flash-attn era dependencies. Weights: ``MizzenAI/HPSv3``
(``HPSv3.safetensors``) or a local file, over ``Qwen/Qwen2-VL-7B-Instruct``'s config and processor (hub id or
local folder); offline without them: ``WeightsUnavailableError`` (``jagg.scale.hub``). The model is built from
the config directly on the reward's device and in its dtype (bf16 by default, as ``HPSv3_7B.yaml``'s
``torch_dtype: bfloat16`` / ``bf16: True``; the head in float32), then the checkpoint is copied in strictly, one
tensor at a time from the memory-mapped file (``load_streamed``): every rank of a node reads the same page cache,
none holds the 16.6 GB state dict in its own memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg.rewards import register_reward
from jagg.scale.hub import hub_file, load_or_explain
from jagg.scale.rewards import CLIP_MEAN, CLIP_STD

# hpsv3 1.0.0 (its sdist on PyPI), hpsv3/dataset/data_collator_qwen.py: INSTRUCTION (lines 11-32) and
# prompt_with_special_token (lines 38-42), copied byte for byte: a prompt, so any change is another score. Pinned
# by SHA-256 in tests/test_hpsv3.py; `make hpsv3-ref` compares them with the sdist (tests/test_hpsv3_reference.py).
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""  # noqa: W291 (their trailing spaces are part of the prompt)
PROMPT_WITH_SPECIAL_TOKEN = """
Please provide the overall ratings of this image: <|Reward|>

END
"""
REWARD_TOKEN = "<|Reward|>"
# hpsv3/config/HPSv3_7B.yaml (torch_dtype: "bfloat16", bf16: True) with hpsv3/train.py : create_model_and_processor
# (model.to(torch.bfloat16), then model.rm_head.to(torch.float32)): the model in bf16, the head in float32
DTYPE = torch.bfloat16
PIXELS = 256 * 28 * 28  # inference.py : prepare_batch (min_pixels = max_pixels)
IMAGE_FACTOR = 28


def chat_text(prompt: str) -> str:
    """Qwen2-VL-Instruct's chat template rendered for one user turn (image, then text) + the generation prompt."""
    text = INSTRUCTION.format(text_prompt=prompt) + PROMPT_WITH_SPECIAL_TOKEN
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def resized_hw(height: int, width: int, pixels: int = PIXELS, factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """qwen-vl-utils ``smart_resize`` with ``min_pixels = max_pixels = pixels``: the aspect ratio kept, both sides
    multiples of ``factor``, the area ``pixels`` up to rounding (448 x 448 for a square image)."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _rm_head(hidden: int, out: int = 2) -> nn.Sequential:
    """``Qwen2VLRewardModelBT``'s ``ranknet`` head without ``rm_head_kwargs`` (HPSv3_7B.yaml)."""
    return nn.Sequential(
        nn.Linear(hidden, 1024),
        nn.ReLU(),
        nn.Dropout(0.05),
        nn.Linear(1024, 16),
        nn.ReLU(),
        nn.Linear(16, out),
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """Parameters created inside are ``dtype`` (torch's default dtype, restored after; None: unchanged)."""
    before = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hpsv3_model(config, special_token_id: int, vocab_size: int, dtype: torch.dtype | None = None):
    """Random-init ``Qwen2VLForConditionalGeneration`` of ``config`` with ``vocab_size`` token embeddings (the
    processor's tokenizer after ``<|Reward|>`` was added) and the float32 ``rm_head``. ``dtype``: the model's
    parameters are created in it (no float32 copy first; None: torch's default dtype)."""
    from transformers import Qwen2VLForConditionalGeneration

    with _default_dtype(dtype):
        model = Qwen2VLForConditionalGeneration(config)
        # the checkpoint overwrites the new row
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.rm_head = _rm_head(config.text_config.hidden_size).float()
    model.reward_token_id = int(special_token_id)
    return model


def hpsv3_key(key: str) -> str:
    """One HPSv3.safetensors key -> transformers 5's ``Qwen2VLForConditionalGeneration`` (+ ``rm_head``): a
    checkpoint saved before transformers 4.52 has ``model.layers`` / ``model.embed_tokens`` / ``model.norm`` /
    ``visual``, later ones ``model.language_model.*`` / ``model.visual.*``; both map to the latter."""
    key = key.removeprefix("module.")
    key = re.sub(r"^visual\.", "model.visual.", key)
    return re.sub(r"^model\.(layers|embed_tokens|norm)\b", r"model.language_model.\1", key)


def convert_hpsv3_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """``hpsv3_key`` on every key of ``state_dict``."""
    return {hpsv3_key(k): v for k, v in state_dict.items()}


def checkpoint_tensors(path: str) -> Iterator[tuple[str, Tensor]]:
    """``(key, tensor)`` of a checkpoint file, one at a time, memory-mapped: a ``.safetensors`` file through
    ``safe_open`` (a tensor is read from the mapping when asked for), a ``.pt`` file through
    ``torch.load(mmap=True)`` (a legacy, non-zip file cannot be mapped: read whole); ``{"model": ...}`` unwrapped.
    The mapped pages are the kernel's page cache: one copy per node whatever the number of ranks reading."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open  # looked up at call time (tests count what it hands out)

        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                yield key, f.get_tensor(key)
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # saved with _use_new_zipfile_serialization=False
        state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    while state:  # handed out and forgotten one by one
        yield state.popitem()


def load_streamed(model: nn.Module, path: str) -> int:
    """Copy the checkpoint at ``path`` (``checkpoint_tensors``) into ``model``'s parameters and buffers where they
    already are (the reward's device, its dtype), one tensor at a time, strictly: a missing or unexpected key or a
    shape that differs is a ``RuntimeError`` as ``load_state_dict`` raises it. So a rank holds at most one
    checkpoint tensor outside the mapping (the largest: the token embedding, 1.1 GB in bf16), never the 16.6 GB
    state dict. Returns the largest tensor's bytes."""
    target = model.state_dict()
    seen, unexpected, largest = set(), [], 0
    for key, tensor in checkpoint_tensors(path):
        name = hpsv3_key(key)
        if name not in target:
            unexpected.append(key)
        elif target[name].shape != tensor.shape:
            raise RuntimeError(
                f"{path}: {key} has shape {tuple(tensor.shape)}, the model's {name} {tuple(target[name].shape)}"
            )
        else:
            with torch.no_grad():
                target[name].copy_(tensor)
            seen.add(name)
            largest = max(largest, tensor.numel() * tensor.element_size())
        del tensor  # before the next one is read
    missing = sorted(set(target) - seen)
    if missing or unexpected:
        raise RuntimeError(
            f"{path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]} (strict load)"
        )
    return largest


@torch.no_grad()
def hpsv3_scores(model, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor, grid_thw: Tensor):
    """(B, 2) head outputs at ``<|Reward|>``: ``Qwen2VLRewardModelBT.forward`` on transformers 5's modules."""
    inner = model.model
    embeds = inner.language_model.embed_tokens(input_ids)
    image = inner.visual(
        pixel_values.to(inner.visual.dtype), grid_thw=grid_thw
    ).pooler_output  # merged patches
    mask = (input_ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(mask, image.to(embeds.dtype))
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # text positions
    hidden = inner.language_model(
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        position_ids=positions.unsqueeze(0).expand(3, -1, -1),
    ).last_hidden_state
    at = input_ids == model.reward_token_id
    if not bool((at.sum(-1) == 1).all()):
        raise ValueError(
            f"HPSv3: each sequence needs exactly one {REWARD_TOKEN} token, got {at.sum(-1).tolist()}"
        )
    return model.rm_head(hidden[at].float())  # (B, 2)


@register_reward("hpsv3")
class HPSv3Reward:
    """HPSv3 as a reward: ``reward(images (B,3,H,W) in [0,1], prompts) -> (B,)`` mu (see the module doc).

    ``checkpoint``: hub repo id (file ``filename``) or a local .safetensors / .pt file or a directory holding
    it. ``base``: hub id or local folder of Qwen2-VL-7B-Instruct (its config and processor). ``dtype``: bf16 by
    default as HPSv3 runs (``DTYPE``; 16.6 GB for 8.3B parameters, the head in float32), unlike the other rewards
    here; ``reward.kwargs: {hpsv3: {dtype: fp32}}`` for float32. The dry-run plan counts the dtype configured.
    """

    name = "hpsv3"

    def __init__(
        self,
        checkpoint: str = "MizzenAI/HPSv3",
        filename: str = "HPSv3.safetensors",
        base: str = "Qwen/Qwen2-VL-7B-Instruct",
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = DTYPE,
        **kwargs,
    ) -> None:
        from transformers import AutoConfig, AutoProcessor

        ckpt = os.path.expanduser(checkpoint)
        path = (
            ckpt if os.path.isfile(ckpt) else hub_file(checkpoint, filename, what="HPSv3 reward checkpoint")
        )
        what = "HPSv3 base model (Qwen2-VL-7B-Instruct)"
        config = load_or_explain(
            lambda p, local: AutoConfig.from_pretrained(p, local_files_only=local),
            base,
            what=f"{what} config",
        )
        processor = load_or_explain(
            lambda p, local: AutoProcessor.from_pretrained(p, local_files_only=local, padding_side="right"),
            base,
            what=f"{what} processor",
        )
        dev = torch.device(device) if device is not None else torch.device("cpu")
        with torch.device(dev):  # 8B parameters: built where and in the dtype they run, then overwritten
            model = hpsv3_with_processor(config, processor, dtype=dtype)
        load_streamed(model, path)
        self._init_from(model, processor, device=dev, dtype=dtype, **kwargs)

    @classmethod
    def from_model(cls, model, processor, **kwargs) -> HPSv3Reward:
        """Wrap a model of ``hpsv3_with_processor`` and its processor (tokenizer with ``<|Reward|>``)."""
        self = cls.__new__(cls)
        self._init_from(model, processor, **kwargs)
        return self

    def _init_from(
        self,
        model,
        processor,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = DTYPE,
        batch_size: int = 8,
    ) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # a no-op for parameters built in ``dtype``; floating buffers (the rotary inv_freq) are cast as their
        # model.to(torch.bfloat16) casts them
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.model.rm_head.float()  # their head stays float32 (create_model_and_processor)
        self.processor = processor
        self.batch_size = int(batch_size)

    def _inputs(self, images: Tensor, prompts: list[str]):
        """The processor's batch: each image resized as qwen-vl-utils does (bicubic, on the [0, 1] tensor), the
        chat text with the image placeholders expanded; right padding."""
        pixels = []
        for img in images.float().clamp(0, 1):
            h, w = resized_hw(*img.shape[-2:])
            img = F.interpolate(img[None], size=(h, w), mode="bicubic", align_corners=False, antialias=True)
            pixels.append(img[0].clamp(0, 1))
        return self.processor(
            text=[chat_text(p) for p in prompts],
            images=pixels,
            padding=True,
            return_tensors="pt",
            images_kwargs={
                "do_rescale": False,
                "do_resize": False,
                "image_mean": CLIP_MEAN,
                "image_std": CLIP_STD,
            },
        )

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        out = []
        for i in range(0, len(prompts), self.batch_size):
            batch = self._inputs(images[i : i + self.batch_size], list(prompts[i : i + self.batch_size]))
            batch = batch.to(self.device)
            scores = hpsv3_scores(
                self.model, batch.input_ids, batch.attention_mask, batch.pixel_values, batch.image_grid_thw
            )
            out.append(scores[:, 0])
        return torch.cat(out).float().to(images.device)


def hpsv3_with_processor(config, processor, dtype: torch.dtype | None = None):
    """Add ``<|Reward|>`` to the processor's tokenizer (as ``create_model_and_processor``) and build the model
    (``hpsv3_model``: parameters in ``dtype``, the head in float32)."""
    tok = processor.tokenizer
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    return hpsv3_model(config, tok.convert_tokens_to_ids(REWARD_TOKEN), len(tok), dtype=dtype)
