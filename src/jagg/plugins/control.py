"""The positive controls as plug-ins of the update (``jagg.engine.control`` holds the math).

``Control``: before every optimizer step the gradient is replaced by one with cosine ``train.control_cosine``
to it and the same norm. ``StructuredControl`` (``train.control_structure``, ``train.control_dial``): the
gradient is recomputed with a structured error on the same steps (class ``StructuredControl``).

Config keys: ``train.control_cosine`` (null: off; in (0, 1]) and ``train.control_direction`` (``fixed``: one
random direction per run, a bias; ``fresh``: one per optimizer step, noise). The directions are functions of
the seed (``SeedStream.CONTROL``), so a resumed run degrades exactly as the uninterrupted one: no state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jagg.common import SeedStream, generator
from jagg.config import Config
from jagg.engine.control import PositiveControl, reweighted, toward
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import Interpolation
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

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        self.control.apply()


class StructuredControl(Plugin):
    """A control whose error has JAGG's kind of structure, with a dial (``jagg.engine.control``): before every
    optimizer step the gradient is recomputed on the step's micro-batches with the control's plan of their
    trained steps (signals re-weighted at random, or the aggregation matrix moved toward the endpoints rule),
    replacing the one the arm's backward made. The re-weighting draws are a function of (seed, iteration), one
    weight per step and sample where the trained steps are per sample (DanceGRPO), per step where the batch
    shares them (windows)."""

    name = "structured_control"
    KEYS = ("train.control_structure", "train.control_dial", "backward.group_size")

    def __init__(self, kind: str, dial: float, seed: int, endpoints: BackwardSetting | None) -> None:
        self.kind, self.dial, self.seed, self.endpoints = kind, dial, seed, endpoints

    @classmethod
    def from_config(cls, cfg: Config, run: RunView) -> StructuredControl | None:
        kind = cfg.train.control_structure
        if kind is None:
            return None
        rule = dataclasses.replace(cfg.backward, strategy="endpoints", jagg_frac=1.0)
        endpoints = rule.fixed_setting() if kind == "toward_endpoints" else None  # config: a fixed group size
        return cls(kind, cfg.train.control_dial, run.seed, endpoints)

    def begin_update(self, view: UpdateView) -> None:
        self.gen = generator(self.seed, SeedStream.CONTROL, view.iteration)

    def plan(self, sigma) -> Interpolation:
        """The control's plan of the micro-batch's T trained steps (times ``sigma``: (T,) or (T, B))."""
        if self.kind == "reweight":
            batch = sigma.shape[1] if sigma.ndim == 2 else 1
            return reweighted(sigma.shape[0], batch, self.dial, self.gen)
        return toward(self.endpoints.routing.interpolation(sigma), self.dial)

    def before_step(self, view: UpdateView, pending: Sequence[MicroBatch]) -> None:
        for p in view.params:
            p.grad = None
        for batch in pending:
            loss, outputs = view.inputs(batch.rows)
            view.setting.run(self.plan(loss.sigma), view.velocity(batch.rows), loss, outputs)
