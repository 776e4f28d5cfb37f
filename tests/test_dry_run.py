"""``python -m jagg.train --dry-run``: every paper config validates and prints its plan offline, without
weights; the paper configs differ only where their experiments differ."""

from __future__ import annotations

import glob

import pytest
import torch

from jagg.config import load_config
from jagg.train import main

# The eight paper recipes in this repository's reading (MixGRPO's window is one group: jagg_frac 1.0; every step
# trained through shared knots: *_dancegrpo_knots); the JAGG authors' own recipe is tested on its own below.
AUTHORS = "configs/paper/qwenimage_dancegrpo_authors.yaml"
PAPER = sorted(p for p in glob.glob("configs/paper/*_*.yaml") if p != AUTHORS)


def test_all_eight_paper_configs_exist():
    names = {p.split("/")[-1] for p in PAPER}
    algorithms = ("dancegrpo", "dancegrpo_knots", "flowgrpo_fast", "mixgrpo")
    assert names == {f"{b}_{a}.yaml" for b in ("flux", "qwenimage") for a in algorithms}


@pytest.mark.parametrize("config", PAPER)
def test_dry_run_prints_plan_offline(tmp_path, capsys, monkeypatch, config):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir = tmp_path / "run"
    assert main(["--config", config, "--dry-run", "--world-size", "8", f"log.run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(config)
    for text in ("trained steps per sample", "cost per sample by endpoint mode", "memory per rank"):
        assert text in out
    backward = cfg.backward
    if backward.strategy == "knots":  # every step trained, K shared knots
        assert f"K={backward.knots}, placement={backward.placement}" in out
        assert "knots (positions among the trained steps)" in out
    else:
        assert f"W={backward.group_size}, jagg_frac={backward.jagg_frac}" in out
        assert "group 0" in out and "-> jagg" in out
    assert "over 8" in out
    assert not run_dir.exists()  # a dry run writes nothing
    # the memory plan counts every resident model and says per GPU size whether the run fits
    encoder = "T5-XXL encoder" if cfg.model.backbone == "flux" else "Qwen2.5-VL-7B"
    if cfg.data.precompute_embeddings:  # encoded once, cached, freed: the plan says so instead
        encoder = "freed after precomputing"
    for text in (
        encoder,
        "VAE",
        "HPSv2.1",
        "PickScore",
        "CLIPScore",
        "AdamW moments",
        "activations (update)",
    ):
        assert text in out, text
    assert "80 GB GPU (74.5 GiB)" in out and "141 GB GPU (131.3 GiB)" in out
    assert "host memory per rank" in out and "export (rank 0 host, once)" in out


def test_dry_run_counts(capsys):
    """Flux DanceGRPO: 9 trained steps, groups of 3, JAGG on round(0.6 * 3) = 2 groups: 7 backward graphs."""
    assert main(["--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "9 of 16" in out and "group 2                            steps [6, 7, 8] -> exact" in out
    rows = {ln.split()[-8]: ln.split()[-6:] for ln in out.splitlines() if len(ln.split()) >= 8}
    # forwards (grad), backward passes, backward calls, all-gathers, reduce-scatters per unit, graphs alive
    assert rows["exact"] == ["(9)", "9", "9", "18", "9", "1"]
    assert rows["jagg/joint"] == ["(7)", "7", "5", "16", "5", "2"]  # the paper's recipe
    assert rows["jagg/batched+stored"] == ["(7)", "7", "5", "10", "5", "2"]  # the default
    assert rows["jagg/sequential"] == ["(7)", "7", "7", "16", "7", "1"]
    # configured: DanceGRPO's cadence, 24 samples per rank = 12 micro-batches, a step every 6 (two per iteration);
    # stored outputs serve the first accumulation window only
    assert "* jagg/batched+stored" in out
    assert "6 of 12 micro-batches" in out and "step every 6" in out
    assert "11.90B total" in out  # FLUX.1-dev transformer built on the meta device


def test_dry_run_rejects_world_size_that_splits_micro_batches(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run", "--world-size", "5"])
    assert exc.value.code == 2
    assert "world_size * train.train_batch_size" in capsys.readouterr().err


def _diff(a: str, b: str) -> set[tuple[str, str]]:
    x, y = load_config(a).to_dict(), load_config(b).to_dict()
    return {(s, k) for s in x for k in x[s] if x[s][k] != y[s][k]}


def test_paper_configs_differ_only_where_declared():
    assert _diff("configs/paper/flux_dancegrpo.yaml", "configs/paper/qwenimage_dancegrpo.yaml") == {
        ("model", "backbone"),
        ("model", "path"),
        ("sampling", "num_steps"),
        ("sampling", "eval_num_steps"),
        ("data", "precompute_embeddings"),  # to fit 8 x 80 GB (see the config's comment)
        ("data", "embedding_cache"),
        ("log", "run_dir"),
    }
    fast = _diff("configs/paper/flux_flowgrpo_fast.yaml", "configs/paper/qwenimage_flowgrpo_fast.yaml")
    assert {s for s, _ in fast} == {"model", "sampling", "algorithm", "backward", "train", "log"}
    assert ("optim", "lr") not in fast and ("reward", "weights") not in fast


def test_paper_recipes_follow_the_references():
    """Values taken from the reference code (each config's header comment cites the file)."""
    for b in ("flux", "qwenimage"):
        dance = load_config(f"configs/paper/{b}_dancegrpo.yaml")
        assert dance.algorithm.init_same_noise  # every DanceGRPO launch script passes --init_same_noise
        t = dance.train  # 8 GPUs: 2 prompts x 12 per rank, a step every 12 samples -> 2 steps per iteration
        per_rank = t.prompts_per_iter * t.images_per_prompt // 8
        assert (
            per_rank,
            t.train_batch_size * t.grad_accum,
            per_rank // (t.train_batch_size * t.grad_accum),
        ) == (
            24,
            12,
            2,
        )
        assert dance.model.true_cfg_scale == 1.0 and dance.sampling.schedule == "shift"  # --cfg 0.0, shift 3
    flux, qwen = (load_config(f"configs/paper/{b}_flowgrpo_fast.yaml") for b in ("flux", "qwenimage"))
    assert flux.model.max_sequence_length == 128 and qwen.model.max_sequence_length == 512
    assert flux.algorithm.adv_std == "group" and qwen.algorithm.adv_std == "global"  # global_std False / True
    assert flux.algorithm.sde_window_range == [0, 3] and qwen.algorithm.sde_window_range == [0, 5]
    fast = _diff("configs/paper/flux_flowgrpo_fast.yaml", "configs/paper/qwenimage_flowgrpo_fast.yaml")
    assert {
        ("model", "max_sequence_length"),
        ("algorithm", "adv_std"),
        ("algorithm", "sde_window_range"),
    } <= fast


def _plan(config, *overrides, world_size=8):
    from jagg.capacity.memory_model import memory_plan
    from jagg.capacity.pass_plan import trained_steps_per_sample

    cfg = load_config(config, list(overrides))
    setting = cfg.backward.fixed_setting()
    cost = setting.cost(trained_steps_per_sample(cfg))
    return memory_plan(cfg, world_size, cost.graphs_alive, setting.holds_gradients)


PRECOMPUTED = ("data.precompute_embeddings=true", "data.embedding_cache=cache/embeddings")


@pytest.mark.parametrize("config", PAPER)
def test_memory_plan_verdicts_for_8_gpus(config):
    """Every paper config, as configured, fits 8 x 80 GB and 8 x 141 GB (none fits 80 GB without gradient
    checkpointing). Qwen-Image DanceGRPO (every-step knots too) and MixGRPO fit only because their configs precompute the prompt
    embeddings to a disk cache (the text encoder freed): with the text encoder kept (full fine-tuning of 20.4B
    parameters + Qwen2.5-VL-7B on every GPU) they would exceed 80 GB."""
    mp = _plan(config)
    assert mp.fits(141) and mp.fits(80)
    assert not mp.fits(80, checkpointing=False)
    precomputed = _plan(config, *PRECOMPUTED)
    assert precomputed.fits(80)
    kept = _plan(config, "data.precompute_embeddings=false")
    full_qwen = config.endswith(
        ("qwenimage_dancegrpo.yaml", "qwenimage_dancegrpo_knots.yaml", "qwenimage_mixgrpo.yaml")
    )
    assert kept.fits(80) == (not full_qwen)
    assert sum(kept.gpu.values()) - sum(precomputed.gpu.values()) > 8 * 2**30  # T5-XXL / Qwen2.5-VL freed


def test_memory_plan_counts():
    """Flux DanceGRPO on 8 ranks: 11.9B parameters, fp32 master weights / gradients / AdamW sharded 8 ways."""
    mp = _plan("configs/paper/flux_dancegrpo.yaml")
    n = 11.90e9
    assert mp.gpu["transformer weights (sharded)"] == pytest.approx(n * 4 / 8, rel=1e-3)
    assert mp.gpu["AdamW moments (sharded)"] == pytest.approx(2 * n * 4 / 8, rel=1e-3)
    assert mp.gpu["T5-XXL encoder (google/t5-v1_1-xxl)"] == pytest.approx(4.762e9 * 2, rel=1e-3)
    assert mp.activations[False] > 10 * mp.activations[True]  # checkpointing keeps block inputs only
    lora = _plan(
        "configs/paper/flux_flowgrpo_fast.yaml", "model.shard_frozen_base=true"
    )  # bf16 base, sharded
    assert lora.gpu["transformer weights (sharded)"] == pytest.approx((n * 2 + 179.3e6 * 4) / 8, rel=2e-3)
    bf16 = _plan("configs/paper/flux_dancegrpo.yaml", "reward.kwargs.hpsv2.dtype=bf16")
    assert bf16.gpu["HPSv2.1: open_clip ViT-H-14"] == mp.gpu["HPSv2.1: open_clip ViT-H-14"] / 2


@pytest.mark.parametrize(
    "config", ["configs/paper/flux_flowgrpo_fast.yaml", "configs/paper/qwenimage_flowgrpo_fast.yaml"]
)
def test_memory_plan_replicated_frozen_base(config):
    """model.shard_frozen_base=false: the bf16 base in full on every rank instead of 1/8 of it, only the
    adapters' blocks in flight, and no all-gather of a base weight (rollout and update, per iteration)."""
    from jagg.capacity.memory_model import all_gather_bytes, meta_transformer
    from jagg.capacity.pass_plan import trained_steps_per_sample

    sharded = _plan(config, "model.shard_frozen_base=true")
    replicated = _plan(config, "model.shard_frozen_base=false")
    cfg = load_config(config)
    model = meta_transformer(cfg)[0]
    n_all = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = (n_all - n_train) * 2  # bf16
    assert replicated.gpu["frozen base (replicated)"] == base
    assert replicated.gpu["transformer weights (sharded)"] == n_train * 4 / 8
    assert sharded.gpu["transformer weights (sharded)"] == (n_train * 4 + base) / 8
    assert "frozen base (replicated)" not in sharded.gpu
    assert replicated.gpu["unsharded blocks in flight"] < sharded.gpu["unsharded blocks in flight"] / 20
    grown = replicated.allocated() - sharded.allocated()  # the same activations and transients
    blocks = sharded.gpu["unsharded blocks in flight"] - replicated.gpu["unsharded blocks in flight"]
    assert grown == pytest.approx(base * 7 / 8 - blocks, rel=1e-9)
    assert replicated.total() - sharded.total() == pytest.approx(
        grown * 1.02, rel=1e-9
    )  # + its fragmentation
    setting = cfg.backward.fixed_setting()
    cost = setting.cost(trained_steps_per_sample(cfg))
    gathered = {
        x: all_gather_bytes(load_config(config, [f"model.shard_frozen_base={x}"]), model, cost.all_gathers, 8)
        for x in ("true", "false")
    }
    assert gathered["false"]["base"] == 0 and gathered["true"]["base"] > 0
    assert gathered["true"]["total"] - gathered["false"]["total"] == gathered["true"]["base"]
    assert gathered["false"]["total"] == n_train * 2 * gathered["false"]["rounds"]


def test_resident_model_parameter_counts_match_the_published_ones():
    """Built on the meta device from the architectures in jagg.scale.architectures; the published counts as a check."""
    from jagg.scale.architectures import AUX_MODELS, aux_params

    for name, (_, published) in AUX_MODELS.items():
        assert aux_params(name) == pytest.approx(published, rel=2e-3), name


def test_reward_dtype_by_name(capsys):
    from jagg.loop.rewards import build_run_reward
    from jagg.rewards import REWARDS

    seen = {}
    REWARDS["dtype_test"] = lambda dtype=torch.float32, device=None: seen.setdefault("dtype", dtype)
    try:
        build_run_reward("dtype_test", {"dtype": "bf16"}, torch.device("cpu"))
    finally:
        del REWARDS["dtype_test"]
    assert seen["dtype"] is torch.bfloat16
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run", "reward.kwargs.hpsv2.dtype=half"])
    assert exc.value.code == 2 and "reward.kwargs.hpsv2.dtype must be one of" in capsys.readouterr().err


def test_dry_run_plans_measured_routing_as_all_jagg_at_the_largest_candidate(capsys):
    """jagg_frac / group_size = auto are decided at run time; the plan assumes every group qualifies at the
    largest candidate W (the most memory any choice can need) and says so."""
    args = ["--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run", "--world-size", "8"]
    auto = ["backward.jagg_frac=auto", "backward.group_size=auto", "backward.group_sizes=[2, 3, 4]"]
    assert main([*args, *auto]) == 0
    out = capsys.readouterr().out
    assert "W=4 of auto [2, 3, 4], jagg_frac=auto" in out and "(if its cosine qualifies)" in out


def test_dry_run_of_the_authors_recipe(capsys):
    """qwenimage_dancegrpo_authors.yaml: 3 of 5 blocks of 4 trained per sample, all on jagg_index with two
    sequential endpoint backwards each, no stored outputs and every signal from a forward without autograd (the
    authors' W + 2 per block): 18 forwards (6 with autograd), 6 backward calls, 8 all-gathers per block."""
    assert main(["--config", AUTHORS, "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "W=4, jagg_frac=1.0, graph_mode=sequential, stored_outputs=False, endpoint_signals=nograd" in out
    assert "trained steps per sample           12 of 21" in out
    for g in range(3):
        assert (
            f"group {g}                            steps {list(range(4 * g, 4 * g + 4))} -> jagg_index" in out
        )
    assert "group 3" not in out
    row = next(line for line in out.splitlines() if "* jagg_index/sequential " in line)
    assert row.split()[2:8] == ["18", "(6)", "6", "6", "24", "6"]
    assert "samples per iteration              768 = 64 prompts x 12 images; 96 per rank" in out


def test_dry_run_plans_shared_knots(capsys):
    """backward.strategy=knots: the knot positions, K backward passes in one call and the cost of every mode
    (the hat weights need no later knot's signal first, so sequential forwards no more than batched)."""
    config = "configs/world/flux_dancegrpo_knots.yaml"
    assert main(["--config", config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "backward.strategy=knots, K=4, placement=low_noise" in out
    assert "knots (positions among the trained steps) [0, 11, 17, 19]" in out
    cost = {}  # mode -> [forwards, (with grad), bwd passes, bwd calls, all-gathers, reduce-scatters, graphs]
    for line in out.splitlines():
        words = line.replace("*", " ").split()
        if words and (words[0] == "exact" or words[0].startswith("knots/")) and len(words) == 8:
            cost[words[0]] = words[1:]
    assert cost["exact"] == ["20", "(20)", "20", "20", "40", "20", "1"]
    assert cost["knots/batched+stored"] == ["4", "(4)", "4", "1", "2", "1", "4"]
    assert cost["knots/batched"][:2] == ["20", "(4)"] and cost["knots/sequential"][:4] == [
        "20",
        "(4)",
        "4",
        "4",
    ]
    assert "backward passes saved              80%" in out
    assert main(["--config", config, "--dry-run", "backward.placement=auto"]) == 0
    assert "measured at iteration 0 among the rules" in capsys.readouterr().out


SHIPPED = sorted(
    c
    for c in glob.glob("configs/paper/**/*.yaml", recursive=True) + glob.glob("configs/world/*.yaml")
    if not c.endswith("base.yaml")
)


@pytest.mark.parametrize("config", SHIPPED)
def test_advisor_on_every_shipped_config(config):
    """The dry run's advisor on every shipped config: exact saves nothing, the rollout is never saved (the
    iteration saving is smaller than the update's), knots with K >= T cost what exact costs, and a config with
    two or fewer trained steps is told that JAGG saves nothing."""
    from jagg.capacity.pass_plan import advice, trained_steps_per_sample

    cfg = load_config(config)
    t = trained_steps_per_sample(cfg)
    saved, line = advice(cfg, t, cfg.backward.planned_setting(), micro_batches=2)
    assert saved["exact"] == (0.0, 0.0)
    for name, (update, iteration) in saved.items():
        assert abs(iteration) <= abs(update) + 1e-12, name
        if (
            name.startswith("knots")
            and int(name.split("=")[1]) >= t
            and cfg.backward.endpoint_signals == "graph"
        ):
            assert update == pytest.approx(0.0, abs=1e-12), name
    if t <= 2:
        assert "JAGG saves nothing on this config" in line
        assert all(abs(u) < 1e-12 for u, _ in saved.values())
    else:
        assert line.startswith("largest predicted saving: ")
        assert max(u for u, _ in saved.values()) > 0


@pytest.mark.parametrize("config", [p for p in PAPER if p.endswith("_knots.yaml")])
def test_every_step_knots_configs_train_every_usable_step_and_the_advisor_agrees(config):
    """The paper's every-step variants: all S - 1 usable steps trained through K = 4 shared knots; the advisor
    finds the configured knots the largest saving on them and says so."""
    from jagg.capacity.pass_plan import advice, trained_steps_per_sample

    cfg = load_config(config)
    base = load_config(config.replace("_knots", ""))
    t = trained_steps_per_sample(cfg)
    assert t == cfg.sampling.num_steps - 1 > trained_steps_per_sample(base)
    assert cfg.backward.planned_setting().cost(t).backward_passes == cfg.backward.knots == 4
    _, line = advice(cfg, t, cfg.backward.planned_setting(), micro_batches=12)
    assert line.startswith("largest predicted saving: knots K=4 (as configured), ")
