"""Measured backward settings: one calibrator per routing kind, each with one shape.

Each calibrator points at its keys (``CONFIG``: a frozen config in the engine's ``CALIBRATIONS``, flat keys of
``backward:``, with their defaults and checks) and reads them once (``keys``). A calibrator says when it is due
(``due``: before the first update, then every ``backward.calibrate_every`` iterations), measures a setting on
one micro-batch of the iteration's rollout (``measure``, from a ``Probe``: velocity, loss, parameters; ``.grad``
is left as it was) and keeps what it measured for checkpoints
(``state_dict`` / ``load_state_dict``), so a resumed run restores it instead of measuring again early.

    GroupsCalibrator   ``backward.jagg_frac: auto``: the cosine of each group position's gradient to its exact one
                       routes the positions that reach ``backward.min_cosine`` (with ``group_size: auto`` also W,
                       by the cost model; ``calibrate_routing``)
    WindowsCalibrator  the same under MixGRPO, whose trained steps are one window sliding along the trajectory:
                       how well interpolation does depends on where it is, so each window position the coming
                       iterations train is measured on a rollout of that window rebuilt from the probe's
                       samples (``window_losses``, ``calibrate_windows``)
    KnotsCalibrator    ``backward.placement: auto``: the placement rule whose gradient is closest to exact
                       (``calibrate_knots``)

``calibrator_for`` picks the one a run needs: the only place that tells the routing kinds apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.common import SeedStream, generator
from jagg.config import BackwardConfig
from jagg.engine.algorithms import Algorithm
from jagg.engine.grpo import GRPOStepLoss, TrainedSteps
from jagg.engine.knots import Knots
from jagg.engine.routing import (
    CALIBRATIONS,
    BackwardSetting,
    CalibrationConfig,
    Routing,
    WindowRouting,
    calibrate_knots,
    calibrate_routing,
    calibrate_windows,
)
from jagg.engine.sampling import Trajectory, sample_trajectory
from jagg.engine.strategies import Velocity
from jagg.plugins.base import Plugin


@dataclass(frozen=True)
class Probe:
    """What a calibration measures from: the micro-batch ``rows`` of the rollout ``traj`` of ``iteration``.

    ``loss`` is its unscaled GRPO loss over its trained steps (the same loss of other steps of these samples is
    ``dataclasses.replace(loss, steps=...)``); ``sigmas`` the run's schedule, on the device; ``micro_batches``
    and ``grad_accum`` describe the update whose cost decides W under ``group_size: auto``."""

    iteration: int
    velocity: Velocity
    loss: GRPOStepLoss
    params: Sequence[torch.nn.Parameter]
    micro_batches: int
    grad_accum: int
    traj: Trajectory
    rows: slice
    sigmas: Tensor


class Calibrator(Plugin):
    """One routing kind's measurement (module docstring); ``setting`` is the last one measured or restored.
    The trainer measures with it before an update when it is due; to the update it is a plug-in that does
    nothing but keep its checkpoint state under ``name`` in the trainer's one list (``jagg.plugins.base``)."""

    name = "calibration"
    CONFIG: type[CalibrationConfig] = CalibrationConfig

    def __init__(self, backward: BackwardConfig) -> None:
        self.config = backward
        self.keys = self.CONFIG.of(backward)
        self.setting: BackwardSetting | None = None

    def due(self, it: int) -> bool:
        return self.setting is None or it % self.keys.calibrate_every == 0

    def measure(self, probe: Probe) -> dict:
        """Measure on ``probe``, keep the result as ``setting``; returns the measurement's metrics."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


class GroupsCalibrator(Calibrator):
    CONFIG = CALIBRATIONS["groups"]

    def measure(self, probe: Probe) -> dict:
        backward = self.config
        calibration = calibrate_routing(
            probe.velocity,
            probe.loss,
            probe.params,
            setting=backward.planned_setting(),
            group_sizes=backward.candidate_group_sizes,
            min_cosine=self.keys.min_cosine,
            micro_batches=probe.micro_batches,
            grad_accum=probe.grad_accum,
        )
        self.setting = backward.setting(calibration.routing)
        return calibration.as_metrics(per_group_size=backward.group_size is None)

    def state_dict(self) -> dict:
        routing = None if self.setting is None else self.setting.routing
        measured = None if routing is None or routing.measured is None else list(routing.measured)
        return {"routing": measured, "group_size": None if routing is None else routing.group_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("routing") is None:
            return
        routing = Routing(
            strategy=self.config.strategy, group_size=state["group_size"], measured=tuple(state["routing"])
        )
        self.setting = self.config.setting(routing)


class WindowsCalibrator(Calibrator):
    CONFIG = CALIBRATIONS["windows"]

    def __init__(self, backward: BackwardConfig, algorithm: Algorithm, num_steps: int, seed: int) -> None:
        super().__init__(backward)
        self.algorithm, self.num_steps, self.seed = algorithm, num_steps, seed

    def measure(self, probe: Probe) -> dict:
        """The windows trained until the next calibration (positions further on would be measured on weights
        they are not used with), each on a rollout of its own (``rebuilt``)."""
        backward, it = self.config, probe.iteration
        windows = self.algorithm.windows(self.num_steps, range(it, it + self.keys.calibrate_every))
        calibration = calibrate_windows(
            probe.velocity,
            self.rebuilt(probe, windows),
            probe.params,
            strategy=backward.strategy,
            group_size=backward.group_size,
            min_cosine=self.keys.min_cosine,
            graph_mode=backward.graph_mode,
        )
        self.setting = backward.setting(calibration.routing)
        return calibration.as_metrics()

    def rebuilt(self, probe: Probe, windows: list[range]) -> dict[int, GRPOStepLoss]:
        """``window_losses`` of the probe's samples, their SDE noise drawn from (seed, ``SeedStream.CALIBRATION``,
        iteration)."""
        gen = generator(self.seed, SeedStream.CALIBRATION, probe.iteration)
        seed = int(torch.randint(2**62, (1,), generator=gen))
        return window_losses(
            probe.velocity, probe.traj, probe.rows, probe.sigmas, windows, probe.loss, seed=seed
        )

    def state_dict(self) -> dict:
        routing = None if self.setting is None else self.setting.routing
        if routing is None:
            return {"group_size": None, "windows": None}
        return {"group_size": routing.group_size, "windows": [list(p) for p in routing.routed]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("windows") is None:
            return
        routed = tuple((int(start), bool(r)) for start, r in state["windows"])
        routing = WindowRouting(strategy=self.config.strategy, group_size=state["group_size"], routed=routed)
        self.setting = self.config.setting(routing)


class KnotsCalibrator(Calibrator):
    CONFIG = CALIBRATIONS["knots"]

    def measure(self, probe: Probe) -> dict:
        backward = self.config
        measured = calibrate_knots(
            probe.velocity,
            probe.loss,
            probe.params,
            count=backward.knots,
            graph_mode=backward.graph_mode,
        )
        self.setting = backward.setting(measured.routing)
        return measured.as_metrics()

    def state_dict(self) -> dict:
        return {"placement": None if self.setting is None else self.setting.routing.placement}

    def load_state_dict(self, state: dict) -> None:
        if state.get("placement") is not None:
            self.setting = self.config.setting(Knots(count=self.config.knots, placement=state["placement"]))


def calibrator_for(
    backward: BackwardConfig, algorithm: Algorithm, num_steps: int, seed: int
) -> Calibrator | None:
    """The calibrator of a run with this backward config and algorithm over ``num_steps`` steps and this seed
    (``train.seed``), or None where nothing is measured (the setting is fixed by the config)."""
    if not backward.calibrated:
        return None
    if backward.strategy == "knots":
        return KnotsCalibrator(backward)
    if algorithm.windows(num_steps, range(0)) is not None:  # trained steps are one sliding window (MixGRPO)
        return WindowsCalibrator(backward, algorithm, num_steps, seed)
    return GroupsCalibrator(backward)


@torch.no_grad()
def window_losses(
    velocity: Velocity,
    traj: Trajectory,
    rows: slice,
    sigmas: Tensor,
    windows: Sequence[range],
    loss: GRPOStepLoss,
    *,
    seed: int,
) -> dict[int, GRPOStepLoss]:
    """Per window, by first step, ``loss`` (the samples' own, at any steps) at a rollout of that window on the
    samples ``rows`` of the rollout ``traj`` (``velocity`` is theirs; ``sigmas`` the run's schedule).

    Why not the stored trajectory at the window's steps: outside the rollout's own window its steps are ODE
    steps, whose next latent is the deterministic Euler step, not an SDE sample, so the SDE log-prob's gradient
    there is not the one a rollout with the window there would train. What a MixGRPO rollout with the window at
    p does is rebuilt instead, for the price of the window's forwards: the ODE path from the samples' initial
    noise to step p (stored up to the rollout's first SDE step, continued from there at most to the last
    window's start), then the window's SDE steps (the loss's ``kind`` and ``noise_level``, drawn from ``seed``)
    with their old log-probs at the current weights (ratios 1, as in the update's first micro-batches). The
    advantages are the samples' own (``loss``'s): the rebuilt windows have no reward, and the cosine compares
    two estimates of the same advantage-weighted gradient (with one sample per micro-batch it does not depend
    on the advantage).
    """
    states = _ode_states(velocity, traj, rows, sigmas, last=max(w.start for w in windows))
    gen = torch.Generator(device=states.device).manual_seed(seed)
    losses = {}
    for w in windows:
        times = sigmas[w.start : w.stop + 1]
        sde = sample_trajectory(
            velocity,
            states[w.start],
            times,
            [loss.kind] * len(w),
            noise_level=loss.noise_level,
            generator=gen,
        )
        trained = TrainedSteps(
            x=sde.latents[:-1],
            x_next=sde.latents[1:],
            sigma=times[:-1],
            sigma_next=times[1:],
            old_log_prob=sde.log_probs,
        )
        losses[w.start] = dataclasses.replace(loss, steps=trained)
    return losses


def _ode_states(velocity: Velocity, traj: Trajectory, rows: slice, sigmas: Tensor, last: int) -> Tensor:
    """x of the samples ``rows`` at steps 0..``last`` on the ODE path: stored up to the rollout's first SDE step
    (every step before it is an ODE step on the run's schedule, MixGRPO-Flash included), Euler steps after."""
    first = min(traj.sde_steps[0], last)
    stored = traj.latents[: first + 1, rows]
    if first == last:
        return stored
    more = sample_trajectory(velocity, stored[-1], sigmas[first : last + 1], ["ode"] * (last - first))
    return torch.cat([stored, more.latents[1:]])
