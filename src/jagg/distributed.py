"""FSDP2 for a backbone's transformer, process-group setup, and a collective counter.

``shard_backbone`` applies ``torch.distributed.fsdp.fully_shard`` to every transformer block and then to the
transformer itself (the root unit holds the embedders and the output head), the layout DanceGRPO's FSDP
wrap policy and Flow-GRPO's Qwen-Image FSDP use per block. Each ``fully_shard`` unit is one "sharded group":
after a backward FSDP2 reduce-scatters its gradients once. Hence (REFERENCE.md section 7):
    exact strategy  W backward calls per group   -> W reduce-scatters per unit
    JAGG            one joint backward over two forwards -> 1 reduce-scatter per unit
(``tests/test_distributed.py`` counts them with ``CollectiveCounter``). Apply LoRA before sharding.

CPU: gloo works for FSDP2 in torch 2.14 (FSDP2 calls ``dist.reduce_scatter_single`` /
``dist.all_gather_single``, both implemented by gloo); use one thread per process.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

# torch.distributed functions FSDP2 (and DDP / manual code) may call to move gradients or parameters.
COLLECTIVES = (
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
)


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; returns (rank, world_size).

    Backend: nccl when CUDA is available, else gloo. A run without torchrun's variables is world size 1
    and initialises nothing.
    """
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a diffusers DiT: Flux double + single stream, Qwen-Image / SD3 joint blocks."""
    blocks: list[nn.Module] = []
    for attr in ("transformer_blocks", "single_transformer_blocks"):
        blocks.extend(getattr(transformer, attr, None) or [])
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no transformer_blocks to shard")
    return blocks


def shard_backbone(
    backbone: nn.Module,
    mesh=None,
    *,
    reshard_after_forward: bool = True,
    mp_policy=None,
) -> nn.Module:
    """``fully_shard`` each block of ``backbone.transformer`` and then the transformer (root), in place.

    ``mesh``: a 1-D device mesh (default: all ranks, ``init_device_mesh(device_type, (world_size,))``).
    ``mp_policy``: e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
    Returns the backbone; its ``transformer`` and blocks are now ``FSDPModule``s.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kw = dict(
        mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy()
    )
    transformer = backbone.transformer
    for block in transformer_blocks(transformer):
        fully_shard(block, **kw)
    fully_shard(transformer, **kw)
    return backbone


def fsdp_units(backbone: nn.Module) -> list[nn.Module]:
    """The ``fully_shard`` units (sharded groups) of a sharded backbone: blocks then root."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in backbone.transformer.modules() if isinstance(m, FSDPModule)]


@contextmanager
def CollectiveCounter(names: tuple[str, ...] = COLLECTIVES) -> Iterator[Counter]:
    """Count calls of ``torch.distributed`` collectives inside the block (outermost calls only).

    FSDP2 looks the functions up on the ``torch.distributed`` module at call time, so patching the module
    attributes sees every call it makes. Nested calls (one collective implemented with another) count once.
    """
    counts: Counter = Counter()
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    depth = [0]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for n, fn in originals.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every gradient (DTensor grads are all-gathered; call on every rank).

    Units left unsharded by ``set_reshard_after_backward(False)`` are resharded first: while unsharded,
    ``named_parameters`` returns the gathered tensors, whose ``.grad`` is None (the gradient lives on the
    sharded parameter).
    """
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    out = {}
    for n, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out
