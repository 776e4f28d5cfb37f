"""Pretrained loading (local pipeline layouts, fast offline failure) and LoRA on tiny Flux / Qwen-Image."""

from __future__ import annotations

import pytest
import torch

from jagg.engine.sde import diffusers_sigmas
from jagg.errors import WeightsUnavailableError
from jagg.models import TextCond, build_tiny_backbone
from jagg.scale.lora import (
    DEFAULT_TARGETS,
    apply_lora,
    default_targets,
    export_lora,
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
    # Flow-GRPO's targets: attention plus the dual-stream feed-forward layers (not Flux's single-block MLP).
    ff = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
    mlp = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
    for target in ff if name == "flux" else mlp:
        assert f"transformer_blocks.1.{target}.lora_A.default.weight" in " ".join(trainable), target
    assert not any("proj_mlp" in n or "single_transformer_blocks.0.proj_out" in n for n in trainable)
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


@pytest.mark.parametrize("name", BACKBONES)
def test_default_targets_match_every_listed_module(name):
    """Every name in DEFAULT_TARGETS[name] adapts a Linear of the real diffusers class (peft matches suffixes)."""
    bb = build_tiny_backbone(name)
    assert default_targets(bb) == DEFAULT_TARGETS[name] == default_targets(bb.transformer)
    linear = [n for n, m in bb.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in DEFAULT_TARGETS[name]:
        assert any(n.endswith("." + target) for n in linear), target
    with_lora = apply_lora(bb, rank=2, alpha=4)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in with_lora.named_parameters() if ".lora_A." in n}
    assert adapted == {
        f"transformer.{n}" for n in linear if any(n.endswith("." + t) for t in DEFAULT_TARGETS[name])
    }


def _perturbed_lora(name: str):
    """A float64 tiny backbone with LoRA r4 / alpha 8 (scale 2) whose adapters were moved off their init."""
    bb = apply_lora(build_tiny_backbone(name, seed=3).double(), rank=4, alpha=8)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in trainable_parameters(bb):
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return bb


@pytest.mark.parametrize("name", BACKBONES)
def test_exported_adapter_loads_in_peft_and_diffusers(tmp_path, name):
    """export_lora writes peft's and diffusers' formats; both libraries rebuild the same model (float64)."""
    from diffusers import FluxPipeline, QwenImagePipeline
    from peft import LoraConfig, PeftModel, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    trained = _perturbed_lora(name)
    z, cond = inputs()
    z, cond = z.double(), cond.to(dtype=torch.float64)
    want = trained.velocity(z, 0.7, cond)
    base = build_tiny_backbone(name, seed=3).double()
    assert not torch.allclose(base.velocity(z, 0.7, cond), want)  # the adapter matters

    written = export_lora(trained, tmp_path / "lora", base_model="tiny-" + name)
    names = sorted(p.split("/")[-1] for p in written)
    assert names == ["adapter_config.json", "adapter_model.safetensors", "pytorch_lora_weights.safetensors"]
    cfg = LoraConfig.from_pretrained(str(tmp_path / "lora"))
    assert (cfg.r, cfg.lora_alpha, cfg.base_model_name_or_path) == (4, 8, "tiny-" + name)
    assert set(cfg.target_modules) == set(DEFAULT_TARGETS[name])
    peft_keys = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    assert all(
        k.startswith("base_model.model.transformer_blocks.") or k.startswith("base_model.model.single_")
        for k in peft_keys
    )

    def check(transformer):
        fresh = build_tiny_backbone(name, seed=3).double()
        fresh.transformer = transformer
        torch.testing.assert_close(fresh.velocity(z, 0.7, cond), want, rtol=1e-12, atol=1e-12)

    # peft, high level: PeftModel.from_pretrained on a fresh base transformer.
    peft_model = PeftModel.from_pretrained(
        build_tiny_backbone(name, seed=3).transformer.double(), str(tmp_path / "lora")
    )
    check(peft_model.base_model.model)
    # peft, low level: inject the saved config, then set_peft_model_state_dict with the saved weights.
    t = build_tiny_backbone(name, seed=3).transformer.double()
    inject_adapter_in_model(cfg, t)
    result = set_peft_model_state_dict(t, peft_keys)
    assert not result.unexpected_keys
    check(t)
    # diffusers: the pipeline's load_lora_weights (folder, default file choice) and the transformer's own loader.
    pipe_cls = FluxPipeline if name == "flux" else QwenImagePipeline
    extra = dict(text_encoder_2=None, tokenizer_2=None) if name == "flux" else {}
    pipe = pipe_cls(
        scheduler=None,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=build_tiny_backbone(name, seed=3).transformer.double(),
        **extra,
    )
    pipe.load_lora_weights(str(tmp_path / "lora"))
    check(pipe.transformer)
    t = build_tiny_backbone(name, seed=3).transformer.double()
    t.load_lora_adapter(
        str(tmp_path / "lora"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
    )
    check(t)


def test_export_from_a_gathered_state(tmp_path):
    """``state=``: the trainer exports adapter tensors it gathered (keys as in the model) through any LoRA model."""
    from peft import PeftModel

    trained = _perturbed_lora("flux")
    carrier = apply_lora(build_tiny_backbone("flux", seed=3).double(), rank=4, alpha=8)
    export_lora(carrier, tmp_path, state=trainable_state_dict(trained))
    z, cond = inputs()
    z, cond = z.double(), cond.to(dtype=torch.float64)
    fresh = build_tiny_backbone("flux", seed=3).double()
    fresh.transformer = PeftModel.from_pretrained(fresh.transformer, str(tmp_path)).base_model.model
    torch.testing.assert_close(
        fresh.velocity(z, 0.7, cond), trained.velocity(z, 0.7, cond), rtol=1e-12, atol=1e-12
    )
    with pytest.raises(ValueError, match="no LoRA adapter"):
        export_lora(build_tiny_backbone("flux"), tmp_path / "x")


@pytest.mark.parametrize(
    "config, adapter, targets",
    [("flux_flowgrpo_fast", 179.3, 12), ("qwenimage_flowgrpo_fast", 424.7, 12)],
)
def test_paper_lora_adapter_size(config, adapter, targets):
    """r64 on the real FLUX.1-dev / Qwen-Image architectures (meta device): attention + FF, as Flow-GRPO
    (attention only would be 104.6M / 188.7M)."""
    from jagg.capacity.memory_model import meta_transformer
    from jagg.config import load_config

    cfg = load_config(f"configs/paper/{config}.yaml")
    assert cfg.model.lora_rank == 64 and not cfg.model.lora_targets  # the backbone default
    model, _ = meta_transformer(cfg)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert round(n / 1e6, 1) == adapter
    assert len(DEFAULT_TARGETS[cfg.model.backbone]) == targets
