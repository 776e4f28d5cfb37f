"""``python -m jagg.scale.weights_check --config C [key=value ...]``: every checkpoint a config loads, checked
against its model before a GPU is booked; no weights are read into memory and nothing is downloaded.

For a ``model.source: pretrained`` config, each model the run loads (the transformer, the text encoders, the VAE,
every train / eval reward: HPSv2.1, PickScore, CLIPScore) is built on the meta device from its own config (the
folder's ``config.json``; open_clip's architecture for HPSv2.1), and its checkpoint files are compared with it
key by key and shape by shape: safetensors files through their JSON header alone, ``.bin`` / ``.pt`` files
through ``torch.load(mmap=True, weights_only=True)`` (memory-mapped: tensor bytes are not read). Files come from
``model.path`` / ``reward.kwargs`` when local, else from the hub cache only (``local_files_only``).

The comparison is strict, stricter than the libraries' loaders (which warn and initialise a missing key at
random): every key of the model must be in a file, with the model's shape, and every key of the files must belong
to the model. The loaders' own rules are applied first, so a checkpoint they load exactly passes: transformers'
key renamings (``get_model_conversion_mapping``), its tied weights (which may be absent) and its ignore patterns,
diffusers' ``_keys_to_ignore_on_load_unexpected``, HPSv2's ``state_dict`` nesting and DDP ``module.`` prefix. A
truncated safetensors file (shorter than its header says) and a file the index names but the folder lacks fail
too. Each failure names the model, the file, and up to ``SHOWN`` keys per kind.

Exit status: 0 every model passes, 1 some failed (the report says which and where), 2 a bad config (one line).
"""

from __future__ import annotations

import inspect
import json
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Spec:
    """One model of a run: what it is, where its files are, and how to build it on the meta device."""

    what: str  # "flux transformer", "hpsv2 reward", ...
    source: str  # hub id or local path, as configured
    subfolder: str | None  # pipeline subfolder (transformer/, vae/, text_encoder/, ...)
    library: str  # "diffusers" | "transformers" | "open_clip"
    cls: type | None = None  # the model class (diffusers / transformers)
    filename: str | None = None  # one named file (HPSv2.1's checkpoint)
    arch: str | None = None  # open_clip architecture name


@dataclass
class Problems:
    """What is wrong in one file (or, for ``missing``, the file or index that should hold the keys)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)  # "key: file (a, b) vs model (c, d)"
    broken: str = ""  # truncated, unreadable, named in the index but absent

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mis_shaped or self.broken)

    def line(self) -> str:
        parts = [self.broken] if self.broken else []
        for name, keys in (("missing", self.missing), ("unexpected", self.unexpected)):
            if keys:
                parts.append(f"{len(keys)} {name} ({_shown(keys)})")
        if self.mis_shaped:
            parts.append(f"{len(self.mis_shaped)} mis-shaped ({_shown(self.mis_shaped)})")
        return "; ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


def _shown(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(sorted(items)[:SHOWN]) + (f", +{more} more" if more > 0 else "")


@dataclass
class Report:
    """The result of one model: where it was looked for, per-file problems, or why it could not be checked."""

    spec: Spec
    where: str = ""
    files: dict[str, Problems] = field(default_factory=dict)
    tensors: int = 0
    parameters: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and not any(self.files.values())

    def lines(self) -> list[str]:
        head = f"  {'ok' if self.ok else 'FAILED':<7} {self.spec.what:<28}"
        if self.error:
            return [f"{head} {self.error}"]
        if self.ok:
            n = len(self.files)
            return [
                f"{head} {self.where}: {n} file{'s' * (n != 1)}, {self.tensors} tensors, "
                f"{_count(self.parameters)} values, every key and shape matches"
            ]
        return [f"{head} {self.where}"] + [f"          {f}: {p.line()}" for f, p in self.files.items() if p]


# --------------------------------------------------------------------------- which models a config loads
def _default(cls: type, name: str) -> str:
    """A reward constructor's default (hub id / file name), read from its signature rather than copied here."""
    return inspect.signature(cls.__init__).parameters[name].default


