"""Wan under FSDP2 on 2 gloo ranks (CPU): the real path loads a tiny Wan pipeline folder with rank 0 alone reading the
transformer (rank 1 builds it on the meta device and receives its shards, ``shard_from_rank0``), Wan's ``blocks``
are the FSDP2 units, and a knots backward over video latents, stacked and per knot, gives the gradient of one
process on the global batch. Kept tiny: one worker run, a ~38k-parameter transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_harness import rank_results, run_ranks, save_rank_result

WORLD, B, T = 2, 4, 5
CONFIG = "configs/paper/wan/wan21_flashgrpo_knots.yaml"
PROMPTS = ["a red ball rolls left", "a blue cube jumps"]


def _cfg(out: Path):
    from jagg.config import load_config, tiny_pipeline_overrides

    return load_config(
        CONFIG,
        [
            *tiny_pipeline_overrides(out / "wan", out / "prompts.txt"),
            "model.lora_rank=0",
            "model.gradient_checkpointing=false",
            "model.true_cfg_scale=1.0",
            "train.precision=fp32",
            "sampling.latent_size=4",
            "sampling.latent_width=null",
            "sampling.latent_frames=2",
        ],
    )


def _problem():
    """T trained steps of B video latents, their times, conditioning and a per-sample loss (the same on every
    rank); ``loss(rows)`` is the mean over ``rows``, so FSDP2's average over 2 ranks of half the rows each
    equals the global mean."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(T, B, 4, 2, 4, 4, generator=g)
    target = torch.randn(T, B, 4, 2, 4, 4, generator=g)
    sigmas = torch.tensor([0.95, 0.8, 0.6, 0.4, 0.2])
    embeds = torch.randn(B, 16, 32, generator=g)

    def loss(rows):
        return lambda j, v: ((v - target[j, rows]) ** 2).flatten(1).sum(1).mean()

    return latents, sigmas, embeds, loss


def _backward(backbone, rows, graph_mode: str) -> dict[str, int]:
    from helpers import Steps
    from jagg.engine.knots import Knots
    from jagg.engine.routing import BackwardSetting
    from jagg.models import TextCond

    latents, sigmas, embeds, loss = _problem()
    velocity = backbone.bind(TextCond(embeds=embeds[rows]))
    setting = BackwardSetting(
        routing=Knots(count=3, placement="index"), graph_mode=graph_mode, stored_outputs=False
    )
    stats = setting.backward(velocity, Steps(latents[:, rows], sigmas, loss(rows)))
    return {"backward_passes": stats.backward_passes, "backward_calls": stats.backward_calls}


