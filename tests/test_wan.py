"""The Wan backbone (diffusers ``WanTransformer3DModel``) on tiny random-init models: sampler equivalence with
diffusers' ``WanPipeline`` (one expert, true CFG, Wan2.2-A14B's two experts, Wan2.2-TI2V's per-token timesteps),
video and one-frame latents, the detached unconditional branch, and which expert serves each step."""

from __future__ import annotations

import pytest
import torch

from helpers import grads_of, make_grpo_step_loss, rel_err, straight_path_latents
from jagg.engine.knots import Knots
from jagg.engine.routing import BackwardSetting
from jagg.engine.sampling import sample_trajectory
from jagg.models import TextCond, build_tiny_backbone
from jagg.models.wan import WanBackbone, tiny_wan_config
from jagg.scale.pretrained import sd3_sigmas

BOUNDARY = 0.875  # Wan2.2-T2V-A14B's model_index.json


def _cond(b: int, seed: int = 0, neg: bool = False, dtype=torch.float32) -> TextCond:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(b, 7, 32, generator=g, dtype=dtype)
    return TextCond(
        embeds=embeds, neg_embeds=torch.randn(b, 5, 32, generator=g, dtype=dtype) if neg else None
    )


def _tiny_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )


def _pipeline_latents(
    bb: WanBackbone, cond: TextCond, noise, steps, *, guidance, guidance_2=None, expand=False
):
    """``WanPipeline`` on the backbone's transformer(s), from ``noise`` with the conditioning's embeddings, to
    latents: diffusers' own loop, scheduler (shift 3, Euler) and CFG."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=_tiny_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=bb.transformer,
        transformer_2=bb.transformer_2,
        boundary_ratio=bb.boundary_ratio,
        expand_timesteps=expand,
    )
    pipe.set_progress_bar_config(disable=True)
    f, (h, w) = noise.shape[2], noise.shape[3:]
    out = pipe(
        prompt_embeds=cond.embeds,
        negative_prompt_embeds=cond.neg_embeds,
        latents=noise,
        num_inference_steps=steps,
        guidance_scale=guidance,
        guidance_scale_2=guidance_2,
        height=8 * h,
        width=8 * w,
        num_frames=4 * (f - 1) + 1,
        output_type="latent",
    )
    return out.frames, sd3_sigmas(dict(pipe.scheduler.config), steps)


CASES = {
    "wan2.1": dict(guidance=1.0),
    "wan2.1_cfg": dict(guidance=5.0),
    "wan2.2_ti2v": dict(guidance=5.0, expand=True),
    "wan2.2_a14b": dict(guidance=4.0, guidance_2=3.0, boundary=BOUNDARY),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ode_sampling_equals_the_wan_pipeline(case):
    """Same noise, same embeddings: ``sample_trajectory`` with every step ODE on the adapter reproduces
    ``WanPipeline``'s latents bit for bit (float32), its scheduler's sigmas read by ``sd3_sigmas``. In the A14B
    case both experts serve steps of the 6 (the schedule crosses 0.875 after step 1)."""
    kw = CASES[case]
    bb = WanBackbone.from_config(
        tiny_wan_config(),
        seed=1,
        boundary_ratio=kw.get("boundary"),
        guidance_scale=kw["guidance"],
        guidance_scale_2=kw.get("guidance_2"),
        expand_timesteps=kw.get("expand", False),
    )
    cond = _cond(2, neg=kw["guidance"] > 1)
    noise = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    steps = 6
    reference, sigmas = _pipeline_latents(
        bb,
        cond,
        noise,
        steps,
        guidance=kw["guidance"],
        guidance_2=kw.get("guidance_2"),
        expand=kw.get("expand", False),
    )
    ours = sample_trajectory(bb.bind(cond), noise, sigmas, ["ode"] * steps).final
    assert reference.shape == noise.shape and reference.abs().max() > 0.1
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    if "boundary" in kw:
        high = bb.high_noise(sigmas[:steps])
        assert 0 < int(high.sum()) < steps


def test_pipeline_equivalence_can_fail():
    """The comparison above is not vacuous: a different guidance scale gives other latents."""
    bb = WanBackbone.from_config(tiny_wan_config(), seed=1, guidance_scale=5.0)
    cond = _cond(2, neg=True)
    noise = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    reference, sigmas = _pipeline_latents(bb, cond, noise, 4, guidance=4.0)
    ours = sample_trajectory(bb.bind(cond), noise, sigmas, ["ode"] * 4).final
    assert (ours - reference).abs().max() > 1e-4


def test_a_four_dim_latent_is_one_frame():
    bb = build_tiny_backbone("wan", seed=2)
    z = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        v = bb.velocity(z, 0.6, _cond(2))
        v_video = bb.velocity(z[:, :, None], 0.6, _cond(2))
    assert v.shape == z.shape
    torch.testing.assert_close(v, v_video[:, :, 0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="Wan latents must be"):
        bb.velocity(z[0], 0.6, _cond(1))


def test_cfg_gradient_flows_through_the_conditional_branch_only():
    """v = u + g (c - u) with u computed without autograd: d<v, w>/dtheta = g d<c, w>/dtheta."""
    g = 4.5
    plain = build_tiny_backbone("wan", seed=3).double()
    guided = WanBackbone(plain.transformer, guidance_scale=g)
    cond = _cond(2, neg=True, dtype=torch.float64)
    z = torch.randn(2, 4, 2, 4, 4, dtype=torch.float64)
    w = torch.randn_like(z)
    params = list(plain.transformer.parameters())
    grads_c = torch.autograd.grad((plain.velocity(z, 0.7, TextCond(embeds=cond.embeds)) * w).sum(), params)
    grads_v = torch.autograd.grad((guided.velocity(z, 0.7, cond) * w).sum(), params)
    flat_v, flat_c = (torch.cat([x.flatten() for x in grads]) for grads in (grads_v, grads_c))
    # 1e-6, not 1e-12: diffusers' Wan runs its norms in float32 (tests/helpers.py FLOAT32_NORMS), and scaling the
    # output gradient by g changes their float32 rounding (measured: 7e-8)
    assert ((flat_v - g * flat_c).norm() / (g * flat_c).norm()) < 1e-6
    with torch.no_grad():  # and the guidance did change the value
        assert not torch.allclose(guided.velocity(z, 0.7, cond), plain.velocity(z, 0.7, cond))


# --------------------------------------------------------------------------- two experts (Wan2.2-A14B)
def _experts(seed: int = 0, dtype=torch.float64) -> WanBackbone:
    return WanBackbone.from_config(tiny_wan_config(), seed=seed, boundary_ratio=BOUNDARY).to(dtype)


def test_each_step_takes_its_velocity_from_the_right_expert():
    """A step at sigma >= 0.875 gets the high-noise expert's velocity, below it the low-noise one's; a stacked
    call with rows on both sides gives each row its own expert's velocity (the batched knot forward)."""
    bb = _experts()
    high, low = WanBackbone(bb.transformer), WanBackbone(bb.transformer_2)
    cond = _cond(2, dtype=torch.float64)
    z = torch.randn(2, 4, 2, 4, 4, dtype=torch.float64)
    sigmas = torch.tensor([1.0, 0.9, BOUNDARY, 0.8, 0.3], dtype=torch.float64)
    with torch.no_grad():
        for s in sigmas:
            expert = high if s >= BOUNDARY else low
            other = low if s >= BOUNDARY else high
            v = bb.velocity(z, s, cond)
            torch.testing.assert_close(v, expert.velocity(z, s, cond), rtol=0, atol=0)
            assert not torch.allclose(v, other.velocity(z, s, cond))
        mixed = bb.velocity(torch.cat([z, z]), torch.tensor([0.9, 0.9, 0.3, 0.3], dtype=torch.float64), cond)
        torch.testing.assert_close(mixed[:2], high.velocity(z, 0.9, cond), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mixed[2:], low.velocity(z, 0.3, cond), rtol=1e-12, atol=1e-12)


