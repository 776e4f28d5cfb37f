"""A run's rewards: every reward module registered, each reward built with its kwargs on the run's device.

This is where the registry (``jagg.rewards.REWARDS``) is filled: importing this module imports the modules that
register rewards (the JPEG rewards, the embedded world's judges, the real HPSv2.1 / PickScore / CLIPScore and
ImageReward), so the lower layers never import the ones above them to find a reward.
"""

from __future__ import annotations

import torch
from torch import Tensor

import jagg.rewards.jpeg  # noqa: F401  (registers jpeg, jpeg_incompressibility)
import jagg.rewards.video  # noqa: F401  (registers temporal, per_frame)
import jagg.scale.hpsv3  # noqa: F401  (registers hpsv3)
import jagg.scale.imagereward  # noqa: F401  (registers imagereward)
import jagg.scale.rewards  # noqa: F401  (registers hpsv2, pickscore, clipscore)
import jagg.world.rewards  # noqa: F401  (registers clip, pref, attr, attr_soft)
import jagg.world.video_rewards  # noqa: F401  (registers video_pref, frames_*, motion_geom, video_geom)
from jagg.config import Config
from jagg.engine.grpo import group_advantages, per_reward_advantages
from jagg.errors import ConfigError
from jagg.ops import preflight
from jagg.rewards import REWARDS, VIDEO_REWARDS, Reward, WeightedRewards, build_reward

VIDEO_BACKBONES = ("wan",)  # backbones whose samples are videos (B, 3, F, H, W)

REWARD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_reward_names(cfg: Config) -> None:
    """``ConfigError`` naming the key when ``reward.weights`` or ``reward.eval`` names a reward missing from the
    filled registry (also one registered after import), or a ``reward.kwargs.<name>.dtype`` is not a dtype name
    (``jagg.ops.preflight.check_reward_names`` against the registry)."""
    preflight.check_reward_names(cfg, known=REWARDS)


def check_sample_kind(cfg: Config) -> None:
    """``ConfigError`` naming the key when a Wan run (its samples are videos) names a reward that scores images,
    or an image run a video reward: caught before anything is written, not at the first scoring."""
    named = list(dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]))
    if "per_frame" in named:
        check_frame_reduction(cfg.reward.kwargs.get("per_frame") or {})
    video = cfg.model.backbone in VIDEO_BACKBONES
    wrong = [n for n in named if (n in VIDEO_REWARDS) != video]
    if not wrong:
        return
    key = "reward.weights" if wrong[0] in cfg.reward.weights else "reward.eval"
    if video:
        raise ConfigError(
            f"{key}: {wrong[0]!r} scores images and model.backbone={cfg.model.backbone} makes videos; "
            f"allowed: {sorted(VIDEO_REWARDS)} (an image reward per frame: per_frame with "
            f"reward.kwargs.per_frame.reward={wrong[0]})"
        )
    raise ConfigError(
        f"{key}: {wrong[0]!r} scores videos and model.backbone={cfg.model.backbone} makes images; "
        f"allowed: any reward but {sorted(VIDEO_REWARDS)}"
    )


def check_frame_reduction(kwargs: dict) -> None:
    """``ConfigError`` naming ``reward.kwargs.per_frame.<key>`` when its frame reducer or a parameter of it is
    not allowed (``jagg.rewards.video.FrameReduction``): before any weight loads."""
    from jagg.rewards.video import FRAME_KWARGS, FrameReduction

    known = {"reward", "reward_kwargs", "device", *FrameReduction.__dataclass_fields__}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(
            f"reward.kwargs.per_frame.{unknown[0]}: unknown key; known: reward, reward_kwargs, {FRAME_KWARGS}"
        )
    try:
        FrameReduction(**{k: v for k, v in kwargs.items() if k in FrameReduction.__dataclass_fields__})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"reward.kwargs.per_frame.{err}") from None


def build_run_reward(name: str, kwargs: dict, device: torch.device) -> Reward:
    """``build_reward(name, device=device, **kwargs)``: every factory takes ``device`` (``jagg.rewards``), so
    each reward gets the run's device unless ``reward.kwargs.<name>.device`` names another.

    ``dtype`` may be given by name in the config (``reward.kwargs: {hpsv2: {dtype: bf16}}``): fp32 | bf16 | fp16
    (the CLIP rewards run their model in that dtype; the dry-run memory plan counts it).
    """
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("dtype"), str):  # checked by check_reward_names
        kwargs["dtype"] = REWARD_DTYPES[kwargs["dtype"]]
    return build_reward(name, **{"device": device, **kwargs})


def check_run_rewards(cfg: Config) -> None:
    """``ArtefactError`` (one line: what to run) when a world reward of the run (training or eval) lacks its
    cached artefact or the artefact is stale (``jagg.world.rewards.REWARD_ARTEFACTS``): the error
    ``build_run_rewards`` would raise inside the trainer, here before the CLI writes anything."""
    from pathlib import Path

    from jagg.world.pretrained import check_artefact
    from jagg.world.rewards import REWARD_ARTEFACTS

    for name in dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]):
        cache = cfg.reward.kwargs.get(name, {}).get("cache_dir")
        for artefact in REWARD_ARTEFACTS.get(name, ()):
            check_artefact(artefact, Path(cache) if cache else None)


def build_run_rewards(cfg: Config, device: torch.device) -> tuple[WeightedRewards, dict[str, Reward]]:
    """The run's training reward (``reward.weights``, a weighted sum) and its eval rewards (``reward.eval``; one
    that is also trained on is the same object), each built once with ``reward.kwargs`` on ``device``."""
    built = {n: build_run_reward(n, cfg.reward.kwargs.get(n, {}), device) for n in cfg.reward.weights}
    train = WeightedRewards(built, dict(cfg.reward.weights))
    evals = {
        n: built.get(n) or build_run_reward(n, cfg.reward.kwargs.get(n, {}), device) for n in cfg.reward.eval
    }
    return train, evals


@torch.no_grad()
def score_samples(
    images: Tensor, prompts: list[str], train: WeightedRewards, evals: dict[str, Reward]
) -> tuple[Tensor, dict[str, Tensor]]:
    """(training reward (B,), every reward's scores {name: (B,)}): the training reward's per-reward scores, and
    each eval reward not trained on (e.g. the attribute accuracy of the training samples)."""
    total = train(images, prompts)
    scores = dict(train.scores)
    for name, fn in evals.items():
        if name not in scores:
            scores[name] = fn(images, prompts).float()
    return total, scores


def rollout_advantages(cfg: Config, rewards: Tensor, scores: dict[str, Tensor], group_ids: Tensor) -> Tensor:
    """The advantages of a global batch: the training reward normalised in its prompt group (``algorithm.adv_*``),
    or under ``algorithm.adv_aggregation: per_reward`` each reward normalised, then weighted (MixGRPO); times
    ``algorithm.adv_scale`` (1: unchanged), then clamped to ``adv_clip``."""
    algorithm = cfg.algorithm
    norm = dict(std_mode=algorithm.adv_std, unbiased=algorithm.adv_unbiased, eps=algorithm.adv_eps)
    scale = algorithm.adv_scale
    clip = algorithm.adv_clip if scale == 1 else float("inf")  # scaled first, then clamped (MixGRPO's order)
    if algorithm.adv_aggregation == "per_reward":
        adv = per_reward_advantages(scores, cfg.reward.weights, group_ids, **norm, clip=clip)
    else:
        adv = group_advantages(rewards, group_ids, **norm, clip=clip)
    return adv if scale == 1 else (scale * adv).clamp(-algorithm.adv_clip, algorithm.adv_clip)
