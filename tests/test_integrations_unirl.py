"""``jagg.integrations.unirl.JaggFlowGRPO`` against the installed UniRL (0.2.0): real stages of three model families
(``SD3DiffusionStage``, ``Flux2KleinDiffusionStage`` and the two-expert ``WAN22DiffusionStage`` with
``FlowSDEStrategy``, tiny random-init diffusers transformers, float32 as UniRL computes its log-probs), a rollout
from the stage's own ``diffuse``, and UniRL's ``FlowGRPO.compute_loss_and_backward`` as the reference:

- exact routing and knots K = T give FlowGRPO's gradient to 1e-6 relative (every graph mode; with beta > 0 too);
- a two-expert stage declares its switch: knots and JAGG groups stay on one side, stacked rows run per expert;
- K knots run K backward passes, JAGG W two per group, FlowGRPO T (counted with hooks on the transformer);
- knots K = 4 over 10 steps in ``sequential`` mode hold at most half FlowGRPO's saved activations
  (``SavedActivationMeter``);
- a UniRL ``TrainStack``-shaped step: backward through the algorithm, then the optimizer step, as UniRL's
  trainer drives it (its own trainer needs a Ray cluster: see ``test_one_training_step_as_unirl_drives_it``).

UniRL is installed by ``make engines`` (its metadata asks for Python >= 3.12; its code runs on 3.11); without it
these tests are skipped with that reason.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import WanTransformer3DModel

from helpers import count_passes, grads_of, rel_err

unirl = pytest.importorskip(
    "unirl", reason="UniRL is not installed: `make engines` installs it (unirl==0.2.0)"
)

from unirl.algorithms.flowgrpo import FlowGRPO  # noqa: E402
from unirl.sde.kernels import FlowSDEStrategy  # noqa: E402
from unirl.types.conditions import TextEmbedCondition  # noqa: E402

from jagg.engine.profiling import SavedActivationMeter  # noqa: E402
from jagg.engine.strategies import GRAPH_MODES  # noqa: E402
from jagg.errors import ConfigError  # noqa: E402
from jagg.integrations.unirl import JaggFlowGRPO  # noqa: E402
from jagg.models import tiny_sd3_config, tiny_wan_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
B, T, ETA, CLIP = 4, 6, 0.7, 2e-3
FAMILIES = ("sd3", "flux2_klein", "wan22")
BOUNDARY = 0.875  # Wan2.2-T2V-A14B's switch of expert


def sd3_stage():
    from diffusers import SD3Transformer2DModel
    from unirl.models.sd3.bundle import SD3Bundle
    from unirl.models.sd3.conditions import SD3Conditions
    from unirl.models.sd3.diffusion import SD3DiffusionStage, SD3DiffusionStep
    from unirl.types.sampling import DiffusionSamplingParams

    transformer = SD3Transformer2DModel(**tiny_sd3_config(latent_channels=4))
    bundle = SD3Bundle(
        transformer=transformer,
        vae=None,
        text_encoder=None,
        text_encoder_2=None,
        text_encoder_3=None,
        tokenizer=None,
        tokenizer_2=None,
        tokenizer_3=None,
        scheduler=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        pretrained_path="",
    )
    stage = SD3DiffusionStage(
        model=bundle,
        step=SD3DiffusionStep(),
        strategy=FlowSDEStrategy(),
        autocast_precision="fp32",
        trajectory_precision="fp32",  # UniRL accepts bf16 / fp16 / fp32 only
        latent_channels=4,
    )
    params = lambda t: DiffusionSamplingParams(  # noqa: E731
        num_inference_steps=t, guidance_scale=1.0, height=32, width=32, eta=ETA, sde_indices=list(range(t))
    )
    return stage, params, SD3Conditions


def flux2_klein_stage():
    from diffusers import Flux2Transformer2DModel
    from unirl.models.flux2_klein.bundle import Flux2KleinBundle
    from unirl.models.flux2_klein.conditions import Flux2KleinConditions
    from unirl.models.flux2_klein.diffusion import (
        Flux2KleinDiffusionParams,
        Flux2KleinDiffusionStage,
        Flux2KleinDiffusionStep,
    )

    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
    )
    bundle = Flux2KleinBundle(
        transformer=transformer,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        scheduler=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        pretrained_path="",
    )
    stage = Flux2KleinDiffusionStage(
        model=bundle,
        step=Flux2KleinDiffusionStep(),
        strategy=FlowSDEStrategy(),
        autocast_precision="fp32",
        trajectory_precision="fp32",
    )
    params = lambda t: Flux2KleinDiffusionParams(  # noqa: E731
        num_inference_steps=t, guidance_scale=1.0, height=64, width=64, eta=ETA, sde_indices=list(range(t))
    )
    return stage, params, Flux2KleinConditions


def wan22_stage():
    """UniRL's two-expert ``WAN22DiffusionStage`` on two tiny random-init Wan transformers (one-frame latents of
    16 channels, the stage's default without a VAE), switching at Wan2.2-A14B's ``boundary_ratio`` 0.875: steps 0
    and 1 of ``rollout``'s 6-step schedule (sigmas 1, 0.94) on the high-noise expert, the rest on the low-noise."""
    from unirl.models.wan21.conditions import WAN21Conditions
    from unirl.models.wan22.bundle import WAN22Bundle, WanDualTransformer
    from unirl.models.wan22.diffusion import WAN22DiffusionStage, WAN22DiffusionStep
    from unirl.types.sampling import DiffusionSamplingParams

    high, low = (WanTransformer3DModel(**tiny_wan_config(latent_channels=16)) for _ in range(2))
    bundle = WAN22Bundle(
        transformer=WanDualTransformer(high_noise=high, low_noise=low),
        high_noise_transformer=high,
        low_noise_transformer=low,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        pretrained_path="",
        max_sequence_length=5,
        boundary_ratio=BOUNDARY,
        guidance_scale_2=None,
        num_train_timesteps=1000,
    )
    stage = WAN22DiffusionStage(
        model=bundle,
        step=WAN22DiffusionStep(),
        strategy=FlowSDEStrategy(),
        autocast_precision="fp32",
        trajectory_precision="fp32",
    )
    params = lambda t: DiffusionSamplingParams(  # noqa: E731
        num_inference_steps=t,
        guidance_scale=1.0,
        height=32,
        width=32,
        num_frames=1,
        eta=ETA,
        sde_indices=list(range(t)),
    )
    return stage, params, WAN21Conditions


