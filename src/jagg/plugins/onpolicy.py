"""The on-policy check as a plug-in of the update: the largest |ratio - 1| of any trained step before the
update's first optimizer step. Rollouts and updates use the same micro-batches and numerics, so on the
rollout's weights every ratio is exactly 1 and this is exactly 0; anything else is a bug (a changed forward,
stale stored outputs, another batch composition). Always on; no config key, no state.
"""

from __future__ import annotations

from collections.abc import Sequence

from jagg.distributed import DistInfo
from jagg.plugins.base import MicroBatch, Plugin, RunView, UpdateView


class OnPolicy(Plugin):
    name = "onpolicy"

    def __init__(self, dist: DistInfo) -> None:
        self.dist = dist
        self.deviation, self.first = 0.0, True

    @classmethod
    def from_config(cls, cfg, run: RunView) -> OnPolicy:
        return cls(run.dist)

    def begin_update(self, view: UpdateView) -> None:
        self.deviation, self.first = 0.0, True

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        if self.first:  # the micro-batches before the first step ran on the rollout's weights
            devs = [st.ppo.ratio_max_dev for batch in pending for st in batch.stats]
            self.deviation = max([self.deviation, *devs])
            self.first = False

    def metrics(self) -> dict:
        """The largest deviation over every rank (a collective: every rank calls it)."""
        return {"onpolicy_ratio_max_dev": self.dist.reduce_scalars({"d": self.deviation}, "max")["d"]}
