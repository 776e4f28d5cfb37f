"""``python -m jagg.scale.weights_check --config C [key=value ...]``: every checkpoint a config loads, checked
against its model before a GPU is booked; no weights are read into memory and nothing is downloaded.

For a ``model.source: pretrained`` config, each model the run loads (the transformer, the text encoders, the VAE,
every train / eval reward: HPSv2.1, PickScore, CLIPScore, ImageReward, HPSv3) is built on the meta device from
its own config (the folder's ``config.json``; open_clip's architecture for HPSv2.1; ``med_config.json`` for
ImageReward; the Qwen2-VL base's config and processor for HPSv3), and its checkpoint files are compared with it
key by key and shape by shape: safetensors files through their JSON header alone, ``.bin`` / ``.pt`` files
through ``torch.load(mmap=True, weights_only=True)`` (memory-mapped: tensor bytes are not read). Files come from
``model.path`` / ``reward.kwargs`` when local, else from the hub cache only (``local_files_only``). A reward it
has no files to check for (the JPEG rewards, the embedded world's judges, a reward it has no rule for) is listed
as ``not checked`` with the reason; tokenizers and processors are not checked (HPSv3's processor is read, since
the model's vocabulary depends on it).

The comparison is strict, stricter than the libraries' loaders (which warn and initialise a missing key at
random): every key of the model must be in a file, with the model's shape, and every key of the files must belong
to the model. The loaders' own rules are applied first, so a checkpoint they load exactly passes: transformers'
key renamings (``get_model_conversion_mapping``), its tied weights (which may be absent) and its ignore patterns,
diffusers' ``_keys_to_ignore_on_load_unexpected``, HPSv2's ``state_dict`` nesting and DDP ``module.`` prefix,
ImageReward's and HPSv3's key conversions (``convert_imagereward_state_dict``, ``convert_hpsv3_state_dict``: the
BLIP weights ImageReward drops are ignored). A truncated safetensors file (shorter than its header says), a file
the index names but the folder lacks, and a floating weight stored as integers fail too; a single-file
(original-format) checkpoint where the loader reads diffusers' folders is named as such. Each failure names the
model, the file, and up to ``SHOWN`` keys per kind.

Dtypes: each model states the dtypes its files store and the ones the loader builds or casts to
(``jagg.scale.pretrained.load_dtype`` for the pipeline, with the libraries' keep-in-float32 modules; a reward's
``dtype``, its head in float32). A note, not a failure, where the difference matters: weights stored in less
precision than they are built in (bf16 in an fp32 model: the values keep bf16's precision), or cast to a dtype
with a smaller range (fp32 or bf16 into fp16: values past 65504 become inf). A cast down to the configured dtype
within its range (fp32 to bf16) is the configuration's choice and is not noted.

Exit status: 0 every model checked passes, 1 some failed (the report says which and where), 2 a bad config (one
line).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from jagg.config import Config
from jagg.errors import ConfigError, WeightsUnavailableError
from jagg.scale.hub import looks_like_local_path, unavailable_message

SHOWN = 5  # keys listed per kind and file
WEIGHT_NAMES = (
    "model",
    "diffusion_pytorch_model",
    "pytorch_model",
)  # file stems diffusers / transformers save
SINGLE_FILE = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin")  # original-format checkpoint suffixes
# rewards without files to check, and why (any other reward the checker has no rule for is "not checked" too)
NOT_CHECKED = {
    "jpeg": "no weights: the JPEG size of the image",
    "jpeg_incompressibility": "no weights: the JPEG size of the image",
    "attr_geom": "no weights: read from the embedded world's render geometry",
    "render_match": "no weights: the distance to the embedded world's own clean renders",
    "temporal": "no weights: differences of consecutive frames",
    **dict.fromkeys(("motion_geom", "video_geom"), "no weights: read from the video world's clip geometry"),
    **dict.fromkeys(
        ("clip", "pref", "attr", "attr_soft", "attr_judge", "video_pref")
        + ("frames_pref", "frames_clip", "frames_attr", "frames_attr_soft"),
        "the embedded world's own model (its artefact cache, make pretrain), not a checkpoint of files",
    ),
}
DTYPE_NAMES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}  # reward.kwargs.<r>.dtype
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Stored(NamedTuple):
    """One tensor of a checkpoint file as its header (or memory-mapped pickle) describes it."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype this table does not know (compared as unknown)


