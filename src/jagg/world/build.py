"""Build (train + evaluate + cache) every world artefact that is missing or stale: what ``make pretrain`` runs.

Evaluation always uses fresh seeds never seen in training ("held-out renders"); backbone sample quality is
measured on the held-out *prompts* (compositions never seen by the generator). The image world's artefacts
(``ARTEFACTS``) are built first, exactly as before the video world existed; the video world's
(``VIDEO_ARTEFACTS``) after them, from their own seeds (``build_video_artefact``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from jagg.common import git_sha
from jagg.rewards.jpeg import JpegReward
from jagg.world.pretrained import (
    ARTEFACTS,
    BACKBONE_NAMES,
    EVAL_JUDGE_TRAIN,
    EVAL_JUDGES,
    FLOW_TRAIN,
    JUDGE_TRAIN,
    JUDGES,
    REPORTS,
    SAMPLE_SHIFT,
    SAMPLE_STEPS,
    VIDEO_ARTEFACTS,
    VIDEO_FLOW_TRAIN,
    VIDEO_JUDGE_TRAIN,
    default_cache_dir,
    dependencies,
    environment,
    expected_config,
    is_up_to_date,
    load_module,
    load_pretrained,
    load_text_encoder,
    new_module,
    read_manifest,
    save_artefact,
)
from jagg.world.rewards import attr_reward, clip_reward, pref_reward
from jagg.world.scene import World
from jagg.world.text import WordTokenizer
from jagg.world.train import (
    DEGRADATIONS,
    agreement,
    attribute_accuracy,
    clip_retrieval_accuracy,
    generator_degrade,
    preference_pairs,
    render_pool,
    sample_images,
    train_attr_judge,
    train_attributes,
    train_clip,
    train_flow,
    train_preference,
)
from jagg.world.video import VideoWorld
from jagg.world.video_train import evaluate_video_pref, score_clips, video_preference_pairs

logger = logging.getLogger(__name__)

EVAL_SEED = 90_000
EVAL_PER_PROMPT = 20  # judges: held-out renders per prompt
SAMPLES_PER_PROMPT = 32  # backbones: samples per held-out prompt
SAMPLES_PER_TRAIN_PROMPT = 8  # backbones: samples per training prompt (5x more prompts)


def _heldout_split(world: World, labels: torch.Tensor) -> torch.Tensor:
    """(N,) bool: which world prompt indices belong to held-out prompts."""
    held = set(world.heldout_prompts)
    return torch.tensor([world.prompts[i] in held for i in labels.tolist()])


def evaluate_judge(name: str, model, world: World) -> dict:
    """Held-out accuracy of a judge on fresh-seed renders (pairs for ``pref``)."""
    tok = WordTokenizer(world.words)
    if name == "pref":
        good, bad, pidx, kinds = preference_pairs(world, 3600, seed=EVAL_SEED)
        ids, mask = tok([world.prompts[i] for i in pidx.tolist()])
        with torch.no_grad():
            win = (model(good, ids, mask) > model(bad, ids, mask)).float()
        per = {k: win[[i for i, kk in enumerate(kinds) if kk == k]].mean().item() for k in DEGRADATIONS}
        return {"pair_accuracy": win.mean().item(), "pair_accuracy_by_degradation": per}
    images, labels = render_pool(world, world.prompts, EVAL_PER_PROMPT, seed=EVAL_SEED)
    held = _heldout_split(world, labels)
    if name in ("clip", "text_encoder"):
        acc = clip_retrieval_accuracy(model, tok, world, images, labels)
        acc_held = clip_retrieval_accuracy(model, tok, world, images[held], labels[held])
        return {"top1_retrieval": acc, "top1_retrieval_heldout_prompts": acc_held}
    prompts = [world.prompts[i] for i in labels.tolist()]
    return {"attr_accuracy": attribute_accuracy(model, world, images, prompts)}


def evaluate_backbone(
    backbone, text_encoder, world: World, rewards: dict, prompts: list[str], per_prompt: int
) -> dict:
    """Attribute accuracy and mean rewards of ``per_prompt`` ODE samples for each of ``prompts``."""
    reps = [p for p in prompts for _ in range(per_prompt)]
    images = sample_images(backbone, text_encoder, world, reps, EVAL_SEED, SAMPLE_STEPS, SAMPLE_SHIFT)
    out = {
        "n_samples": len(reps),
        "attr_accuracy": attribute_accuracy(rewards["attr"].model, world, images, reps),
    }
    out["mean_reward"] = {k: r(images, reps).mean().item() for k, r in rewards.items()}
    return out


def reference_rewards(world: World, rewards: dict, prompts: list[str]) -> dict:
    """Mean rewards of clean renders of ``prompts``: the ceiling a perfect generator would reach."""
    reps = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    images = world.render(reps, EVAL_SEED)
    return {k: r(images, reps).mean().item() for k, r in rewards.items()}


def world_rewards(cache_dir: Path) -> dict:
    """The three project-trained rewards (built by their registered factories) plus the weight-free JPEG
    compressibility."""
    return {
        "clip": clip_reward(cache_dir),
        "pref": pref_reward(cache_dir),
        "attr": attr_reward(cache_dir),
        "jpeg": JpegReward(),
    }


@torch.no_grad()
def hack_probe(world: World, rewards: dict, prompts: list[str]) -> dict:
    """Mean reward of clean renders vs the same renders with a noisy background or pixel noise.

    The hack a pure alignment reward invites (docs/decisions.md): ``clip`` barely moves, ``pref`` drops.
    """
    reps = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    images, alpha, _ = world.render_attributes(
        [world.parse(p) for p in reps], np.random.default_rng(EVAL_SEED)
    )
    gen = torch.Generator().manual_seed(EVAL_SEED)
    variants = {
        "clean": images,
        "noisy_background": images + 0.4 * (2 * torch.rand(images.shape, generator=gen) - 1) * (1 - alpha),
        "pixel_noise_0.15": images + 0.15 * torch.randn(images.shape, generator=gen),
    }
    return {
        v: {k: r(x.clamp(0, 1), reps).mean().item() for k, r in rewards.items()} for v, x in variants.items()
    }


@torch.no_grad()
def evaluate_eval_judge(judge, attr, backbones: dict, text_encoder, world: World) -> dict:
    """The eval-only judge on known content (fresh clean renders; fresh renders degraded by each backbone),
    and its agreement with the training classifier ``attr`` on base-model samples whose content is unknown
    (the exact-match verdicts against the prompt: fraction equal, Cohen's kappa)."""
    images, labels = render_pool(world, world.prompts, EVAL_PER_PROMPT, seed=EVAL_SEED)
    prompts = [world.prompts[i] for i in labels.tolist()]
    judges = {"attr_judge": judge, "attr": attr}
    out: dict = {
        "clean_renders": {n: attribute_accuracy(m, world, images, prompts) for n, m in judges.items()}
    }
    cfg = EVAL_JUDGE_TRAIN["attr_judge"]
    gen = torch.Generator().manual_seed(EVAL_SEED)
    reps = [p for p in world.prompts for _ in range(SAMPLES_PER_TRAIN_PROMPT)]
    truth = world.labels(reps)
    for name, backbone in backbones.items():
        degraded = generator_degrade(
            [backbone], text_encoder, world, images, prompts, gen, cfg.sdedit_sigma, cfg.sdedit_steps
        )
        out[f"degraded_by_{name}"] = {
            n: attribute_accuracy(m, world, degraded, prompts) for n, m in judges.items()
        }
        samples = sample_images(backbone, text_encoder, world, reps, EVAL_SEED, SAMPLE_STEPS, SAMPLE_SHIFT)
        verdict = {n: m.predict(samples).eq(truth).all(-1) for n, m in judges.items()}
        out[f"agreement_on_{name}_samples"] = agreement(verdict["attr_judge"], verdict["attr"]) | {
            f"exact_{n}": v.float().mean().item() for n, v in verdict.items()
        }
    return out


def _manifest(name: str, stats: dict, metrics: dict) -> dict:
    trains = (JUDGE_TRAIN, FLOW_TRAIN, EVAL_JUDGE_TRAIN, VIDEO_JUDGE_TRAIN, VIDEO_FLOW_TRAIN)
    seed = next(t[name] for t in trains if name in t).seed
    return {
        "name": name,
        "config": expected_config(name),
        "seed": seed,
        "git_sha": git_sha(ignore=REPORTS),
    } | (environment() | stats | {"metrics": metrics})


def build_artefact(name: str, cache_dir: Path, log: Callable[[str], None] = logger.info) -> dict:
    """Train, evaluate and cache one artefact (its dependencies must already be cached)."""
    world = World()
    tok = WordTokenizer(world.words)
    log(f"[pretrain] training {name} ...")
    if name in JUDGES:
        if name == "pref":
            model, stats = train_preference(world, tok, JUDGE_TRAIN[name])
        elif name == "attr":
            model, stats = train_attributes(world, JUDGE_TRAIN[name])
        else:  # text_encoder, clip: same recipe, different seeds and weights
            model, stats = train_clip(world, tok, JUDGE_TRAIN[name])
        metrics = evaluate_judge(name, model, world)
        manifest = _manifest(name, stats, metrics)
    elif name in EVAL_JUDGES:
        backbones = {n: load_pretrained(n, cache_dir)[0].requires_grad_(False) for n in BACKBONE_NAMES}
        text_encoder = load_text_encoder(cache_dir)
        model, stats = train_attr_judge(world, list(backbones.values()), text_encoder, EVAL_JUDGE_TRAIN[name])
        metrics = evaluate_eval_judge(model, attr_reward(cache_dir).model, backbones, text_encoder, world)
        manifest = _manifest(name, stats, metrics)
    else:
        text_encoder = load_text_encoder(cache_dir)  # frozen, trained first
        model = new_module(name, world)
        stats = train_flow(model, text_encoder, world, FLOW_TRAIN[name], log=log)
        rewards = world_rewards(cache_dir)
        metrics = {
            "sampler": {"steps": SAMPLE_STEPS, "shift": SAMPLE_SHIFT, "kinds": "ode"},
            "heldout_prompts": evaluate_backbone(
                model, text_encoder, world, rewards, world.heldout_prompts, SAMPLES_PER_PROMPT
            ),
            "train_prompts": evaluate_backbone(
                model, text_encoder, world, rewards, world.train_prompts, SAMPLES_PER_TRAIN_PROMPT
            ),
        }
        manifest = _manifest(name, stats, metrics)
    manifest["depends_on"] = {d: read_manifest(d, cache_dir)["sha256"] for d in dependencies(name)}
    manifest = save_artefact(name, model, manifest, cache_dir)
    log(f"[pretrain] {name}: {stats['train_seconds']:.0f} s, final loss {stats['final_loss']:.4f}, {metrics}")
    return manifest


VIDEO_SAMPLES_PER_PROMPT = 16  # the video backbone: samples per held-out prompt
VIDEO_SAMPLES_PER_TRAIN_PROMPT = 4


def build_video_artefact(name: str, cache_dir: Path, log: Callable[[str], None] = logger.info) -> dict:
    """Train, evaluate and cache one video-world artefact (its dependencies must already be cached): the text
    encoder and the preference model by the image world's trainers on clips, the Wan by rectified flow."""
    world = VideoWorld()
    tok = WordTokenizer(world.words)
    log(f"[pretrain] training {name} ...")
    if name == "video_text_encoder":
        model, stats = train_clip(world, tok, VIDEO_JUDGE_TRAIN[name])
        images, labels = render_pool(world, world.prompts, EVAL_PER_PROMPT, seed=EVAL_SEED)
        held = _heldout_split(world, labels)
        metrics = {
            "top1_retrieval": clip_retrieval_accuracy(model, tok, world, images, labels),
            "top1_retrieval_heldout_prompts": clip_retrieval_accuracy(
                model, tok, world, images[held], labels[held]
            ),
        }
    elif name == "video_pref":
        model, stats = train_preference(world, tok, VIDEO_JUDGE_TRAIN[name], pairs=video_preference_pairs)
        metrics = evaluate_video_pref(model, world, seed=EVAL_SEED)
    else:
        text_encoder = load_text_encoder(cache_dir, video=True)
        model = new_module(name, world)
        stats = train_flow(model, text_encoder, world, VIDEO_FLOW_TRAIN[name], log=log)
        pref = load_module("video_pref", cache_dir) if is_up_to_date("video_pref", cache_dir) else None
        metrics = {"sampler": {"steps": SAMPLE_STEPS, "shift": SAMPLE_SHIFT, "kinds": "ode"}}
        for split, prompts, per in (
            ("heldout_prompts", world.heldout_prompts, VIDEO_SAMPLES_PER_PROMPT),
            ("train_prompts", world.train_prompts, VIDEO_SAMPLES_PER_TRAIN_PROMPT),
        ):
            reps = [p for p in prompts for _ in range(per)]
            clips = sample_images(model, text_encoder, world, reps, EVAL_SEED, SAMPLE_STEPS, SAMPLE_SHIFT)
            metrics[split] = score_clips(clips, reps, world, pref)
        metrics["clean_renders_heldout"] = score_clips(
            world.render(world.heldout_prompts * VIDEO_SAMPLES_PER_PROMPT, EVAL_SEED),
            world.heldout_prompts * VIDEO_SAMPLES_PER_PROMPT,
            world,
            pref,
        )
    manifest = _manifest(name, stats, metrics)
    manifest["depends_on"] = {d: read_manifest(d, cache_dir)["sha256"] for d in dependencies(name)}
    manifest = save_artefact(name, model, manifest, cache_dir)
    log(f"[pretrain] {name}: {stats['train_seconds']:.0f} s, final loss {stats['final_loss']:.4f}, {metrics}")
    return manifest


def pretrain_all(cache_dir: Path | None = None, log: Callable[[str], None] = logger.info) -> list[str]:
    """Build every stale or missing artefact in dependency order, the image world's then the video world's;
    returns the names rebuilt ([] = no-op)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    rebuilt = []
    for name in ARTEFACTS + VIDEO_ARTEFACTS:
        # A rebuilt text encoder invalidates the backbones through their recorded sha256.
        if is_up_to_date(name, cache_dir):
            log(f"[pretrain] {name}: up to date ({cache_dir / name}.safetensors)")
            continue
        (build_video_artefact if name in VIDEO_ARTEFACTS else build_artefact)(name, cache_dir, log)
        rebuilt.append(name)
    return rebuilt


__all__ = [
    "BACKBONE_NAMES",
    "build_artefact",
    "build_video_artefact",
    "hack_probe",
    "pretrain_all",
    "reference_rewards",
    "world_rewards",
]
