"""Typed training configuration: dataclasses, YAML loading with inheritance, ``a.b=value`` overrides, checks.

A YAML file may name a parent with ``inherit: other.yaml`` (relative to itself); keys are merged recursively,
so configs that differ only in, e.g., the backward strategy share one base file. Every error is a
``ConfigError`` (``jagg.errors``) whose message names the key and what is allowed; the CLI turns it into one
line on stderr and exit status 2 before anything is written.

Layer: above the engine, the model adapters and the rewards, below the world / scale / loop. It imports only
the engine (the names it checks against) and ``jagg.errors``, so loading a config imports neither diffusers nor
the world; the reward names are checked by the composition root (``jagg.loop.components.check_config``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jagg.engine.algorithms import ALGORITHMS
from jagg.engine.grpo import KL_STD
from jagg.engine.sde import SDE_KINDS
from jagg.engine.strategies import validate_routing
from jagg.errors import ConfigError
from jagg.rewards import EVAL_ONLY

# The adapters of ``jagg.models.BACKBONES``, named without importing them (they import diffusers); a test
# (tests/test_architecture.py) checks that the two agree.
BACKBONE_NAMES = ("flux", "qwenimage")

# The one definition of a tiny run (tests, smoke modes of the drivers, notebooks): overrides on top of any world
# config. TINY_OVERRIDES makes it need no `make pretrain`: random-init world backbones (model.source=tiny) scored
# by the JPEG reward (the world rewards need the pretrained cache). TINY_RUN adds the smallest batch: one
# iteration of 2 prompts x 2 images in one micro-batch, no evaluation. Later overrides win, so a caller appends
# what it needs to differ, e.g. ``load_config(path, [*TINY_RUN, "sampling.num_steps=4"])``.
TINY_OVERRIDES = ("model.source=tiny", "reward.weights={jpeg: 1.0}", "reward.eval=[jpeg]")
TINY_RUN = (
    *TINY_OVERRIDES,
    "train.iterations=1",
    "train.prompts_per_iter=2",
    "train.images_per_prompt=2",
    "train.train_batch_size=4",
    "log.eval_every=0",
)


@dataclass
class ModelConfig:
    backbone: str = "flux"  # flux | qwenimage
    source: str = (
        "world"  # world (embedded default, `make pretrain`) | tiny (random init) | pretrained (hub/path)
    )
    path: str | None = None  # hub id or local directory for source=pretrained
    guidance_scale: float = 3.5  # Flux embedded guidance
    true_cfg_scale: float = 1.0  # Qwen-Image true CFG (> 1 needs a negative prompt)
    gradient_checkpointing: bool = False
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 0.0
    lora_targets: list[str] = field(default_factory=list)  # empty = backbone default
    negative_prompt: str = (
        " "  # Qwen-Image true CFG (used when true_cfg_scale > 1), as the Qwen-Image pipeline
    )
    max_sequence_length: int = 512  # text tokens: Flux T5 padding length, Qwen-Image truncation


@dataclass
class SamplingConfig:
    num_steps: int = 16
    shift: float = 3.0  # shifted-linear schedule (DanceGRPO); real models use their scheduler
    latent_size: int = 16  # latent height = width (must be even: 2x2 packing)
    eval_num_steps: int = 16
    schedule: str = "shift"  # shift (shifted linear, DanceGRPO) | scheduler (the model's diffusers scheduler)


@dataclass
class AlgorithmConfig:
    name: str = "dancegrpo"  # dancegrpo | flowgrpo_fast | flowgrpo
    sde_kind: str = "dance"  # dance | flow_grpo | cps
    noise_level: float = 0.3  # eta (dance) or a (flow_grpo, cps)
    timestep_fraction: float = 0.6  # DanceGRPO: fraction of the S-1 steps trained per sample
    sde_window_size: int = 3  # Flow-GRPO-Fast: consecutive SDE steps per rollout
    sde_window_range: list[int] = field(default_factory=lambda: [0, 3])  # window start drawn in [lo, hi)
    init_same_noise: bool = False  # one initial noise per prompt group (DanceGRPO's --init_same_noise)
    clip_range: float = 1e-4
    adv_clip: float = 5.0
    adv_eps: float = 1e-8
    adv_unbiased: bool = True
    adv_std: str = "group"  # group | global
    kl_beta: float = 0.0
    kl_std: str = "flow_grpo"  # flow_grpo (Flow-GRPO's std_dev_t, no sqrt(dt)) | step (exact step KL)


@dataclass
class BackwardConfig:
    strategy: str = "jagg"  # exact | jagg | endpoints | uniform
    group_size: int | str = 3  # W, or "auto": chosen from `group_sizes` at each calibration (see below)
    jagg_frac: float | str = 0.6  # leading fraction of groups on `strategy`, or "auto" (measured, see below)
    min_cosine: float = 0.9  # auto: a group position uses `strategy` when cos(its gradient, exact) >= this
    calibrate_every: int = 25  # auto: measure the cosines at iteration 0 and every this many iterations
    group_sizes: list[int] = field(default_factory=lambda: [2, 3, 4])  # group_size=auto: the candidates
    endpoints: str = "batched"  # batched | joint (paper-literal) | sequential (one graph alive)
    reuse_rollout: bool = (
        True  # intermediate signals from the rollout's outputs before the first optimizer step
    )

    @property
    def calibrated(self) -> bool:
        """Whether the trainer measures cosines at run time (jagg_frac is "auto"; group_size may be too)."""
        return self.strategy != "exact" and self.jagg_frac == "auto"

    @property
    def candidate_group_sizes(self) -> list[int]:
        """The group sizes a run may use: ``group_sizes`` under group_size=auto, else ``[group_size]``."""
        return sorted(set(self.group_sizes)) if self.group_size == "auto" else [int(self.group_size)]


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    ema_decay: float = 0.0  # 0 = no EMA


@dataclass
class TrainConfig:
    iterations: int = 30
    prompts_per_iter: int = 4
    images_per_prompt: int = 8
    train_batch_size: int = 8  # samples per forward, in rollout and in update (on-policy ratio == 1)
    grad_accum: int = 4  # micro-batches per optimizer step
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp64
    device: str = "cpu"  # cpu | cuda | auto
    max_consecutive_skips: int = 3
    # positive control (jagg.engine.control): the gradient mixed with one fixed random direction at this cosine
    control_cosine: float | None = None


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"pref": 1.0})
    eval: list[str] = field(default_factory=lambda: ["pref", "clip", "attr"])
    kwargs: dict[str, dict] = field(default_factory=dict)  # reward name -> constructor kwargs


@dataclass
class DataConfig:
    """Prompts and text-embedding cache for model.source=pretrained (the world sources use the world's own)."""

    train_prompts: str = "hpdv2_train"  # local file or a name in jagg.scale.prompts.PROMPT_DATASETS
    eval_prompts: str = "hpdv2_test"
    train_limit: int | None = None  # first N prompts (None = all)
    eval_limit: int | None = None
    embedding_cache: str | None = None  # directory of per-prompt embedding files (shared by all ranks)
    precompute_embeddings: bool = False  # encode every prompt up front, then free the text encoders


@dataclass
class LogConfig:
    run_dir: str = "runs/default"
    eval_every: int = 10  # iterations; 0 = never
    eval_prompts: int = 24
    eval_images_per_prompt: int = 1
    checkpoint_every: int = 10  # iterations; 0 = only at the end
    grid_every: int = 0  # sample grid PNG every N iterations (0 = with each eval)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- loading
def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config, resolving ``inherit:`` chains (paths relative to the including file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must be a mapping")
    parent = data.pop("inherit", None)
    return _merge(load_yaml(path.parent / parent), data) if parent else data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``backward.strategy=exact`` -> (["backward", "strategy"], "exact") with YAML typing of the value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value)


def _coerce(key: str, tp, value):
    """Check ``value`` against the annotation ``tp`` (int -> float is allowed); return the value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for a in args[:-1]:  # the first type that accepts the value
            try:
                return _coerce(key, a, value)
            except ConfigError:
                pass
        return _coerce(key, args[-1], value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _coerce(f"{key}.{k}", vt, v) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool) or tp is not bool and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; allowed: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping")
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _coerce(key, tp, value)
    return cls(**kwargs)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file (with inheritance) <- ``a.b=value`` overrides, then ``validate``."""
    data = load_yaml(path) if path else {}
    for text in overrides or []:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- validation
def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config) -> None:
    """Range and consistency checks; each failure names the key and the allowed range.

    Only what this layer can check from the engine's registries and static name tuples: reward names need
    the full reward registry and are checked by the composition root (``jagg.loop.components.check_config``).
    """
    m, s, a, b, o, t = cfg.model, cfg.sampling, cfg.algorithm, cfg.backward, cfg.optim, cfg.train
    _require(
        m.backbone in BACKBONE_NAMES,
        f"model.backbone must be one of {sorted(BACKBONE_NAMES)}, got {m.backbone!r}",
    )
    _require(
        m.source in ("world", "tiny", "pretrained"),
        f"model.source must be world|tiny|pretrained, got {m.source!r}",
    )
    _require(m.source != "pretrained" or bool(m.path), "model.path is required when model.source=pretrained")
    _require(m.lora_rank >= 0, f"model.lora_rank must be >= 0, got {m.lora_rank}")
    _require(
        m.lora_rank == 0 or m.lora_alpha > 0,
        f"model.lora_alpha must be > 0 when model.lora_rank > 0, got {m.lora_alpha}",
    )
    _require(m.true_cfg_scale >= 1, f"model.true_cfg_scale must be >= 1, got {m.true_cfg_scale}")
    _require(
        m.max_sequence_length >= 1, f"model.max_sequence_length must be >= 1, got {m.max_sequence_length}"
    )
    _require(
        s.schedule in ("shift", "scheduler"), f"sampling.schedule must be shift|scheduler, got {s.schedule!r}"
    )
    _require(
        s.schedule == "shift" or m.source == "pretrained",
        f"sampling.schedule=scheduler needs model.source=pretrained (a diffusers scheduler), got {m.source!r}",
    )
    _require(s.num_steps >= 2, f"sampling.num_steps must be >= 2, got {s.num_steps}")
    _require(s.eval_num_steps >= 1, f"sampling.eval_num_steps must be >= 1, got {s.eval_num_steps}")
    _require(s.shift > 0, f"sampling.shift must be > 0, got {s.shift}")
    _require(
        s.latent_size >= 2 and s.latent_size % 2 == 0,
        f"sampling.latent_size must be even and >= 2, got {s.latent_size}",
    )
    _require(a.name in ALGORITHMS, f"algorithm.name must be one of {sorted(ALGORITHMS)}, got {a.name!r}")
    _require(
        a.sde_kind in SDE_KINDS and a.sde_kind != "ode",
        f"algorithm.sde_kind must be dance|flow_grpo|cps, got {a.sde_kind!r}",
    )
    _require(a.noise_level > 0, f"algorithm.noise_level must be > 0, got {a.noise_level}")
    _require(
        0 < a.timestep_fraction <= 1,
        f"algorithm.timestep_fraction must be in (0, 1], got {a.timestep_fraction}",
    )
    _require(a.clip_range > 0, f"algorithm.clip_range must be > 0, got {a.clip_range}")
    _require(a.adv_clip > 0, f"algorithm.adv_clip must be > 0, got {a.adv_clip}")
    _require(a.adv_std in ("group", "global"), f"algorithm.adv_std must be group|global, got {a.adv_std!r}")
    _require(a.kl_beta >= 0, f"algorithm.kl_beta must be >= 0, got {a.kl_beta}")
    _require(a.kl_std in KL_STD, f"algorithm.kl_std must be one of {list(KL_STD)}, got {a.kl_std!r}")
    ALGORITHMS[a.name].validate(a, s.num_steps)
    auto = isinstance(b.jagg_frac, str)
    _require(
        not auto or b.jagg_frac == "auto",
        f"backward.jagg_frac must be a number in [0, 1] or 'auto', got {b.jagg_frac!r}",
    )
    _require(
        not isinstance(b.group_size, str) or b.group_size == "auto",
        f"backward.group_size must be an integer >= 1 or 'auto', got {b.group_size!r}",
    )
    _require(
        b.group_size != "auto" or b.jagg_frac == "auto",
        "backward.group_size=auto chooses W by the measured routing: set backward.jagg_frac=auto too "
        f"(got jagg_frac={b.jagg_frac!r})",
    )
    _require(
        bool(b.group_sizes) and all(isinstance(w, int) and w >= 2 for w in b.group_sizes),
        f"backward.group_sizes must be a non-empty list of integers >= 2, got {b.group_sizes!r}",
    )
    try:  # the one routing validator (the engine's)
        for w in b.candidate_group_sizes:
            validate_routing(w, 1.0 if auto else b.jagg_frac, b.strategy, b.endpoints)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _require(-1.0 <= b.min_cosine <= 1.0, f"backward.min_cosine must be in [-1, 1], got {b.min_cosine}")
    _require(b.calibrate_every >= 1, f"backward.calibrate_every must be >= 1, got {b.calibrate_every}")
    _require(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _require(o.max_grad_norm > 0, f"optim.max_grad_norm must be > 0, got {o.max_grad_norm}")
    _require(0 <= o.ema_decay < 1, f"optim.ema_decay must be in [0, 1), got {o.ema_decay}")
    _require(
        len(o.betas) == 2 and all(0 <= x < 1 for x in o.betas),
        f"optim.betas must be two values in [0, 1), got {o.betas}",
    )
    for key in (
        "iterations",
        "prompts_per_iter",
        "images_per_prompt",
        "train_batch_size",
        "grad_accum",
        "max_consecutive_skips",
    ):
        _require(getattr(t, key) >= 1, f"train.{key} must be >= 1, got {getattr(t, key)}")
    _require(
        t.images_per_prompt >= 2,
        f"train.images_per_prompt must be >= 2 (group advantages), got {t.images_per_prompt}",
    )
    _require(
        t.precision in ("fp32", "bf16", "fp64"),
        f"train.precision must be fp32|bf16|fp64, got {t.precision!r}",
    )
    _require(
        t.control_cosine is None or 0 < t.control_cosine <= 1,
        f"train.control_cosine must be null or in (0, 1], got {t.control_cosine}",
    )
    _require(t.device in ("cpu", "cuda", "auto"), f"train.device must be cpu|cuda|auto, got {t.device!r}")
    _require(bool(cfg.reward.weights), "reward.weights must name at least one reward")
    trained_on = sorted(EVAL_ONLY & set(cfg.reward.weights))
    _require(
        not trained_on,
        f"reward.weights: {', '.join(trained_on)} is an eval-only judge (allowed in reward.eval only): "
        "a metric the policy trains on is no longer an independent check",
    )
    named = set(cfg.reward.weights) | set(cfg.reward.eval)
    extra = sorted(set(cfg.reward.kwargs) - named)
    _require(
        not extra, f"reward.kwargs: {extra[0] if extra else ''!r} is not a reward in reward.weights/eval"
    )
    _validate_data(cfg)
    for key in ("eval_every", "checkpoint_every", "grid_every"):
        _require(getattr(cfg.log, key) >= 0, f"log.{key} must be >= 0, got {getattr(cfg.log, key)}")
    _require(cfg.log.eval_prompts >= 1, f"log.eval_prompts must be >= 1, got {cfg.log.eval_prompts}")


def _validate_data(cfg: Config) -> None:
    d = cfg.data
    for key in ("train_limit", "eval_limit"):
        v = getattr(d, key)
        _require(v is None or v >= 1, f"data.{key} must be >= 1 or null, got {v}")
    for key in ("train_prompts", "eval_prompts"):
        _require(
            bool(getattr(d, key)), f"data.{key} must name a prompt file or dataset, got {getattr(d, key)!r}"
        )
    _require(
        cfg.model.source == "pretrained" or dataclasses.asdict(d) == dataclasses.asdict(DataConfig()),
        f"data.* is used only with model.source=pretrained (world/tiny use the world's prompts), "
        f"got model.source={cfg.model.source!r}",
    )


def validate_world_size(cfg: Config, world_size: int) -> None:
    """Multi-process runs split the global batch into whole micro-batches per rank (same count everywhere)."""
    t = cfg.train
    n = t.prompts_per_iter * t.images_per_prompt
    _require(
        world_size == 1 or n % (world_size * t.train_batch_size) == 0,
        f"train.prompts_per_iter * train.images_per_prompt = {n} must be a multiple of "
        f"world_size * train.train_batch_size = {world_size} * {t.train_batch_size} for multi-process runs",
    )