Shapes = dict[str, tuple[int, ...]]
Tensors = dict[str, Stored]


@dataclass(frozen=True)
class Spec:
    """One model of a run: what it is, where its files are, how to build it on the meta device, and in which
    dtype the loader builds it. ``skip``: a model the check cannot look at, and why (reported, not failed)."""

    what: str  # "flux transformer", "hpsv2 reward", ...
    source: str  # hub id or local path, as configured
    subfolder: str | None  # pipeline subfolder (transformer/, vae/, text_encoder/, ...)
    library: str  # "diffusers" | "transformers" | "open_clip" | "imagereward" | "hpsv3" | "" (skipped)
    cls: type | None = None  # the model class (diffusers / transformers)
    filename: str | None = None  # one named file (the rewards' checkpoints)
    arch: str | None = None  # open_clip architecture name
    key: str = ""  # the config key that sets ``source`` (named in the hints)
    dtype: torch.dtype | None = None  # the loader's dtype for floating weights (None: the class's own)
    extra: dict = field(default_factory=dict)  # ImageReward: med_config, vision; HPSv3: base
    skip: str = ""


@dataclass
class Problems:
    """What is wrong in one file (or, for ``missing``, the file or index that should hold the keys)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)  # "key: file (a, b) vs model (c, d)"
    mis_typed: list[str] = field(default_factory=list)  # "key: file int8 vs model float32"
    broken: str = ""  # truncated, unreadable, named in the index but absent

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mis_shaped or self.mis_typed or self.broken)

    def line(self) -> str:
        parts = [self.broken] if self.broken else []
        for name, keys in (("missing", self.missing), ("unexpected", self.unexpected)):
            if keys:
                parts.append(f"{len(keys)} {name} ({_shown(keys)})")
        for name, keys in (("mis-shaped", self.mis_shaped), ("mis-typed", self.mis_typed)):
            if keys:
                parts.append(f"{len(keys)} {name} ({_shown(keys)})")
        return "; ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


def _shown(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(sorted(items)[:SHOWN]) + (f", +{more} more" if more > 0 else "")


def dtype_name(dtype: torch.dtype | None) -> str:
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return "unknown" if dtype is None else short.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class Report:
    """The result of one model: where it was looked for, per-file problems, the dtypes stored and built, or why
    it could not be checked (``error``: a failure; ``skipped``: not checked, with the reason)."""

    spec: Spec
    where: str = ""
    files: dict[str, Problems] = field(default_factory=dict)
    tensors: int = 0
    parameters: int = 0
    error: str = ""
    skipped: str = ""
    stored: set[str] = field(default_factory=set)  # floating dtypes in the files
    built: set[str] = field(default_factory=set)  # floating dtypes the loader builds
    notes: list[str] = field(default_factory=list)  # dtype differences that matter

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.error and not any(self.files.values())

    def lines(self) -> list[str]:
        status = "not checked" if self.skipped else "ok" if self.ok else "FAILED"
        head = f"  {status:<11} {self.spec.what:<28}"
        if self.skipped or self.error:
            return [f"{head} {self.skipped or self.error}"]
        notes = [f"              note: {n}" for n in self.notes]
        if self.ok:
            n = len(self.files)
            dtypes = f"; stored {'+'.join(sorted(self.stored)) or '-'}, built {'+'.join(sorted(self.built)) or '-'}"
            return [
                f"{head} {self.where}: {n} file{'s' * (n != 1)}, {self.tensors} tensors, "
                f"{_count(self.parameters)} values, every key and shape matches{dtypes}"
            ] + notes
        bad = [f"              {f}: {p.line()}" for f, p in self.files.items() if p]
        return [f"{head} {self.where}"] + bad + notes


# --------------------------------------------------------------------------- which models a config loads
def _default(fn: Callable, name: str):
    """A constructor's default (hub id / file name / dtype), read from its signature rather than copied here."""
    return inspect.signature(fn).parameters[name].default


