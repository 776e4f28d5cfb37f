"""Every config under configs/paper/ (recursively) starts: it validates, its backbone and rewards go together
(``jagg.loop.components.check_config``: image rewards for images, video rewards for videos), and every reward it
names, for training and for evaluation, is built and scores a batch of its backbone's samples, on tiny random-init
stand-ins of the real reward classes (HPSv2.1's open_clip, PickScore's and CLIPScore's transformers CLIPModel,
ImageReward's BLIP, HPSv3's Qwen2-VL) saved to disk and loaded through the rewards' own constructors.

Before issue 55 none of the three Wan configs passed this: each named an image reward (hpsv3 / pickscore, and
base.yaml's image evaluation rewards) on a video backbone. A last test runs one iteration of each config on a
tiny pipeline folder of its backbone's real classes with its own rewards (the 2-rank FSDP2 runs of the configs
that shard: tests/test_paper_configs_two_ranks.py, tests/test_wan_distributed.py, tests/test_sd3.py); no longer
marked slow: all 16 take about 35 s with -n 0, so it is part of the default run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from jagg.config import load_config

PAPER = Path("configs/paper")
CONFIGS = sorted(str(p) for p in PAPER.rglob("*.yaml") if p.name != "base.yaml")
VIDEO_FRAMES = 9  # frames of the stand-in videos (Flash-GRPO's top 30% of 9: the best 2)


@pytest.fixture(scope="module")
def built_once():
    """Each registered reward built once per distinct kwargs across the configs (the same constructor call
    gives the same model): the default run stays short. Only the default-run test uses it."""
    import jagg.loop.rewards  # noqa: F401  (fills the registry)
    from jagg.rewards import REWARDS

    memo: dict[tuple[str, str], object] = {}

    def cached(name, factory):
        def build(**kwargs):
            key = (name, repr(sorted(kwargs.items())))
            if key not in memo:
                memo[key] = factory(**kwargs)
            return memo[key]

        return build

    with pytest.MonkeyPatch.context() as mp:
        for name, factory in list(REWARDS.items()):
            mp.setitem(REWARDS, name, cached(name, factory))
        yield memo


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    """Tiny saved checkpoints of every real reward class (the layouts tests/test_weights_check.py checks)."""
    import open_clip

    from jagg.scale.rewards import clip_bpe_tokenizer
    from test_rewards_real import TINY_OPEN_CLIP, tiny_hf_clip, tiny_open_clip
    from test_weights_check import save_hpsv3, save_imagereward

    root = tmp_path_factory.mktemp("reward_stand_ins")
    tiny_hf_clip(seed=3).save_pretrained(root / "clip")
    clip_bpe_tokenizer().save_pretrained(root / "clip")
    (root / "hps").mkdir()
    torch.save({"state_dict": tiny_open_clip().state_dict()}, root / "hps" / "HPS_v2.1_compressed.pt")
    (root / "tiny-hps.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(root / "tiny-hps.json")
    save_imagereward(root / "imagereward")
    save_hpsv3(root / "hpsv3")
    return root


def stand_in_kwargs(root: Path, name: str) -> dict:
    """The constructor kwargs that point reward ``name`` at its stand-in (empty for a reward without weights)."""
    from test_imagereward import TINY_VIT

    clip = str(root / "clip")
    return {
        "hpsv2": {"checkpoint": str(root / "hps" / "HPS_v2.1_compressed.pt"), "arch": "tiny-hps"},
        "pickscore": {"model": clip, "processor": clip},
        "clipscore": {"model": clip},
        "imagereward": {"checkpoint": str(root / "imagereward"), "vision": TINY_VIT},
        "hpsv3": {
            "checkpoint": str(root / "hpsv3" / "HPSv3.safetensors"),
            "base": str(root / "hpsv3" / "base"),
        },
    }.get(name, {})


def with_stand_ins(cfg, root: Path) -> dict:
    """``reward.kwargs`` of ``cfg`` with every named reward (a per_frame reward's image reward too) pointed at
    its stand-in, the config's own kwargs (scales, frame reducers) kept."""
    kwargs = {k: dict(v) for k, v in cfg.reward.kwargs.items()}
    for name in dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]):
        kw = kwargs.setdefault(name, {})
        if name == "per_frame":
            inner = kw.get("reward", "jpeg")
            kw["reward_kwargs"] = {**(kw.get("reward_kwargs") or {}), **stand_in_kwargs(root, inner)}
        else:
            kw.update(stand_in_kwargs(root, name))
    return kwargs