def model_specs(cfg: Config) -> list[Spec]:
    """Every model a ``model.source: pretrained`` run of ``cfg`` loads, in load order."""
    from jagg.models import BACKBONES
    from jagg.scale.pretrained import PIPELINE_PARTS, PRETRAINED_IDS, part_class

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
        )
    ]
    for sub, (library, _) in PIPELINE_PARTS[m.backbone].items():
        if not sub.startswith("tokenizer"):
            specs.append(Spec(f"{m.backbone} {sub}", repo, sub, library, part_class(m.backbone, sub)))
    return specs + reward_specs(cfg)


def reward_specs(cfg: Config) -> list[Spec]:
    """The real reward models among ``reward.weights`` and ``reward.eval`` (with their ``reward.kwargs``)."""
    from transformers import CLIPModel

    from jagg.scale.rewards import CLIPScoreReward, HPSv2Reward, PickScoreReward

    out = []
    for name in dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]):
        kw = cfg.reward.kwargs.get(name, {})
        if name == "hpsv2":
            ckpt = kw.get("checkpoint", _default(HPSv2Reward, "checkpoint"))
            filename = kw.get("filename", _default(HPSv2Reward, "filename"))
            arch = kw.get("arch", _default(HPSv2Reward, "arch"))
            out.append(Spec("hpsv2 reward", ckpt, None, "open_clip", filename=filename, arch=arch))
        elif name in ("pickscore", "clipscore"):
            cls = PickScoreReward if name == "pickscore" else CLIPScoreReward
            out.append(
                Spec(
                    f"{name} reward", kw.get("model", _default(cls, "model")), None, "transformers", CLIPModel
                )
            )
    return out


# --------------------------------------------------------------------------- files
def local_root(spec: Spec) -> Path:
    """The local folder (or file) of ``spec.source``: the path itself, else the hub cache's snapshot; never the
    network."""
    path = Path(spec.source).expanduser()
    if path.exists():
        return path
    if looks_like_local_path(spec.source):
        raise WeightsUnavailableError(
            unavailable_message(spec.what, spec.source, "local path does not exist")
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec.source, local_files_only=True))
    except Exception as err:  # huggingface_hub raises several kinds for a cache miss
        reason = f"not in the local hub cache ({type(err).__name__})"
        raise WeightsUnavailableError(unavailable_message(spec.what, spec.source, reason)) from err