STAGES = {"sd3": sd3_stage, "flux2_klein": flux2_klein_stage, "wan22": wan22_stage}


def rollout(family: str, steps: int = T, seed: int = 0):
    """(stage, params, conditions_cls, conditions dict, segment, advantages): a tiny stage of ``family``, a
    rollout of ``steps`` SDE steps by the stage's own ``diffuse`` (3x-shifted schedule), old log-probs nudged off
    the rollout's (ratios != 1, some clipped) and random advantages."""
    torch.manual_seed(seed)
    stage, params_of, conditions_cls = STAGES[family]()
    params = params_of(steps)
    g = torch.Generator().manual_seed(seed + 1)
    text = TextEmbedCondition(
        embeds=torch.randn(B, 5, 32, generator=g), pooled=torch.randn(B, 32, generator=g)
    )
    conditions = {"text": text}
    t = torch.linspace(1.0, 0.0, steps + 1)
    schedule = 3 * t / (1 + 2 * t)
    segment = stage.diffuse(conditions_cls.from_dict(conditions), schedule=schedule, params=params)
    segment.sde_logp = segment.sde_logp + 1e-3 * torch.randn(segment.sde_logp.shape, generator=g)
    advantages = torch.randn(B, generator=g)
    return SimpleNamespace(
        stage=stage, params=params, cls=conditions_cls, conditions=conditions, segment=segment, adv=advantages
    )


def step(algorithm, r, loss_scale=0.5):
    """One micro-batch through ``algorithm`` as UniRL's TrainStack calls it; returns (gradient, result)."""
    module = r.stage.trainable_module()
    module.zero_grad(set_to_none=True)
    result = algorithm.compute_loss_and_backward(
        conditions=r.conditions,
        segment=r.segment,
        advantages=r.adv,
        training_progress=0.0,
        loss_scale=loss_scale,
    )
    return grads_of(module).clone(), result


