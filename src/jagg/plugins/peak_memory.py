"""Peak memory as a plug-in of the update: after each update, the process's peak memory on the run's device
(``jagg.common.peak_memory_mb``: CUDA's allocated peak, else the host's peak resident set) as ``peak_memory_mb``
in the row. Always on; no config key, no state.
"""

from __future__ import annotations

import torch

from jagg.common import peak_memory_mb
from jagg.plugins.base import Plugin, RunView


class PeakMemory(Plugin):
    name = "peak_memory"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def from_config(cls, cfg, run: RunView) -> PeakMemory:
        return cls(run.device)

    def metrics(self) -> dict:
        return {"peak_memory_mb": peak_memory_mb(self.device)}
