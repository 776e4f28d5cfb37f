"""The export step: a run's trained weights written once, by rank 0, in the format their library loads.

    full fine-tuning  a diffusers transformer folder (``save_pretrained``: ``config.json`` + safetensors), for
                      ``FluxTransformer2DModel`` / ``QwenImageTransformer2DModel.from_pretrained(folder)`` and
                      hence ``FluxPipeline.from_pretrained(base, transformer=...)``
    LoRA              the adapter only, via ``jagg.scale.lora.export_lora``: ``adapter_config.json`` +
                      ``adapter_model.safetensors`` (peft) and ``pytorch_lora_weights.safetensors`` (diffusers'
                      ``load_lora_weights``)
    two experts       (Wan2.2-A14B) the low-noise expert's the same way in ``OUT/transformer_2``: its folder, or
                      its adapter (``pipe.transformer_2.load_lora_adapter(OUT/transformer_2,
                      prefix="transformer", weight_name="pytorch_lora_weights.safetensors")``)

Which weights: the EMA weights when the run keeps an EMA (``optim.ema_decay > 0``; what evaluation scores),
else the trained ones. dtype: a full model in the compute dtype of ``train.precision`` (bf16 for the paper
configs: the published checkpoints' dtype, what inference runs in; half the size of the fp32 master
weights), else the master dtype; adapters as trained (fp32). Under FSDP2 the weights are gathered one tensor
at a time (every rank joins each all-gather) and only rank 0 keeps a CPU copy, so rank 0's host peak is the
exported weights once (FLUX.1-dev in bf16: ~22 GiB) and the other ranks hold nothing extra.

Where: ``OUT`` must be absent, empty or an earlier export (``jagg.ops.exportdir.check_export_target``: never
empty, ``.``, ``..``, a symbolic link, inside or above the run directory, the working directory, a git root or
the home directory; ``~`` expanded), checked before anything is gathered and again before the rename. The
export is written into a temporary directory beside ``OUT``, marked (``.jagg_export`` records each file's size
and SHA-256) and renamed into place; an earlier export is moved aside, checked byte for byte and only then
deleted (``jagg.ops.exportdir.place_export``), so ``OUT`` is complete or absent and nothing the export did not
write is ever deleted.

``export_run``: the same from the checkpoint in ``log.run_dir``, without training
(``python -m jagg.train --config ... --export OUT``): builds the components, places the backbone like the
trainer (``jagg.scale.placement``; any world size, DCP reshards), loads only the weights, exports.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from jagg.config import Config
from jagg.distributed import DistInfo, full_tensor
from jagg.errors import ConfigError
from jagg.models import BACKBONES, Backbone
from jagg.ops.checkpoint import find_checkpoint, load_weights, trainable_names
from jagg.ops.exportdir import check_export_target, export_path, export_tmp, place_export
from jagg.scale.lora import export_lora
from jagg.scale.placement import DTYPES, place_backbone, weights_dtype


def _gather(tensors: dict[str, torch.Tensor], dist: DistInfo, dtype: torch.dtype | None) -> dict:
    """Full CPU copies on rank 0 (floating tensors in ``dtype`` when given), {} elsewhere; one all-gather
    per tensor, every rank calls it."""
    out = {}
    for name, t in tensors.items():
        full = full_tensor(t.detach())
        if dist.is_main:
            cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
            out[name] = full.to("cpu", cast).contiguous()
        del full
    return out


def export_trained(
    cfg: Config,
    backbone: Backbone,
    out_dir: str | Path,
    *,
    dist: DistInfo,
    ema: list[torch.Tensor] | None = None,
) -> Path:
    """Write ``backbone``'s weights (``ema``, laid out like its trainable parameters, replaces them) to
    ``out_dir`` in the format of the module docstring. A collective under FSDP2; rank 0 writes. ``ConfigError``
    on every rank when ``out_dir`` may not be written (``check_export_target``), before and after the gather."""
    out = export_path(out_dir)
    check_export_target(out, cfg.log.run_dir)  # every rank: the same answer, before any collective
    tmp = export_tmp(out) if dist.is_main else out
    try:
        _write_networks(cfg, backbone, tmp, dist, ema)
    except BaseException:
        if dist.is_main:  # a failed write leaves nothing (a killed one: the next export removes it)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    refused = None
    if dist.is_main:
        try:
            place_export(tmp, out, cfg.log.run_dir)  # checks ``out`` again: it may have changed meanwhile
        except (ConfigError, OSError) as err:  # every rank stops, rank 0 with its error
            refused = err
    if dist.reduce_scalars({"refused": float(refused is not None)}, op="max")["refused"] > 0:
        raise refused or ConfigError(f"--export refuses OUT={out} (rank 0 says why)")
    return out


def _write_networks(cfg: Config, backbone: Backbone, tmp: Path, dist: DistInfo, ema) -> None:
    """Each network's weights into ``tmp`` (rank 0 writes; every rank joins the gathers): the transformer in
    ``tmp``, Wan2.2-A14B's low-noise expert in ``tmp/transformer_2``."""
    trained = dict(zip(trainable_names(backbone), ema, strict=True)) if ema is not None else {}
    for name, network in _named_networks(backbone):
        where, prefix = (tmp if name == "transformer" else tmp / name), f"{name}."
        if cfg.model.lora_rank > 0:
            named = dict(backbone.named_parameters())
            mine = [n for n in trainable_names(backbone) if n.startswith(prefix)]
            state = _gather({n.removeprefix(prefix): trained.get(n, named[n]) for n in mine}, dist, None)
            if dist.is_main:
                export_lora(network, where, state=state, base_model=cfg.model.path)
        else:
            sd = {k: trained.get(prefix + k, v) for k, v in network.state_dict().items()}
            full = _gather(sd, dist, DTYPES[cfg.train.precision])
            if dist.is_main:
                _save_transformer(cfg.model.backbone, network.config, full, where)


