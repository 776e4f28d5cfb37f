"""The cached, project-trained artefacts of the embedded world and their manifests.

Artefacts (``cache/world/<name>.safetensors`` + ``<name>.json``), built in this order by ``make pretrain``:
    text_encoder  frozen text tower of a tiny CLIP (conditions both backbones)
    clip, pref, attr  the judges behind the ``clip`` / ``pref`` / ``attr`` rewards
    flux, qwenimage   FluxTransformer2DModel / QwenImageTransformer2DModel trained by rectified flow
    attr_judge        eval-only attribute judge (``attr_judge`` metric): another architecture, seed and data
                      than ``attr`` (renders degraded by the two backbones); never a training reward
and after them, with their own seeds, the video world's (``VIDEO_ARTEFACTS``, ``jagg.world.video``):
    video_text_encoder  frozen text tower of a tiny clip-CLIP (conditions the video backbone)
    video_pref          the ``video_pref`` reward: a preference model on (faithful, degraded) clip pairs
    wan                 WanTransformer3DModel trained by rectified flow on moving-shape clips
The video artefacts are not in ``ARTEFACTS``: ``world_build()``, the build an image run records, names the
image artefacts only, whatever else the cache holds.

Each manifest stores the artefact's full config (world, model, training), seed, git SHA, versions, hardware,
training time, final loss and held-out metrics. Loading compares the stored config with the one this code
expects and refuses a mismatch, so a stale cache can never silently pair with new code. Backbones record
the sha256 of the text encoder they were trained with, the eval judge those of the backbones too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_model, save_model
from torch import nn

from jagg.common import hardware, versions
from jagg.errors import ArtefactError
from jagg.models import BACKBONES, Backbone, tiny_flux_config, tiny_qwenimage_config, tiny_wan_config
from jagg.world.models import AttrClassifier, AttrJudge, PreferenceModel, TinyCLIP
from jagg.world.scene import World, WorldConfig
from jagg.world.text import WordTokenizer, WorldTextEncoder
from jagg.world.train import EvalJudgeTrainConfig, FlowTrainConfig, JudgeTrainConfig
from jagg.world.video import VideoWorld, VideoWorldConfig

FORMAT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[3]
JUDGES = ("text_encoder", "clip", "pref", "attr")
BACKBONE_NAMES = ("flux", "qwenimage")
EVAL_JUDGES = ("attr_judge",)  # eval-only: trained after the backbones, on renders they degraded
ARTEFACTS = JUDGES + BACKBONE_NAMES + EVAL_JUDGES
VIDEO_JUDGES = ("video_text_encoder", "video_pref")
VIDEO_BACKBONE_NAMES = ("wan",)
VIDEO_ARTEFACTS = VIDEO_JUDGES + VIDEO_BACKBONE_NAMES  # built after ARTEFACTS; never in world_build()
# What `make pretrain` (experiments/pretrain.py) writes about them into the repository, as git pathspec globs
# (jagg.common.tree_state): left out of the dirty check of the world's records and of every driver that `make`
# runs after it, since a rebuild rewrites them (timings, SHAs) and the build itself is named by world_build().
REPORTS = ("results/world.md", "results/world.json", "results/world_video.*", "paper_figures/world_samples_*")

# Training budgets (tuned so each backbone trains in minutes on one CPU thread and lands at a base
# held-out attribute accuracy in [0.2, 0.7]: recognisable objects with headroom for RL).
JUDGE_TRAIN = {
    "text_encoder": JudgeTrainConfig(steps=400, seed=1),
    "clip": JudgeTrainConfig(steps=600, seed=2),
    "pref": JudgeTrainConfig(steps=600, seed=3),
    "attr": JudgeTrainConfig(steps=500, seed=4),
}
EVAL_JUDGE_TRAIN = {"attr_judge": EvalJudgeTrainConfig()}
FLOW_TRAIN = {
    "flux": FlowTrainConfig(steps=450, seed=5),
    "qwenimage": FlowTrainConfig(steps=500, seed=6),
}
# The video world's: seeds 21-23, none shared with the image world's (its data draws are seeded from them).
VIDEO_JUDGE_TRAIN = {
    "video_text_encoder": JudgeTrainConfig(steps=400, seed=21),
    "video_pref": JudgeTrainConfig(steps=600, pairs=8000, seed=22),
}
# The Wan's budget, measured on the busy 2-core machine (docs/decisions.md 25): 2 blocks or 2x2 patches (256
# tokens a clip) learned colour and shape but hardly the motion in this time (held-out motion_geom <= 0.17);
# 3 blocks on 4x4 patches (64 tokens) reach about 0.4, headroom left for RL.
VIDEO_FLOW_TRAIN = {"wan": FlowTrainConfig(steps=2000, batch=32, lr=3e-3, per_prompt=100, seed=23)}
# Evaluation sampler of the manifests and the report (DanceGRPO-style schedule, all ODE).
SAMPLE_STEPS, SAMPLE_SHIFT = 16, 3.0


def default_cache_dir() -> Path:
    """``$JAGG_WORLD_CACHE`` or ``<repo>/cache/world``."""
    return Path(os.environ.get("JAGG_WORLD_CACHE", REPO_ROOT / "cache" / "world"))


def world_backbone_config(name: str, world: World) -> dict:
    """Transformer config (diffusers) of a world backbone: ~1M parameters, pixel-space latents (C = 3)."""
    if name == "flux":
        return tiny_flux_config(world.latent_channels, num_attention_heads=6, guidance_embeds=False)
    if name == "qwenimage":
        return tiny_qwenimage_config(world.latent_channels, num_attention_heads=6, num_layers=3)
    if name == "wan":
        return tiny_wan_config(
            world.latent_channels,
            patch_size=(1, 4, 4),
            num_attention_heads=4,
            attention_head_dim=32,
            ffn_dim=256,
            num_layers=3,
        )
    raise ValueError(f"backbone must be one of {BACKBONE_NAMES + VIDEO_BACKBONE_NAMES}, got {name!r}")


def world_of(name: str, world_config: WorldConfig | VideoWorldConfig | None = None) -> World | VideoWorld:
    """The world artefact ``name`` belongs to: the video world's for ``VIDEO_ARTEFACTS``, else the image world."""
    if name in VIDEO_ARTEFACTS:
        return VideoWorld(world_config if isinstance(world_config, VideoWorldConfig) else None)
    return World(world_config if isinstance(world_config, WorldConfig) else None)