def model_specs(cfg: Config) -> list[Spec]:
    """Every model a ``model.source: pretrained`` run of ``cfg`` loads, in load order."""
    from jagg.models import BACKBONES
    from jagg.scale.pretrained import PIPELINE_PARTS, PRETRAINED_IDS, load_dtype, part_class

    m = cfg.model
    if m.source != "pretrained":
        raise ConfigError(
            f"model.source={m.source}: the weights check is for model.source=pretrained configs"
        )
    repo = m.path or PRETRAINED_IDS[m.backbone]
    specs = [
        Spec(
            f"{m.backbone} transformer",
            repo,
            "transformer",
            "diffusers",
            BACKBONES[m.backbone].transformer_cls,
            key="model.path",
            dtype=load_dtype(cfg, "transformer"),
        )
    ]
    if m.backbone == "wan" and wan_experts(repo) > 1:  # Wan2.2-A14B's low-noise expert, the same class
        second = dataclasses.replace(specs[0], what="wan transformer_2", subfolder="transformer_2")
        specs.append(second)
    for sub, (library, _) in PIPELINE_PARTS[m.backbone].items():
        if not sub.startswith("tokenizer"):
            cls = part_class(m.backbone, sub)
            dtype = load_dtype(cfg, sub)
            specs.append(Spec(f"{m.backbone} {sub}", repo, sub, library, cls, key="model.path", dtype=dtype))
    return specs + reward_specs(cfg)


def wan_experts(repo: str) -> int:
    """Experts of the Wan pipeline at ``repo``: a local folder's model_index.json says (``transformer_2``), else the
    published pipeline its id names (``jagg.scale.architectures.known_wan``: 2 for Wan2.2-T2V-A14B)."""
    from jagg.scale.architectures import known_wan

    index = Path(repo).expanduser() / "model_index.json"
    if index.is_file():
        return 2 if (json.loads(index.read_text()).get("transformer_2") or [None])[0] is not None else 1
    return known_wan(repo).experts


def reward_specs(cfg: Config) -> list[Spec]:
    """Every reward among ``reward.weights`` and ``reward.eval`` (with its ``reward.kwargs``): a Spec to check,
    or one that says why it is not checked."""
    out = []
    for name in dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]):
        kw = cfg.reward.kwargs.get(name, {})
        rule = REWARD_RULES.get(name)
        if rule is not None:
            out.append(rule(name, kw))
        else:
            why = NOT_CHECKED.get(name, "the weights check has no rule for this reward's files")
            out.append(Spec(f"{name} reward", "", None, "", skip=why))
    return out


def _reward_dtype(kw: dict, default: torch.dtype) -> torch.dtype:
    """``reward.kwargs.<name>.dtype`` by name (``jagg.loop.rewards.REWARD_DTYPES``), else the reward's default."""
    dtype = kw.get("dtype", default)
    return DTYPE_NAMES[dtype] if isinstance(dtype, str) else dtype


def _hpsv2_spec(name: str, kw: dict) -> Spec:
    from jagg.scale.rewards import HPSv2Reward, _ClipReward

    init = HPSv2Reward.__init__
    return Spec(
        "hpsv2 reward",
        kw.get("checkpoint", _default(init, "checkpoint")),
        None,
        "open_clip",
        filename=kw.get("filename", _default(init, "filename")),
        arch=kw.get("arch", _default(init, "arch")),
        key="reward.kwargs.hpsv2.checkpoint",
        dtype=_reward_dtype(kw, _default(_ClipReward.__init__, "dtype")),
    )


def _clip_spec(name: str, kw: dict) -> Spec:
    from transformers import CLIPModel

    from jagg.scale.rewards import CLIPScoreReward, PickScoreReward, _ClipReward

    cls = PickScoreReward if name == "pickscore" else CLIPScoreReward
    return Spec(
        f"{name} reward",
        kw.get("model", _default(cls.__init__, "model")),
        None,
        "transformers",
        CLIPModel,
        key=f"reward.kwargs.{name}.model",
        dtype=_reward_dtype(kw, _default(_ClipReward.__init__, "dtype")),
    )


