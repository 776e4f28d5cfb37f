"""SD3 / SD3.5 through the backbone seam, on a tiny random-init pipeline of the real classes (diffusers
``SD3Transformer2DModel``, ``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler``; transformers CLIP-L / CLIP-G
``CLIPTextModelWithProjection`` and T5), offline: our sampler equals diffusers' ``StableDiffusion3Pipeline``; the
backward strategies and graph modes; two training iterations of the paper config's recipe with LoRA; the LoRA
export loads into diffusers; the config and offline errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import make_grpo_step_loss, one_group, paper_tiny_argv
from jagg.config import load_config, tiny_pipeline_overrides
from jagg.engine.sampling import sample_trajectory
from jagg.engine.strategies import GRAPH_MODES
from jagg.errors import ConfigError, WeightsUnavailableError
from jagg.models import TextCond, build_tiny_backbone
from jagg.models.sd3 import SD3Backbone
from jagg.scale.tiny_pipeline import save_tiny_sd3_pipeline

PROMPTS = ["a red circle on the left", "a photo of a cat", "an astronaut riding a horse", "a blue square"]
LATENT = 16  # latent size (VAE factor 1 here); pos_embed_max_size 16 covers 16 / patch 2 = 8 patches a side


def reference_pipeline(root):
    """diffusers' ``StableDiffusion3Pipeline`` built from the folder's parts, each loaded by its own class."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel.from_pretrained(root / "transformer"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=AutoencoderKL.from_pretrained(root / "vae"),
        text_encoder=CLIPTextModelWithProjection.from_pretrained(root / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(root / "text_encoder_2"),
        tokenizer_2=AutoTokenizer.from_pretrained(root / "tokenizer_2"),
        text_encoder_3=T5EncoderModel.from_pretrained(root / "text_encoder_3"),
        tokenizer_3=AutoTokenizer.from_pretrained(root / "tokenizer_3"),
    )


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3")
    save_tiny_sd3_pipeline(root / "sd3", PROMPTS)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return root


def sd3_cfg(pipeline_dir, tmp_path, *overrides):
    """The paper config on the tiny pipeline: the recipe (CFG 4.5, empty negative prompt, flow_grpo SDE, KL,
    LoRA on attention) at a size that trains in seconds."""
    return load_config(
        "configs/paper/sd3/sd35m_flowgrpo.yaml",
        [
            *tiny_pipeline_overrides(pipeline_dir / "sd3", pipeline_dir / "prompts.txt"),
            "model.gradient_checkpointing=false",
            "model.lora_rank=4",
            "model.lora_alpha=8",
            f"sampling.latent_size={LATENT}",
            "sampling.num_steps=4",
            "sampling.eval_num_steps=3",
            "algorithm.clip_range=0.2",
            "train.precision=fp32",
            "train.iterations=2",
            "train.prompts_per_iter=2",
            "train.images_per_prompt=2",
            "train.train_batch_size=2",
            "train.grad_accum=1",
            "optim.lr=1e-3",
            "optim.ema_every=1",  # the recipe's first EMA update is after step 7; these runs take 2 to 4
            "log.eval_every=2",
            "log.eval_prompts=2",
            f"log.run_dir={tmp_path}",
            *overrides,
        ],
    )


