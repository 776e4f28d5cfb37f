"""The process group and the rank helpers every run uses, one process included.

``init_distributed`` joins torchrun's process group (nothing without torchrun); ``DistInfo`` is this process's
place in the job, whose helpers (this rank's share of a global batch, gathers, scalar reductions, a barrier)
are identities on one process; ``full_tensor`` unshards a DTensor (an FSDP2 parameter, gradient or optimizer
state) and passes a plain tensor through. Sharding a model (FSDP2) is ``jagg.scale.distributed``.

Layer: bottom (beside ``jagg.common``); it imports only torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: float = 3600.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; returns (rank, world_size).

    Backend: nccl when CUDA is available, else gloo. ``timeout_s`` bounds every collective, barriers
    included (``train.dist_timeout_s``; torch's NCCL default of 10 min is shorter than rank 0 alone loading,
    precomputing embeddings or exporting 22-38 GiB while the others wait). A run without torchrun's
    variables is world size 1 and initialises nothing.
    """
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


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