def _imagereward_spec(name: str, kw: dict) -> Spec:
    from jagg.scale.imagereward import ImageRewardReward

    init = ImageRewardReward.__init__
    return Spec(
        "imagereward reward",
        kw.get("checkpoint", _default(init, "checkpoint")),
        None,
        "imagereward",
        filename=kw.get("filename", _default(init, "filename")),
        key="reward.kwargs.imagereward.checkpoint",
        dtype=_reward_dtype(kw, _default(ImageRewardReward._init_from, "dtype")),
        extra={
            "med_config": kw.get("med_config", _default(init, "med_config")),
            "vision": kw.get("vision"),
        },
    )


def _hpsv3_spec(name: str, kw: dict) -> Spec:
    from jagg.scale.hpsv3 import HPSv3Reward

    init = HPSv3Reward.__init__
    return Spec(
        "hpsv3 reward",
        kw.get("checkpoint", _default(init, "checkpoint")),
        None,
        "hpsv3",
        filename=kw.get("filename", _default(init, "filename")),
        key="reward.kwargs.hpsv3.checkpoint",
        dtype=_reward_dtype(kw, _default(init, "dtype")),
        extra={"base": kw.get("base", _default(init, "base"))},
    )


def _per_frame_spec(name: str, kw: dict) -> Spec:
    """``per_frame`` loads the image reward it wraps (``reward``, with ``reward_kwargs``): that reward's files,
    its config keys under ``reward.kwargs.per_frame.reward_kwargs``."""
    from jagg.rewards.video import per_frame_reward

    inner = kw.get("reward", _default(per_frame_reward, "reward"))
    what = f"{name} ({inner}) reward"
    rule = REWARD_RULES.get(inner)
    if rule is None:
        why = NOT_CHECKED.get(inner, "the weights check has no rule for this reward's files")
        return Spec(what, "", None, "", skip=why)
    spec = rule(inner, kw.get("reward_kwargs") or {})
    key = spec.key.replace(f"reward.kwargs.{inner}.", f"reward.kwargs.{name}.reward_kwargs.")
    return dataclasses.replace(spec, what=what, key=key)


# reward name -> its Spec from reward.kwargs.<name> (defaults read from the reward's own signature)
REWARD_RULES: dict[str, Callable[[str, dict], Spec]] = {
    "hpsv2": _hpsv2_spec,
    "pickscore": _clip_spec,
    "clipscore": _clip_spec,
    "imagereward": _imagereward_spec,
    "hpsv3": _hpsv3_spec,
    "per_frame": _per_frame_spec,
}
FP32_HEADS = {"imagereward": ("mlp.",), "hpsv3": ("rm_head.",)}  # the rewards' heads stay float32


# --------------------------------------------------------------------------- files
def _unavailable(what: str, source: str, key: str, reason: str, where: Path | str | None = None) -> str:
    """The hint for files that are not there: for a local ``source``, what to fix there and which config key
    points at it; for a hub id, how to get it (``hf download <id>``), naming the cached snapshot looked in."""
    if looks_like_local_path(source):
        return unavailable_message(what, str(where or source), reason, f"({key} points at it)" if key else "")
    if where is not None:
        reason = f"{reason} in its cached snapshot {where}"
    return unavailable_message(what, source, reason)


def _spec_unavailable(spec: Spec, reason: str, where: Path | str | None = None) -> str:
    return _unavailable(spec.what, spec.source, spec.key, reason, where)


def _locate(what: str, source: str, key: str) -> Path:
    """The local file or folder of ``source`` (a path, else the hub cache's snapshot); never the network."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if looks_like_local_path(source):
        raise WeightsUnavailableError(_unavailable(what, source, key, "local path does not exist"))
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception as err:  # huggingface_hub raises several kinds for a cache miss
        reason = f"not in the local hub cache ({type(err).__name__})"
        raise WeightsUnavailableError(unavailable_message(what, source, reason)) from err


def local_root(spec: Spec) -> Path:
    """The local folder (or file) of ``spec.source``: the path itself, else the hub cache's snapshot."""
    return _locate(spec.what, spec.source, spec.key)


def _single_files(root: Path) -> list[str]:
    """The original-format checkpoint files at the top of ``root`` (a file itself, or a folder's)."""
    if root.is_file():
        return [root.name] if root.suffix in SINGLE_FILE else []
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix in SINGLE_FILE)