def expected_config(name: str, world_config: WorldConfig | VideoWorldConfig | None = None) -> dict:
    """The full config an artefact must have been built with (JSON-normalised for comparison)."""
    if name in VIDEO_ARTEFACTS:
        return _expected_video_config(name, world_config)
    world = World(world_config)
    cfg: dict = {"format": FORMAT_VERSION, "artefact": name, "world": asdict(world.config)}
    if name in JUDGES:
        cfg |= {"vocab": WordTokenizer(world.words).vocab, "train": asdict(JUDGE_TRAIN[name])}
    elif name in BACKBONE_NAMES:
        cfg |= {
            "transformer_class": BACKBONES[name].transformer_cls.__name__,
            "transformer": world_backbone_config(name, world),
            "train": asdict(FLOW_TRAIN[name]),
            "latent": "pixel space: z = 2 * image - 1, (B, 3, H, W)",
        }
    elif name in EVAL_JUDGES:
        cfg |= {"train": asdict(EVAL_JUDGE_TRAIN[name]), "degraded_by": list(BACKBONE_NAMES)}
    else:
        raise ValueError(f"artefact must be one of {ARTEFACTS}, got {name!r}")
    cfg["architecture"] = architecture_signature(new_module(name, world))
    return json.loads(json.dumps(cfg))


