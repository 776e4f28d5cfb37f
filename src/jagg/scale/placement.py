"""Where the trained backbone lives: LoRA, parameter dtypes, device, and FSDP2 shards loaded from rank 0.

    dtypes        ``train.precision=bf16``: the trained parameters are fp32 master weights under bf16 autocast;
                  frozen parameters (the LoRA base) stay in bf16, the dtype they were loaded in, and are never
                  upcast; with ``model.base_dtype: fp32`` they are loaded and kept in fp32 (Flow-GRPO's SD3
                  trainer), autocast casting each matmul's weight. fp32 / fp64: every parameter in that dtype.
    one process   the backbone is cast and moved to the training device.
    N processes   only rank 0 holds the loaded weights (``model.source=pretrained`` builds the transformer on
                  the meta device on the other ranks); every rank shards its copy per block
                  (``shard_backbone``), allocates only its own shards and receives them from rank 0 one tensor
                  at a time (``jagg.scale.distributed.shard_from_rank0``). No rank but 0 ever holds the full
                  model, and rank 0 holds it once, in the dtype it was loaded in.
                  ``model.shard_frozen_base: false`` (LoRA): the frozen base is left out of the shards (FSDP2
                  ``ignored_params``) and every rank receives it in full, in the compute dtype; only the
                  adapters are sharded, all-gathered and reduce-scattered.

The trainer and the export step (``jagg.loop.export``) place the backbone the same way, so a checkpoint's
keys and shapes match whichever of them loads it.
"""

from __future__ import annotations

import copy

import torch

from jagg.config import Config
from jagg.distributed import DistInfo
from jagg.models import Backbone
from jagg.scale.distributed import broadcast_module, cast_parameters, shard_backbone, shard_from_rank0
from jagg.scale.lora import DEFAULT_TARGETS, apply_lora

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def parameter_dtypes(precision: str, base_dtype: str = "compute") -> tuple[torch.dtype, torch.dtype]:
    """(trained, frozen) parameter dtypes of ``train.precision`` and ``model.base_dtype``: bf16 -> (fp32
    master, bf16), or (fp32, fp32) with an fp32 base."""
    compute = DTYPES[precision]
    frozen = torch.float32 if base_dtype == "fp32" else compute
    return (torch.float32 if compute == torch.bfloat16 else compute), frozen


def weights_dtype(cfg: Config) -> torch.dtype:
    """The dtype a pretrained transformer and its VAE load in: the frozen parameters' (above); fp64 runs load
    fp32 and are cast by ``place_backbone``."""
    frozen = parameter_dtypes(cfg.train.precision, cfg.model.base_dtype)[1]
    return torch.bfloat16 if frozen == torch.bfloat16 else torch.float32


def mixed_precision(precision: str):
    """FSDP2 policy: bf16 compute and all-gathers, fp32 gradient reduction, when ``precision`` is bf16.

    Forward inputs keep their dtype (``cast_forward_inputs=False``; FSDP2's default casts every float input
    of every block to bf16, Flux's rotary cos / sin included): the rotary tables stay fp32 as in the diffusers
    pipelines, DanceGRPO and a one-process run, and the trainer's bf16 autocast picks each op's compute dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if DTYPES[precision] != torch.bfloat16:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def apply_run_lora(cfg: Config, backbone: Backbone) -> None:
    """peft LoRA on the transformer (rank, alpha, targets from model.*); the same init on every rank."""
    m = cfg.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        targets = m.lora_targets or DEFAULT_TARGETS[m.backbone]
        for network in backbone.networks:  # Wan2.2-A14B: both experts, one after the other from one seed
            apply_lora(network, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=targets)


def place_backbone(
    cfg: Config,
    backbone: Backbone,
    *,
    device: torch.device,
    dist: DistInfo,
    reference: bool = False,
) -> tuple[Backbone, Backbone | None]:
    """LoRA (``model.lora_rank > 0``), gradient checkpointing, dtypes, device and, under several processes,
    FSDP2 sharding with rank 0's weights (module docstring). Returns (backbone, reference): ``reference`` asks
    for an unsharded frozen copy of the initial model on every rank (the KL reference; small models only)."""
    trained, frozen = parameter_dtypes(cfg.train.precision, cfg.model.base_dtype)
    if cfg.model.lora_rank > 0:  # before sharding and before the optimizer sees the parameters
        apply_run_lora(cfg, backbone)
    if cfg.model.gradient_checkpointing:
        for network in backbone.networks:
            network.enable_gradient_checkpointing()
    ref = None
    if not dist.enabled:
        cast_parameters(backbone, trainable=trained, frozen=frozen, device=device)
        if reference:
            ref = copy.deepcopy(backbone).requires_grad_(False)
        return backbone, ref
    if reference:  # cast first (free on the meta ranks), so the copy has the trained model's dtypes
        cast_parameters(backbone, trainable=trained, frozen=frozen)
        ref = broadcast_module(copy.deepcopy(backbone).requires_grad_(False), device=device)
    policy = mixed_precision(cfg.train.precision)
    shard_from_rank0(
        backbone,
        lambda b: shard_backbone(b, mp_policy=policy, shard_frozen=cfg.model.shard_frozen_base),
        device=device,
        trainable=trained,
        frozen=frozen,
    )
    return backbone, ref