def model_folder(spec: Spec, root: Path) -> Path:
    """The folder holding the model's config and weights (a pipeline's subfolder, or a bare model folder). A
    single-file (original-format) checkpoint is named as such: the loaders read diffusers' folder layout."""
    if root.is_dir() and spec.subfolder and (root / spec.subfolder).is_dir():
        return root / spec.subfolder
    if root.is_dir() and (root / "config.json").is_file():
        return root
    singles = _single_files(root)
    if singles:
        held = "is" if root.is_file() else f"holds {', '.join(singles[:3])}:"
        reason = (
            f"{held} a single-file (original-format) checkpoint, and no {spec.subfolder or 'config.json'}"
            f"{'/ folder' if spec.subfolder else ''}: the loader reads the diffusers / transformers layout "
            "(model_index.json, transformer/, vae/, text_encoder/ ..., each with its config.json); use the "
            "diffusers-format repo, or convert the file (diffusers' from_single_file, then save_pretrained)"
        )
        raise WeightsUnavailableError(f"{spec.what}: {root} {reason}")
    raise WeightsUnavailableError(
        _spec_unavailable(spec, f"no {spec.subfolder}/ folder or config.json", root)
    )


def weight_files(folder: Path, spec: Spec | None = None) -> tuple[list[Path], dict[str, str] | None]:
    """(files, the index's key -> file map or None): a sharded checkpoint's index, else the one weights file."""
    for stem in WEIGHT_NAMES:
        for suffix in (".safetensors", ".bin"):
            index = folder / f"{stem}{suffix}.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return [folder / f for f in sorted(set(weight_map.values()))], weight_map
            if (folder / f"{stem}{suffix}").is_file():
                return [folder / f"{stem}{suffix}"], None
    reason = f"no {' / '.join(WEIGHT_NAMES)} .safetensors or .bin file"
    if spec is None:
        raise WeightsUnavailableError(unavailable_message("weights", str(folder), reason))
    raise WeightsUnavailableError(_spec_unavailable(spec, reason, folder))


def safetensors_tensors(path: Path) -> Tensors:
    """Key -> (shape, dtype) from a safetensors file's header alone; ``ValueError`` for a truncated file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"truncated: {size} bytes, no header")
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            raise ValueError(f"truncated: {size} bytes, the header alone needs {8 + n}")
        header = json.loads(f.read(n))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 8 + n + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if end > size:
        raise ValueError(f"truncated: {size} bytes, the header says {end}")
    return {k: Stored(tuple(v["shape"]), SAFETENSORS_DTYPES.get(v["dtype"])) for k, v in tensors.items()}


def torch_tensors(path: Path, unwrap: str | None = None) -> Tensors:
    """Key -> (shape, dtype) of a torch pickle, memory-mapped (the zip format; an old-format file is read in
    full). ``unwrap``: the key the loader takes the state dict from when present (HPSv2 and ImageReward
    ``"state_dict"``, HPSv3 ``"model"``)."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if unwrap and isinstance(obj, dict):
        obj = obj.get(unwrap, obj)
    if not isinstance(obj, dict):
        raise ValueError(f"not a state dict ({type(obj).__name__})")
    return {k: Stored(tuple(v.shape), v.dtype) for k, v in obj.items() if torch.is_tensor(v)}


def file_tensors(path: Path, unwrap: str | None = None) -> Tensors:
    return safetensors_tensors(path) if path.suffix == ".safetensors" else torch_tensors(path, unwrap)


UNWRAP = {"open_clip": "state_dict", "imagereward": "state_dict", "hpsv3": "model"}  # the loaders' .get(...)


def reward_files(spec: Spec, root: Path) -> tuple[Path, Path | None]:
    """(checkpoint file, its config file or None) of a reward, found as its constructor finds them: the
    configured file itself, else ``filename`` in the local folder or cached snapshot."""
    path = root if root.is_file() else root / spec.filename
    if not path.is_file():
        raise WeightsUnavailableError(_spec_unavailable(spec, f"{spec.filename} missing", root))
    if spec.library != "imagereward":
        return path, None
    med = spec.extra["med_config"]
    config = Path(med).expanduser() if root.is_file() else root / med
    if root.is_file() and not config.is_file():  # the loader's fallback: next to the .pt file
        config = root.parent / med
    if not config.is_file():
        raise WeightsUnavailableError(_spec_unavailable(spec, f"{med} missing", config.parent))
    return path, config


