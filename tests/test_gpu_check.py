"""``make gpu-check`` without CUDA: the same code on the tiny configs, written outside results/gpu/."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="covers the CPU path (no CUDA)")


def test_cpu_default_output_is_not_results_gpu():
    assert gpu_check.default_out(cuda=True) == "results/gpu/gpu_check.csv"
    assert not gpu_check.default_out(cuda=False).startswith("results/")


def test_meta_built_transformer_keeps_the_rope_tables():
    """Qwen-Image's RoPE tables are plain attributes: the meta build takes them from a CPU-built copy."""
    from jagg.models import BACKBONES, TINY_CONFIGS

    cfg = TINY_CONFIGS["qwenimage"]()
    built = gpu_check.build_transformer("qwenimage", cfg, torch.device("cpu"), torch.float32, seed=0)
    ref = BACKBONES["qwenimage"].transformer_cls.from_config(cfg)
    torch.testing.assert_close(built.pos_embed.pos_freqs, ref.pos_embed.pos_freqs)
    assert built.gradient_checkpointing and not any(p.is_meta for p in built.parameters())


def test_cpu_run_covers_every_variant(tmp_path, capsys):
    out = tmp_path / "gpu" / "gpu_check.csv"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    df = pd.read_csv(out)
    assert (df.status == "ok").all() and (df.config == "tiny").all()
    want = {gpu_check.variant_name(*v) for v in gpu_check.VARIANTS}
    assert want == {"exact"} | {
        f"jagg/{m}{s}" for m in ("batched", "joint", "sequential") for s in ("", "+stored")
    }
    combos = {(r.backbone, r.resolution_px, r.gradients) for r in df.itertuples()}
    assert combos == {
        (b, px, g) for b, pxs in gpu_check.RESOLUTIONS.items() for px in pxs for g in ("full", "lora")
    }
    for _, group in df.groupby(["backbone", "resolution_px", "gradients"]):
        assert set(group.variant) == want
        rows = {r.variant: r for r in group.itertuples()}
        # DanceGRPO trajectory: 9 trained steps in groups of 3, JAGG on 2 groups (7 graphs), exact on 9
        assert (rows["exact"].forward_passes, rows["exact"].backward_passes) == (9, 9)
        assert (rows["jagg/batched+stored"].forward_passes, rows["jagg/batched+stored"].backward_passes) == (
            7,
            7,
        )
        assert rows["jagg/batched"].forward_passes == 9 and rows["jagg/sequential"].backward_calls == 7
    full, lora = (df[df.gradients == g].iloc[0] for g in ("full", "lora"))
    assert full.trainable_m == pytest.approx(full.params_b * 1e3)  # every weight
    assert lora.trainable_m != full.trainable_m  # adapters only (r64 is larger than a tiny model)
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["tiny"] is True and "CPU" in meta["hardware"]
    assert "Tiny configs, not the real architectures" in out.with_suffix(".md").read_text()
