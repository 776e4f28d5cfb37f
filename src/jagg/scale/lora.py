"""LoRA on a backbone's transformer (peft), adapter-only parameters / checkpoints, and peft / diffusers export.

Flow-GRPO trains Flux and Qwen-Image with LoRA r = 64, alpha = 128, Gaussian init, on the joint-attention
projections **and** the feed-forward layers of the dual-stream blocks (``DEFAULT_TARGETS``; docs/references.md:
``scripts/train_flux.py`` and the Qwen-Image trainer list the module names). DanceGRPO fine-tunes fully.
``apply_lora`` freezes the base weights and injects peft LoRA layers with ``peft.inject_adapter_in_model``
(what diffusers' ``add_adapter`` does), so the model keeps its class and the adapters (``Backbone``) and FSDP
wrapping see the same module tree. Apply LoRA *before* ``jagg.scale.distributed.shard_backbone``.

``export_lora`` writes a folder that both libraries load: ``adapter_config.json`` + ``adapter_model.safetensors``
(peft's ``PeftModel.save_pretrained`` layout, keys ``base_model.model.<module>.lora_A.weight``) for
``PeftModel.from_pretrained`` / ``set_peft_model_state_dict``, and ``pytorch_lora_weights.safetensors``
(diffusers' ``save_lora_weights`` layout, keys ``transformer.<module>...`` plus the LoRA config as
``lora_adapter_metadata``) for ``FluxPipeline`` / ``QwenImagePipeline`` / ``StableDiffusion3Pipeline`` /
``WanPipeline.load_lora_weights`` and
``transformer.load_lora_adapter``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

# Joint-attention projections of both diffusers DiTs (image stream to_*, text stream add_*_proj / to_add_out).
# Flux's single-stream blocks have attn.to_q/k/v as well; they match the same names (peft matches suffixes).
ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
# Feed-forward layers of the dual-stream blocks (diffusers ``FeedForward``: net.0.proj in, net.2 out). Flux's
# single-stream blocks (proj_mlp / proj_out) are not adapted, as in Flow-GRPO.
FLUX_FF_TARGETS = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
QWENIMAGE_MLP_TARGETS = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
# Per backbone, the target list of the Flow-GRPO trainers (``model.lora_targets`` overrides it):
#   flux:      scripts/train_flux.py (yifan123/flow_grpo @ 74db691), ``target_modules`` in ``main``
#   qwenimage: scripts/train_qwenimage.py (same list in scripts/train_qwenimage_edit_plus.py @ 9dcdc35)
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "flux": ATTENTION_TARGETS + FLUX_FF_TARGETS,
    "qwenimage": ATTENTION_TARGETS + QWENIMAGE_MLP_TARGETS,
    "sd3": ATTENTION_TARGETS,  # scripts/train_sd3.py (ac4c86e): the eight attention projections, r 32, alpha 64
    # Wan's self- and cross-attention projections (WanAttention: attn1 / attn2 .to_q/k/v/out.0) and its FFN
    "wan": ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
}
_CLASS_TO_BACKBONE = {
    "FluxTransformer2DModel": "flux",
    "QwenImageTransformer2DModel": "qwenimage",
    "SD3Transformer2DModel": "sd3",
    "WanTransformer3DModel": "wan",
}
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
DIFFUSERS_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # what load_lora_weights(folder) picks


def _transformer(model: nn.Module) -> nn.Module:
    """The diffusers transformer of a ``Backbone`` (or the module itself)."""
    return getattr(model, "transformer", model)


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """``DEFAULT_TARGETS`` of the transformer's class (Flux / Qwen-Image); other classes: attention only."""
    name = _CLASS_TO_BACKBONE.get(type(_transformer(model)).__name__)
    return DEFAULT_TARGETS[name] if name else ATTENTION_TARGETS