# --------------------------------------------------------------------------- the model side
@dataclass
class Expected:
    """The meta model's keys and shapes, the dtypes the loader builds them in, and its rules for reading a
    checkpoint into it."""

    shapes: Shapes
    rename: Callable[[str], tuple[str, bool]] = lambda k: (k, False)  # key -> (model key, converted)
    may_miss: Callable[[str], bool] = lambda k: False
    may_ignore: Callable[[str], bool] = lambda k: False
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # model key -> built dtype (floating only)


def _patterns(patterns) -> Callable[[str], bool]:
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return lambda k: regex is not None and regex.search(k) is not None


def meta_model(spec: Spec, folder: Path, config_file: Path | None = None) -> nn.Module:
    """The model of ``spec`` from its config, on the meta device (no memory, no weights)."""
    if spec.library == "hpsv3":
        return _hpsv3_meta(spec)
    with torch.device("meta"):
        if spec.library == "open_clip":
            from jagg.scale.architectures import quiet_open_clip

            return quiet_open_clip(spec.arch)
        if spec.library == "imagereward":
            from jagg.scale.imagereward import ImageRewardModel

            med = json.loads(config_file.read_text())
            return ImageRewardModel.from_med_config(med, spec.extra.get("vision"))
        if spec.library == "diffusers":
            return spec.cls.from_config(spec.cls.load_config(str(folder)))
        config = spec.cls.config_class.from_pretrained(str(folder))
        return spec.cls._from_config(config)


def _hpsv3_meta(spec: Spec) -> nn.Module:
    """HPSv3 as its constructor builds it (``hpsv3_with_processor``: the base's config, the processor's
    vocabulary with ``<|Reward|>``), on the meta device in the reward's dtype."""
    from transformers import AutoConfig, AutoProcessor

    from jagg.scale.hpsv3 import hpsv3_with_processor

    what = f"{spec.what} base (Qwen2-VL-7B-Instruct)"
    base = str(_locate(what, spec.extra["base"], "reward.kwargs.hpsv3.base"))
    config = AutoConfig.from_pretrained(base, local_files_only=True)
    processor = AutoProcessor.from_pretrained(base, local_files_only=True)
    with torch.device("meta"):
        return hpsv3_with_processor(config, processor, dtype=spec.dtype)


def built_dtypes(spec: Spec, model: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each floating tensor of the state dict has once loaded: ``spec.dtype`` (a reward's
    ``model.to(dtype)``, the pipeline's ``torch_dtype``), except the modules the loader keeps in float32 (a
    reward's head; diffusers' ``_keep_in_fp32_modules``; transformers' ``_keep_in_fp32_modules_strict`` in
    bf16 / fp16 and ``_keep_in_fp32_modules`` in fp16)."""
    dtype = spec.dtype
    keep: tuple[str, ...] = ()
    if spec.library == "diffusers":
        keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    elif spec.library == "transformers" and dtype in (torch.float16, torch.bfloat16):
        keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            keep += tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    heads = FP32_HEADS.get(spec.library, ())
    out = {}
    for key, value in model.state_dict().items():
        if not value.is_floating_point():
            continue
        if key.startswith(heads) or any(m in key.split(".") for m in keep):
            out[key] = torch.float32
        else:
            out[key] = dtype or value.dtype
    return out


def expected(spec: Spec, model: nn.Module) -> Expected:
    """The model's state-dict shapes and built dtypes plus its library's loading rules (module docstring)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    dtypes = built_dtypes(spec, model)
    if spec.library == "diffusers":
        ignore = _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None))
        return Expected(shapes, may_ignore=ignore, dtypes=dtypes)
    if spec.library == "open_clip":  # load_hps_state_dict: the DDP prefix removed
        return Expected(shapes, rename=lambda k: (k.removeprefix("module."), False), dtypes=dtypes)
    if spec.library in ("imagereward", "hpsv3"):
        return _converted(spec.library, shapes, dtypes)
    ignore = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    names = [n for n, _ in model.named_buffers()]
    ignore |= {r"rotary_emb\.inv_freq"} if any(n.endswith("rotary_emb.inv_freq") for n in names) else set()
    ignore |= {r"(^|\.)position_ids$"} if any(n.endswith("position_ids") for n in names) else set()
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    missing_ok = _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None))
    return Expected(
        shapes,
        rename=_hf_rename(model, shapes),
        may_miss=lambda k: k in tied or missing_ok(k),
        may_ignore=_patterns(ignore),
        dtypes=dtypes,
    )