def test_a_step_trains_only_its_own_expert():
    bb = _experts()
    cond = _cond(2, dtype=torch.float64)
    z = torch.randn(2, 4, 2, 4, 4, dtype=torch.float64)
    for s, trained, frozen in (
        (0.95, bb.transformer, bb.transformer_2),
        (0.4, bb.transformer_2, bb.transformer),
    ):
        bb.zero_grad(set_to_none=True)
        bb.velocity(z, s, cond).square().sum().backward()
        assert all(p.grad is None for p in frozen.parameters())
        assert sum(p.grad.norm() for p in trained.parameters() if p.grad is not None) > 0
    assert bb.expert_boundaries == (BOUNDARY,) and build_tiny_backbone("wan").expert_boundaries == ()


def test_two_experts_need_a_boundary():
    t = build_tiny_backbone("wan").transformer
    with pytest.raises(ValueError, match="needs a boundary_ratio"):
        WanBackbone(t, transformer_2=t)
    with pytest.raises(ValueError, match="boundary_ratio must lie in"):
        WanBackbone(t, transformer_2=t, boundary_ratio=1.5)


@pytest.mark.parametrize("graph_mode", ["batched", "sequential"])
def test_knots_give_each_expert_the_gradient_of_its_own_plan(graph_mode):
    """Nine trained steps, the switch after step 1 (sigma 0.9 >= 0.875 > 0.81). Five knots through the bound
    two-expert velocity: each expert's gradient equals the knots plan of its own steps alone (2 and 3 knots,
    ``split_count``) run on that expert alone, in one stacked graph (batched) and knot by knot (sequential: the
    per-knot backward). Without the declared boundary, a knot interval straddles the switch and the gradients
    differ: the test can tell."""
    sigmas = torch.tensor([0.97, 0.9, 0.81, 0.71, 0.6, 0.47, 0.33, 0.19, 0.08, 0.02], dtype=torch.float64)
    bb = _experts(seed=4)
    cond = _cond(2, dtype=torch.float64)
    velocity = bb.bind(cond)
    latents = straight_path_latents((2, 4, 2, 4, 4), sigmas[:9], seed=7)
    loss = make_grpo_step_loss(velocity, latents, sigmas[:9], sigmas[1:], seed=3)
    setting = BackwardSetting(
        routing=Knots(count=5, placement="low_noise"), stored_outputs=False, graph_mode=graph_mode
    )
    assert setting.plan(velocity, sigmas[:9]).knots == (0, 1, 2, 6, 8)

    bb.zero_grad(set_to_none=True)
    stats = setting.backward(velocity, loss)
    assert stats.backward_calls == (1 if graph_mode == "batched" else 5)
    joint_high, joint_low = grads_of(bb.transformer), grads_of(bb.transformer_2)

    for expert, steps, count in ((bb.transformer, range(0, 2), 2), (bb.transformer_2, range(2, 9), 3)):
        alone = WanBackbone(expert).bind(cond)
        bb.zero_grad(set_to_none=True)
        knots = Knots(count=count, placement="low_noise")
        plan = knots.interpolation(sigmas[steps.start : steps.stop])
        setting.run_plan(
            plan,
            alone,
            latents[steps.start : steps.stop],
            sigmas[steps.start : steps.stop],
            lambda j, v, off=steps.start: loss(j + off, v),
        )
        separate = grads_of(expert)
        joint = joint_high if expert is bb.transformer else joint_low
        assert separate.norm() > 0
        assert rel_err(joint, separate) < 1e-8  # the float32 norms of diffusers' Wan (tests/helpers.py)

    bb.zero_grad(set_to_none=True)
    blind = BackwardSetting(routing=Knots(count=5, placement="low_noise"), stored_outputs=False)
    blind.backward(lambda z, t: bb.velocity(z, t, cond), loss)  # a velocity that does not declare the switch
    assert blind.plan(lambda z, t: None, sigmas[:9]).knots == (0, 4, 6, 7, 8)  # 0..4 spans the switch
    assert rel_err(grads_of(bb.transformer_2), joint_low) > 1e-3


