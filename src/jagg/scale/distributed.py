"""FSDP2 for a backbone's transformer, process-group setup, and a collective counter.

``shard_backbone`` applies ``torch.distributed.fsdp.fully_shard`` to every transformer block and then to the
transformer itself (the root unit holds the embedders and the output head), the layout DanceGRPO's FSDP
wrap policy and Flow-GRPO's Qwen-Image FSDP use per block. Each ``fully_shard`` unit is one "sharded group":
after a backward FSDP2 reduce-scatters its gradients once. Hence (docs/decisions.md):
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
from dataclasses import dataclass

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


# --------------------------------------------------------------------------- rank plumbing for the trainer
@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job. World size 1 (no process group) makes every helper an identity."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> DistInfo:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def share(self, n: int) -> slice:
        """This rank's contiguous block of ``n`` global items (``n`` divisible by the world size)."""
        k = n // self.world_size
        return slice(self.rank * k, (self.rank + 1) * k)

    def _comm_device(self) -> torch.device:
        return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")

    def gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's equally shaped ``x`` along dim 0, in rank order (on x's device)."""
        if not self.enabled:
            return x
        local = x.detach().to(self._comm_device()).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(x.device)

    def reduce_scalars(self, values: dict[str, float], op: str = "mean") -> dict[str, float]:
        """Mean / max / sum of per-rank floats (one all-reduce); identity on one process."""
        if not self.enabled or not values:
            return dict(values)
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t /= self.world_size
        return dict(zip(values, t.tolist()))

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (an FSDP2-sharded parameter, its gradient or its optimizer state)."""
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor (all-gather for a DTensor: call on every rank); plain tensors pass through."""
    return t.full_tensor() if is_sharded(t) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``like`` (a DTensor: this rank's shard, via ``distribute_tensor``; call on every
    rank), on ``like``'s device and dtype."""
    full = full.to(device=like.device, dtype=like.dtype)
    if not is_sharded(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded state tensor gathered to a full CPU tensor."""
    sd = optimizer.state_dict()
    state = {
        pid: {k: full_tensor(v).cpu() if torch.is_tensor(v) else v for k, v in st.items()}
        for pid, st in sd["state"].items()
    }
    return {**sd, "state": state}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, params: list, sd: dict) -> None:
    """Inverse of ``full_optimizer_state`` for the single parameter group over ``params``."""
    state = {}
    for pid, st in sd["state"].items():
        p = params[int(pid)]
        state[pid] = {
            k: shard_like(v, p) if torch.is_tensor(v) and v.shape == p.shape else v for k, v in st.items()
        }
    optimizer.load_state_dict({**sd, "state": state})