def _converted(library: str, shapes: Shapes, dtypes: dict[str, torch.dtype]) -> Expected:
    """The rewards whose constructor converts the checkpoint's keys, then loads strictly: each key through the
    same conversion (one key at a time); a key it drops is ignored (ImageReward's unused BLIP weights), a key it
    cannot convert is unexpected."""
    from jagg.scale.hpsv3 import convert_hpsv3_state_dict
    from jagg.scale.imagereward import convert_imagereward_state_dict

    convert = convert_hpsv3_state_dict if library == "hpsv3" else convert_imagereward_state_dict

    def one(key: str) -> str | None:
        try:
            return next(iter(convert({key: None})), None)
        except KeyError:  # ImageReward: a ViT key without a rule raises in the loader
            return key

    return Expected(
        shapes,
        rename=lambda k: (one(k) or k, False),
        may_ignore=lambda k: one(k) is None,
        dtypes=dtypes,
    )


def _hf_rename(model: nn.Module, shapes: Shapes) -> Callable[[str], tuple[str, bool]]:
    """transformers' own checkpoint-key renaming for ``model`` (identity where this version has none); a key a
    tensor-converting rule matches is flagged (its shape changes on load, so it is not compared)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # pragma: no cover - an older transformers loads keys as they are
        return lambda k: (k, False)
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, bool]:
        new, pattern = rename_source_key(key, renamings, converters, prefix, shapes)
        return new, pattern is not None

    return rename


# --------------------------------------------------------------------------- compare
def compare(
    exp: Expected, files: dict[str, Tensors], weight_map: dict[str, str] | None
) -> dict[str, Problems]:
    """Per file: keys the model lacks, mis-shaped keys, floating weights stored as integers; model keys no file
    holds go to the file the index names for them (else the first file)."""
    problems = {name: Problems() for name in files}
    seen: set[str] = set()
    for name, tensors in files.items():
        for key, stored in tensors.items():
            target, converted = exp.rename(key)
            if target not in exp.shapes:
                if not exp.may_ignore(key):
                    problems[name].unexpected.append(key)
                continue
            seen.add(target)
            if not converted and tuple(exp.shapes[target]) != tuple(stored.shape):
                problems[name].mis_shaped.append(
                    f"{key}: file {tuple(stored.shape)} vs model {tuple(exp.shapes[target])}"
                )
            built = exp.dtypes.get(target)
            if built is not None and stored.dtype is not None and not stored.dtype.is_floating_point:
                problems[name].mis_typed.append(
                    f"{key}: file {dtype_name(stored.dtype)} vs model {dtype_name(built)}"
                )
    first = next(iter(problems))
    for key in exp.shapes:
        if key not in seen and not exp.may_miss(key):
            owner = (weight_map or {}).get(key, first)
            problems.setdefault(owner, Problems()).missing.append(key)
    return problems


def dtype_notes(exp: Expected, files: dict[str, Tensors]) -> tuple[set[str], set[str], list[str]]:
    """(floating dtypes stored, floating dtypes built, a note per (stored, built) pair that matters: stored in
    less precision than built, or cast to a dtype whose range is smaller)."""
    pairs: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    stored_names: set[str] = set()
    for tensors in files.values():
        for key, stored in tensors.items():
            target, _ = exp.rename(key)
            built = exp.dtypes.get(target)
            if built is None or stored.dtype is None or not stored.dtype.is_floating_point:
                continue
            stored_names.add(dtype_name(stored.dtype))
            pairs.setdefault((stored.dtype, built), []).append(key)
    notes = []
    for (src, dst), keys in sorted(pairs.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        a, b = torch.finfo(src), torch.finfo(dst)
        what = f"{len(keys)} tensors stored {dtype_name(src)} are built {dtype_name(dst)}"
        if 2 * b.max <= a.max:  # a smaller exponent range (fp32 -> bf16 is the same range, 0.4% short)
            notes.append(f"{what}: values past {b.max:.6g} become inf ({_shown(keys)})")
        elif a.eps > b.eps:
            notes.append(f"{what}: their values keep {dtype_name(src)}'s precision ({_shown(keys)})")
    return stored_names, {dtype_name(d) for d in exp.dtypes.values()}, notes


def _read_files(report: Report, paths: list[Path], unwrap: str | None) -> dict[str, Tensors]:
    """Every file's tensors (a missing or unreadable one: none, and ``broken`` set in ``report.files``)."""
    found: dict[str, Tensors] = {}
    for path in paths:
        try:
            found[path.name] = file_tensors(path, unwrap) if path.exists() else {}
            broken = "" if path.exists() else "named in the index, missing on disk"
        except (ValueError, RuntimeError, OSError) as err:
            found[path.name], broken = {}, f"unreadable: {str(err).splitlines()[0]}"
        report.files[path.name] = Problems(broken=broken)
    return found