def test_sampler_equals_diffusers_sd3_pipeline(pipeline_dir, tmp_path):
    """ODE sampling with our components (SD3TextEncoder, SD3Backbone with CFG 4.5 and the empty negative prompt,
    the scheduler's sigmas) equals ``StableDiffusion3Pipeline(...)`` from the same folder and noise, and so do
    the decoded images."""
    from jagg.scale.pretrained import build_pretrained_components

    cfg = sd3_cfg(pipeline_dir, tmp_path, "sampling.num_steps=5")
    comp = build_pretrained_components(cfg)
    assert isinstance(comp.backbone, SD3Backbone) and comp.backbone.guidance_scale == 4.5
    assert comp.latent_shape == (16, LATENT, LATENT)
    noise = torch.randn(2, 16, LATENT, LATENT, generator=torch.Generator().manual_seed(3))
    cond = comp.text_encoder.encode_prompts(PROMPTS[:2])
    assert cond.neg_embeds is not None and cond.neg_pooled.shape == (2, 32)
    backbone = comp.backbone.transformer.float().eval()
    assert backbone is comp.backbone.transformer
    with torch.no_grad():
        ours = sample_trajectory(comp.backbone.bind(cond), noise, comp.sigmas.float(), ["ode"] * 5).final
        pipe = reference_pipeline(pipeline_dir / "sd3")
        ref = pipe(
            prompt=PROMPTS[:2],
            num_inference_steps=5,
            guidance_scale=4.5,
            latents=noise.clone(),
            height=LATENT,
            width=LATENT,
            max_sequence_length=16,
            output_type="latent",
        ).images
    assert torch.allclose(comp.sigmas.float(), pipe.scheduler.sigmas.float())
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert (ours - noise).abs().mean() > 0.1  # the sampler moved
    image = comp.decode(ours)
    with torch.no_grad():
        ref_img = pipe.vae.decode(ref / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor).sample
    torch.testing.assert_close(image, (ref_img / 2 + 0.5).clamp(0, 1), atol=1e-4, rtol=1e-4)
    # without guidance: one conditional call per step, another result
    comp.backbone.guidance_scale = 1.0
    with torch.no_grad():
        plain = sample_trajectory(comp.backbone.bind(cond), noise, comp.sigmas.float(), ["ode"] * 5).final
    assert not torch.allclose(plain, ours, atol=1e-3)


def test_timesteps_reach_the_transformer_as_the_pipeline_passes_them(pipeline_dir, tmp_path):
    """The recipe's schedule (SD3.5-M's scheduler config, shift 3, 10 steps) with the transformer in bf16: at every
    step our velocity hands the transformer the timestep ``StableDiffusion3Pipeline`` hands it, the scheduler's
    float32 ``timesteps`` bit for bit (913.35, 857.69, 790.37, ...), not rounded to bf16 (916, 860, 788, ...)."""
    from jagg.scale.pretrained import build_pretrained_components

    comp = build_pretrained_components(sd3_cfg(pipeline_dir, tmp_path, "sampling.num_steps=10"))
    sigmas = comp.sigmas  # as the trainer holds them (float64 copies of the scheduler's float32 sigmas)
    pipe = reference_pipeline(pipeline_dir / "sd3").to(torch.bfloat16)
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].detach().clone()), with_kwargs=True
    )
    try:
        with torch.no_grad():
            pipe(
                prompt=PROMPTS[:2],
                num_inference_steps=10,
                guidance_scale=4.5,
                height=LATENT,
                width=LATENT,
                max_sequence_length=16,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            )
            theirs, seen[:] = list(seen), []
            backbone = SD3Backbone(pipe.transformer, guidance_scale=4.5)
            cond = comp.text_encoder.encode_prompts(PROMPTS[:2])
            z = torch.randn(2, 16, LATENT, LATENT, generator=torch.Generator().manual_seed(1))
            for sigma in sigmas[:-1]:
                backbone.velocity(z, sigma, cond)
    finally:
        hook.remove()
    assert len(seen) == len(theirs) == 10
    for ours, ref in zip(seen, theirs, strict=True):
        assert ours.dtype == ref.dtype == torch.float32 and ours.shape == ref.shape == (4,)  # CFG: 2 x 2 rows
        assert torch.equal(ours, ref)
    first = torch.stack([t[0] for t in seen])
    assert torch.equal(first, pipe.scheduler.timesteps)
    expected = torch.tensor([913.3490, 857.6923, 790.3683, 707.2785, 602.1506])
    torch.testing.assert_close(first[2:7], expected, atol=1e-3, rtol=0)
    # what the backbone fed before (1000 sigma in bf16): 916, 860, 788, ...
    rounded = (1000 * sigmas[:-1].to(torch.bfloat16)).float()
    assert rounded[2:5].tolist() == [916.0, 860.0, 788.0] and (first - rounded).abs().max() > 2.5