def wan_worker(rank: int, out_dir: str) -> None:
    """One rank (``dist_harness.run_ranks`` owns the process group)."""
    from jagg.distributed import DistInfo
    from jagg.models import WanBackbone
    from jagg.scale.distributed import fsdp_units, full_grads
    from jagg.scale.placement import place_backbone
    from jagg.scale.pretrained import build_pretrained_components

    out = Path(out_dir)
    cfg = _cfg(out)
    rows = list(range(rank * B // WORLD, (rank + 1) * B // WORLD))
    report = {}
    for graph_mode in ("batched", "sequential"):
        comp = build_pretrained_components(cfg)
        report["meta"] = next(comp.backbone.parameters()).is_meta
        backbone, _ = place_backbone(cfg, comp.backbone, device=torch.device("cpu"), dist=DistInfo.current())
        report["units"] = len(fsdp_units(backbone))
        report[graph_mode] = _backward(backbone, rows, graph_mode)
        grads = full_grads(backbone)
        # one process on the global batch, from the same files
        from diffusers import WanTransformer3DModel

        ref = WanBackbone(WanTransformer3DModel.from_pretrained(out / "wan", subfolder="transformer"))
        _backward(ref, list(range(B)), graph_mode)
        ref_grads = {f"transformer.{n}": p.grad for n, p in ref.transformer.named_parameters()}
        assert ref_grads.keys() == grads.keys(), sorted(set(ref_grads) ^ set(grads))[:5]
        report[f"{graph_mode}_max_abs_diff"] = max(
            (grads[n] - g).abs().max().item() for n, g in ref_grads.items()
        )
        report[f"{graph_mode}_max_abs_grad"] = max(g.abs().max().item() for g in ref_grads.values())
    save_rank_result(out, rank, report, name="wan")


@pytest.fixture(scope="module")
def wan_ranks(tmp_path_factory):
    from jagg.scale.tiny_pipeline import save_tiny_wan_pipeline

    out = tmp_path_factory.mktemp("wan_dist")
    save_tiny_wan_pipeline(out / "wan", PROMPTS)
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    run_ranks("test_wan_distributed:wan_worker", WORLD, out)
    return rank_results(out, WORLD, name="wan")


def test_rank0_loads_and_every_wan_block_is_a_unit(wan_ranks):
    assert [r["meta"] for r in wan_ranks] == [False, True]  # only rank 0 read the weights
    assert all(r["units"] == 2 + 1 for r in wan_ranks)  # the tiny Wan's 2 blocks + the root


@pytest.mark.parametrize("graph_mode", ["batched", "sequential"])
def test_knots_under_fsdp2_equal_one_process(wan_ranks, graph_mode):
    for r in wan_ranks:
        assert r[graph_mode] == {"backward_passes": 3, "backward_calls": 1 if graph_mode == "batched" else 3}
        assert r[f"{graph_mode}_max_abs_diff"] <= 1e-5 * max(1.0, r[f"{graph_mode}_max_abs_grad"])


# --------------------------------------------------------------------------- Wan2.2-A14B's two experts, LoRA
def _experts_cfg(out: Path, *extra: str):
    from jagg.config import load_config, tiny_pipeline_overrides

    return load_config(
        "configs/paper/wan/wan22_a14b_flowfactory_knots.yaml",
        [
            *tiny_pipeline_overrides(out / "wan2", out / "prompts.txt"),
            "model.lora_rank=4",
            "model.lora_alpha=8",
            "model.gradient_checkpointing=false",
            "model.true_cfg_scale=1.0",
            "model.true_cfg_scale_2=1.0",
            "train.precision=fp32",
            "sampling.latent_size=4",
            "sampling.latent_frames=2",
            *extra,
        ],
    )


def _lora_grads(backbone) -> dict[str, torch.Tensor]:
    """Full copies of the adapters' gradients (every rank joins the gathers)."""
    from jagg.scale.distributed import full_grads

    return {n: g for n, g in full_grads(backbone).items() if "lora_" in n}


def experts_worker(rank: int, out_dir: str) -> None:
    """Both experts with LoRA on 2 ranks (FSDP2 units in each, rank 0 loading) against one process: a per-knot
    backward whose steps straddle the switch trains both experts' adapters, each with one process's gradient."""
    from jagg.distributed import DistInfo
    from jagg.scale.distributed import fsdp_units
    from jagg.scale.placement import place_backbone
    from jagg.scale.pretrained import build_pretrained_components

    out = Path(out_dir)
    cfg = _experts_cfg(out)
    rows = list(range(rank * B // WORLD, (rank + 1) * B // WORLD))
    comp = build_pretrained_components(cfg)
    report = {"meta": next(comp.backbone.parameters()).is_meta}
    backbone, _ = place_backbone(cfg, comp.backbone, device=torch.device("cpu"), dist=DistInfo.current())
    report["units"] = len(fsdp_units(backbone))
    _perturb(backbone)
    report["stats"] = _backward(backbone, rows, "sequential")
    grads = _lora_grads(backbone)
    if rank == 0:  # the same placement on one process (same adapters: one seed), the global batch
        ref = build_pretrained_components(cfg).backbone
        ref, _ = place_backbone(cfg, ref, device=torch.device("cpu"), dist=DistInfo())
        _perturb(ref)
        _backward(ref, list(range(B)), "sequential")
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n}
        assert ref_grads.keys() == grads.keys(), sorted(set(ref_grads) ^ set(grads))[:5]
        report["max_abs_diff"] = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
        report["max_abs_grad"] = max(g.abs().max().item() for g in ref_grads.values())
        report["experts_trained"] = sorted(
            {n.split(".")[0] for n, g in ref_grads.items() if g.abs().max().item() > 0}
        )
    save_rank_result(out, rank, report, name="experts")


def _perturb(backbone) -> None:
    """lora_B made non-zero (deterministically, per parameter name), so that lora_A gets gradients too."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(backbone.named_parameters())):
            if "lora_B" in name:
                g = torch.Generator().manual_seed(i)
                full = 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                if isinstance(p, DTensor):
                    full = distribute_tensor(full, p.device_mesh, p.placements)
                p.copy_(full)


@pytest.fixture(scope="module")
def experts_ranks(tmp_path_factory):
    from jagg.scale.tiny_pipeline import save_tiny_wan_pipeline

    out = tmp_path_factory.mktemp("wan_experts")
    save_tiny_wan_pipeline(out / "wan2", PROMPTS, boundary_ratio=0.7)
    (out / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    run_ranks("test_wan_distributed:experts_worker", WORLD, out)
    return rank_results(out, WORLD, name="experts")


def test_both_experts_with_lora_under_fsdp2_equal_one_process(experts_ranks):
    """sigmas 0.95, 0.8 on the high-noise expert (>= 0.7), 0.6, 0.4, 0.2 on the low-noise one."""
    assert [r["meta"] for r in experts_ranks] == [False, True]
    assert all(r["units"] == 2 * (2 + 1) for r in experts_ranks)  # each expert: 2 blocks + its root
    assert all(r["stats"]["backward_passes"] >= 3 for r in experts_ranks)
    main = experts_ranks[0]
    assert main["experts_trained"] == ["transformer", "transformer_2"]
    assert main["max_abs_diff"] <= 1e-5 * max(1.0, main["max_abs_grad"])