def model_folder(spec: Spec, root: Path) -> Path:
    """The folder holding the model's config and weights (a pipeline's subfolder, or a bare model folder)."""
    if spec.subfolder and (root / spec.subfolder).is_dir():
        return root / spec.subfolder
    if (root / "config.json").is_file() or spec.library == "open_clip":
        return root
    raise WeightsUnavailableError(
        unavailable_message(spec.what, str(root), f"no {spec.subfolder}/ folder or config.json")
    )


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(files, the index's key -> file map or None): a sharded checkpoint's index, else the one weights file."""
    for stem in WEIGHT_NAMES:
        for suffix in (".safetensors", ".bin"):
            index = folder / f"{stem}{suffix}.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return [folder / f for f in sorted(set(weight_map.values()))], weight_map
            if (folder / f"{stem}{suffix}").is_file():
                return [folder / f"{stem}{suffix}"], None
    raise WeightsUnavailableError(
        unavailable_message(
            "weights", str(folder), f"no {' / '.join(WEIGHT_NAMES)} .safetensors or .bin file"
        )
    )


def safetensors_shapes(path: Path) -> Shapes:
    """Key -> shape from a safetensors file's header alone; ``ValueError`` for a truncated or unreadable file."""
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
    return {k: tuple(v["shape"]) for k, v in tensors.items()}


def torch_shapes(path: Path, nested: bool = False) -> Shapes:
    """Key -> shape of a torch pickle, memory-mapped (the zip format; an old-format file is read in full).
    ``nested``: HPSv2's ``{"state_dict": ...}`` with DDP's ``module.`` prefix (``load_hps_state_dict``)."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
        obj = torch.load(path, map_location="cpu", weights_only=True)
    if nested and isinstance(obj, dict):
        obj = obj.get("state_dict", obj)
    if not isinstance(obj, dict):
        raise ValueError(f"not a state dict ({type(obj).__name__})")
    strip = (lambda k: k.removeprefix("module.")) if nested else (lambda k: k)  # noqa: E731
    return {strip(k): tuple(v.shape) for k, v in obj.items() if torch.is_tensor(v)}


def file_shapes(path: Path, nested: bool = False) -> Shapes:
    return safetensors_shapes(path) if path.suffix == ".safetensors" else torch_shapes(path, nested)


# --------------------------------------------------------------------------- the model side
@dataclass
class Expected:
    """The meta model's keys and shapes and the loader's rules for reading a checkpoint into it."""

    shapes: Shapes
    rename: Callable[[str], tuple[str, bool]] = lambda k: (k, False)  # key -> (model key, converted)
    may_miss: Callable[[str], bool] = lambda k: False
    may_ignore: Callable[[str], bool] = lambda k: False


def _patterns(patterns) -> Callable[[str], bool]:
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return lambda k: regex is not None and regex.search(k) is not None


def meta_model(spec: Spec, folder: Path) -> nn.Module:
    """The model of ``spec`` from the folder's config, on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        if spec.library == "open_clip":
            from jagg.scale.architectures import quiet_open_clip

            return quiet_open_clip(spec.arch)
        if spec.library == "diffusers":
            return spec.cls.from_config(spec.cls.load_config(str(folder)))
        config = spec.cls.config_class.from_pretrained(str(folder))
        return spec.cls._from_config(config)


def expected(spec: Spec, model: nn.Module) -> Expected:
    """The model's state-dict shapes plus its library's loading rules (module docstring)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if spec.library == "diffusers":
        return Expected(
            shapes, may_ignore=_patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None))
        )
    if spec.library != "transformers":
        return Expected(shapes)
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
    exp: Expected, files: dict[str, Shapes], weight_map: dict[str, str] | None
) -> dict[str, Problems]:
    """Per file: keys the model lacks, mis-shaped keys; model keys no file holds go to the file the index names
    for them (else the first file)."""
    problems = {name: Problems() for name in files}
    seen: set[str] = set()
    for name, shapes in files.items():
        for key, shape in shapes.items():
            target, converted = exp.rename(key)
            if target not in exp.shapes:
                if not exp.may_ignore(key):
                    problems[name].unexpected.append(key)
                continue
            seen.add(target)
            if not converted and tuple(exp.shapes[target]) != tuple(shape):
                problems[name].mis_shaped.append(
                    f"{key}: file {tuple(shape)} vs model {tuple(exp.shapes[target])}"
                )
    first = next(iter(problems))
    for key in exp.shapes:
        if key not in seen and not exp.may_miss(key):
            owner = (weight_map or {}).get(key, first)
            problems.setdefault(owner, Problems()).missing.append(key)
    return problems


def check_model(spec: Spec) -> Report:
    """Locate, build on meta and compare one model (``Report.error`` when it cannot be checked at all)."""
    report = Report(spec)
    try:
        root = local_root(spec)
        if spec.library == "open_clip":
            path = root if root.is_file() else root / spec.filename
            if not path.is_file():
                raise WeightsUnavailableError(unavailable_message(spec.what, str(path), "file missing"))
            folder, paths, weight_map = path.parent, [path], None
        else:
            folder = model_folder(spec, root)
            paths, weight_map = weight_files(folder)
        model = meta_model(spec, folder)
    except (WeightsUnavailableError, OSError, ValueError) as err:
        report.error = str(err)
        return report
    report.where = str(folder)
    shapes: dict[str, Shapes] = {}
    for path in paths:
        try:
            shapes[path.name] = file_shapes(path, nested=spec.library == "open_clip") if path.exists() else {}
            broken = "" if path.exists() else "named in the index, missing on disk"
        except (ValueError, RuntimeError, OSError) as err:
            shapes[path.name], broken = {}, f"unreadable: {str(err).splitlines()[0]}"
        report.files[path.name] = Problems(broken=broken)
    exp = expected(spec, model)
    for name, found in compare(exp, shapes, weight_map).items():
        report.files.setdefault(name, Problems())
        broken = report.files[name].broken
        report.files[name] = found
        found.broken = broken
    report.tensors = sum(len(s) for s in shapes.values())
    report.parameters = sum(int(torch.Size(s).numel()) for f in shapes.values() for s in f.values())
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
    print(f"weights check: {args.config} ({len(specs)} models; headers and memory-mapped files only)")
    reports = []
    for spec in specs:
        reports.append(check_model(spec))
        print("\n".join(reports[-1].lines()), flush=True)
    failed = [r.spec.what for r in reports if not r.ok]
    print(
        f"weights check: {len(reports) - len(failed)} of {len(reports)} models ok"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