# --------------------------------------------------------------------------- the real path on a tiny pipeline folder
def test_pretrained_components_load_a_wan_pipeline_folder(tmp_path):
    """``model.source=pretrained`` on a tiny Wan2.2-A14B-layout folder: both experts and the boundary from
    model_index.json, the UMT5 embeddings as ``WanPipeline.encode_prompt`` gives them, video latents (C, F, H, W)
    and the Wan VAE decoding them to frames."""
    from diffusers import WanPipeline

    from jagg.config import TINY_PIPELINE, load_config
    from jagg.scale.pretrained import build_pretrained_components
    from jagg.scale.tiny_pipeline import save_tiny_wan_pipeline

    prompts = ["a red ball rolls left", "a blue cube spins"]
    save_tiny_wan_pipeline(tmp_path / "wan", prompts, boundary_ratio=BOUNDARY)
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    cfg = load_config(
        None,
        [
            *TINY_PIPELINE,
            "model.backbone=wan",
            "model.source=pretrained",
            f"model.path={tmp_path / 'wan'}",
            "model.true_cfg_scale=4.0",
            "model.true_cfg_scale_2=3.0",
            f"data.train_prompts={tmp_path / 'p.txt'}",
            f"data.eval_prompts={tmp_path / 'p.txt'}",
            "sampling.latent_size=8",
            "sampling.latent_frames=3",
            "train.precision=fp32",
        ],
    )
    comp = build_pretrained_components(cfg)
    bb = comp.backbone
    assert isinstance(bb, WanBackbone) and bb.expert_boundaries == (BOUNDARY,)
    assert (bb.guidance_scale, bb.guidance_scale_2) == (4.0, 3.0)
    assert comp.latent_shape == (4, 3, 8, 8)
    cond = comp.text_encoder.encode_prompts(prompts)
    ref = WanPipeline.from_pretrained(tmp_path / "wan")
    embeds, neg = ref.encode_prompt(prompts, negative_prompt=[" "] * 2, max_sequence_length=16, device="cpu")
    # float32 rounding only (measured 7e-7 of values up to 3): UMT5 runs on other batch shapes there
    torch.testing.assert_close(cond.embeds, embeds.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(cond.neg_embeds, neg.detach(), rtol=0, atol=1e-5)
    z = torch.randn(2, *comp.latent_shape)
    video = comp.decode(z)
    # the tiny VAE halves height and width once and keeps the frames (one level, no temporal downsampling)
    assert video.shape == (2, 3, 3, 16, 16) and float(video.min()) >= 0 and float(video.max()) <= 1
    assert comp.decode(z[:, :, 0]).shape == (2, 3, 16, 16)  # one frame: an image


def test_the_real_path_fails_fast_offline(tmp_path, monkeypatch):
    from jagg.errors import WeightsUnavailableError
    from jagg.scale.pretrained import load_backbone

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsUnavailableError, match="local path does not exist"):
        load_backbone("wan", str(tmp_path / "missing"))
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE is set"):
        load_backbone("wan", "Wan-AI/Wan2.2-T2V-A14B-Diffusers-not-cached")


