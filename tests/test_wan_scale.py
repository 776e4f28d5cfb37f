"""Wan at paper scale without weights: the video paper configs (configs/paper/wan/), their dry run, the memory plan
of video latents (frames, non-square), the per-knot graph mode the dry run picks where a stacked graph does not
fit, the published Wan architectures, and the weights check of a two-expert pipeline folder."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from jagg.capacity.memory_model import (
    PER_TOKEN_MODULATION_BYTES,
    block_bytes,
    expand_timesteps,
    expert_boundaries,
    experts,
    memory_plan,
    sequence_tokens,
)
from jagg.config import load_config, paper_config_paths
from jagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
WAN = sorted(str(p.relative_to(ROOT)) for p in paper_config_paths(ROOT) if p.parent.name == "wan")
ONE_THREE_B = "configs/paper/wan/wan21_flashgrpo_knots.yaml"
A14B = "configs/paper/wan/wan22_a14b_flowfactory_knots.yaml"
TI2V = "configs/paper/wan/wan22_ti2v_dancegrpo.yaml"
VIDEO_480P = ["sampling.latent_size=60", "sampling.latent_width=104", "sampling.latent_frames=21"]


def test_a_recipe_and_its_every_step_knots_variant_per_wan_model():
    assert len(WAN) == 6
    models = {}
    for path in WAN:
        cfg = load_config(path)
        models.setdefault(cfg.model.path, []).append(cfg.backward.strategy)
    assert sorted(models) == [
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    ]
    assert all(sorted(s) == ["exact", "knots"] for s in models.values())


@pytest.mark.parametrize("path", WAN, ids=lambda p: Path(p).stem)
def test_every_wan_paper_config_dry_runs(path, capsys):
    from jagg.train import main

    assert main(["--config", path, "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "video / latent" in out and "(text by cross-attention)" in out
    assert "UMT5-XXL encoder" in out and "Wan2" in out  # the text encoder and the VAE are counted


def test_video_tokens_and_latent_shape():
    """480x832x81 through Wan2.1's VAE (8x, 4 frames per latent frame) and (1, 2, 2) patches: 21 x 30 x 52."""
    from jagg.scale.pretrained import latent_shape

    cfg = load_config(ONE_THREE_B)
    assert sequence_tokens(cfg) == 21 * 30 * 52 == 32_760
    assert latent_shape(cfg, 16) == (16, 21, 60, 104)
    hunyuan = load_config(ONE_THREE_B, ["sampling.latent_width=null", "sampling.latent_frames=14"])
    assert sequence_tokens(hunyuan) == 14 * 30 * 30 and latent_shape(hunyuan, 16) == (16, 14, 60, 60)


@pytest.mark.parametrize(
    ("override", "source"),
    [("sampling.latent_width=105", "pretrained"), ("sampling.latent_width=1", "pretrained"), ("", "world")],
)
def test_latent_width_is_checked(override, source, capsys):
    from jagg.train import main

    base = "configs/world/flux_dancegrpo.yaml" if source == "world" else ONE_THREE_B
    args = [override or "sampling.latent_width=32"]
    with pytest.raises(ConfigError, match="sampling.latent_width must be null or an even integer >= 2"):
        load_config(base, args)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", base, "--dry-run", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "sampling.latent_width" in err


def _update_terms(path: str, *overrides: str):
    """The plan's activations and total of ``path`` as the dry run computes them."""
    cfg = load_config(path, list(overrides))
    cost = cfg.backward.planned_setting().cost(19, batch=cfg.train.train_batch_size, stored_outputs=True)
    mp = memory_plan(cfg, 8, graphs=cost.graphs_alive, held_grad=False)
    return mp.activations[True], mp.total()


def test_per_knot_activations_equal_the_exact_loops_and_stacked_knots_hold_k():
    """Plan: the per-knot mode (sequential) holds one knot graph, as the exact per-step loop; the stacked
    (batched) mode holds K = 4 graphs and recomputes a block of K x B rows."""
    exact, _ = _update_terms(ONE_THREE_B, "backward.strategy=exact")
    per_knot, _ = _update_terms(ONE_THREE_B, "backward.graph_mode=sequential")
    stacked, _ = _update_terms(ONE_THREE_B, "backward.graph_mode=batched")
    assert per_knot == exact
    assert stacked == pytest.approx(4 * exact)  # every term of the graph and its recompute x 4