def _locate_model(spec: Spec) -> tuple[Path, list[Path], dict[str, str] | None, nn.Module]:
    """(folder, weight files, the index's key map or None, the meta model) of ``spec``."""
    root = local_root(spec)
    if spec.library in ("open_clip", "imagereward", "hpsv3"):
        path, config = reward_files(spec, root)
        return path.parent, [path], None, meta_model(spec, path.parent, config)
    folder = model_folder(spec, root)
    paths, weight_map = weight_files(folder, spec)
    return folder, paths, weight_map, meta_model(spec, folder)


def check_model(spec: Spec) -> Report:
    """Locate, build on meta and compare one model (``Report.error`` when it cannot be checked at all,
    ``Report.skipped`` for a model this check has no files for)."""
    report = Report(spec, skipped=spec.skip)
    if spec.skip:
        return report
    try:
        folder, paths, weight_map, model = _locate_model(spec)
    except WeightsUnavailableError as err:
        report.error = str(err)
        return report
    except (
        Exception
    ) as err:  # a config or processor the library cannot read: this model fails, the rest go on
        report.error = (
            f"cannot build the model from its config: {type(err).__name__}: {str(err).splitlines()[0]}"
        )
        return report
    report.where = str(folder)
    tensors = _read_files(report, paths, UNWRAP.get(spec.library))
    exp = expected(spec, model)
    for name, found in compare(exp, tensors, weight_map).items():
        report.files.setdefault(name, Problems())
        found.broken = report.files[name].broken
        report.files[name] = found
    report.stored, report.built, report.notes = dtype_notes(exp, tensors)
    report.tensors = sum(len(t) for t in tensors.values())
    report.parameters = sum(int(torch.Size(s.shape).numel()) for f in tensors.values() for s in f.values())
    return report


def check_weights(cfg: Config) -> list[Report]:
    """Every model of ``cfg`` checked (``model_specs``); ``ConfigError`` for a config that loads no weights."""
    return [check_model(spec) for spec in model_specs(cfg)]


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); prints the report, returns the exit status."""
    import argparse

    from jagg.common import set_threads
    from jagg.config import load_config

    ap = argparse.ArgumentParser(
        prog="python -m jagg.scale.weights_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--config", required=True, help="a model.source=pretrained config (configs/paper/...)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as for python -m jagg.train")
    args = ap.parse_args(argv)
    set_threads(1)
    try:
        cfg = load_config(args.config, args.overrides)
        specs = model_specs(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    skipped = [s for s in specs if s.skip]
    print(
        f"weights check: {args.config} ({len(specs) - len(skipped)} models to check"
        + (f", {len(skipped)} not checked" if skipped else "")
        + "; headers and memory-mapped files only)"
    )
    reports = []
    for spec in specs:
        reports.append(check_model(spec))
        print("\n".join(reports[-1].lines()), flush=True)
    failed = [r.spec.what for r in reports if not r.ok and not r.skipped]
    print(
        f"weights check: {len(specs) - len(skipped) - len(failed)} of {len(specs) - len(skipped)} models ok"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
        + (f"; not checked: {', '.join(s.what for s in skipped)}" if skipped else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