def algorithms(r, backward=None, **kw):
    common = dict(stage=r.stage, params=r.params, conditions_cls=r.cls, clip_range=CLIP, **kw)
    return FlowGRPO(**common), (None if backward is None else JaggFlowGRPO(backward=backward, **common))


@pytest.fixture(scope="module", params=FAMILIES)
def family_rollout(request):
    return rollout(request.param)


@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
@pytest.mark.parametrize(
    "backward", [{"strategy": "exact"}, {"strategy": "knots", "knots": T}], ids=["exact", "knotsT"]
)
def test_exact_and_knots_at_every_step_give_flowgrpos_gradient(family_rollout, backward, graph_mode):
    r = family_rollout
    flowgrpo, jagg = algorithms(r, {**backward, "graph_mode": graph_mode})
    reference, ref_result = step(flowgrpo, r)
    got, result = step(jagg, r)
    assert reference.norm() > 0
    assert rel_err(got, reference) <= 1e-6
    assert result.loss == pytest.approx(ref_result.loss, rel=1e-6)
    assert result.metrics["clip_fraction"] == ref_result.metrics["clip_fraction"]
    assert 0 < ref_result.metrics["clip_fraction"] < 1  # the check covers clipped and unclipped samples
    for name in ("policy_loss", "ratio_mean", "approx_kl"):
        assert result.metrics[name] == pytest.approx(ref_result.metrics[name], rel=1e-5, abs=1e-9)


def test_a_jagg_group_is_not_flowgrpos_gradient(family_rollout):
    """The check above can fail: JAGG W = 3 interpolates the Jacobians, so on a nonlinear transformer its
    gradient differs from FlowGRPO's beyond the tolerance."""
    r = family_rollout
    flowgrpo, jagg = algorithms(r, {"strategy": "jagg", "group_size": 3, "jagg_frac": 1.0})
    reference, _ = step(flowgrpo, r)
    got, _ = step(jagg, r)
    assert rel_err(got, reference) > 1e-3


def test_a_two_expert_stage_declares_its_switch_and_plans_each_expert_apart():
    """UniRL's WAN22 stage: the velocity declares ``boundary_ratio`` (0.875), so K = 3 knots are raised to the two
    ends of each expert's steps, [0, 1] and [2, 5] (4 backward passes), and the JAGG groups [0, 1, 2], [3, 4, 5]
    are cut at the switch into [0, 1], [2] exact, [3, 4, 5] (5 passes), and both experts are trained. Before,
    ``StageVelocity`` declared nothing: 3 knots with the interval [1, 5] across the switch, and 4 passes."""
    from jagg.integrations.unirl import StageVelocity

    r = rollout("wan22")
    conds = r.cls.from_dict(r.conditions)
    assert StageVelocity(r.stage, conds, r.params).expert_boundaries == (BOUNDARY,)
    assert StageVelocity(sd3_stage()[0], conds, r.params).expert_boundaries == ()
    experts = r.stage.trainable_module()
    for backward, passes in (
        ({"strategy": "knots", "knots": 3, "placement": "time"}, 4),
        ({"strategy": "jagg", "group_size": 3, "jagg_frac": 1.0}, 5),
    ):
        _, jagg = algorithms(r, backward)
        step(jagg, r)
        assert jagg.last_stats.backward_passes == passes
        assert all(
            p.grad.abs().max() > 0
            for p in (experts.high_noise.proj_out.weight, experts.low_noise.proj_out.weight)
        )


