"""The moving-shapes video world (jagg.world.video): deterministic clips, the geometric motion judge, the video
rewards (per-frame wrapper, temporal term, preference pairs), the image world's build left as it was, and GRPO
on the tiny Wan. Nothing here needs `make pretrain`."""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest
import torch

from jagg.config import load_config
from jagg.loop.rewards import REWARDS  # fills the registry
from jagg.rewards import EVAL_ONLY, build_reward
from jagg.rewards.jpeg import JpegReward
from jagg.rewards.video import PerFrameReward, temporal_consistency
from jagg.world.motion import MIN_TRAVEL, clip_match, motion_match, read_clips, read_motion
from jagg.world.video import MOTIONS, VideoWorld
from jagg.world.video_train import VIDEO_DEGRADATIONS, video_preference_pairs


@pytest.fixture(scope="module")
def vw():
    return VideoWorld()


# --------------------------------------------------------------------------- the world
def test_clips_are_deterministic_in_the_seed_and_move_where_the_prompt_says(vw):
    prompts = vw.prompts[:6]
    a, b, c = vw.render(prompts, seed=3), vw.render(prompts, seed=3), vw.render(prompts, seed=4)
    assert a.shape == (6, 3, 4, 16, 16) and a.dtype == torch.float32 and a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, b) and not torch.equal(a, c)
    right = vw.render(["a red circle moving right"], 0)[0, 0]  # red channel, (F, H, W)
    assert right[0, :, :8].sum() > right[0, :, 8:].sum() and right[-1, :, 8:].sum() > right[-1, :, :8].sum()
    up = vw.render(["a red circle moving up"], 0)[0, 0]
    assert up[0, 8:].sum() > up[0, :8].sum() and up[-1, :8].sum() > up[-1, 8:].sum()


def test_prompts_split_and_frame_prompts(vw):
    assert len(vw.prompts) == 72 and len(vw.heldout_prompts) == 12
    assert set(vw.train_prompts).isdisjoint(vw.heldout_prompts)
    assert {vw.parse(p).motion for p in vw.train_prompts} == set(MOTIONS)
    assert vw.parse("an orange square moving down") == ("orange", "square", "down")
    with pytest.raises(ValueError, match="not in the video world"):
        vw.parse("a red circle on the left")
    assert (
        vw.frame_prompts("a red circle moving right")
        == ["a red circle on the left"] * 2 + ["a red circle on the right"] * 2
    )
    assert vw.frame_prompts("a blue square moving up")[::3] == [
        "a blue square at the bottom",
        "a blue square at the top",
    ]


# --------------------------------------------------------------------------- the motion judge
@pytest.mark.parametrize("seed", [0, 1])
def test_motion_judge_reads_every_clean_clip_right(vw, seed):
    prompts = vw.prompts * 2
    clips = vw.render(prompts, seed=seed)
    assert motion_match(clips, prompts, vw).sum().item() == len(prompts)
    assert clip_match(clips, prompts, vw).sum().item() == len(prompts)  # colour and shape too


def test_motion_judge_scores_wrong_motion_zero(vw):
    """Another direction, the clip played backwards, the object standing still, frames shuffled: all 0."""
    prompts = vw.prompts
    attrs = [vw.parse(p) for p in prompts]
    rng = np.random.default_rng(5)
    turned = {"right": "up", "left": "down", "up": "left", "down": "right"}
    wrong = vw.render_attributes([a._replace(motion=turned[a.motion]) for a in attrs], rng)[0]
    assert motion_match(wrong, prompts, vw).sum().item() == 0
    assert [r.motion for r in read_clips(wrong, vw)] == [turned[a.motion] for a in attrs]
    clips = vw.render(prompts, seed=5)
    assert motion_match(clips.flip(2), prompts, vw).sum().item() == 0
    still = vw.render_attributes(attrs, rng, still=True)[0]
    assert motion_match(still, prompts, vw).sum().item() == 0
    for order in ([0, 2, 1, 3], [1, 0, 2, 3], [0, 1, 3, 2]):
        assert motion_match(clips[:, :, order], prompts, vw).sum().item() == 0
    empty = vw.render_attributes([None], rng)[0]
    assert read_clips(empty, vw) == [None] and motion_match(empty, prompts[:1], vw).item() == 0


