"""The cached, project-trained artefacts of the embedded world and their manifests.

Artefacts (``cache/world/<name>.safetensors`` + ``<name>.json``), built in this order by ``make pretrain``:
    text_encoder  frozen text tower of a tiny CLIP (conditions both backbones)
    clip, pref, attr  the judges behind the ``clip`` / ``pref`` / ``attr`` rewards
    flux, qwenimage   FluxTransformer2DModel / QwenImageTransformer2DModel trained by rectified flow
    attr_judge        eval-only attribute judge (``attr_judge`` metric): another architecture, seed and data
                      than ``attr`` (renders degraded by the two backbones); never a training reward

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
from jagg.models import BACKBONES, Backbone, tiny_flux_config, tiny_qwenimage_config
from jagg.world.models import AttrClassifier, AttrJudge, PreferenceModel, TinyCLIP
from jagg.world.scene import World, WorldConfig
from jagg.world.text import WordTokenizer, WorldTextEncoder
from jagg.world.train import EvalJudgeTrainConfig, FlowTrainConfig, JudgeTrainConfig

FORMAT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[3]
JUDGES = ("text_encoder", "clip", "pref", "attr")
BACKBONE_NAMES = ("flux", "qwenimage")
EVAL_JUDGES = ("attr_judge",)  # eval-only: trained after the backbones, on renders they degraded
ARTEFACTS = JUDGES + BACKBONE_NAMES + EVAL_JUDGES

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
    raise ValueError(f"backbone must be one of {BACKBONE_NAMES}, got {name!r}")


def expected_config(name: str, world_config: WorldConfig | None = None) -> dict:
    """The full config an artefact must have been built with (JSON-normalised for comparison)."""
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


def architecture_signature(module: nn.Module) -> str:
    """sha256 (16 hex) of the parameter names and shapes: catches code changes the config does not name."""
    spec = ";".join(f"{k}:{tuple(v.shape)}" for k, v in module.state_dict().items())
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- model construction
def new_module(name: str, world: World) -> nn.Module:
    """An untrained module of the right architecture for artefact ``name``."""
    tok = WordTokenizer(world.words)
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


def text_encoder_from_clip(clip: TinyCLIP, world: World) -> WorldTextEncoder:
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


def world_build(cache_dir: Path | None = None) -> dict[str, str]:
    """The sha256 (16 hex) of every cached artefact: which build of the world a run loaded. Pretraining is
    bitwise reproducible on one machine but not across CPUs (their float kernels differ), so runs compare
    exactly only on the same build."""
    manifests = {name: read_manifest(name, cache_dir) for name in ARTEFACTS}
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


def check_artefact(name: str, cache_dir: Path | None = None, world_config: WorldConfig | None = None) -> dict:
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
    return ()


def load_module(
    name: str, cache_dir: Path | None = None, world_config: WorldConfig | None = None
) -> nn.Module:
    """Load one cached artefact after ``check_artefact`` (eval mode, no grad)."""
    check_artefact(name, cache_dir, world_config)
    module = new_module(name, World(world_config))
    load_model(module, str(Path(cache_dir or default_cache_dir()) / f"{name}.safetensors"))
    return module.requires_grad_(False).eval()


# --------------------------------------------------------------------------- public loaders
def load_text_encoder(
    cache_dir: Path | None = None, world_config: WorldConfig | None = None
) -> WorldTextEncoder:
    """The frozen world text encoder (``encode_prompts(list[str]) -> TextCond``)."""
    clip = load_module("text_encoder", cache_dir, world_config)
    return text_encoder_from_clip(clip, World(world_config))


def load_pretrained(
    name: str, cache_dir: Path | None = None, world_config: WorldConfig | None = None
) -> tuple[Backbone, WorldTextEncoder]:
    """``(backbone, text_encoder)`` for "flux" or "qwenimage", pretrained on the world by ``make pretrain``.

    The backbone is returned in eval mode with gradients enabled (ready for RL fine-tuning).
    """
    if name not in BACKBONE_NAMES:
        raise ValueError(f"world backbone must be one of {BACKBONE_NAMES}, got {name!r}")
    backbone = load_module(name, cache_dir, world_config).requires_grad_(True)
    return backbone, load_text_encoder(cache_dir, world_config)


def is_up_to_date(name: str, cache_dir: Path | None = None) -> bool:
    try:
        check_artefact(name, cache_dir)
        return True
    except ArtefactError:
        return False
