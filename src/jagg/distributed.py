"""The process group and the rank helpers every run uses, one process included.

``init_distributed`` joins torchrun's process group (nothing without torchrun); ``DistInfo`` is this process's
place in the job (its global rank, and its rank on its node: ``local_rank`` of ``local_world_size``), whose helpers (this rank's share of a global batch, gathers, scalar reductions, a barrier)
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
    """This process's place in the job. World size 1 (no process group) makes every helper an identity.

    ``rank`` / ``world_size`` are global: they split batches and name shards, and rank 0 alone writes what the
    job writes once (run.json, metrics, the lock) to ``log.run_dir``, which every node must share.
    ``local_rank`` / ``local_world_size`` are this process's place on its node (torchrun's ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE``; unset: one node, equal to the global ones): its GPU, and what each node does once
    (``is_node_main``: the node report, a node-local cache filled per node)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None  # None: one node (the global rank)
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if self.local_rank is None:
            object.__setattr__(self, "local_rank", self.rank)
        if self.local_world_size is None:
            object.__setattr__(self, "local_world_size", self.world_size)

    @classmethod
    def current(cls) -> DistInfo:
        if dist.is_available() and dist.is_initialized():
            local, local_world = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
            return cls(
                dist.get_rank(),
                dist.get_world_size(),
                None if local is None else int(local),
                None if local_world is None else int(local_world),
            )
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_node_main(self) -> bool:
        """The first process on its node (what a node does once)."""
        return self.local_rank == 0

    @property
    def nodes(self) -> int:
        """Nodes in the job (torchrun gives every node the same number of processes)."""
        return max(1, self.world_size // max(1, self.local_world_size))

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

    def gather_objects(self, obj) -> list:
        """Every rank's picklable ``obj`` in rank order (one ``all_gather_object``); ``[obj]`` on one process."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def first_error(self, error: str | None) -> str | None:
        """The lowest rank's error of a check every rank made (None: none failed), the same on every rank, so
        all stop together instead of the others waiting in the next collective until the timeout; another
        rank's is prefixed with its rank."""
        for r, err in enumerate(self.gather_objects(error)):
            if err is not None:
                return err if r == 0 else f"rank {r}: {err}"
        return None

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (an FSDP2-sharded parameter, its gradient or its optimizer state)."""
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor (all-gather for a DTensor: call on every rank); plain tensors pass through."""
    return t.full_tensor() if is_sharded(t) else t