def reward_overrides(cfg, root: Path) -> list[str]:
    """The config's own rewards as overrides (after ``TINY_PIPELINE``'s JPEG), pointed at the stand-ins."""
    flow = dict(default_flow_style=True, width=10**6)
    return [
        f"reward.weights={yaml.safe_dump(dict(cfg.reward.weights), **flow).strip()}",
        f"reward.eval={yaml.safe_dump(list(cfg.reward.eval), **flow).strip()}",
        f"reward.kwargs={yaml.safe_dump(with_stand_ins(cfg, root), **flow).strip()}",
    ]


def samples(cfg, b: int = 2) -> torch.Tensor:
    """``b`` decoded samples in [0, 1] of the config's kind: videos (B, 3, F, H, W) for Wan, else images."""
    g = torch.Generator().manual_seed(0)
    shape = (b, 3, VIDEO_FRAMES, 32, 32) if cfg.model.backbone == "wan" else (b, 3, 32, 32)
    return torch.rand(shape, generator=g)


def test_every_paper_config_is_found():
    """Both image backbones' recipes, SD3.5-M's and the three Wan references' (each with its knots variant)."""
    names = {str(Path(c).relative_to(PAPER)) for c in CONFIGS}
    assert len(CONFIGS) == 16 and {"sd3/sd35m_flowgrpo.yaml", "flux_mixgrpo.yaml"} <= names
    assert sum(n.startswith("wan/") for n in names) == 6


@pytest.mark.parametrize("config", CONFIGS)
def test_paper_config_builds_and_scores_every_reward(stand_ins, built_once, config):
    from jagg.loop.components import check_config
    from jagg.loop.rewards import build_run_rewards, score_samples

    cfg = load_config(config)
    check_config(cfg)  # the backbone and every reward go together
    cfg = load_config(config, reward_overrides(cfg, stand_ins))
    check_config(cfg)
    train, evals = build_run_rewards(cfg, torch.device("cpu"))
    x = samples(cfg)
    total, scores = score_samples(x, ["a red ball", "a cat on a sofa"], train, evals)
    assert total.shape == (2,) and bool(torch.isfinite(total).all())
    assert set(scores) == {*cfg.reward.weights, *cfg.reward.eval}
    assert all(s.shape == (2,) and bool(torch.isfinite(s).all()) for s in scores.values())