def test_read_motion_thresholds():
    path = lambda dx, dy: torch.tensor(
        [[0.3 + dx * k / 3, 0.5 + dy * k / 3] for k in range(4)], dtype=torch.float64
    )  # noqa: E731
    motions = tuple(MOTIONS)
    assert read_motion(path(0.44, 0.0), motions) == "right"
    assert read_motion(path(0.0, -0.44), motions) == "up"
    assert read_motion(path(MIN_TRAVEL * 0.9, 0.0), motions) is None  # too short: standing still
    assert read_motion(path(0.3, 0.3), motions) is None  # 45 degrees: no direction of the world


def test_the_geometric_video_judges_are_eval_only():
    assert {"motion_geom", "video_geom"} <= EVAL_ONLY
    assert {"motion_geom", "video_geom", "temporal", "per_frame", "video_pref", "frames_pref"} <= set(REWARDS)


# --------------------------------------------------------------------------- video rewards
def test_per_frame_reward_is_the_mean_of_the_image_reward_over_frames(vw):
    """float64 throughout: an image reward (a fixed linear read-out of the pixels) against a loop over frames;
    and the registered real-path ``per_frame`` on the (real, weight-free) JPEG reward."""
    gen = torch.Generator().manual_seed(0)
    videos = torch.rand(3, 3, 5, 8, 8, generator=gen, dtype=torch.float64)
    weights = torch.randn(3, 8, 8, generator=gen, dtype=torch.float64)
    seen: list[list[str]] = []

    def image_reward(images, prompts):
        seen.append(list(prompts))
        return (images * weights).sum(dim=(1, 2, 3))

    prompts = ["a", "b", "c"]
    got = PerFrameReward(image_reward)(videos, prompts)
    want = torch.stack([image_reward(videos[:, :, f], prompts) for f in range(5)]).mean(0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert seen[0] == [p for p in prompts for _ in range(5)]  # every frame scored against its video's prompt

    clips = vw.render(vw.prompts[:4], seed=1)
    jpeg = build_reward("per_frame", reward="jpeg")(clips, vw.prompts[:4])
    frames = torch.stack([JpegReward()(clips[:, :, f], vw.prompts[:4]) for f in range(4)])
    torch.testing.assert_close(jpeg, frames.mean(0), rtol=1e-6, atol=0)


def test_per_frame_reward_gives_each_frame_its_own_prompt(vw):
    seen = []
    PerFrameReward(lambda x, p: seen.extend(p) or torch.zeros(len(p)), vw.frame_prompts)(
        vw.render(["a red circle moving left"], 0), ["a red circle moving left"]
    )
    assert seen == ["a red circle on the right"] * 2 + ["a red circle on the left"] * 2


def test_temporal_term_is_one_on_a_constant_clip_and_lower_on_shuffled_frames(vw):
    """1 exactly on a constant clip; on a moving clip the true order beats every shuffle but the reversal
    (which the term cannot tell from it)."""
    gen = torch.Generator().manual_seed(0)
    frame = torch.rand(2, 3, 1, 16, 16, generator=gen, dtype=torch.float64)
    assert torch.equal(
        temporal_consistency(frame.expand(-1, -1, 4, -1, -1)), torch.ones(2, dtype=torch.float64)
    )
    clips = vw.render(vw.prompts[:8], seed=2).double()
    ordered = temporal_consistency(clips)
    assert bool((ordered < 1).all())
    for order in itertools.permutations(range(4)):
        score = temporal_consistency(clips[:, :, list(order)])
        if order in ((0, 1, 2, 3), (3, 2, 1, 0)):
            torch.testing.assert_close(score, ordered, rtol=1e-12, atol=0)
        else:
            assert bool((score < ordered).all()), order
    noisy = (clips + 0.1 * torch.randn(clips.shape, generator=gen, dtype=torch.float64)).clamp(0, 1)
    assert bool((temporal_consistency(noisy) < ordered).all())  # flicker costs too


def test_video_preference_pairs(vw):
    good, bad, idx, kinds = video_preference_pairs(vw, 22, seed=0)
    again = video_preference_pairs(vw, 22, seed=0)
    assert torch.equal(good, again[0]) and torch.equal(bad, again[1])
    assert good.shape == bad.shape == (22, 3, 4, 16, 16) and kinds[:11] == list(VIDEO_DEGRADATIONS)
    assert all(not torch.equal(g, b) for g, b in zip(good, bad, strict=True))
    prompts = [vw.prompts[i] for i in idx.tolist()]
    assert motion_match(good, prompts, vw).sum().item() == 22
    wrong = [i for i, k in enumerate(kinds) if k in ("motion", "still", "shuffle")]
    assert motion_match(bad[wrong], [prompts[i] for i in wrong], vw).sum().item() == 0


# --------------------------------------------------------------------------- the image world's build is untouched
# sha256 (16 hex) of each image artefact's expected config (world, training, architecture signature) as the
# code before the video world computed it, equal to the manifests of the cache it built: a changed seed, data,
# budget or architecture of any image artefact fails here.
IMAGE_CONFIGS = {
    "text_encoder": "ae090e8b1e859c7d",
    "clip": "32cadcb02a8951ed",
    "pref": "d7fcd00a7590bcd6",
    "attr": "1cdfdda3df0b7733",
    "flux": "c9c8b6e5483d7764",
    "qwenimage": "2ce6ae74b51a9c8d",
    "attr_judge": "2de89996bacacaa4",
}


def test_image_world_artefacts_and_build_are_unchanged(tmp_path, monkeypatch):
    from jagg.world import build
    from jagg.world.pretrained import ARTEFACTS, VIDEO_ARTEFACTS, expected_config, world_build

    assert tuple(IMAGE_CONFIGS) == ARTEFACTS and not set(ARTEFACTS) & set(VIDEO_ARTEFACTS)
    for name, digest in IMAGE_CONFIGS.items():
        cfg = json.dumps(expected_config(name), sort_keys=True).encode()
        assert hashlib.sha256(cfg).hexdigest()[:16] == digest, name
    for i, name in enumerate(ARTEFACTS + VIDEO_ARTEFACTS):  # a cache holding both worlds' artefacts
        (tmp_path / f"{name}.json").write_text(json.dumps({"sha256": f"{i:02d}" * 32}))
    assert world_build(tmp_path) == {n: f"{i:02d}" * 8 for i, n in enumerate(ARTEFACTS)}  # no key gained
    assert set(world_build(tmp_path, artefacts=VIDEO_ARTEFACTS)) == set(VIDEO_ARTEFACTS)
    order: list[str] = []  # make pretrain: the image artefacts first, in their order, then the video ones
    monkeypatch.setattr(build, "is_up_to_date", lambda name, cache: False)
    monkeypatch.setattr(build, "build_artefact", lambda name, cache, log: order.append(name))
    monkeypatch.setattr(build, "build_video_artefact", lambda name, cache, log: order.append("v:" + name))
    build.pretrain_all(tmp_path, log=lambda _: None)
    assert order == [*ARTEFACTS, *(f"v:{n}" for n in VIDEO_ARTEFACTS)]


def test_video_artefacts_have_their_own_seeds_and_architectures(vw):
    from jagg.models import WanBackbone
    from jagg.world.pretrained import (
        EVAL_JUDGE_TRAIN,
        FLOW_TRAIN,
        JUDGE_TRAIN,
        VIDEO_ARTEFACTS,
        VIDEO_FLOW_TRAIN,
        VIDEO_JUDGE_TRAIN,
        expected_config,
        new_module,
    )

    image_seeds = {c.seed for t in (JUDGE_TRAIN, FLOW_TRAIN, EVAL_JUDGE_TRAIN) for c in t.values()}
    video_seeds = [c.seed for t in (VIDEO_JUDGE_TRAIN, VIDEO_FLOW_TRAIN) for c in t.values()]
    assert len(set(video_seeds)) == len(video_seeds) and not image_seeds & set(video_seeds)
    for name in VIDEO_ARTEFACTS:
        assert expected_config(name)["world"]["frames"] == vw.frames
    wan = new_module("wan", vw)
    assert isinstance(wan, WanBackbone) and wan.latent_channels == 3
    with pytest.raises(ValueError, match="belongs to the video world"):
        from jagg.world import World

        new_module("wan", World())


# --------------------------------------------------------------------------- GRPO on the tiny Wan
# TINY_OVERRIDES' JPEG reward scores images: a tiny video run is scored by the weight-free video rewards instead
VIDEO_TINY = ("reward.weights={temporal: 1.0}", "reward.eval=[temporal, motion_geom, video_geom]")


def test_grpo_smoke_on_the_video_world(tmp_path, tiny_cfg):
    """Two GRPO iterations of configs/world/wan_video.yaml on a random-init tiny Wan (model.source=tiny), the
    temporal term as the reward, the geometric judges evaluated; clips in the sample grid."""
    from helpers import build_trainer

    cfg = tiny_cfg(
        *VIDEO_TINY,
        "log.eval_every=2",
        "log.eval_prompts=2",
        "log.eval_images_per_prompt=2",
        config="configs/world/wan_video.yaml",
    )
    assert (cfg.model.backbone, cfg.sampling.latent_frames) == ("wan", 4)
    trainer = build_trainer(cfg)
    assert trainer.comp.latent_shape == (3, 4, 16, 16)
    before = [p.detach().clone() for p in trainer.backbone.parameters()]
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["iteration"] for r in trained] == [1, 2]
    assert all(
        np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 and r["skipped_steps"] == 0 for r in trained
    )
    assert all(0 < r["reward_temporal_mean"] <= 1 for r in trained)
    assert "eval_motion_geom_mean" in rows[-1] and "eval_video_geom_mean" in rows[-1]
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.backbone.parameters(), strict=True))
    from PIL import Image

    grid = Image.open(tmp_path / "samples" / "iter_00002.png")
    assert grid.width > 4 * grid.height  # 4 clips of 4 frames side by side, one row


