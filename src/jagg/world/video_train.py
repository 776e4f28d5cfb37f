"""Data and evaluation of the video world's artefacts (the trainers are the image world's, ``jagg.world.train``).

video_preference_pairs  (faithful clip, degraded clip) pairs for the ``video_pref`` model: the image world's
                        degradations plus the ones only a clip can show (a wrong direction, standing
                        still, shuffled frames, per-frame flicker)
evaluate_video_pref     held-out pair accuracy, overall and per degradation
evaluate_video_backbone motion / full match read by the geometric judge (``jagg.world.motion``), the
                        ``video_pref`` score and the temporal term of ODE samples
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import Tensor

from jagg.rewards.video import temporal_consistency
from jagg.world.models import PreferenceModel
from jagg.world.motion import clip_match, motion_match
from jagg.world.text import WordTokenizer
from jagg.world.train import box_blur, degraded_pairs
from jagg.world.video import VideoWorld

VIDEO_DEGRADATIONS = (
    "motion",
    "still",
    "shuffle",
    "flicker",
    "color",
    "shape",
    "noise",
    "noisy_background",
    "blur",
    "faded",
    "empty",
)


def _shuffles(frames: int) -> list[tuple[int, ...]]:
    """Frame orders other than forwards and backwards (a clip that jumps back and forth)."""
    keep = (tuple(range(frames)), tuple(reversed(range(frames))))
    return [p for p in itertools.permutations(range(frames)) if p not in keep]


def video_preference_pairs(world: VideoWorld, n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, list[str]]:
    """``n`` (preferred, rejected) clip pairs: a faithful clean clip vs a degraded one for the same prompt.

    Degradations cycle through ``VIDEO_DEGRADATIONS``: another direction, the object standing still at its
    start, the frames shuffled, per-frame brightness flicker, a wrong colour or shape, pixel noise, a noisy
    background, blur, low contrast, an empty clip. Returns good, bad (n, 3, F, H, W), prompt indices (n,) and
    the degradation names (as ``jagg.world.train.preference_pairs``)."""
    c = world.config
    wrong = {
        "motion": lambda a, other: a._replace(motion=other(c.motions, a.motion)),
        "color": lambda a, other: a._replace(color=other(c.image.colors, a.color)),
        "shape": lambda a, other: a._replace(shape=other(c.image.shapes, a.shape)),
    }

    def clip_only(rerendered, rng, kinds, attrs):
        still_rows = [i for i, k in enumerate(kinds) if k == "still"]
        still = world.render_attributes([attrs[i] for i in still_rows], rng, still=True)[0]
        shuffles = _shuffles(world.frames)

        def own(i: int, kind: str, x: Tensor, u: float, gen: torch.Generator) -> Tensor | None:
            if kind == "still":
                return still[still_rows.index(i)]
            if kind == "shuffle":
                return x[:, list(shuffles[int(rng.integers(len(shuffles)))])]
            if kind == "flicker":  # each frame's brightness and colour shifted on its own
                return x + (0.1 + 0.2 * u) * (2 * torch.rand(1, x.shape[1], 1, 1, generator=gen) - 1)
            return None

        return own

    return degraded_pairs(world, n, seed, VIDEO_DEGRADATIONS, wrong, clip_only, _blur_frames)


def _blur_frames(clip: Tensor) -> Tensor:
    """The image world's box blur on each frame of a (3, F, H, W) clip."""
    return box_blur(clip.permute(1, 0, 2, 3)).permute(1, 0, 2, 3)


@torch.no_grad()
def evaluate_video_pref(model: PreferenceModel, world: VideoWorld, seed: int, n: int = 2200) -> dict:
    """Held-out pair accuracy of the video preference model (fresh seed), overall and per degradation."""
    good, bad, pidx, kinds = video_preference_pairs(world, n, seed=seed)
    ids, mask = WordTokenizer(world.words)([world.prompts[i] for i in pidx.tolist()])
    win = (model(good, ids, mask) > model(bad, ids, mask)).float()
    per = {k: win[[i for i, kk in enumerate(kinds) if kk == k]].mean().item() for k in VIDEO_DEGRADATIONS}
    return {"pair_accuracy": win.mean().item(), "pair_accuracy_by_degradation": per}


@torch.no_grad()
def score_clips(clips: Tensor, prompts: list[str], world: VideoWorld, pref: PreferenceModel | None) -> dict:
    """Mean geometric motion match, full match (colour, shape, motion), temporal term and ``video_pref``."""
    out = {
        "n_samples": len(prompts),
        "motion_geom": motion_match(clips, prompts, world).mean().item(),
        "video_geom": clip_match(clips, prompts, world).mean().item(),
        "temporal": temporal_consistency(clips).mean().item(),
    }
    if pref is not None:
        ids, mask = WordTokenizer(world.words)(prompts)
        out["video_pref"] = pref(clips, ids, mask).mean().item()
    return out


@torch.no_grad()
def motion_probe(world: VideoWorld, rewards: dict, seed: int, per_prompt: int = 2) -> dict:
    """Mean of each reward (name -> ``reward(clips, prompts)``) on clean clips of every prompt, on the same clips
    moving the opposite way, and with the object standing still at its start: which rewards see the motion."""
    prompts = [p for p in world.prompts for _ in range(per_prompt)]
    attrs = [world.parse(p) for p in prompts]
    opposite = {"right": "left", "left": "right", "up": "down", "down": "up"}
    variants = {
        "clean": world.render(prompts, seed),
        "opposite_direction": world.render_attributes(
            [a._replace(motion=opposite[a.motion]) for a in attrs], np.random.default_rng(seed)
        )[0],
        "standing_still": world.render_attributes(attrs, np.random.default_rng(seed), still=True)[0],
    }
    return {
        v: {n: r(x, prompts).float().mean().item() for n, r in rewards.items()} for v, x in variants.items()
    }