def test_stacked_rows_never_run_across_the_switch(monkeypatch):
    """A two-expert stage with a batched replay (``_tile_conditions``, here added to the WAN22 stage as SD3's
    is): UniRL runs one expert per call, chosen by the first row's sigma, so a stacked knot forward of all 6
    steps must be split at the switch. Knots K = T in ``batched`` mode then give FlowGRPO's gradient; before, one
    tiled call ran the low-noise steps on the high-noise expert."""
    from unirl.models.wan22.diffusion import WAN22DiffusionStage

    tiled = []

    def tile(conditions, repeats):
        tiled.append(repeats)
        text = conditions.text
        return type(conditions)(
            text=TextEmbedCondition(
                embeds=text.embeds.repeat(repeats, 1, 1), pooled=text.pooled.repeat(repeats, 1)
            )
        )

    monkeypatch.setattr(WAN22DiffusionStage, "_tile_conditions", staticmethod(tile), raising=False)
    r = rollout("wan22")
    flowgrpo, jagg = algorithms(r, {"strategy": "knots", "knots": T, "graph_mode": "batched"})
    reference, _ = step(flowgrpo, r)
    got, _ = step(jagg, r)
    assert rel_err(got, reference) <= 1e-6
    assert tiled == [2, 4]  # the high-noise steps 0-1 in one call, the low-noise steps 2-5 in another


def test_the_kl_term_with_beta(tmp_path):
    """beta > 0: FlowGRPO's KL to the LoRA-disabled reference (a PEFT LoRA on the transformer, random B so the
    reference differs) is the same in the per-step loss."""
    from peft import LoraConfig, inject_adapter_in_model

    r = rollout("sd3")
    module = r.stage.trainable_module()
    config = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False)
    inject_adapter_in_model(config, module)
    backend = SimpleNamespace(model=module)
    flowgrpo, jagg = algorithms(r, {"strategy": "exact"}, beta=0.5, backend=backend)
    reference, ref_result = step(flowgrpo, r)
    got, result = step(jagg, r)
    assert ref_result.metrics["kl_ref_mean"] > 0
    assert rel_err(got, reference) <= 1e-6
    assert result.metrics["kl_ref_mean"] == pytest.approx(ref_result.metrics["kl_ref_mean"], rel=1e-5)


