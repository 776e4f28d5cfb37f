"""Pretrained loading (local pipeline layouts, fast offline failure) and LoRA on tiny Flux / Qwen-Image."""

from __future__ import annotations

import pytest
import torch

from jagg.engine.sde import diffusers_sigmas
from jagg.errors import WeightsUnavailableError
from jagg.models import TextCond, build_tiny_backbone
from jagg.scale.lora import (
    apply_lora,
    load_trainable,
    save_trainable,
    trainable_parameters,
    trainable_state_dict,
)
from jagg.scale.pretrained import load_backbone, load_scheduler_config, set_gradient_checkpointing

BACKBONES = ["flux", "qwenimage"]
# A FLUX.1-dev-like scheduler config (dynamic shift; docs/conventions.md).
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def inputs(seed: int = 0, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, 16, 8, 8, generator=g)
    return z, TextCond(embeds=torch.randn(b, 5, 32, generator=g))


def save_pipeline(tmp_path, name: str):
    from diffusers import FlowMatchEulerDiscreteScheduler

    bb = build_tiny_backbone(name, seed=1)
    bb.transformer.save_pretrained(tmp_path / "transformer")
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER).save_config(tmp_path / "scheduler")
    return bb


@pytest.mark.parametrize("name", BACKBONES)
def test_load_local_pipeline_layout(tmp_path, name):
    ref = save_pipeline(tmp_path, name)
    for path in (tmp_path, tmp_path / "transformer"):  # pipeline snapshot or bare transformer dir
        bb = load_backbone(name, str(path), dtype=torch.float32, gradient_checkpointing=True)
        assert type(bb) is type(ref) and bb.transformer.gradient_checkpointing
        z, cond = inputs()
        torch.testing.assert_close(bb.velocity(z, 0.7, cond), ref.velocity(z, 0.7, cond))
    set_gradient_checkpointing(bb, False)
    assert not bb.transformer.gradient_checkpointing
    bf16 = load_backbone(name, str(tmp_path))
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_scheduler_config_to_sigmas(tmp_path):
    save_pipeline(tmp_path, "flux")
    cfg = load_scheduler_config(str(tmp_path))
    assert cfg["use_dynamic_shifting"] and cfg["max_shift"] == 1.15
    sig = diffusers_sigmas(cfg, num_steps=6, image_seq_len=1024)  # 512 px Flux: mu = 0.63
    assert sig.shape == (7,) and sig[0] == 1 and sig[-1] == 0 and (sig[1:] < sig[:-1]).all()


@pytest.mark.parametrize("call", ["flux", "qwenimage", "scheduler"])
def test_offline_fails_fast(monkeypatch, tmp_path, call):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE") as err:
        load_scheduler_config("flux") if call == "scheduler" else load_backbone(call)
    assert ("FLUX.1-dev" in str(err.value)) or ("Qwen/Qwen-Image" in str(err.value))
    with pytest.raises(WeightsUnavailableError, match="local path does not exist"):
        load_backbone("flux", str(tmp_path / "nothing"))


@pytest.mark.parametrize("name", BACKBONES)
def test_lora_trains_only_adapters(tmp_path, name):
    bb = apply_lora(build_tiny_backbone(name), rank=4, alpha=8)
    params = dict(bb.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".attn.to_q.lora_A" in n for n in trainable) and any(
        "add_k_proj.lora_B" in n for n in trainable
    )
    assert len(trainable_parameters(bb)) == len(trainable)
    z, cond = inputs()
    before = {n: p.detach().clone() for n, p in params.items()}
    v0 = bb.velocity(z, 0.7, cond).detach()
    opt = torch.optim.SGD(trainable_parameters(bb), lr=0.5)
    for _ in range(2):  # lora_B starts at 0, so lora_A first moves in the 2nd step
        opt.zero_grad()
        (bb.velocity(z, 0.7, cond) ** 2).mean().backward()
        assert all(params[n].grad is None for n in params if n not in trainable)
        opt.step()
    changed = {n for n, p in params.items() if not torch.equal(p, before[n])}
    assert changed <= trainable  # the frozen base is bit-identical
    # Some adapters legitimately get no gradient (the last block's text-stream output is discarded).
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    assert not torch.allclose(bb.velocity(z, 0.7, cond), v0)

    # Adapter-only checkpoint: a fresh LoRA model with the saved adapters reproduces the trained one.
    save_trainable(bb, tmp_path / "lora.safetensors")
    assert set(trainable_state_dict(bb)) == trainable
    fresh = apply_lora(build_tiny_backbone(name), rank=4, alpha=8)
    assert not torch.allclose(fresh.velocity(z, 0.7, cond), bb.velocity(z, 0.7, cond))
    load_trainable(fresh, tmp_path / "lora.safetensors")
    torch.testing.assert_close(fresh.velocity(z, 0.7, cond), bb.velocity(z, 0.7, cond))
    with pytest.raises(KeyError, match="missing"):
        load_trainable(
            apply_lora(build_tiny_backbone(name), rank=4, alpha=8, target_modules=["proj_out"]),
            tmp_path / "lora.safetensors",
        )
