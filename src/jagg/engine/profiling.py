"""Memory accounting that works on CPU as well as GPU: peak bytes held by autograd for backward.

``SavedActivationMeter`` hooks ``torch.autograd.graph.saved_tensors_hooks`` and tracks the storages that
live autograd graphs keep alive (parameters excluded, shared storages counted once). JAGG keeps two graphs
alive until its joint backward; the exact strategy keeps one at a time.
"""

from __future__ import annotations

import torch


class _Held:
    """A saved tensor plus the bookkeeping that releases its bytes when autograd frees it."""

    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: SavedActivationMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class SavedActivationMeter:
    """Context manager; ``peak_bytes`` is the high-water mark of bytes saved for backward."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage ptr -> [nbytes, refs]
        self.current = 0
        self.peak_bytes = 0

    def _pack(self, t: torch.Tensor):
        if t.is_leaf and t.requires_grad:  # a parameter, not an activation
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current)
        else:
            entry[1] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def _unpack(obj):
        return obj.tensor if isinstance(obj, _Held) else obj

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __enter__(self) -> SavedActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20
