"""Measured backward settings: what ``Trainer.calibrate`` measures, and how a checkpoint keeps it.

``backward.jagg_frac: auto`` (groups) measures the cosine of each group position's gradient to its exact one and
routes the positions that reach ``backward.min_cosine`` (``calibrate_routing``; with ``backward.group_size: auto``
also W, by the cost model). ``backward.placement: auto`` (knots) keeps the placement rule whose micro-batch
gradient is closest to exact (``calibrate_knots``). Both run on one micro-batch and leave ``.grad`` as it was.
Under MixGRPO (``Algorithm.windows``) the trained steps are one window that slides along the trajectory, and how
well interpolation does depends on where it is, so ``jagg_frac: auto`` measures per window position instead
(``window_losses``, ``measure_windows``): a ``WindowRouting`` keyed by the window's first step.
A checkpoint stores the measured routing (``record``), and a resumed run restores it (``restore``) rather than
measuring again before its next calibration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from jagg.config import BackwardConfig
from jagg.engine.algorithms import Algorithm
from jagg.engine.grpo import TrainedSteps
from jagg.engine.knots import Knots
from jagg.engine.routing import (
    BackwardSetting,
    Routing,
    WindowRouting,
    calibrate_knots,
    calibrate_routing,
    calibrate_windows,
)
from jagg.engine.sampling import Trajectory, sample_trajectory
from jagg.engine.strategies import StepLoss, Velocity


def measure_setting(
    backward: BackwardConfig,
    velocity: Velocity,
    loss,
    params: Sequence[torch.nn.Parameter],
    *,
    micro_batches: int,
    grad_accum: int,
) -> tuple[BackwardSetting, dict]:
    """The measured setting of ``backward`` on one micro-batch's ``loss`` (a ``GRPOStepLoss``) and its metrics."""
    if backward.strategy == "knots":
        measured = calibrate_knots(
            velocity, loss.x, loss.sigma, loss, params, count=backward.knots, endpoints=backward.endpoints
        )
        return backward.setting(measured.routing), measured.as_metrics()
    calibration = calibrate_routing(
        velocity,
        loss.x,
        loss.sigma,
        loss,
        params,
        setting=backward.planned_setting(),
        group_sizes=backward.candidate_group_sizes,
        min_cosine=backward.min_cosine,
        micro_batches=micro_batches,
        grad_accum=grad_accum,
    )
    metrics = calibration.as_metrics(per_group_size=backward.group_size is None)
    return backward.setting(calibration.routing), metrics


def calibration_windows(
    backward: BackwardConfig, algorithm: Algorithm, num_steps: int, iteration: int
) -> list[range] | None:
    """The windows a calibration at ``iteration`` measures: those the algorithm trains until the next calibration
    (``calibrate_every`` iterations on; positions further on would be measured on weights they are not used
    with), or None where routing is not per window (not MixGRPO, or knots: their placement is measured)."""
    if backward.strategy == "knots":
        return None
    return algorithm.windows(num_steps, range(iteration, iteration + backward.calibrate_every))


@torch.no_grad()
def window_losses(
    velocity: Velocity,
    traj: Trajectory,
    rows: slice,
    sigmas: Tensor,
    windows: Sequence[range],
    loss_of: Callable[[TrainedSteps], StepLoss],
    *,
    kind: str,
    noise_level: float,
    seed: int,
) -> dict[int, StepLoss]:
    """Per window, by first step, the loss (``loss_of``) of a rollout of that window on the samples ``rows`` of
    the rollout ``traj`` (``velocity`` is theirs; ``sigmas`` the run's schedule).

    Why not the stored trajectory at the window's steps: outside the rollout's own window its steps are ODE
    steps, whose next latent is the deterministic Euler step, not an SDE sample, so the SDE log-prob's gradient
    there is not the one a rollout with the window there would train. What a MixGRPO rollout with the window at
    p does is rebuilt instead, for the price of the window's forwards: the ODE path from the samples' initial
    noise to step p (stored up to the rollout's first SDE step, continued from there at most to the last
    window's start), then the window's SDE steps (``kind``, ``noise_level``, drawn from ``seed``) with their old
    log-probs at the current weights (ratios 1, as in the update's first micro-batches). The advantages are the
    samples' own (``loss_of``): the rebuilt windows have no reward, and the cosine compares two estimates of the
    same advantage-weighted gradient (with one sample per micro-batch it does not depend on the advantage).
    """
    states = _ode_states(velocity, traj, rows, sigmas, last=max(w.start for w in windows))
    gen = torch.Generator(device=states.device).manual_seed(seed)
    losses = {}
    for w in windows:
        times = sigmas[w.start : w.stop + 1]
        sde = sample_trajectory(
            velocity, states[w.start], times, [kind] * len(w), noise_level=noise_level, generator=gen
        )
        trained = TrainedSteps(
            x=sde.latents[:-1],
            x_next=sde.latents[1:],
            sigma=times[:-1],
            sigma_next=times[1:],
            old_log_prob=sde.log_probs,
        )
        losses[w.start] = loss_of(trained)
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


def measure_windows(
    backward: BackwardConfig,
    velocity: Velocity,
    losses: dict[int, StepLoss],
    params: Sequence[torch.nn.Parameter],
) -> tuple[BackwardSetting, dict]:
    """The setting routed per window position (``calibrate_windows`` on ``window_losses``) and its metrics."""
    calibration = calibrate_windows(
        velocity,
        losses,
        params,
        strategy=backward.strategy,
        group_size=backward.group_size,
        min_cosine=backward.min_cosine,
        endpoints=backward.endpoints,
    )
    return backward.setting(calibration.routing), calibration.as_metrics()


def record(setting: BackwardSetting | None) -> dict:
    """The measured part of ``setting`` as a checkpoint keeps it (``Progress`` fields; None where unmeasured)."""
    routing = None if setting is None else setting.routing
    kept = {"routing": None, "group_size": None, "placement": None, "windows": None}
    if isinstance(routing, Knots):
        return kept | {"placement": routing.placement}
    if isinstance(routing, WindowRouting):
        return kept | {"group_size": routing.group_size, "windows": [list(p) for p in routing.routed]}
    measured = None if routing is None or routing.measured is None else list(routing.measured)
    return kept | {"routing": measured, "group_size": None if routing is None else routing.group_size}


def restore(backward: BackwardConfig, progress) -> BackwardSetting | None:
    """The measured setting a checkpoint's ``progress`` recorded, or None (not calibrated, or not yet measured)."""
    if not backward.calibrated:
        return None
    if backward.strategy == "knots":
        placement = progress.placement
        return (
            None if placement is None else backward.setting(Knots(count=backward.knots, placement=placement))
        )
    if progress.windows is not None:
        routed = tuple((int(start), bool(r)) for start, r in progress.windows)
        return backward.setting(
            WindowRouting(strategy=backward.strategy, group_size=progress.group_size, routed=routed)
        )
    if progress.routing is None:
        return None
    routing = Routing(
        strategy=backward.strategy, group_size=progress.group_size, measured=tuple(progress.routing)
    )
    return backward.setting(routing)