@functools.cache
def real_block_saved_bytes(per_token_timesteps: bool = False) -> float:
    """Bytes per token x hidden that a real WanTransformerBlock at a quarter of Wan2.1-1.3B's width saves for its
    backward (head dim 128, FFN 5.83x the width, q/k RMSNorm across heads, cross-attention to 512 text tokens),
    bf16, frozen weights and an input that needs its gradient, as LoRA trains: the marginal bytes of 1,024 more
    video tokens (the text's keys and values do not grow with them). ``per_token_timesteps``: the six
    modulations come per token (B, S, 6, D), as Wan2.2-TI2V's ``expand_timesteps`` feeds them. Cached: two
    tests read the per-sample block."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    from jagg.engine.profiling import SavedActivationMeter

    dim, heads = 384, 3
    block = WanTransformerBlock(dim, dim * 8960 // 1536, heads, "rms_norm_across_heads", 1e-6, True)
    block = block.to(torch.bfloat16).requires_grad_(False)
    rope = WanRotaryPosEmbed(dim // heads, (1, 2, 2), 1024)
    saved = []
    for tokens in (1024, 2048):
        x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        text = torch.randn(1, 512, dim, dtype=torch.bfloat16)
        temb = torch.randn(1, *((tokens,) if per_token_timesteps else ()), 6, dim, dtype=torch.bfloat16)
        with SavedActivationMeter() as meter:
            block(x, text, temb, rope(torch.zeros(1, 16, 1, 64, tokens // 16)))
        saved.append(meter.peak_bytes)
    return (saved[1] - saved[0]) / (1024 * dim)


def test_the_plans_wan_block_figure_is_what_a_real_wan_block_saves():
    """The plan's bytes per token x hidden saved by one recomputed Wan block (53, read off the simulated node)
    against the saved-tensor meter on a real block (``real_block_saved_bytes``). GPT's 34 would fail this by a
    third."""
    per_token_hidden = real_block_saved_bytes()
    wan_saved, wan_temporaries = block_bytes(load_config(ONE_THREE_B))
    assert wan_saved == pytest.approx(per_token_hidden, rel=0.1) and wan_temporaries > 0
    assert per_token_hidden > 34 * 1.3


def test_per_token_timesteps_add_their_modulations_to_the_plans_block(tmp_path):
    """Wan2.2-TI2V-5B embeds one timestep per token: the plan adds ``PER_TOKEN_MODULATION_BYTES`` to its block,
    what the meter reads on the same real block fed per-token modulations (32.0 bytes: the fp32 sum of the six,
    and the fp32 (1 + scale) of the two modulated norms). The known TI2V pipeline and a local folder whose
    model_index.json sets ``expand_timesteps`` get it; Wan2.1 and a folder without the key do not."""
    extra = real_block_saved_bytes(per_token_timesteps=True) - real_block_saved_bytes()
    assert extra == pytest.approx(PER_TOKEN_MODULATION_BYTES, rel=0.1)
    wan21 = load_config(ONE_THREE_B)
    assert not expand_timesteps(wan21)
    ti2v = load_config(TI2V)
    assert expand_timesteps(ti2v)
    assert block_bytes(ti2v) == (block_bytes(wan21)[0] + PER_TOKEN_MODULATION_BYTES, block_bytes(wan21)[1])
    for flag in (True, False):
        folder = tmp_path / f"ti2v_{flag}"
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"expand_timesteps": flag} if flag else {}))
        assert expand_timesteps(load_config(ONE_THREE_B, [f"model.path={folder}"])) is flag


def test_the_dry_run_picks_the_per_knot_mode_where_a_stacked_graph_does_not_fit(capsys):
    """Wan2.2-A14B at 480x832x81: four stacked 32,760-token graphs fit no GPU, one at a time fits 141 GB; the
    dry run says so. Wan2.1-1.3B's knots config runs per knot (its stacked graph needs 92 GiB): nothing is
    picked as configured, and stacked it is picked on 80 GB."""
    from jagg.train import main

    args = ["--config", A14B, "--dry-run", "--world-size", "8", *VIDEO_480P]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "graph mode picked" in ln)
    assert "sequential (per-knot backward) on 141 GB" in line and "backward.graph_mode=sequential" in line
    assert "141 GB GPU (131.3 GiB)             does NOT fit" in out  # the configured stacked mode
    assert main([*args, "backward.graph_mode=sequential"]) == 0
    assert "graph mode picked" not in capsys.readouterr().out
    assert main(["--config", ONE_THREE_B, "--dry-run", "--world-size", "8"]) == 0
    assert "graph mode picked" not in capsys.readouterr().out
    assert (
        main(["--config", ONE_THREE_B, "--dry-run", "--world-size", "8", "backward.graph_mode=batched"]) == 0
    )
    assert "sequential (per-knot backward) on 80 GB" in capsys.readouterr().out


def test_two_experts_are_counted_and_their_knots_respect_the_switch(capsys):
    from jagg.train import main

    cfg = load_config(A14B)
    assert experts(cfg) == 2 and expert_boundaries(cfg) == (0.875,)
    one = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    )
    assert experts(one) == 1 and expert_boundaries(one) == ()
    assert main(["--config", A14B, "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "29.19B total" in out  # two experts of 14.29B (+ LoRA)
    # shift-3 schedule of 10 steps: steps 0-3 on the high-noise expert (sigma_3 = 0.8749999999999999 is timestep
    # 875 in float32, jagg.common.expert_side, as the model runs it), 4-8 below: 2 + 2 knots
    assert "no interval spans the expert switch at sigma 0.875): [0, 3, 4, 8]" in out


def test_a_local_pipeline_folder_says_how_many_experts(tmp_path):
    (tmp_path / "model_index.json").write_text(
        json.dumps(
            {"transformer": ["diffusers", "X"], "transformer_2": ["diffusers", "X"], "boundary_ratio": 0.9}
        )
    )
    cfg = load_config(ONE_THREE_B, [f"model.path={tmp_path}"])
    assert expert_boundaries(cfg) == (0.9,) and experts(cfg) == 2
    (tmp_path / "model_index.json").write_text(
        json.dumps({"transformer": ["diffusers", "X"], "transformer_2": [None, None]})
    )
    assert experts(cfg) == 1


@pytest.mark.parametrize(
    ("repo", "params"),
    [
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 1.419e9),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", 5.000e9),
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 14.288e9),
    ],
)
def test_known_wan_architectures_build_on_meta(repo, params):
    from diffusers import WanTransformer3DModel

    from jagg.scale.architectures import known_wan

    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(known_wan(repo).config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
    assert known_wan(f"/data/{repo.split('/')[1]}") == known_wan(repo)  # a local copy named like the repo


def test_weights_check_covers_both_experts_of_a_wan_pipeline(tmp_path):
    """A tiny Wan2.2-A14B-layout folder: both transformers, UMT5 and the Wan VAE pass; the second expert's file
    broken, its check fails and names it."""
    from safetensors.torch import load_file, save_file

    from jagg.scale.tiny_pipeline import save_tiny_wan_pipeline
    from jagg.scale.weights_check import check_weights

    save_tiny_wan_pipeline(tmp_path / "wan", ["a red ball", "a blue cube"], boundary_ratio=0.875)
    jpeg = ["reward.weights={jpeg: 1.0}", "reward.eval=[jpeg]", "reward.kwargs={}"]
    cfg = load_config(A14B, [f"model.path={tmp_path / 'wan'}", *jpeg])
    reports = check_weights(cfg)
    names = [
        r.spec.what for r in reports if r.spec.library == "diffusers" or r.spec.library == "transformers"
    ]
    assert names == ["wan transformer", "wan transformer_2", "wan text_encoder", "wan vae"]
    assert all(r.ok for r in reports if r.spec.what in names)
    file = tmp_path / "wan" / "transformer_2" / "diffusion_pytorch_model.safetensors"
    sd = load_file(file)
    del sd[sorted(sd)[0]]
    save_file(sd, file, metadata={"format": "pt"})
    broken = {r.spec.what: r for r in check_weights(cfg)}
    assert not broken["wan transformer_2"].ok and broken["wan transformer"].ok