def apply_lora(
    model: nn.Module,
    rank: int = 64,
    alpha: float = 128,
    target_modules: Sequence[str] | None = None,
    *,
    dropout: float = 0.0,
    init: str | bool = "gaussian",
    adapter_name: str = "default",
) -> nn.Module:
    """Freeze ``model``'s transformer and inject LoRA layers into ``target_modules`` (in place).

    ``target_modules`` default: ``default_targets(model)`` (the Flow-GRPO list of the transformer's class),
    matched as name suffixes by peft. ``init="gaussian"`` (lora_A Gaussian, lora_B zero: the model is
    unchanged at step 0), as Flow-GRPO. Returns ``model``.
    """
    from peft import LoraConfig, inject_adapter_in_model

    transformer = _transformer(model)
    targets = list(target_modules or default_targets(model))
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=init, target_modules=targets
    )
    transformer.requires_grad_(False)
    inject_adapter_in_model(config, transformer, adapter_name=adapter_name)
    for n, p in transformer.named_parameters():  # peft marks adapters trainable; make it explicit
        p.requires_grad_("lora_" in n)
    if not any(p.requires_grad for p in transformer.parameters()):
        raise ValueError(f"LoRA matched no module: target_modules={targets}")
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer should see (LoRA adapters after ``apply_lora``; all for full FT)."""
    return [p for p in model.parameters() if p.requires_grad]


def trainable_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Detached CPU copies of the trainable parameters only, keyed by their names in ``model``."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into ``model``'s trainable parameters; every trainable name must be present exactly."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise KeyError(f"trainable state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n].to(device=p.device, dtype=p.dtype))


def save_trainable(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the trainable (adapter) weights to a safetensors file."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in trainable_state_dict(model).items()}, str(path))


def load_trainable(model: nn.Module, path: str | os.PathLike) -> None:
    """Read a file written by ``save_trainable`` into ``model`` (after the same ``apply_lora``)."""
    from safetensors.torch import load_file

    load_trainable_state_dict(model, load_file(str(path)))


def _full_cpu(t: Tensor) -> Tensor:
    """A plain CPU tensor; a DTensor (FSDP2 shard) is gathered first, a collective every rank must join."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def adapter_state_dict(
    model: nn.Module, state: Mapping[str, Tensor] | None = None, adapter_name: str = "default"
) -> dict[str, Tensor]:
    """The LoRA weights of ``model``'s transformer in peft's saved naming: ``<module>.lora_A.weight`` (CPU).

    ``state``: the adapter tensors to export instead of the model's own, keyed as in ``model`` (e.g. a
    ``trainable_state_dict`` gathered from a sharded model, or one loaded from a checkpoint).
    """
    from peft import get_peft_model_state_dict

    transformer = _transformer(model)
    if not getattr(transformer, "peft_config", None):
        raise ValueError("the model has no LoRA adapter (apply_lora first)")
    if state is not None and transformer is not model:  # keys of a Backbone start with "transformer."
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
    sd = get_peft_model_state_dict(
        transformer, state_dict=dict(state) if state else None, adapter_name=adapter_name
    )
    if not sd:
        raise ValueError(f"no LoRA weights for adapter {adapter_name!r}")
    return {k: _full_cpu(v) for k, v in sd.items()}


def save_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    state: Mapping[str, Tensor] | None = None,
    base_model: str | None = None,
    adapter_name: str = "default",
    diffusers: bool = True,
) -> list[str]:
    """Write ``model``'s LoRA adapter to ``out_dir`` in peft's format and (``diffusers``) diffusers' format.

    Files: ``adapter_config.json`` (the ``LoraConfig`` used by ``apply_lora``, ``base_model_name_or_path`` =
    ``base_model`` or the transformer's ``_name_or_path``) and ``adapter_model.safetensors`` (keys
    ``base_model.model.<module>.lora_{A,B}.weight``, as ``PeftModel.save_pretrained`` writes them), plus
    ``pytorch_lora_weights.safetensors`` written by diffusers' own ``save_lora_weights`` of the backbone's
    pipeline (keys ``transformer.<module>...``, the config as ``lora_adapter_metadata`` so that alpha / rank
    survive). Returns the paths written. Call on one process only; see ``adapter_state_dict`` for ``state``.
    """
    import copy

    from safetensors.torch import save_file

    transformer = _transformer(model)
    weights = adapter_state_dict(model, state, adapter_name)
    config = copy.deepcopy(transformer.peft_config[adapter_name])
    config.base_model_name_or_path = base_model or getattr(transformer.config, "_name_or_path", None) or None
    config.inference_mode = True
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(str(out_dir))
    peft_file = os.path.join(out_dir, PEFT_WEIGHTS_NAME)
    save_file({f"base_model.model.{k}": v for k, v in weights.items()}, peft_file, metadata={"format": "pt"})
    written = [os.path.join(out_dir, PEFT_CONFIG_NAME), peft_file]
    if diffusers:
        from diffusers.loaders.lora_pipeline import (
            FluxLoraLoaderMixin,
            QwenImageLoraLoaderMixin,
            SD3LoraLoaderMixin,
            WanLoraLoaderMixin,
        )

        mixins = {
            "flux": FluxLoraLoaderMixin,
            "qwenimage": QwenImageLoraLoaderMixin,
            "sd3": SD3LoraLoaderMixin,
            "wan": WanLoraLoaderMixin,  # WanPipeline's; one transformer (the first expert of Wan2.2-A14B)
        }
        name = _CLASS_TO_BACKBONE.get(type(transformer).__name__)
        if name is None:
            raise ValueError(
                f"no diffusers LoRA format for {type(transformer).__name__}; pass diffusers=False"
            )
        meta = json.loads(json.dumps(config.to_dict(), default=list))  # sets (target_modules) -> lists
        mixins[name].save_lora_weights(
            str(out_dir),
            transformer_lora_layers=weights,
            weight_name=DIFFUSERS_WEIGHTS_NAME,
            transformer_lora_adapter_metadata=meta,
        )
        written.append(os.path.join(out_dir, DIFFUSERS_WEIGHTS_NAME))
    return written


def export_lora(
    backbone_or_transformer: nn.Module,
    out_dir: str | os.PathLike,
    *,
    state: Mapping[str, Tensor] | None = None,
    base_model: str | None = None,
) -> list[str]:
    """The trainer's LoRA export: ``save_adapter`` in both formats (peft + diffusers) into ``out_dir``.

    Load the result with ``PeftModel.from_pretrained(transformer, out_dir)``, or
    ``pipe.load_lora_weights(out_dir)`` / ``transformer.load_lora_adapter(out_dir, prefix="transformer")``.
    Under FSDP2 gather the adapter on every rank first (``DTensor.full_tensor``) and call this on rank 0 with
    the gathered tensors as ``state``.
    """
    return save_adapter(backbone_or_transformer, out_dir, state=state, base_model=base_model)