def test_wan_config_keys_are_checked():
    from jagg.config import load_config
    from jagg.errors import ConfigError

    base = ["model.backbone=wan", "model.source=pretrained", "model.path=x"]
    assert load_config(None, ["model.backbone=wan"]).model.source == "world"  # the video world's tiny Wan
    with pytest.raises(ConfigError, match="sampling.latent_frames must be >= 1 for model.backbone=wan"):
        load_config(None, ["sampling.latent_frames=3"])
    with pytest.raises(ConfigError, match="sampling.schedule must be shift for model.backbone=wan"):
        load_config(None, [*base, "sampling.schedule=scheduler"])
    with pytest.raises(ConfigError, match="model.true_cfg_scale_2 must be null or >= 1"):
        load_config(None, [*base, "model.true_cfg_scale_2=0.5"])


def test_lora_export_loads_into_diffusers_wan_pipeline(tmp_path):
    """A LoRA on the tiny Wan (the default targets: self- and cross-attention projections and the FFN), its
    adapters made non-zero, exported by ``export_lora``: ``WanPipeline.load_lora_weights`` on a fresh copy of the
    base gives the adapted model's velocity; without it the velocity differs (the test can tell)."""
    import copy

    from diffusers import WanPipeline

    from jagg.scale.lora import DEFAULT_TARGETS, apply_lora, export_lora

    bb = build_tiny_backbone("wan")
    base = copy.deepcopy(bb.transformer)
    apply_lora(bb, rank=4, alpha=8, target_modules=DEFAULT_TARGETS["wan"])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in bb.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    written = export_lora(bb, tmp_path / "lora")
    assert any(f.endswith("pytorch_lora_weights.safetensors") for f in written)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=base)
    cond = _cond(2, seed=1)
    z = torch.randn(2, 4, 2, 4, 4, generator=g)
    with torch.no_grad():
        adapted = bb.velocity(z, 0.7, cond)
        plain = WanBackbone(base).velocity(z, 0.7, cond)
        pipe.load_lora_weights(str(tmp_path / "lora"))
        loaded = WanBackbone(pipe.transformer).velocity(z, 0.7, cond)
    assert rel_err(plain, adapted) > 1e-3
    assert rel_err(loaded, adapted) < 1e-5