def _expected_video_config(name: str, world_config: WorldConfig | VideoWorldConfig | None) -> dict:
    world = world_of(name, world_config)
    cfg: dict = {"format": FORMAT_VERSION, "artefact": name, "world": asdict(world.config)}
    if name in VIDEO_JUDGES:
        cfg |= {"vocab": WordTokenizer(world.words).vocab, "train": asdict(VIDEO_JUDGE_TRAIN[name])}
    else:
        cfg |= {
            "transformer_class": BACKBONES[name].transformer_cls.__name__,
            "transformer": world_backbone_config(name, world),
            "train": asdict(VIDEO_FLOW_TRAIN[name]),
            "latent": "pixel space: z = 2 * clip - 1, (B, 3, F, H, W)",
        }
    cfg["architecture"] = architecture_signature(new_module(name, world))
    return json.loads(json.dumps(cfg))


def architecture_signature(module: nn.Module) -> str:
    """sha256 (16 hex) of the parameter names and shapes: catches code changes the config does not name."""
    spec = ";".join(f"{k}:{tuple(v.shape)}" for k, v in module.state_dict().items())
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- model construction
def new_module(name: str, world: World | VideoWorld) -> nn.Module:
    """An untrained module of the right architecture for artefact ``name`` (of ``world_of(name)``'s world)."""
    tok = WordTokenizer(world.words)
    if name in VIDEO_ARTEFACTS:
        if not isinstance(world, VideoWorld):
            raise ValueError(f"artefact {name!r} belongs to the video world, got {type(world).__name__}")
        if name == "video_text_encoder":
            return TinyCLIP(len(tok), max_len=tok.max_len, frames=world.frames)
        if name == "video_pref":
            return PreferenceModel(len(tok), max_len=tok.max_len, frames=world.frames)
        return BACKBONES[name].from_config(
            world_backbone_config(name, world), seed=VIDEO_FLOW_TRAIN[name].seed
        )
    if name in ("text_encoder", "clip"):
        return TinyCLIP(len(tok), max_len=tok.max_len)
    if name == "pref":
        return PreferenceModel(len(tok), max_len=tok.max_len)
    if name == "attr":
        return AttrClassifier(world.num_classes)
    if name == "attr_judge":
        return AttrJudge(world.num_classes, world.size)
    if name not in BACKBONE_NAMES:
        raise ValueError(f"artefact must be one of {ARTEFACTS}, got {name!r}")
    return BACKBONES[name].from_config(world_backbone_config(name, world), seed=FLOW_TRAIN[name].seed)


def text_encoder_from_clip(clip: TinyCLIP, world: World | VideoWorld) -> WorldTextEncoder:
    """Freeze the text tower of a trained TinyCLIP into the backbones' prompt encoder."""
    return WorldTextEncoder(WordTokenizer(world.words), clip.text)


