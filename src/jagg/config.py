"""Typed training configuration: the ``Config`` of a run, YAML loading with inheritance, ``a.b=value`` overrides,
stored configs of earlier versions, checks.

A YAML file may name a parent with ``inherit: other.yaml`` (relative to itself); keys are merged recursively.
A key that was renamed (``RENAMED_KEYS``) is still read under its old name, in a file, an override and a run's
stored config (``current_keys``); a run's stored config, written by any earlier version, reads through
``stored_config`` (keys added since at their defaults). Every error is a ``ConfigError`` (``jagg.errors``)
naming the key and what is allowed; the CLI prints it as one line and exits 2 before anything is written.

A section is declared beside its owner where the owner sits below this module, with its defaults and checks:
``sampling``, ``algorithm`` and ``backward`` in ``jagg.engine.config`` (``backward`` composes the calibrators'
keys from ``jagg.engine.routing.CALIBRATIONS``), ``reward`` in ``jagg.rewards``, and ``plugins:`` composed here
from ``jagg.plugins.PLUGINS`` (each a ``PluginConfig`` beside its plug-in). The sections whose owners sit
above (model, optim, train, data, log) are declared here. Importing this module imports neither diffusers
nor the world; the reward names are checked by the composition root (``jagg.loop.components.check_config``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jagg.common import auto_field
from jagg.engine.config import AlgorithmConfig, BackwardConfig, SamplingConfig
from jagg.errors import ConfigError, require
from jagg.plugins import PLUGINS
from jagg.rewards import RewardConfig

# The adapters of ``jagg.models.BACKBONES``, named without importing them (they import diffusers); a test
# (tests/test_architecture.py) checks that the two agree.
BACKBONE_NAMES = ("flux", "qwenimage", "sd3", "wan")
# log.report_to: the experiment trackers of ``jagg.ops.trackers`` (imported there only when named).
TRACKER_NAMES = ("tensorboard", "wandb")
# train.seed's largest value: jagg.common.generator seeds with seed * 1_000_003 + offsets, which must stay
# inside torch's 64-bit seed range (the usual 32-bit seeds leave ample room)
MAX_SEED = 2**32 - 1
# train.sdpa_kernels: torch's scaled-dot-product-attention kernels, by their torch.backends.cuda flag names
SDPA_KERNELS = ("flash", "mem_efficient", "cudnn", "math")

# The one definition of a tiny run (tests, smoke modes of the drivers, notebooks): overrides on top of any world
# config. TINY_OVERRIDES makes it need no `make pretrain`: random-init world backbones (model.source=tiny) scored
# by the JPEG reward (the world rewards need the pretrained cache). TINY_RUN adds the smallest batch
# (TINY_BATCH: one iteration of 2 prompts x 2 images in one micro-batch, no evaluation). Later overrides win, so a
# caller appends what it needs to differ, e.g. ``load_config(path, [*TINY_RUN, "sampling.num_steps=4"])``.
TINY_OVERRIDES = ("model.source=tiny", "reward.weights={jpeg: 1.0}", "reward.eval=[jpeg]")
# The gradient-geometry experiments' plain DanceGRPO loss (make cosine, make knots): the paper-scale eta 0.3, the
# pref reward, per-group advantages, no KL, no EMA, so their numbers do not move when the world recipe is re-tuned.
PLAIN_DANCEGRPO_LOSS = (
    "algorithm.noise_level=0.3",
    "reward.weights={pref: 1.0}",
    "algorithm.kl_beta=0.0",
    "algorithm.adv_std=group",
    "algorithm.init_same_noise=false",
    "optim.ema_decay=0.0",
)
TINY_BATCH = (
    "train.iterations=1",
    "train.prompts_per_iter=2",
    "train.images_per_prompt=2",
    "train.train_batch_size=4",
    "log.eval_every=0",
)
TINY_RUN = (*TINY_OVERRIDES, *TINY_BATCH)
# A paper config on a tiny random-init pipeline folder of the real classes (jagg.scale.tiny_pipeline) on the CPU:
# its recipe kept (precision, checkpointing, LoRA, CFG, schedule, SDE, KL), the paper's rewards (they need their
# weights) replaced by JPEG, T5 shortened. ``tiny_pipeline_overrides`` adds the folder and the prompts file.
TINY_PIPELINE = (
    "model.max_sequence_length=16",
    "train.device=cpu",
    "reward.weights={jpeg: 1.0}",
    "reward.eval=[jpeg]",
    "reward.kwargs={}",
    "data.eval_limit=null",
)


def tiny_pipeline_overrides(pipeline: str | Path, prompts: str | Path) -> list[str]:
    """``TINY_PIPELINE`` with ``model.path`` = the tiny pipeline folder and ``prompts`` (a file, one prompt a
    line) for training and evaluation."""
    return [
        *TINY_PIPELINE,
        f"model.path={pipeline}",
        f"data.train_prompts={prompts}",
        f"data.eval_prompts={prompts}",
    ]


@dataclass(kw_only=True)
class ModelConfig:
    backbone: str = "flux"  # flux | qwenimage | sd3 | wan (SD3 / SD3.5: model.source=pretrained only; wan on
    # model.source=world|tiny is the video world's tiny Wan)
    # world (embedded default, `make pretrain`) | tiny (random init) | pretrained (hub/path)
    source: str = "world"
    path: str | None = None  # hub id or local directory for source=pretrained
    guidance_scale: float = 3.5  # Flux embedded guidance
    # Qwen-Image / SD3 / Wan true CFG (> 1 needs a negative prompt; SD3.5 in Flow-GRPO: 4.5)
    true_cfg_scale: float = 1.0
    # Wan2.2-A14B's low-noise expert's CFG scale (WanPipeline's guidance_scale_2); null = true_cfg_scale
    true_cfg_scale_2: float | None = None
    gradient_checkpointing: bool = False
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 0.0
    lora_targets: list[str] = field(default_factory=list)  # empty = backbone default
    # Under FSDP2 (several processes): true = the frozen LoRA base is sharded per block like everything else
    # (all-gathered at every forward); false (LoRA only) = it stays replicated on every rank in the compute
    # dtype and only the adapters are sharded and reduced, as Flow-GRPO trains LoRA (docs/decisions.md)
    shard_frozen_base: bool = True
    # Qwen-Image true CFG (used when true_cfg_scale > 1), as the Qwen-Image pipeline
    negative_prompt: str = " "
    max_sequence_length: int = 512  # text tokens: Flux T5 padding length, Qwen-Image truncation
    # the dtype the frozen transformer weights (the LoRA base; all of it before LoRA) and the VAE are loaded
    # and kept in: compute = train.precision's (bf16 at paper scale); fp32 = Flow-GRPO's SD3 trainer, whose
    # transformer and VAE stay fp32 with the matmuls under autocast (jagg.scale.placement.weights_dtype)
    base_dtype: str = "compute"


# Keys that were renamed, old -> new (dotted). Files, overrides and the configs stored in run.json and checkpoints
# (``current_keys``) still name them the old way; both names at once is an error.
RENAMED_KEYS = {
    "backward.endpoints": "backward.graph_mode",
    "backward.reuse_rollout": "backward.stored_outputs",
    "train.control_cosine": "plugins.control.cosine",
    "train.control_direction": "plugins.control.direction",
    "train.control_structure": "plugins.structured_control.kind",
    "train.control_dial": "plugins.structured_control.dial",
    "log.fidelity_every": "plugins.fidelity.every",
    "log.landing": "plugins.landing.enabled",
    "log.save_eval_state": "plugins.eval_state.enabled",
}
# Keys that were removed, with the value the code now always behaves as. A stored config (run.json, a
# checkpoint) holding that value reads as if the key were absent; another value is a real change of behaviour,
# which a resume reports like any other.
REMOVED_KEYS: dict[str, Any] = {}


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    ema_decay: float = 0.0  # 0 = no EMA
    # the EMA's cadence (jagg.scale.optimizer.ema_decay_at; Flow-GRPO's EMAModuleWrapper): updated after
    # optimizer steps k-1, 2k-1, ... (every step for k = 1); warm-up: decay min((1 + s) / (10 + s), ema_decay)
    # at step s; repeats: r applications on the same weights at each update (decay ** r)
    ema_every: int = 1
    ema_warmup: bool = False
    ema_repeats: int = 1
    # fused AdamW (one kernel, no step temporaries) instead of torch's default foreach; jagg.scale.optimizer
    fused: bool = False


@dataclass(kw_only=True)
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
    # seconds any collective (barriers included) may wait under torchrun: rank 0 alone loads the weights,
    # precomputes embeddings, exports or writes a slow checkpoint while the others wait (NCCL default: 10 min)
    dist_timeout_s: int = 3600
    # the attention (SDPA) kernels a CUDA run may use (torch.backends.cuda.enable_<name>_sdp), a subset of
    # SDPA_KERNELS; null: torch's own choice. The paper configs leave cuDNN out: on torch 2.11 / H200 its
    # backward failed in the first Flux update ("mha_graph.execute", then an illegal memory access:
    # results/gpu/README.md)
    sdpa_kernels: list[str] | None = None


@dataclass(kw_only=True)
class DataConfig:
    """Prompts and text-embedding cache for model.source=pretrained (the world sources use the world's own)."""

    train_prompts: str = "hpdv2_train"  # local file or a name in jagg.scale.prompts.PROMPT_DATASETS
    eval_prompts: str = "hpdv2_test"
    train_limit: int | None = None  # first N prompts (None = all)
    eval_limit: int | None = None
    embedding_cache: str | None = None  # directory of per-prompt embedding files (shared by all ranks)
    precompute_embeddings: bool = False  # encode every prompt up front, then free the text encoders


@dataclass(kw_only=True)
class LogConfig:
    run_dir: str = "runs/default"
    eval_every: int = 10  # iterations; 0 = never
    # also evaluate after exactly these iterations (0 = the base model): a schedule at fractions of a run whose
    # length is not a multiple of one cadence (experiments/curves.py's equal-cost arms)
    eval_at: list[int] = field(default_factory=list)
    eval_prompts: int = 24
    eval_images_per_prompt: int = 1
    checkpoint_every: int = 10  # iterations; 0 = only at the end
    # 1 | 2: also keep the previous checkpoint (checkpoint.prev/), which --resume falls back to, with a warning,
    # when the newest fails its size / SHA-256 check (one more checkpoint's worth of disk at rest)
    keep_checkpoints: int = 1
    # write a checkpoint's shards in the background (DCP async_save: the state is first copied to CPU memory,
    # then written while training goes on; the save becomes the checkpoint only once complete, as a synchronous
    # one); auto (null in the dataclass): on CUDA, where the copy is fast and the write is not. Costs host memory
    # for this rank's share of a checkpoint while it is written.
    async_checkpoint: bool | None = auto_field(None, "true, false or 'auto'")
    grid_every: int = 0  # sample grid PNG every N iterations (0 = with each eval)
    report_to: list[str] = field(default_factory=list)  # trackers fed the metrics rows: tensorboard | wandb
    # also score every training batch with the eval rewards (reward_<name>_mean of reward.eval in the metrics);
    # off: the eval reward models (HPSv2.1, PickScore, CLIPScore at paper scale) run at evaluations only
    eval_rewards_on_train: bool = False
    # jagg.ops.heartbeat: a log line per rank every heartbeat_s a phase lasts (rollout, reward, update,
    # checkpoint, ...); every thread's stack to run_dir/hang_rank<r>.txt once one lasts phase_timeout_s; 0 = off
    heartbeat_s: float = 300.0
    phase_timeout_s: float = 1800.0

    def writes_async(self, device_type: str) -> bool:
        """Whether checkpoints are written in the background on a ``device_type`` ("cuda" / "cpu") run."""
        return device_type == "cuda" if self.async_checkpoint is None else self.async_checkpoint


# plugins: one section per plug-in with keys, composed from the registry (jagg.plugins.PLUGINS): each plug-in
# declares its keys, defaults and checks beside it (a PluginConfig), so a new one changes nothing here
PluginsConfig = dataclasses.make_dataclass(
    "PluginsConfig",
    [(p.name, p.CONFIG, field(default_factory=p.CONFIG)) for p in PLUGINS if p.CONFIG is not None],
    kw_only=True,
)


@dataclass(kw_only=True)
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
    plugins: PluginsConfig = field(default_factory=PluginsConfig)

    def to_dict(self) -> dict:
        """The config as YAML would write it (``auto`` where a field is decided at run time)."""
        return _as_yaml(self)


def _as_yaml(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _as_yaml(value)
        elif value is None and "auto" in f.metadata:
            value = "auto"
        out[f.name] = copy.deepcopy(value)
    return out


# --------------------------------------------------------------------------- loading
def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a YAML config, resolving ``inherit:`` chains (paths relative to the including file); a file that
    inherits from itself, directly or through others, is a ``ConfigError`` naming the cycle."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    if path.resolve() in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path.resolve()))
        raise ConfigError(f"config: inherit: cycle {cycle}")
    data = _safe_load(_read_text(path), f"config: {path}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must be a mapping")
    data = current_keys(data, f"config: {path}")
    parent = data.pop("inherit", None)
    if parent is not None and not isinstance(parent, str):
        raise ConfigError(f"config: {path}: inherit must be a file name, got {parent!r}")
    return _merge(load_yaml(path.parent / parent, (*_chain, path.resolve())), data) if parent else data


def _read_text(path: Path) -> str:
    """The file's text; unreadable (permissions, an I/O error) or not UTF-8 (a binary file, another encoding) is
    one ``ConfigError`` line naming the file, not a traceback."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config: {path} is not a UTF-8 text file (byte {err.start}: {err.reason}); give a YAML file"
        ) from None
    except OSError as err:
        raise ConfigError(f"config: {path} cannot be read ({err.strerror or err})") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``backward.strategy=exact`` -> (["backward", "strategy"], "exact") with YAML typing of the value; a
    renamed key under its current name (``backward.endpoints=joint`` -> ``backward.graph_mode``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    return RENAMED_KEYS.get(key, key).split("."), _safe_load(value, f"override {text!r}")


def current_keys(data: dict, where: str = "config") -> dict:
    """A copy of the config mapping ``data`` (a YAML file, run.json's or a checkpoint's ``config``) with every
    renamed key (``RENAMED_KEYS``, any depth, also into another section) under its current name, so that old
    files and runs read as they did; ``ConfigError`` where one mapping gives both names."""
    out = copy.deepcopy(data)
    for old, new in RENAMED_KEYS.items():
        *path, old_name = old.split(".")
        node = _node(out, path)
        if node is None or old_name not in node:
            continue
        *new_path, new_name = new.split(".")
        target = _node(out, new_path, create=True)
        if target is None or new_name in target:
            raise ConfigError(f"{where}: {old} is the old name of {new}; give one of them, not both")
        target[new_name] = node.pop(old_name)
        if not node and path:  # a section emptied by the move is not a key of its own
            _node(out, path[:-1]).pop(path[-1])
    return out


def _node(data: dict, path: list[str], create: bool = False) -> dict | None:
    """The mapping at ``path`` in ``data`` (created empty where missing and ``create``); None where absent or
    where something on the way is not a mapping."""
    for name in path:
        if create and name not in data:
            data[name] = {}
        data = data.get(name)
        if not isinstance(data, dict):
            return None
    return data


def stored_config(data: dict, where: str = "config") -> dict:
    """A run's stored config (run.json's or a checkpoint's ``config``, written by any earlier version) as the
    current code reads it: a renamed key under its new name (``current_keys``), a key added since (absent
    there) at its default, and a removed key (``REMOVED_KEYS``) dropped where it holds the value the code now
    always behaves as. Everything else is kept as stored, so a comparison with ``Config.to_dict()`` shows only
    values that really differ."""
    data = current_keys(data, where)
    for key, value in REMOVED_KEYS.items():
        *path, name = key.split(".")
        node = _node(data, path)
        if node is not None and name in node and node[name] == value:
            node.pop(name)
    return _with_defaults(json_safe(Config().to_dict()), data)


def _with_defaults(defaults: dict, stored: dict, cls: type = None) -> dict:
    """``stored`` over ``defaults``, section by section of the dataclass ``cls`` (``Config``); a value, a
    mapping such as reward.weights included, is taken whole from ``stored`` where it is there."""
    hints = typing.get_type_hints(cls or Config)
    out = dict(stored)
    for key, default in defaults.items():
        if key not in stored:
            out[key] = default
        elif dataclasses.is_dataclass(hints.get(key)) and isinstance(stored[key], dict):
            out[key] = _with_defaults(default, stored[key], hints[key])
    return out


def known_keys(cls: type = None, prefix: str = "") -> frozenset[str]:
    """Every dotted config key of ``cls`` (``Config``): ``optim.lr``, ``reward.weights`` (a mapping value is one
    key)."""
    out: set[str] = set()
    for name, tp in typing.get_type_hints(cls or Config).items():
        key = f"{prefix}{name}"
        out |= known_keys(tp, key + ".") if dataclasses.is_dataclass(tp) else {key}
    return frozenset(out)


def json_safe(data: dict) -> dict:
    """``data`` as it reads back from JSON (run.json), for comparing with a stored config."""
    return json.loads(json.dumps(data, default=str))


def _safe_load(text: str, where: str) -> Any:
    """``yaml.safe_load``; a syntax error becomes one ``ConfigError`` line naming ``where``, line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error{at}: {problem}") from None


def type_name(tp) -> str:
    """How a config message names an annotation: ``int``, ``float or 'auto'``, ``list of int``, ``int or null``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping to {type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def unknown_key_message(key: str, allowed: list[str]) -> str:
    """``unknown key backward.strategi (did you mean backward.strategy?); allowed: [...]``, by difflib."""
    prefix, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    hint = f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""
    return f"unknown key {key}{hint}; allowed: {sorted(allowed)}"


def _coerce(key: str, tp, value):
    """Check ``value`` against the annotation ``tp`` (int -> float is allowed); return the value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        for a in args:  # the first type that accepts the value
            try:
                return _coerce(key, a, value)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
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
    if tp is float and not isinstance(value, bool) and isinstance(value, int | float | str):
        try:  # int -> float; PyYAML reads "1e-3" (no dot) as a string
            number = float(value)
        except (ValueError, OverflowError):
            number = None
        if number is not None and not math.isfinite(number):  # .inf / nan pass every `x > 0` check
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        if number is not None:
            return number
    if tp is bool and not isinstance(value, bool) or tp is not bool and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if tp is int and not -(2**63) <= value < 2**63:  # every count ends up in a 64-bit tensor or seed
        raise ConfigError(f"{key} must be a 64-bit integer (below 2^63 in magnitude), got {value}")
    return value


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    auto = {f.name: f.metadata["auto"] for f in dataclasses.fields(cls) if "auto" in f.metadata}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(unknown_key_message(where + unknown[0], sorted(names)))
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping")
            kwargs[name] = _build(tp, value, key)
        elif name in auto:  # `auto` -> None (decided at run time); anything else must be the other type
            kwargs[name] = None if value == "auto" else _not_auto(key, tp, value, auto[name])
        else:
            kwargs[name] = _coerce(key, tp, value)
    return cls(**kwargs)


def _not_auto(key: str, tp, value, allowed: str):
    """``value`` of an ``auto`` field that is not ``auto``: checked against the non-None type of ``tp``."""
    (concrete,) = [a for a in typing.get_args(tp) if a is not type(None)]
    try:
        if value is None:
            raise ConfigError(key)
        return _coerce(key, concrete, value)
    except ConfigError:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}") from None


def paper_config_paths(root: str | Path = ".") -> list[Path]:
    """Every paper run config under ``root``: configs/paper/**/<backbone>_<recipe>.yaml, sorted (SD3.5-M's in
    configs/paper/sd3/; base.yaml, which they inherit, is not a run)."""
    return sorted(Path(root, "configs", "paper").glob("**/*_*.yaml"))


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
    # ~ in log.run_dir means the home directory, as in the data.* paths (jagg.scale.prompts expands them with
    # os.path.expanduser): expanded here, once, so the directory, the lock and run.json all see the same path
    cfg.log.run_dir = os.path.expanduser(cfg.log.run_dir)
    return cfg


# --------------------------------------------------------------------------- validation
def validate(cfg: Config) -> None:
    """Range and consistency checks; each failure names the key and the allowed range.

    Only what this layer can check from the engine's registries and static name tuples: reward names need
    the full reward registry and are checked by the composition root (``jagg.loop.components.check_config``).
    """
    model, sampling = cfg.model, cfg.sampling
    _validate_model(model)
    sampling.validate(model)
    cfg.algorithm.validate(sampling, cfg.backward)
    cfg.backward.validate()
    _validate_optim(cfg.optim)
    _validate_train(cfg.train)
    require(
        model.base_dtype == "compute" or cfg.train.precision in ("bf16", "fp32"),
        f"model.base_dtype=fp32 needs train.precision bf16 or fp32, got {cfg.train.precision!r}",
    )
    cfg.reward.validate()
    _validate_data(cfg)
    for plugin in PLUGINS:  # each plug-in's own checks (jagg.plugins.base.PluginConfig.validate)
        if plugin.CONFIG is not None:
            getattr(cfg.plugins, plugin.name).validate(cfg)
    for key in ("eval_every", "checkpoint_every", "grid_every", "heartbeat_s", "phase_timeout_s"):
        require(getattr(cfg.log, key) >= 0, f"log.{key} must be >= 0, got {getattr(cfg.log, key)}")
    bad_at = [i for i in cfg.log.eval_at if not (isinstance(i, int) and 0 <= i <= cfg.train.iterations)]
    require(
        not bad_at,
        f"log.eval_at: {bad_at[0] if bad_at else ''!r} is not an iteration in [0, train.iterations = "
        f"{cfg.train.iterations}]",
    )
    require(
        bool(cfg.log.run_dir) and "\0" not in cfg.log.run_dir,
        f"log.run_dir must be a non-empty path without NUL bytes, got {cfg.log.run_dir!r}",
    )
    require(cfg.log.eval_prompts >= 1, f"log.eval_prompts must be >= 1, got {cfg.log.eval_prompts}")
    require(
        cfg.log.keep_checkpoints in (1, 2),
        f"log.keep_checkpoints must be 1 or 2, got {cfg.log.keep_checkpoints}",
    )
    bad = [name for name in cfg.log.report_to if name not in TRACKER_NAMES]
    require(
        not bad, f"log.report_to: unknown tracker {bad[0] if bad else ''!r}; allowed: {list(TRACKER_NAMES)}"
    )


def _validate_model(model: ModelConfig) -> None:
    require(
        model.backbone in BACKBONE_NAMES,
        f"model.backbone must be one of {sorted(BACKBONE_NAMES)}, got {model.backbone!r}",
    )
    require(
        model.source in ("world", "tiny", "pretrained"),
        f"model.source must be world|tiny|pretrained, got {model.source!r}",
    )
    require(
        model.source != "pretrained" or bool(model.path),
        "model.path is required when model.source=pretrained",
    )
    require(
        model.backbone != "sd3" or model.source == "pretrained",
        f"model.backbone={model.backbone} needs model.source=pretrained (the embedded world has no "
        f"{model.backbone} backbone), "
        f"got {model.source!r}",
    )
    require(
        model.true_cfg_scale_2 is None or model.true_cfg_scale_2 >= 1,
        f"model.true_cfg_scale_2 must be null or >= 1, got {model.true_cfg_scale_2}",
    )
    require(model.lora_rank >= 0, f"model.lora_rank must be >= 0, got {model.lora_rank}")
    require(
        model.lora_rank == 0 or model.lora_alpha > 0,
        f"model.lora_alpha must be > 0 when model.lora_rank > 0, got {model.lora_alpha}",
    )
    require(
        model.shard_frozen_base or model.lora_rank > 0,
        "model.shard_frozen_base=false needs a frozen base to replicate: set model.lora_rank > 0 "
        f"(got lora_rank={model.lora_rank}) or model.shard_frozen_base=true",
    )
    require(model.true_cfg_scale >= 1, f"model.true_cfg_scale must be >= 1, got {model.true_cfg_scale}")
    require(
        model.base_dtype in ("compute", "fp32"),
        f"model.base_dtype must be compute|fp32, got {model.base_dtype!r}",
    )
    require(
        model.max_sequence_length >= 1,
        f"model.max_sequence_length must be >= 1, got {model.max_sequence_length}",
    )


def backward_config(data: dict, prefix: str = "backward") -> BackwardConfig:
    """A ``backward`` section given as a mapping (an engine's config, e.g. UniRL's ``algorithm.backward``), read
    and checked as a run's: a ``ConfigError`` naming ``prefix.key`` for an unknown key or a bad value."""
    backward = _build(BackwardConfig, dict(data), prefix)
    backward.validate()
    return backward


def _validate_optim(optim: OptimConfig) -> None:
    require(optim.lr > 0, f"optim.lr must be > 0, got {optim.lr}")
    require(optim.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    require(optim.max_grad_norm > 0, f"optim.max_grad_norm must be > 0, got {optim.max_grad_norm}")
    require(0 <= optim.ema_decay < 1, f"optim.ema_decay must be in [0, 1), got {optim.ema_decay}")
    for key in ("ema_every", "ema_repeats"):
        require(getattr(optim, key) >= 1, f"optim.{key} must be >= 1, got {getattr(optim, key)}")
    require(
        len(optim.betas) == 2 and all(0 <= x < 1 for x in optim.betas),
        f"optim.betas must be two values in [0, 1), got {optim.betas}",
    )


def _validate_train(train: TrainConfig) -> None:
    require(
        0 <= train.seed <= MAX_SEED,
        f"train.seed must be in [0, {MAX_SEED}] (it seeds torch generators), got {train.seed}",
    )
    require(
        train.sdpa_kernels is None
        or (bool(train.sdpa_kernels) and set(train.sdpa_kernels) <= set(SDPA_KERNELS)),
        f"train.sdpa_kernels must be null or a non-empty list from {list(SDPA_KERNELS)}, got {train.sdpa_kernels!r}",
    )
    for key in (
        "iterations",
        "prompts_per_iter",
        "images_per_prompt",
        "train_batch_size",
        "grad_accum",
        "max_consecutive_skips",
        "dist_timeout_s",
    ):
        require(getattr(train, key) >= 1, f"train.{key} must be >= 1, got {getattr(train, key)}")
    require(
        train.images_per_prompt >= 2,
        f"train.images_per_prompt must be >= 2 (group advantages), got {train.images_per_prompt}",
    )
    require(
        train.precision in ("fp32", "bf16", "fp64"),
        f"train.precision must be fp32|bf16|fp64, got {train.precision!r}",
    )
    require(
        train.device in ("cpu", "cuda", "auto"), f"train.device must be cpu|cuda|auto, got {train.device!r}"
    )


def _validate_data(cfg: Config) -> None:
    data = cfg.data
    for key in ("train_limit", "eval_limit"):
        limit = getattr(data, key)
        require(limit is None or limit >= 1, f"data.{key} must be >= 1 or null, got {limit}")
    for key in ("train_prompts", "eval_prompts"):
        require(
            bool(getattr(data, key)),
            f"data.{key} must name a prompt file or dataset, got {getattr(data, key)!r}",
        )
    require(
        cfg.model.source == "pretrained" or dataclasses.asdict(data) == dataclasses.asdict(DataConfig()),
        f"data.* is used only with model.source=pretrained (world/tiny use the world's prompts), "
        f"got model.source={cfg.model.source!r}",
    )


def validate_world_size(cfg: Config, world_size: int) -> None:
    """Multi-process runs split the global batch into whole micro-batches per rank (same count everywhere)."""
    train = cfg.train
    n = train.prompts_per_iter * train.images_per_prompt
    require(
        world_size == 1 or n % (world_size * train.train_batch_size) == 0,
        f"train.prompts_per_iter * train.images_per_prompt = {n} must be a multiple of "
        f"world_size * train.train_batch_size = {world_size} * {train.train_batch_size} for multi-process runs",
    )