def _cond(b: int, seed: int = 0) -> TextCond:
    g = torch.Generator().manual_seed(seed)
    return TextCond(
        embeds=torch.randn(b, 6, 32, generator=g),
        pooled=torch.randn(b, 32, generator=g),
        neg_embeds=torch.randn(1, 6, 32, generator=g).expand(b, -1, -1),
        neg_pooled=torch.randn(1, 32, generator=g).expand(b, -1),
    )


def test_cfg_gradient_flows_through_the_conditional_branch_only():
    """v = u + g (c - u) with u detached (Flow-GRPO): d<v, w>/dtheta = g d<c, w>/dtheta."""
    bb = build_tiny_backbone("sd3", seed=0).double()
    bb.guidance_scale = 4.5
    cond = _cond(2)
    z = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    w = torch.randn_like(z)
    params = [p for p in bb.parameters() if p.requires_grad]
    (bb.velocity(z, 0.6, cond) * w).sum().backward()
    got = [p.grad.clone() for p in params]
    bb.zero_grad()
    plain = TextCond(embeds=cond.embeds, pooled=cond.pooled)
    (4.5 * bb.velocity(z, 0.6, plain) * w).sum().backward()
    for a, p in zip(got, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-9, atol=1e-12)
    with torch.no_grad():  # the value is the full CFG combination
        u = bb.velocity(z, 0.6, TextCond(embeds=cond.neg_embeds, pooled=cond.neg_pooled))
        c = bb.velocity(z, 0.6, plain)
        torch.testing.assert_close(bb.velocity(z, 0.6, cond), u + 4.5 * (c - u))


def test_strategies_and_graph_modes():
    """On the tiny SD3 with CFG: at W = 2 JAGG equals the exact backward in every graph mode (exact there);
    at W = 3 every graph mode gives the same JAGG gradient, which differs from the exact one."""
    bb = build_tiny_backbone("sd3", seed=0).double()
    bb.guidance_scale = 4.5
    velocity = bb.bind(_cond(2))
    params = [p for p in bb.parameters() if p.requires_grad]

    def grad(strategy, w, **how):
        sig = torch.tensor([0.9, 0.75, 0.6, 0.45], dtype=torch.float64)[: w + 1]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(w, 2, 16, 8, 8, generator=g, dtype=torch.float64)
        loss = make_grpo_step_loss(velocity, x, sig[:w], sig[1:])
        bb.zero_grad()
        stats = one_group(strategy, w, **how).backward(velocity, loss)
        return torch.cat([p.grad.flatten() for p in params]), stats

    exact2, _ = grad("exact", 2)
    exact3, stats = grad("exact", 3)
    assert stats.backward_calls == 3
    jagg3, _ = grad("jagg", 3)
    assert not torch.allclose(jagg3, exact3, atol=1e-6)
    for graph_mode in GRAPH_MODES:
        torch.testing.assert_close(grad("jagg", 2, graph_mode=graph_mode)[0], exact2, rtol=1e-9, atol=1e-12)
        got, stats = grad("jagg", 3, graph_mode=graph_mode)
        torch.testing.assert_close(got, jagg3, rtol=1e-9, atol=1e-12)
        assert stats.backward_passes == 2


