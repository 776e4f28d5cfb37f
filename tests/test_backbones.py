"""Backbone adapters over the real diffusers classes (tiny random-init configs)."""

from __future__ import annotations

import pytest
import torch

from jagg.models import BACKBONES, TextCond, build_tiny_backbone, pack_2x2, unpack_2x2
from jagg.models.qwenimage import QwenImageBackbone


def _cond(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TextCond(
        embeds=torch.randn(b, 6, 32, generator=g),
        mask=torch.ones(b, 6, dtype=torch.long),
        pooled=torch.randn(b, 32, generator=g),
    )


def test_pack_unpack_roundtrip_matches_pipeline_layout():
    z = torch.randn(2, 3, 6, 8)
    tokens = pack_2x2(z)
    assert tokens.shape == (2, 12, 12)
    # token (row 0, col 1) holds the 2x2 patch z[:, :, 0:2, 2:4] channel-major
    assert torch.equal(tokens[:, 1].view(2, 3, 2, 2), z[:, :, 0:2, 2:4])
    assert torch.equal(unpack_2x2(tokens, 6, 8), z)


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_velocity_shape_and_per_sample_time(name):
    bb = build_tiny_backbone(name, latent_channels=3)
    cond = _cond(2)
    z = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        v_scalar = bb.velocity(z, 0.4, cond)
        v_batch = bb.velocity(z, torch.tensor([0.4, 0.4]), cond)
        v_mixed = bb.velocity(z, torch.tensor([0.4, 0.9]), cond)
        v_one = bb.velocity(z[1:], 0.9, cond.select(slice(1, 2)))
    assert v_scalar.shape == z.shape
    assert torch.allclose(v_scalar, v_batch)
    assert torch.allclose(v_mixed[1:], v_one, atol=1e-6)
    assert bb.latent_channels == 3


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_text_conditioning_changes_the_output(name):
    bb = build_tiny_backbone(name, latent_channels=3)
    z = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        a, b = bb.velocity(z, 0.5, _cond(1, 0)), bb.velocity(z, 0.5, _cond(1, 1))
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("name, guidance", [*((n, None) for n in sorted(BACKBONES)), ("sd3", 4.5)])
def test_stacked_latents_tile_the_conditioning(name, guidance):
    """k * B latent rows on a conditioning of B rows (the batched endpoint forward) give each block of B rows
    the velocity it gets alone; SD3 also under true CFG, whose negative conditioning is tiled with the rest.
    Rows that are no multiple of B are refused (``Backbone.conditioning_for``)."""
    channels = 16 if name == "sd3" else 3
    bb = build_tiny_backbone(name, **({} if name == "sd3" else {"latent_channels": channels})).double()
    cond = _cond(2).to(dtype=torch.float64)
    if guidance is not None:
        bb.guidance_scale = guidance
        neg = torch.zeros(2, 6, 32, dtype=torch.float64)
        cond.neg_embeds, cond.neg_pooled = neg, neg[:, 0]
    z = torch.randn(6, channels, 8, 8, dtype=torch.float64)
    t = torch.tensor([0.2, 0.3, 0.5, 0.6, 0.8, 0.9], dtype=torch.float64)
    with torch.no_grad():
        stacked = bb.velocity(z, t, cond)
        blocks = [bb.velocity(z[i : i + 2], t[i : i + 2], cond) for i in (0, 2, 4)]
        if guidance is not None:  # CFG changes the output, so the tiled negative conditioning was used
            plain = bb.velocity(z[:2], t[:2], TextCond(embeds=cond.embeds, pooled=cond.pooled))
            assert not torch.allclose(blocks[0], plain)
    torch.testing.assert_close(stacked, torch.cat(blocks), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="not a multiple of the conditioning batch 2"):
        bb.velocity(z[:3], 0.5, cond)


def test_tiny_backbone_is_deterministic_in_seed():
    a, b = build_tiny_backbone("flux", seed=3), build_tiny_backbone("flux", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_qwen_true_cfg_rescales_to_conditional_norm():
    bb = build_tiny_backbone("qwenimage", latent_channels=3)
    cfg = QwenImageBackbone(bb.transformer, true_cfg_scale=4.0)
    cond = _cond(1)
    cond.neg_embeds, cond.neg_mask = torch.zeros(1, 6, 32), torch.ones(1, 6, dtype=torch.long)
    z = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        v_cond = pack_2x2(bb.velocity(z, 0.5, cond))
        v_cfg = pack_2x2(cfg.velocity(z, 0.5, cond))
    assert not torch.allclose(v_cfg, v_cond)
    assert torch.allclose(v_cfg.norm(dim=-1), v_cond.norm(dim=-1), rtol=1e-5)


def test_unknown_backbone_name():
    with pytest.raises(ValueError, match="backbone must be one of"):
        build_tiny_backbone("sdxl")
