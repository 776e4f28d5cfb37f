"""The export step (one process; the 2-rank path is in test_distributed_checkpoint.py) and the placement
dtypes: full fine-tuning -> a diffusers transformer folder, LoRA -> a peft adapter; ``--export`` from a
checkpoint without training; with LoRA under bf16 the frozen base stays in bf16."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers import build_trainer, tiny_config
from jagg.config import TINY_RUN
from jagg.distributed import DistInfo
from jagg.loop.components import build_components
from jagg.loop.export import export_trained
from jagg.models import BACKBONES
from jagg.ops.checkpoint import read_checkpoint
from jagg.scale.placement import place_backbone
from jagg.train import main

RUN = [*TINY_RUN, "sampling.num_steps=4", "optim.lr=1e-2"]


def _cfg(tmp_path, *over, config="configs/world/flux_dancegrpo.yaml"):
    return tiny_config(tmp_path / "run", *over, config=config, base=RUN)


def _inputs(trainer, n=2):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(n, *trainer.comp.latent_shape, generator=g)
    cond = trainer.comp.text_encoder.encode_prompts(trainer.comp.eval_prompts[:n])
    return z, torch.tensor([0.7, 0.3]), cond


@pytest.mark.parametrize("backbone", ["flux", "qwenimage"])
def test_full_finetune_export_is_a_diffusers_folder_with_the_trained_weights(tmp_path, backbone):
    cfg = _cfg(tmp_path, "optim.ema_decay=0", config=f"configs/world/{backbone}_dancegrpo.yaml")
    trainer = build_trainer(cfg)
    before = trainer.backbone.velocity(*_inputs(trainer)).detach()
    trainer.fit()
    out = export_trained(cfg, trainer.backbone, tmp_path / "export", dist=trainer.dist)
    cls = BACKBONES[backbone]
    loaded = cls(cls.transformer_cls.from_pretrained(out))
    z, t, cond = _inputs(trainer)
    expected = trainer.backbone.velocity(z, t, cond)
    assert not torch.allclose(expected, before)  # the trained weights, not the initial ones
    torch.testing.assert_close(loaded.velocity(z, t, cond), expected, rtol=0, atol=0)


def test_export_uses_the_ema_weights_when_the_run_keeps_an_ema(tmp_path):
    cfg = _cfg(tmp_path, "optim.ema_decay=0.5", "train.iterations=2")
    trainer = build_trainer(cfg)
    trainer.fit()
    out = export_trained(cfg, trainer.backbone, tmp_path / "export", dist=trainer.dist, ema=trainer.ema)
    saved = load_file(out / "diffusion_pytorch_model.safetensors")
    names = [n for n, p in trainer.backbone.named_parameters() if p.requires_grad]
    for n, e in zip(names, trainer.ema, strict=True):
        assert torch.equal(saved[n.removeprefix("transformer.")], e)
    assert any(not torch.equal(e, p) for e, p in zip(trainer.ema, trainer.params))


def test_cli_export_from_a_checkpoint_without_training(tmp_path, capsys):
    cli = ["--config", "configs/world/flux_dancegrpo.yaml", *RUN, f"log.run_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exc:
        main([*cli, "--export", str(tmp_path / "out")])
    assert exc.value.code == 2 and "missing checkpoint" in capsys.readouterr().err
    assert main(cli) == 0
    with pytest.raises(SystemExit) as exc:
        main([*cli, "--resume", "--export", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert main([*cli, "--export", str(tmp_path / "out")]) == 0
    assert "exported:" in capsys.readouterr().out
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoint")
    saved = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    # the world config keeps an EMA (optim.ema_decay 0.9): the export holds it
    assert saved.keys() == {k.removeprefix("ema.transformer.") for k in ckpt if k.startswith("ema.")}
    assert all(torch.equal(saved[k], ckpt[f"ema.transformer.{k}"]) for k in saved)
    assert not all(torch.equal(saved[k], ckpt[f"model.transformer.{k}"]) for k in saved)


def test_lora_export_is_a_peft_adapter_that_reproduces_the_trained_model(tmp_path):
    from peft import PeftModel

    cfg = _cfg(tmp_path, "model.lora_rank=4", "model.lora_alpha=8", "optim.ema_decay=0")
    trainer = build_trainer(cfg)
    trainer.fit()
    out = export_trained(cfg, trainer.backbone, tmp_path / "adapter", dist=trainer.dist)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    fresh = build_components(cfg).backbone  # the same base weights (seeded)
    fresh.transformer = PeftModel.from_pretrained(fresh.transformer, out).base_model.model
    z, t, cond = _inputs(trainer)
    torch.testing.assert_close(fresh.velocity(z, t, cond), trainer.backbone.velocity(z, t, cond))


@pytest.mark.parametrize(("lora", "frozen"), [(0, None), (4, torch.bfloat16)])
def test_bf16_keeps_frozen_weights_in_bf16_and_trains_fp32(tmp_path, lora, frozen):
    """train.precision=bf16: fp32 master copies of the trained parameters only; with LoRA the frozen base
    stays in bf16 (never upcast), and one iteration runs under autocast."""
    cfg = _cfg(tmp_path, "train.precision=bf16", f"model.lora_rank={lora}", "model.lora_alpha=8")
    backbone, _ = place_backbone(
        cfg, build_components(cfg).backbone, device=torch.device("cpu"), dist=DistInfo()
    )
    dtypes = {(p.requires_grad, p.dtype) for p in backbone.parameters()}
    assert {d for g, d in dtypes if g} == {torch.float32}
    assert {d for g, d in dtypes if not g} == ({frozen} if frozen else set())
    if lora:
        (m,) = build_trainer(cfg).fit()
        assert torch.isfinite(torch.tensor(m["loss"])) and m["onpolicy_ratio_max_dev"] == 0.0