def test_video_world_config_checks(tiny_cfg):
    from helpers import build_trainer
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.latent_frames must equal the video world's 4 frames"):
        build_trainer(
            tiny_cfg(*VIDEO_TINY, "sampling.latent_frames=2", config="configs/world/wan_video.yaml")
        )
    with pytest.raises(ConfigError, match="reward.weights"):
        tiny_cfg("reward.weights={motion_geom: 1.0}", config="configs/world/wan_video.yaml")


def test_the_weights_check_follows_per_frame_to_the_image_reward_it_wraps():
    from jagg.scale.weights_check import reward_specs

    cfg = load_config(
        "configs/world/wan_video.yaml",
        [
            "reward.eval=[per_frame, temporal, motion_geom]",
            "reward.kwargs={per_frame: {reward: hpsv2, reward_kwargs: {checkpoint: /x}}}",
        ],
    )
    specs = {s.what: s for s in reward_specs(cfg)}
    hps = specs["per_frame (hpsv2) reward"]
    assert (hps.library, hps.source, hps.key) == (
        "open_clip",
        "/x",
        "reward.kwargs.per_frame.reward_kwargs.checkpoint",
    )
    assert specs["temporal reward"].skip.startswith("no weights")
    cfg.reward.kwargs = {}
    (jpeg,) = [s for s in reward_specs(cfg) if s.what.startswith("per_frame")]
    assert jpeg.what == "per_frame (jpeg) reward" and jpeg.skip.startswith("no weights")


def test_the_video_config_names_video_rewards_only_and_image_runs_image_rewards_only():
    """A Wan run's samples are clips: an image reward would fail at the first scoring, so the config is refused
    before anything is written (and a video reward in an image run likewise)."""
    from jagg.errors import ConfigError
    from jagg.loop.components import check_config

    cfg = load_config("configs/world/wan_video.yaml")
    check_config(cfg)
    assert set(cfg.reward.weights) == {"video_pref"}  # nothing merged in from base.yaml's image rewards
    with pytest.raises(ConfigError, match=r"reward.eval: 'pref' scores images and model.backbone=wan"):
        check_config(load_config("configs/world/wan_video.yaml", ["reward.eval=[temporal, pref]"]))
    with pytest.raises(ConfigError, match=r"reward.weights: 'temporal' scores videos"):
        check_config(load_config("configs/world/flux_dancegrpo.yaml", ["reward.weights={temporal: 1.0}"]))