def _named_networks(backbone: Backbone) -> list[tuple[str, nn.Module]]:
    """(attribute name, module) of each of ``backbone.networks``: ``transformer``, Wan2.2-A14B's
    ``transformer_2``."""
    names = {id(m): n for n, m in backbone.named_children()}
    return [(names[id(net)], net) for net in backbone.networks]


def _save_transformer(backbone: str, config, state: dict[str, torch.Tensor], out: Path) -> None:
    """``save_pretrained`` of a fresh transformer of the backbone's diffusers class holding ``state``
    (built on the meta device and given the tensors: no second copy)."""
    cls = BACKBONES[backbone].transformer_cls
    with torch.device("meta"):
        model: nn.Module = cls.from_config(dict(config))
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(str(out))


def export_run(cfg: Config, out_dir: str | Path) -> Path:
    """Export the checkpoint of ``cfg.log.run_dir`` to ``out_dir`` without training (module docstring):
    the EMA weights when the checkpoint holds them. Every rank calls it; ``FileNotFoundError`` when the run
    has no checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    dist = DistInfo.current()
    path = find_checkpoint(cfg.log.run_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under log.run_dir={cfg.log.run_dir}: train first")
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    t = cfg.train
    device = torch.device("cuda" if t.device == "auto" and torch.cuda.is_available() else t.device)
    backbone, _ = place_backbone(cfg, _load_backbone(cfg, dist), device=device, dist=dist)
    load_weights(path, backbone, ema=any(k.startswith("ema.") for k in keys))
    return export_trained(cfg, backbone, out_dir, dist=dist)


def _load_backbone(cfg: Config, dist: DistInfo) -> Backbone:
    """The run's backbone before training, nothing else (no text encoders, VAE or rewards): pretrained
    weights on rank 0 and the meta device elsewhere, as ``build_pretrained_components`` loads it."""
    if cfg.model.source != "pretrained":
        from jagg.loop.components import build_components

        return build_components(cfg).backbone
    from jagg.scale.pretrained import load_backbone

    return load_backbone(cfg.model.backbone, cfg.model.path, dtype=weights_dtype(cfg), meta=not dist.is_main)