# --------------------------------------------------------------------------- manifests
def environment() -> dict:
    """Versions and hardware recorded with every artefact and result (``jagg.common``)."""
    return {**versions(), "hardware": hardware()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(name: str, cache_dir: Path | None = None) -> dict | None:
    path = Path(cache_dir or default_cache_dir()) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def world_build(cache_dir: Path | None = None, artefacts: tuple[str, ...] = ARTEFACTS) -> dict[str, str]:
    """The sha256 (16 hex) of every cached artefact: which build of the world a run loaded. Pretraining is
    bitwise reproducible on CPUs that run the same float kernels (``make`` pins AVX2 on x86-64: AVX-512
    kernels give another build), so runs compare exactly only on the same build. By default the image world's
    artefacts only (what every image run records); ``artefacts=VIDEO_ARTEFACTS``: the video world's (a video
    run records both)."""
    manifests = {name: read_manifest(name, cache_dir) for name in artefacts}
    return {name: m["sha256"][:16] for name, m in manifests.items() if m is not None}


def save_artefact(name: str, module: nn.Module, manifest: dict, cache_dir: Path | None = None) -> dict:
    """Write ``<name>.safetensors`` then ``<name>.json`` (the manifest last, so a crash leaves no valid pair)."""
    cache = Path(cache_dir or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    weights = cache / f"{name}.safetensors"
    save_model(module, str(weights))
    manifest = manifest | {
        "weights": weights.name,
        "sha256": sha256(weights),
        "num_params": sum(p.numel() for p in module.parameters()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (cache / f"{name}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _diff(expected, found, prefix: str = "") -> list[str]:
    """Dotted keys where two JSON trees differ."""
    if isinstance(expected, dict) and isinstance(found, dict):
        keys = sorted(set(expected) | set(found))
        return [d for k in keys for d in _diff(expected.get(k), found.get(k), f"{prefix}{k}.")]
    return [] if expected == found else [prefix.rstrip(".")]


def check_artefact(
    name: str, cache_dir: Path | None = None, world_config: WorldConfig | VideoWorldConfig | None = None
) -> dict:
    """Return the manifest of a usable cached artefact, or raise ``ArtefactError`` saying what to do."""
    cache = Path(cache_dir or default_cache_dir())
    manifest = read_manifest(name, cache)
    weights = cache / f"{name}.safetensors"
    if manifest is None or not weights.exists():
        raise ArtefactError(
            f"world artefact {name!r} not found in {cache} (missing {name}.json or {name}.safetensors); "
            "run `make pretrain` to train and cache the embedded-world models"
        )
    diff = _diff(expected_config(name, world_config), manifest.get("config"))
    if diff:
        raise ArtefactError(
            f"cached world artefact {cache / name}.safetensors does not match this code's config "
            f"(differs in: {', '.join(diff)}); delete it and run `make pretrain` to retrain"
        )
    if manifest.get("sha256") != sha256(weights):
        raise ArtefactError(f"{weights} does not match the sha256 in its manifest; run `make pretrain`")
    for dep in dependencies(name):
        found = read_manifest(dep, cache)
        if found is None or found.get("sha256") != manifest.get("depends_on", {}).get(dep):
            raise ArtefactError(
                f"cached {name!r} was trained with a different {dep!r} than the cached one; "
                "run `make pretrain` to retrain it"
            )
    return manifest


def dependencies(name: str) -> tuple[str, ...]:
    """The cached artefacts ``name`` was trained with (their sha256 is recorded in its manifest)."""
    if name in BACKBONE_NAMES:
        return ("text_encoder",)
    if name in EVAL_JUDGES:
        return ("text_encoder", *BACKBONE_NAMES)
    if name in VIDEO_BACKBONE_NAMES:
        return ("video_text_encoder",)
    return ()


def load_module(
    name: str, cache_dir: Path | None = None, world_config: WorldConfig | VideoWorldConfig | None = None
) -> nn.Module:
    """Load one cached artefact after ``check_artefact`` (eval mode, no grad)."""
    check_artefact(name, cache_dir, world_config)
    module = new_module(name, world_of(name, world_config))
    load_model(module, str(Path(cache_dir or default_cache_dir()) / f"{name}.safetensors"))
    return module.requires_grad_(False).eval()


# --------------------------------------------------------------------------- public loaders
def load_text_encoder(
    cache_dir: Path | None = None, world_config: WorldConfig | None = None, *, video: bool = False
) -> WorldTextEncoder:
    """The frozen world text encoder (``encode_prompts(list[str]) -> TextCond``); ``video``: the video world's."""
    name = "video_text_encoder" if video else "text_encoder"
    clip = load_module(name, cache_dir, world_config)
    return text_encoder_from_clip(clip, world_of(name, world_config))


def load_pretrained(
    name: str, cache_dir: Path | None = None, world_config: WorldConfig | None = None
) -> tuple[Backbone, WorldTextEncoder]:
    """``(backbone, text_encoder)`` for "flux" or "qwenimage" (the image world) or "wan" (the video world),
    pretrained by ``make pretrain``.

    The backbone is returned in eval mode with gradients enabled (ready for RL fine-tuning).
    """
    if name not in BACKBONE_NAMES + VIDEO_BACKBONE_NAMES:
        raise ValueError(
            f"world backbone must be one of {BACKBONE_NAMES + VIDEO_BACKBONE_NAMES}, got {name!r}"
        )
    backbone = load_module(name, cache_dir, world_config).requires_grad_(True)
    return backbone, load_text_encoder(cache_dir, world_config, video=name in VIDEO_BACKBONE_NAMES)


def is_up_to_date(name: str, cache_dir: Path | None = None) -> bool:
    try:
        check_artefact(name, cache_dir)
        return True
    except ArtefactError:
        return False
