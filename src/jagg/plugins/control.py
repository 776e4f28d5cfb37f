"""The positive controls as plug-ins of the update (``jagg.engine.control`` holds the math).

``Control``: before every optimizer step the gradient is replaced by one with cosine ``plugins.control.cosine``
to it and the same norm. ``StructuredControl`` (``plugins.structured_control.kind`` and ``.dial``): the
gradient is recomputed with a structured error on the same steps (class ``StructuredControl``).

Config keys (``ControlConfig``, ``StructuredControlConfig``; train.control_* before, still read under those
names). The directions are functions of the seed (``SeedStream.CONTROL``), so a resumed run degrades exactly as
the uninterrupted one: no state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jagg.common import SeedStream, generator
from jagg.engine.control import (
    CONTROL_DIRECTIONS,
    MAX_FRESH_ITERATIONS,
    STRUCTURED_CONTROLS,
    PositiveControl,
    reweighted,
    toward,
)
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import Interpolation
from jagg.plugins.base import MicroBatch, Plugin, PluginConfig, RunView, UpdateView, require


@dataclass(frozen=True, kw_only=True)
class ControlConfig(PluginConfig):
    """plugins.control (train.control_cosine / control_direction before): the gradient mixed with a random
    direction at ``cosine`` (null: off), the direction drawn once per run (``fixed``: a bias, as JAGG's error
    is) or for every optimizer step (``fresh``: noise)."""

    cosine: float | None = None
    direction: str = "fixed"

    def validate(self, cfg) -> None:
        require(
            self.cosine is None or 0 < self.cosine <= 1,
            f"plugins.control.cosine must be null or in (0, 1], got {self.cosine}",
        )
        require(
            self.direction in CONTROL_DIRECTIONS,
            f"plugins.control.direction must be one of {list(CONTROL_DIRECTIONS)}, got {self.direction!r}",
        )
        require(
            self.direction == "fixed" or cfg.train.iterations <= MAX_FRESH_ITERATIONS,
            f"plugins.control.direction=fresh draws from the control's seed stream, which holds "
            f"{MAX_FRESH_ITERATIONS} iterations; train.iterations must be <= {MAX_FRESH_ITERATIONS}, "
            f"got {cfg.train.iterations}",
        )
        require(
            self.cosine is None or cfg.plugins.structured_control.kind is None,
            "plugins.control.cosine and plugins.structured_control.kind are two controls: set one, got both",
        )


@dataclass(frozen=True, kw_only=True)
class StructuredControlConfig(PluginConfig):
    """plugins.structured_control (train.control_structure / control_dial before): on the exact strategy's own
    steps, the gradient recomputed with every step's signal re-weighted at random (``reweight``, ``dial`` = the
    log-weights' SD) or with the aggregation matrix moved toward the endpoints rule (``toward_endpoints``, dial
    in [0, 1]: 1 is the endpoints ablation); ``kind`` null: off."""

    kind: str | None = None
    dial: float = 0.0

    def validate(self, cfg) -> None:
        require(
            self.kind is None or self.kind in STRUCTURED_CONTROLS,
            f"plugins.structured_control.kind must be null or one of {list(STRUCTURED_CONTROLS)}, "
            f"got {self.kind!r}",
        )
        top = 1.0 if self.kind == "toward_endpoints" else math.inf
        require(
            0 <= self.dial <= top,
            f"plugins.structured_control.dial for kind={self.kind} must be in [0, {top}], got {self.dial}",
        )
        require(
            self.kind != "toward_endpoints" or cfg.backward.group_size is not None,
            "plugins.structured_control.kind=toward_endpoints moves toward the endpoints rule on groups of "
            "backward.group_size, which must then be an integer, got 'auto'",
        )


class Control(Plugin):
    name = "control"
    CONFIG = ControlConfig

    def __init__(self, control: PositiveControl) -> None:
        self.control = control

    @classmethod
    def from_config(cls, cfg, run: RunView) -> Control | None:
        own = cfg.plugins.control
        if own.cosine is None:
            return None
        draw = lambda i: generator(run.seed, SeedStream.CONTROL, i)  # noqa: E731
        return cls(PositiveControl(run.params, own.cosine, own.direction, draw))

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
    CONFIG = StructuredControlConfig

    def __init__(self, kind: str, dial: float, seed: int, endpoints: BackwardSetting | None) -> None:
        self.kind, self.dial, self.seed, self.endpoints = kind, dial, seed, endpoints

    @classmethod
    def from_config(cls, cfg, run: RunView) -> StructuredControl | None:
        kind = cfg.plugins.structured_control.kind
        if kind is None:
            return None
        rule = dataclasses.replace(cfg.backward, strategy="endpoints", jagg_frac=1.0)
        endpoints = rule.fixed_setting() if kind == "toward_endpoints" else None  # config: a fixed group size
        return cls(kind, cfg.plugins.structured_control.dial, run.seed, endpoints)

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