def test_two_training_iterations_with_lora_and_export(pipeline_dir, tmp_path):
    """The paper recipe (LoRA r4 on the attention projections, CFG 4.5, KL 0.01, flow_grpo SDE on every step)
    trains two iterations through the CLI, with the JAGG groups of its routing; ``--export`` then writes a LoRA
    that diffusers' SD3 pipeline loads and that changes its output."""
    import yaml

    from jagg.train import main

    cfg = sd3_cfg(pipeline_dir, tmp_path / "run")
    config = tmp_path / "sd3.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["--config", str(config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["iteration"] for r in trained] == [1, 2]
    for r in trained:
        assert r["optimizer_steps"] == 2 and r["skipped_steps"] == 0 and r["onpolicy_ratio_max_dev"] == 0.0
        assert (
            r["backward_passes_per_sample"] == 2
        )  # int(0.99 * 4) = 3 trained steps, one JAGG group (exact: 3)
    out = tmp_path / "lora"
    assert main(["--config", str(config), "--export", str(out)]) == 0
    pipe = reference_pipeline(pipeline_dir / "sd3")
    noise = torch.randn(1, 16, LATENT, LATENT, generator=torch.Generator().manual_seed(0))
    kw = dict(
        num_inference_steps=2, height=LATENT, width=LATENT, max_sequence_length=16, output_type="latent"
    )
    with torch.no_grad():
        before = pipe(prompt=PROMPTS[:1], latents=noise.clone(), **kw).images
        pipe.load_lora_weights(str(out))
        after = pipe(prompt=PROMPTS[:1], latents=noise.clone(), **kw).images
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("base_dtype", ["fp32", "compute"])
def test_base_dtype_keeps_the_frozen_transformer_and_vae_in_fp32(pipeline_dir, tmp_path, base_dtype):
    """``model.base_dtype: fp32`` (the paper config, as Flow-GRPO's SD3 trainer): under bf16 autocast the
    frozen transformer and the VAE load and stay fp32 (compute: bf16), the adapters fp32 either way; a
    training iteration runs; the memory plan counts the frozen base at 4 bytes a parameter (compute: 2)."""
    from jagg.capacity.memory_model import memory_plan
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    cfg = sd3_cfg(
        pipeline_dir,
        tmp_path,
        "train.precision=bf16",
        f"model.base_dtype={base_dtype}",
        "train.iterations=1",
        "log.eval_every=0",
        "algorithm.kl_beta=0",
    )
    want = torch.float32 if base_dtype == "fp32" else torch.bfloat16
    comp = build_components(cfg)
    assert {p.dtype for p in comp.decode.vae.parameters()} == {want}
    trainer = Trainer(cfg, comp, tmp_path)
    params = dict(trainer.backbone.named_parameters())
    assert {p.dtype for n, p in params.items() if p.requires_grad} == {torch.float32}
    assert {p.dtype for n, p in params.items() if not p.requires_grad} == {want}
    (row,) = trainer.fit()
    assert row["optimizer_steps"] == 2 and row["skipped_steps"] == 0 and math.isfinite(row["loss"])
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    paper = load_config("configs/paper/sd3/sd35m_flowgrpo.yaml", [f"model.base_dtype={base_dtype}"])
    plan = memory_plan(paper, 8, 2, False)
    assert frozen > 0 and paper.model.shard_frozen_base is False
    n_frozen = plan.gpu["frozen base (replicated)"] / (4 if base_dtype == "fp32" else 2)
    assert n_frozen == 2_243_171_520  # SD3.5-M's own parameters (the r32 adapters are the trained ones)


def test_base_dtype_is_validated():
    with pytest.raises(ConfigError, match="model.base_dtype must be compute|fp32, got 'fp16'"):
        load_config("configs/paper/sd3/sd35m_flowgrpo.yaml", ["model.base_dtype=fp16"])
    with pytest.raises(ConfigError, match="model.base_dtype=fp32 needs train.precision bf16 or fp32"):
        load_config("configs/paper/sd3/sd35m_flowgrpo.yaml", ["train.precision=fp64"])


def test_config_errors_and_offline(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="model.backbone=sd3 needs model.source=pretrained"):
        load_config("configs/world/flux_dancegrpo.yaml", ["model.backbone=sd3"])
    from jagg.scale.pretrained import load_backbone

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE") as err:
        load_backbone("sd3")
    assert "stabilityai/stable-diffusion-3.5-medium" in str(err.value) and "gated" in str(err.value)