@pytest.mark.parametrize(
    "backward, passes",
    [
        ({"strategy": "knots", "knots": 3, "placement": "time"}, 3),
        ({"strategy": "jagg", "group_size": 3, "jagg_frac": 1.0}, 2 * (T // 3)),
        ({"strategy": "exact"}, T),
    ],
    ids=["knots3", "jaggW3", "exact"],
)
def test_backward_passes_are_counted_on_the_transformer(backward, passes):
    r = rollout("sd3")
    flowgrpo, jagg = algorithms(r, {**backward, "graph_mode": "joint"})
    module = r.stage.trainable_module()
    with count_passes(module) as theirs:
        step(flowgrpo, r)
    with count_passes(module) as ours:
        _, result = step(jagg, r)
    assert theirs["backward_graphs"] == T and theirs["backward_calls"] == 1  # FlowGRPO: T graphs, one call
    assert ours["backward_graphs"] == passes == jagg.last_stats.backward_passes
    assert result.metrics["jagg/backward_passes"] == passes


def test_knots_four_over_ten_steps_halve_the_activation_peak():
    """The goal: K = 4 knots over 10 trained steps, ``sequential``: 4 backward passes where FlowGRPO runs 10, and
    at most 0.5x FlowGRPO's peak of saved activations (FlowGRPO keeps all 10 graphs for its one backward)."""
    r = rollout("sd3", steps=10)
    flowgrpo, jagg = algorithms(
        r, {"strategy": "knots", "knots": 4, "placement": "time", "graph_mode": "sequential"}
    )
    module = r.stage.trainable_module()
    with count_passes(module) as theirs, SavedActivationMeter() as their_memory:
        step(flowgrpo, r)
    with count_passes(module) as ours, SavedActivationMeter() as our_memory:
        step(jagg, r)
    assert (theirs["backward_graphs"], ours["backward_graphs"]) == (10, 4)
    assert our_memory.peak_bytes <= 0.5 * their_memory.peak_bytes
    assert our_memory.peak_bytes > 0


def test_one_training_step_as_unirl_drives_it():
    """UniRL's own trainer (``unirl.trainer.diffusion``) builds every role with ``remote()`` inside a Ray
    placement: it does not run as one CPU process without a Ray cluster. Its ``TrainStack`` calls
    ``prepare_segment`` once, then per micro-batch ``compute_loss_and_backward(loss_scale=1 / n_micro)``, then clips
    and steps the optimizer; this does the same with JaggFlowGRPO (knots, sequential), and the step moves the
    weights the way FlowGRPO's does, to the gradients' agreement."""
    r = rollout("sd3")
    module = r.stage.trainable_module()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    moved = {}
    for name, backward in {
        "flowgrpo": None,
        "knots": {"strategy": "knots", "knots": T, "graph_mode": "sequential"},
    }.items():
        module.load_state_dict(start)
        flowgrpo, jagg = algorithms(r, backward)
        algorithm = jagg or flowgrpo
        algorithm.prepare_segment(conditions=r.conditions, segment=r.segment)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        optimizer.zero_grad(set_to_none=True)
        halves = [slice(0, B // 2), slice(B // 2, B)]
        for half in halves:
            micro = SimpleNamespace(**vars(r))
            micro.conditions = {
                "text": TextEmbedCondition(
                    embeds=r.conditions["text"].embeds[half], pooled=r.conditions["text"].pooled[half]
                )
            }
            micro.segment = r.segment.__class__(
                **{
                    **vars(r.segment),
                    "latents": r.segment.latents[half],
                    "sde_logp": r.segment.sde_logp[half],
                }
            )
            micro.adv = r.adv[half]
            result = algorithm.compute_loss_and_backward(
                conditions=micro.conditions,
                segment=micro.segment,
                advantages=micro.adv,
                training_progress=0.0,
                loss_scale=1 / len(halves),
            )
            assert result.has_backward
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        moved[name] = torch.cat([(module.state_dict()[k] - start[k]).flatten() for k in start])
    assert moved["knots"].norm() > 0
    assert rel_err(moved["knots"], moved["flowgrpo"]) <= 1e-5


def test_bad_backward_config_names_the_key():
    r = rollout("sd3", steps=2)
    with pytest.raises(ConfigError, match="algorithm.backward.strategi"):
        algorithms(r, {"strategi": "knots"})
    with pytest.raises(ConfigError, match="measured routing"):
        algorithms(r, {"strategy": "jagg", "jagg_frac": "auto"})


def test_the_shipped_config_switches_a_flowgrpo_recipe_with_one_target():
    """configs/engines/unirl_knots.yaml merged over a FlowGRPO recipe's algorithm block (UniRL's SD3 recipe's
    keys, conditions_cls through hydra.utils.get_class as there) and built by Hydra with the pipeline, as UniRL's
    trainer builds its algorithm (``remote_hydra(algorithm_cfg, pipeline=...)``): a JaggFlowGRPO with the recipe's settings and 4 knots, 4 backward passes."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    r = rollout("sd3")
    recipe = OmegaConf.create(
        {
            "algorithm": {
                "_target_": "unirl.algorithms.flowgrpo.FlowGRPO",
                "stage_attr": "diffusion",
                "clip_range": CLIP,
                "clip_schedule": "constant",
                "old_logp_source": "rollout",
                "conditions_cls": {
                    "_target_": "hydra.utils.get_class",
                    "path": "unirl.models.sd3.conditions.SD3Conditions",
                },
            }
        }
    )
    cfg = OmegaConf.merge(recipe, OmegaConf.load(ROOT / "configs" / "engines" / "unirl_knots.yaml"))
    # the pipeline and the sampling params are live objects the trainer passes in (Hydra configs hold data only)
    build = instantiate(cfg.algorithm, _partial_=True)
    algorithm = build(pipeline=SimpleNamespace(diffusion=r.stage), params=r.params)
    assert (
        type(algorithm) is JaggFlowGRPO and algorithm.clip_range == CLIP and algorithm.conditions_cls is r.cls
    )
    assert algorithm.setting.key == "knots/K4/time/sequential"
    _, result = step(algorithm, r)
    assert algorithm.last_stats.backward_passes == 4 and result.metrics["jagg/backward_passes"] == 4
