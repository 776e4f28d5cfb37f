"""Measured backward settings: what ``Trainer.calibrate`` measures, and how a checkpoint keeps it.

``backward.jagg_frac: auto`` (groups) measures the cosine of each group position's gradient to its exact one and
routes the positions that reach ``backward.min_cosine`` (``calibrate_routing``; with ``backward.group_size: auto``
also W, by the cost model). ``backward.placement: auto`` (knots) keeps the placement rule whose micro-batch
gradient is closest to exact (``calibrate_knots``). Both run on one micro-batch and leave ``.grad`` as it was.
A checkpoint stores the measured routing (``record``), and a resumed run restores it (``restore``) rather than
measuring again before its next calibration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jagg.config import BackwardConfig
from jagg.engine.knots import Knots
from jagg.engine.routing import BackwardSetting, Routing, calibrate_knots, calibrate_routing
from jagg.engine.strategies import Velocity


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
        strategy=backward.strategy,
        group_sizes=backward.candidate_group_sizes,
        min_cosine=backward.min_cosine,
        endpoints=backward.endpoints,
        reuse_outputs=backward.reuse_rollout,
        endpoint_signals=backward.endpoint_signals,
        micro_batches=micro_batches,
        grad_accum=grad_accum,
    )
    metrics = calibration.as_metrics(per_group_size=backward.group_size is None)
    return backward.setting(calibration.routing), metrics


def record(setting: BackwardSetting | None) -> dict:
    """The measured part of ``setting`` as a checkpoint keeps it (``Progress`` fields; None where unmeasured)."""
    routing = None if setting is None else setting.routing
    if isinstance(routing, Knots):
        return {"routing": None, "group_size": None, "placement": routing.placement}
    measured = None if routing is None or routing.measured is None else list(routing.measured)
    return {
        "routing": measured,
        "group_size": None if routing is None else routing.group_size,
        "placement": None,
    }


def restore(backward: BackwardConfig, progress) -> BackwardSetting | None:
    """The measured setting a checkpoint's ``progress`` recorded, or None (not calibrated, or not yet measured)."""
    if not backward.calibrated:
        return None
    if backward.strategy == "knots":
        placement = progress.placement
        return (
            None if placement is None else backward.setting(Knots(count=backward.knots, placement=placement))
        )
    if progress.routing is None:
        return None
    routing = Routing(
        strategy=backward.strategy, group_size=progress.group_size, measured=tuple(progress.routing)
    )
    return backward.setting(routing)