def test_dry_run_plan_of_the_paper_config(capsys):
    """``--dry-run`` of the SD3.5-M config without files: the known architecture (2.24B + LoRA r32 on attention),
    its three text encoders and VAE, true CFG doubling the transformer calls, 9 of 10 steps trained."""
    from jagg.scale.architectures import AUX_MODELS, KNOWN_CONFIGS, aux_params
    from jagg.train import main

    assert main(["--config", "configs/paper/sd3/sd35m_flowgrpo.yaml", "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "sd3 / pretrained (stabilityai/stable-diffusion-3.5-medium)" in out
    assert "transformer from known sd3 architecture" in out and "2.26B total, 18.8M trainable" in out
    assert (
        "x2 transformer work with true CFG (one call, twice the rows)" in out
        and "trained steps per sample           9 of 10" in out
    )
    for name in ("t5_xxl", "clip_l_text", "clip_g_text", "flux_vae"):
        assert AUX_MODELS[name][0] in out, name
    assert aux_params("clip_g_text") == 694_659_840  # CLIP-G text with its 1280 x 1280 projection
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        n = sum(p.numel() for p in SD3Transformer2DModel.from_config(KNOWN_CONFIGS["sd3"]).parameters())
    assert n == 2_243_171_520


# --------------------------------------------------------------------------- FSDP2 on 2 gloo ranks
def _two_rank_argv(out, name: str, *extra: str) -> list[str]:
    return paper_tiny_argv(
        "configs/paper/sd3/sd35m_flowgrpo.yaml", out / "sd3", out / "prompts.txt", out / "runs" / name, *extra
    )


TWO_RANK_RUNS = {  # the paper config as it is (bf16, checkpointing, LoRA on a replicated base), and full FT
    "lora_replicated_base": (),
    "full_finetune_sharded": ("model.lora_rank=0", "model.shard_frozen_base=true", "algorithm.kl_beta=0"),
}


def sd3_two_rank_worker(rank: int, out_dir: str) -> None:
    """One rank: the CLI's ``main`` for each run; rank 1 builds the transformer on the meta device and receives
    rank 0's weights (``shard_from_rank0``), including the patch embedding's positional table (a buffer)."""
    from pathlib import Path

    import jagg.train

    jagg.train._shutdown = lambda: None  # the harness destroys the process group
    out = Path(out_dir)
    codes = {
        name: jagg.train.main(_two_rank_argv(out, name, *extra)) for name, extra in TWO_RANK_RUNS.items()
    }
    (out / f"codes_rank{rank}.json").write_text(json.dumps(codes))


def test_paper_config_trains_on_two_ranks(tmp_path):
    from dist_harness import run_ranks

    save_tiny_sd3_pipeline(tmp_path / "sd3", PROMPTS)
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    run_ranks("test_sd3:sd3_two_rank_worker", 2, tmp_path)
    for r in range(2):
        assert json.loads((tmp_path / f"codes_rank{r}.json").read_text()) == dict.fromkeys(TWO_RANK_RUNS, 0)
    for name in TWO_RANK_RUNS:
        rows = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "loss" in r]
        assert len(trained) == 1 and trained[0]["optimizer_steps"] == 1 and trained[0]["skipped_steps"] == 0
        assert all(torch.isfinite(torch.tensor(r[k])) for r in trained for k in ("loss", "grad_norm"))
        assert "eval_jpeg_mean" in rows[-1]


def test_embedding_cache_keeps_the_negative_pooled_vector(pipeline_dir, tmp_path):
    """SD3's conditioning (tokens, pooled, negative tokens and pooled) through ``CachedTextEncoder``'s files and
    back, after the text encoders are freed: equal to a fresh encoding."""
    from jagg.scale.pipelines import CachedTextEncoder
    from jagg.scale.pretrained import load_text_encoder

    cfg = sd3_cfg(pipeline_dir, tmp_path)
    encoder = load_text_encoder(cfg, torch.device("cpu"), torch.float32)
    direct = encoder.encode_prompts(PROMPTS[:3])
    cached = CachedTextEncoder(encoder, cache_dir=str(tmp_path / "emb"), namespace="sd3")
    assert cached.precompute(PROMPTS[:3]) == 3
    cached.release()
    got = cached.encode_prompts(PROMPTS[:3])
    for name in ("embeds", "pooled", "neg_embeds", "neg_pooled"):
        torch.testing.assert_close(getattr(got, name), getattr(direct, name), msg=name)
    assert got.embeds.shape == (3, 77 + 16, 32) and got.neg_pooled.shape == (3, 32)
