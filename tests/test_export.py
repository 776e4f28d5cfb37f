"""The export step (one process; the 2-rank path is in test_distributed_checkpoint.py) and the placement
dtypes: full fine-tuning -> a diffusers transformer folder, LoRA -> a peft adapter; ``--export`` from a
checkpoint without training; with LoRA under bf16 the frozen base stays in bf16."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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
from jagg.ops.rundir import REPO_ROOT as ROOT
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


# --------------------------------------------------------------------------- issue 41: export never deletes what it did not write
WORLD = str(ROOT / "configs" / "world" / "flux_dancegrpo.yaml")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One trained run (checkpoint in ``run/``) that the export cases read."""
    run = tmp_path_factory.mktemp("exported") / "run"
    assert main(["--config", WORLD, *RUN, f"log.run_dir={run}"]) == 0
    return run


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` (not following symlinks) with its bytes' hash: what a refusal must keep."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = "-> " + str(p.readlink())
        elif p.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _three_files(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (path / f"precious_{i}.txt").write_text(f"file {i}\n")
    return path


@pytest.mark.parametrize(
    "case",
    [
        "three files",
        "git repository",
        "home",
        "working directory",
        "run directory",
        "holds the run",
        "dotdot",
        "dot",
        "symlink",
        "forged marker",
    ],
)
def test_export_refuses_what_it_did_not_write(trained_run, tmp_path, monkeypatch, capsys, case):
    scratch = _three_files(tmp_path / "scratch")
    sub = _three_files(scratch / "sub")
    repo = _three_files(scratch / "repo")
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    home = _three_files(scratch / "home")
    monkeypatch.setenv("HOME", str(home))
    (scratch / "link").symlink_to(sub, target_is_directory=True)
    forged = _three_files(scratch / "forged")
    (forged / ".jagg_export").write_text('{"files": ["diffusion_pytorch_model.safetensors"]}\n')
    monkeypatch.chdir(sub)
    out, why = {
        "three files": (scratch / "precious", "not empty and not an earlier export"),
        "git repository": (repo, "git repository's root"),
        "home": (home, "home directory"),
        "working directory": (sub, "working directory"),
        "run directory": (trained_run, "run directory"),
        "holds the run": (trained_run.parent, "run directory (log.run_dir) or holds it"),
        "dotdot": (Path(".."), "'..'"),
        "dot": (Path("."), "'.'"),
        "symlink": (scratch / "link", "symbolic link"),
        "forged marker": (forged, "no .jagg_export marker recording each file's size and hash"),
    }[case]
    if case == "three files":
        _three_files(out)
    watched = [scratch, trained_run]
    before = [_tree(w) for w in watched]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--config", WORLD, *RUN, f"log.run_dir={trained_run}", "--export", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--export refuses OUT={out}" in err and why in err, err
    assert [_tree(w) for w in watched] == before  # every file as it was, byte for byte; nothing added


def test_export_checks_out_again_where_it_writes(trained_run, tmp_path):
    """Defence in depth: ``export_trained`` refuses by itself (a caller that skipped the CLI's check)."""
    from jagg.errors import ConfigError

    cfg = _cfg(tmp_path)
    precious = _three_files(tmp_path / "precious")
    before = _tree(precious)
    backbone = build_components(cfg).backbone
    with pytest.raises(ConfigError, match="not empty and not an earlier export"):
        export_trained(cfg, backbone, precious, dist=DistInfo())
    assert _tree(precious) == before and [p.name for p in tmp_path.iterdir() if "export" in p.name] == []


@pytest.mark.parametrize("case", ["absent", "empty", "earlier export"])
def test_export_writes_an_absent_or_empty_out_and_replaces_an_earlier_export(
    trained_run, tmp_path, capsys, case
):
    out = tmp_path / "out"
    cli = ["--config", WORLD, *RUN, f"log.run_dir={trained_run}", "--export", str(out)]
    if case == "empty":
        out.mkdir()
    if case == "earlier export":
        assert main(cli) == 0
    assert main(cli) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [".jagg_export", "config.json", "diffusion_pytorch_model.safetensors"]
    marker = json.loads((out / ".jagg_export").read_text())
    assert sorted(marker["files"]) == ["config.json", "diffusion_pytorch_model.safetensors"]
    for name, record in marker["files"].items():  # each file's size and hash, computed independently here
        data = (out / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    saved = load_file(out / "diffusion_pytorch_model.safetensors")
    ckpt = read_checkpoint(trained_run / "checkpoint")
    assert all(torch.equal(saved[k], ckpt[f"ema.transformer.{k}"]) for k in saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left beside it


# --------------------------------------------------------------------------- issue 58: every refusal one line, before anything is built
def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("empty", "--export needs a directory name"),
        ("under a file", "which is a file"),
        ("under /dev/null", "lies under /dev/null, which is a file"),
        ("250 characters", "its name is longer than 234 bytes"),
        ("a 300-character folder", "File name too long [ENAMETOOLONG]"),  # the CLI's edge: any OSError
        ("inside the run", "inside the run directory"),
        ("samples", "inside the run directory"),
    ],
)
def test_export_to_an_unusable_out_is_one_line_and_touches_nothing(trained_run, tmp_path, capsys, case, says):
    (tmp_path / "a_file").write_text("mine\n")
    out = {
        "empty": "",
        "under a file": str(tmp_path / "a_file" / "out"),
        "under /dev/null": "/dev/null/out",
        "250 characters": str(tmp_path / ("x" * 250)),
        "a 300-character folder": str(tmp_path / ("x" * 300) / "out"),
        "inside the run": str(trained_run / "checkpoint.tmp"),
        "samples": str(trained_run / "samples" / "export"),
    }[case]
    before = [_tree(tmp_path), _tree(trained_run)]
    err = _refused(["--config", WORLD, *RUN, f"log.run_dir={trained_run}", "--export", out], capsys)
    assert says in err and "Traceback" not in err
    assert [_tree(tmp_path), _tree(trained_run)] == before


def test_export_expands_the_home_directory(trained_run, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert main(["--config", WORLD, *RUN, f"log.run_dir={trained_run}", "--export", "~/exported"]) == 0
    assert (home / "exported" / "diffusion_pytorch_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no literal './~'
