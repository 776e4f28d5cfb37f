"""The positive control as a plug-in of the update: before every optimizer step the gradient is replaced by one
with cosine ``train.control_cosine`` to it and the same norm (``jagg.engine.control`` holds the math).

Config keys: ``train.control_cosine`` (null: off; in (0, 1]) and ``train.control_direction`` (``fixed``: one
random direction per run, a bias; ``fresh``: one per optimizer step, noise). The directions are functions of
the seed (``SeedStream.CONTROL``), so a resumed run degrades exactly as the uninterrupted one: no state.
"""

from __future__ import annotations

from collections.abc import Sequence

from jagg.common import SeedStream, generator
from jagg.config import Config
from jagg.engine.control import PositiveControl
from jagg.plugins.base import MicroBatch, Plugin, RunView, UpdateView


class Control(Plugin):
    name = "control"
    KEYS = ("train.control_cosine", "train.control_direction")

    def __init__(self, control: PositiveControl) -> None:
        self.control = control

    @classmethod
    def from_config(cls, cfg: Config, run: RunView) -> Control | None:
        train = cfg.train
        if train.control_cosine is None:
            return None
        draw = lambda i: generator(run.seed, SeedStream.CONTROL, i)  # noqa: E731
        return cls(PositiveControl(run.params, train.control_cosine, train.control_direction, draw))

    def begin_update(self, view: UpdateView) -> None:
        self.control.start_iteration(view.iteration)

    def before_step(self, view: UpdateView | None, pending: Sequence[MicroBatch]) -> None:
        self.control.apply()