def test_mixgrpo_as_launched_is_the_advantage_scale_three_quarters():
    """MixGRPO's launch script passes ``--unified_reward_url None`` (a string), so a fourth reward, UnifiedReward,
    joins at weight 1 (train_grpo_flux.py:728); its calls fail, its rewards are constant and its advantage 0, and
    the weights are normalised over four (:746-770). Their merged advantage, computed here as their loop does
    (:429-456, per group of num_generations: (r - mean) / (std + 1e-8), unbiased), equals ours over the three
    real rewards with ``algorithm.adv_scale=0.75``, and differs from ours without it."""
    from jagg.loop.rewards import rollout_advantages

    g = torch.Generator().manual_seed(0)
    n, groups = 4, 3
    scores = {
        k: torch.rand(n * groups, generator=g, dtype=torch.float64)
        for k in ("hpsv2", "imagereward", "pickscore")
    }
    theirs = torch.zeros(n * groups, dtype=torch.float64)
    for r in [
        *scores.values(),
        torch.full((n * groups,), 0.5, dtype=torch.float64),
    ]:  # + the failed UnifiedReward
        for i in range(groups):
            grp = r[i * n : (i + 1) * n]
            theirs[i * n : (i + 1) * n] += (grp - grp.mean()) / (grp.std() + 1e-8) / 4
    theirs = theirs.clamp(-5, 5)
    ids = torch.arange(groups).repeat_interleave(n)
    cfg = load_config("configs/paper/flux_mixgrpo.yaml", ["algorithm.adv_scale=0.75"])
    assert cfg.algorithm.adv_aggregation == "per_reward" and cfg.algorithm.adv_eps == 1e-8
    ours = rollout_advantages(cfg, torch.zeros(n * groups), scores, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    plain = rollout_advantages(
        load_config("configs/paper/flux_mixgrpo.yaml"), torch.zeros(n * groups), scores, ids
    )
    torch.testing.assert_close(plain * 0.75, theirs, rtol=1e-12, atol=1e-12)
    assert (plain - theirs).abs().max() > 0.1


# --------------------------------------------------------------------------- one iteration
def _pipeline(root: Path, cfg) -> Path:
    """A tiny pipeline folder of ``cfg``'s backbone in its published layout (Wan: two experts for A14B, expanded
    timesteps for TI2V-5B), written once per layout under ``root``."""
    from jagg.scale.tiny_pipeline import save_tiny_sd3_pipeline, save_tiny_wan_pipeline
    from test_pretrained_pipeline import PROMPTS, save_flux_pipeline, save_qwenimage_pipeline

    b, path = cfg.model.backbone, str(cfg.model.path)
    name = b if b != "wan" else "wan_a14b" if "A14B" in path else "wan_ti2v" if "TI2V" in path else "wan"
    folder = root / name
    if not folder.exists():
        if b == "flux":
            save_flux_pipeline(folder)
        elif b == "qwenimage":
            save_qwenimage_pipeline(folder)
        elif b == "sd3":
            save_tiny_sd3_pipeline(folder, PROMPTS)
        else:
            boundary = 0.875 if name == "wan_a14b" else None
            save_tiny_wan_pipeline(
                folder, PROMPTS, boundary_ratio=boundary, expand_timesteps=name == "wan_ti2v"
            )
    return folder


@pytest.mark.parametrize("config", CONFIGS)
def test_paper_config_trains_one_iteration_with_its_own_rewards(stand_ins, tmp_path_factory, config):
    """The CLI on one process: the config's precision, checkpointing, LoRA, CFG, SDE and KL kept (sizes shrunk,
    ``helpers.PAPER_TINY_RUN``), its own training and evaluation rewards on the stand-ins."""
    import jagg.train
    from helpers import paper_tiny_argv
    from test_pretrained_pipeline import PROMPTS

    root = tmp_path_factory.getbasetemp() / "paper_pipelines"
    root.mkdir(exist_ok=True)
    (root / "prompts.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    cfg = load_config(config)
    name = Path(config).stem
    extra = ["sampling.num_steps=9"] if name.endswith("_authors") else []
    extra += ["backward.knots=2"] if name.endswith("_knots") else []
    if cfg.model.backbone == "wan":
        extra += ["sampling.latent_width=null", "sampling.latent_frames=2"]
    if cfg.model.backbone in ("wan", "sd3"):
        extra += ["train.precision=fp32"]  # bf16 autocast on the CPU: the tiny VAE's 3-D convolutions
    run = tmp_path_factory.mktemp(name)
    argv = paper_tiny_argv(config, _pipeline(root, cfg), root / "prompts.txt", run / "run", *extra)
    assert jagg.train.main([*argv, *reward_overrides(cfg, stand_ins)]) == 0
    rows = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["iteration"] == 1 and last["optimizer_steps"] >= 1
    assert all(f"eval_{n}_mean" in last for n in cfg.reward.eval)
    assert torch.isfinite(
        torch.tensor([last["loss"], *(last[f"eval_{n}_mean"] for n in cfg.reward.eval)])
    ).all()
