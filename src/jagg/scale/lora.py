"""LoRA on a backbone's transformer (peft), and adapter-only parameters / checkpoints.

Flow-GRPO trains Flux and Qwen-Image with LoRA r = 64, alpha = 128 on the attention projections
(docs/references.md); DanceGRPO fine-tunes fully. ``apply_lora`` freezes the base weights and injects
peft LoRA layers with ``peft.inject_adapter_in_model`` (what diffusers' ``add_adapter`` does), so the model
keeps its class and the adapters (``Backbone``) and FSDP wrapping see the same module tree. Apply LoRA
*before* ``jagg.scale.distributed.shard_backbone``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

# Joint-attention projections of both diffusers DiTs (image stream to_*, text stream add_*_proj / to_add_out).
# Flux's single-stream blocks have attn.to_q/k/v as well; they match the same names.
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
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {"flux": ATTENTION_TARGETS, "qwenimage": ATTENTION_TARGETS}


def _transformer(model: nn.Module) -> nn.Module:
    """The diffusers transformer of a ``Backbone`` (or the module itself)."""
    return getattr(model, "transformer", model)


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

    ``target_modules`` default: the attention projections (``ATTENTION_TARGETS``), matched as name
    suffixes by peft. ``init="gaussian"`` (lora_A Gaussian, lora_B zero: the model is unchanged at step 0),
    as Flow-GRPO. Returns ``model``.
    """
    from peft import LoraConfig, inject_adapter_in_model

    transformer = _transformer(model)
    targets = list(target_modules or ATTENTION_TARGETS)
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