@pytest.mark.parametrize("lora", [4, 0])
def test_two_experts_train_and_export_both(tmp_path, lora):
    """Wan2.2-A14B's layout through the real path: both experts are trained (LoRA: adapters on both, one seed),
    and the export writes the high-noise expert in OUT and the low-noise one in OUT/transformer_2 (an adapter
    diffusers loads into ``transformer`` / ``transformer_2``, or a transformer folder): each expert's velocity
    then equals the trained backbone's, and differs from the untrained one's."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from jagg.config import load_config, tiny_pipeline_overrides
    from jagg.distributed import DistInfo
    from jagg.loop.export import export_trained
    from jagg.scale.placement import place_backbone
    from jagg.scale.pretrained import build_pretrained_components
    from jagg.scale.tiny_pipeline import save_tiny_wan_pipeline

    prompts = ["a red ball", "a blue cube"]
    save_tiny_wan_pipeline(tmp_path / "wan", prompts, boundary_ratio=BOUNDARY)
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    cfg = load_config(
        "configs/paper/wan/wan22_a14b_flowfactory.yaml",
        [
            *tiny_pipeline_overrides(tmp_path / "wan", tmp_path / "prompts.txt"),
            f"model.lora_rank={lora}",
            "model.lora_alpha=8",
            f"model.shard_frozen_base={'false' if lora else 'true'}",
            "train.precision=fp32",
            "optim.ema_decay=0",
            f"log.run_dir={tmp_path / 'run'}",
        ],
    )
    bb, _ = place_backbone(cfg, build_pretrained_components(cfg).backbone, device="cpu", dist=DistInfo())
    trained = {n.split(".")[0] for n, p in bb.named_parameters() if p.requires_grad}
    assert trained == {"transformer", "transformer_2"}
    assert all(("lora_" in n) == bool(lora) for n, p in bb.named_parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a stand-in for training: the adapters' B (LoRA) or every weight (full) moved
        for n, p in bb.named_parameters():
            if p.requires_grad and ("lora_B" in n or not lora):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    out = export_trained(cfg, bb, tmp_path / "export", dist=DistInfo())
    if lora:
        pipe = WanPipeline.from_pretrained(tmp_path / "wan")
        pipe.load_lora_weights(str(out))
        pipe.transformer_2.load_lora_adapter(
            str(out / "transformer_2"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
        )
        high, low = pipe.transformer, pipe.transformer_2
    else:
        high = WanTransformer3DModel.from_pretrained(out)
        low = WanTransformer3DModel.from_pretrained(out / "transformer_2")
    loaded = WanBackbone(high, transformer_2=low, boundary_ratio=BOUNDARY)
    plain = WanBackbone.from_config(
        tiny_wan_config(), seed=1, boundary_ratio=BOUNDARY
    )  # the folder's weights
    cond = _cond(2, seed=2)
    z = torch.randn(2, 4, 2, 4, 4, generator=g)
    with torch.no_grad():
        for t in (0.95, 0.3):  # one step on each expert
            v = bb.velocity(z, t, cond)
            assert rel_err(loaded.velocity(z, t, cond), v) < 1e-5
            assert rel_err(plain.velocity(z, t, cond), v) > 1e-3
