"""JAGG / knots as a UniRL algorithm: ``JaggFlowGRPO``, FlowGRPO's loss with its backward run as one plan.

UniRL (``pip install --no-deps --ignore-requires-python unirl==0.2.0``, ``make engines``) trains a diffusion
stage with ``FlowGRPO.compute_loss_and_backward`` (``unirl/algorithms/flowgrpo.py``, v0.2.0): ``stage.replay``
forwards every trained step with autograd, the clipped GRPO loss (plus ``beta`` times the KL to the LoRA-disabled
reference) is averaged over [B, T], and ``(loss * loss_scale).backward()`` runs through the T live graphs.
``JaggFlowGRPO`` computes the same loss step by step (``SegmentLoss``: ``stage.step.forward`` on the model output
is the step's log-prob and mean, exactly what ``replay`` computes from it) and hands it, with the stage's velocity
(``StageVelocity``: ``stage.predict_noise_at_step``), to one ``BackwardSetting``: exact, JAGG groups or knots, in
any graph mode. One line of UniRL config selects it::

    algorithm:
      _target_: jagg.integrations.unirl.JaggFlowGRPO
      backward: {strategy: knots, knots: 4, placement: time, graph_mode: sequential}

(``configs/engines/unirl_sd3_knots.yaml``). Nothing in UniRL changes. Stored outputs are never read: a UniRL
segment keeps latents and log-probs, not model outputs, and its rollout may come from another engine (vLLM-omni,
SGLang) or from weights synced late (docs/engine.md, "Stored outputs").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from unirl.algorithms.base import (
    AlgorithmStepResult,
    _gaussian_kl_div,
    _grpo_clip_loss,
    _reference_replay_means,
    _resolve_clip_range_from_schedule,
    _transition_sigma,
    gather_sde_field,
    typed_conditions,
)
from unirl.algorithms.flowgrpo import FlowGRPO

from jagg.config import backward_config
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import BackwardFn, GroupStats, autograd_backward
from jagg.errors import ConfigError


class StageVelocity:
    """``velocity(z, t)`` of a UniRL diffusion stage: ``stage.predict_noise_at_step`` at the sampling params (CFG
    included when ``guidance_scale > 1``), what ``stage.replay`` forwards. z may hold n x B rows with one t per
    row (a stacked knot forward): the conditioning is tiled with the stage's own ``_tile_conditions`` (the one
    its batched replay uses), or, for a stage without one, the rows run B at a time.

    A two-expert stage (UniRL's ``WAN22DiffusionStage``: the model's ``boundary_ratio``, the high-noise transformer
    at sigma >= it) declares the switch as ``expert_boundaries``, so the plan keeps knots and groups on one side.
    UniRL picks one expert per call, from its first row's sigma: stacked rows are run in runs of whole B-row
    blocks whose first sigmas lie on one side, never across the switch. (The plan's side of a step,
    ``jagg.common.expert_side`` on 1000 x float32 sigma, is UniRL's but for a sigma within float32 rounding of the
    ratio: float32(0.9) is below 0.9 for UniRL, at 900 for the plan.)"""

    def __init__(self, stage, conditions, params) -> None:
        self.stage, self.conditions, self.params = stage, conditions, params
        self.batch = _batch_size(conditions)
        ratio = getattr(stage.model, "boundary_ratio", None)
        self.expert_boundaries = () if ratio is None else (float(ratio),)

    def __call__(self, z: Tensor, t: Tensor) -> Tensor:
        if z.shape[0] == self.batch:
            return self._predict(self.conditions, z, t)
        t = t.expand(z.shape[0]) if t.ndim == 0 else t
        return torch.cat([self._stacked(z[rows], t[rows]) for rows in self._one_expert_runs(t)])

    def _one_expert_runs(self, t: Tensor) -> list[slice]:
        """The stacked rows as consecutive runs of B-row blocks on one side of every switch, by UniRL's own rule
        (``WAN22DiffusionStep._select_for_sigma``: the block's first sigma as a Python float >= the ratio)."""
        if not self.expert_boundaries:
            return [slice(None)]
        starts = range(0, t.shape[0], self.batch)
        sides = [sum(float(t[r]) >= b for b in self.expert_boundaries) for r in starts]
        cuts = [r for r, side, prev in zip(starts, sides, [None, *sides]) if side != prev] + [t.shape[0]]
        return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]

    def _stacked(self, z: Tensor, t: Tensor) -> Tensor:
        reps = z.shape[0] // self.batch
        if reps == 1:
            return self._predict(self.conditions, z, t)
        if hasattr(type(self.stage), "_tile_conditions"):
            try:
                return self._predict(self.stage._tile_conditions(self.conditions, reps), z, t)
            except NotImplementedError:
                pass
        rows = range(0, z.shape[0], self.batch)
        return torch.cat(
            [self._predict(self.conditions, z[r : r + self.batch], t[r : r + self.batch]) for r in rows]
        )

    def _predict(self, conditions, z: Tensor, t: Tensor) -> Tensor:
        return self.stage.predict_noise_at_step(conditions, sample=z, sigma=t, params=self.params)


def _batch_size(conditions) -> int:
    """B: the rows of the first conditioning tensor (UniRL's conditions are batch-first dataclasses or dicts)."""
    items = conditions.items() if isinstance(conditions, Mapping) else vars(conditions).items()
    for _, value in items:
        if isinstance(value, Tensor):
            return value.shape[0]
        nested = getattr(value, "embeds", None)
        if isinstance(nested, Tensor):
            return nested.shape[0]
    raise ValueError("cannot read the batch size from the conditions (no tensor field)")


@dataclass
class SegmentLoss:
    """FlowGRPO's loss of one segment, step by step (a ``jagg.engine.strategies.StepLoss``): for trained step i
    (UniRL step ``steps[i]``), ``loss(i, v)`` is

        scale * ( mean_b clip_loss(logp_i[b], old_logp[b, i], A_b)  +  beta * mean_b KL_i[b] ),  scale = loss_scale / T

    with ``logp_i``, ``mean_i`` from ``stage.step.forward(noise_pred=v, ...)`` on the stored latents, so that
    sum_i loss(i, v_i) is ``FlowGRPO.compute_loss_and_backward``'s ``loss * loss_scale`` (its mean over [B, T]).
    ``x`` (T, B, ...) and ``sigma`` (T,) are the steps' inputs and times. Each evaluation's detached log-prob is
    kept in ``log_probs`` (FlowGRPO's ratio metrics)."""

    stage: Any
    steps: list[int]
    x: Tensor
    x_next: Tensor
    sigma: Tensor
    sigma_next: Tensor
    sigma_max: Tensor
    old_logp: Tensor  # (B, T)
    advantages: Tensor  # (B,)
    clip_range: float
    eta: float
    scale: float
    beta: float = 0.0
    ref_means: Tensor | None = None  # (B, T, ...) the reference policy's step means (beta > 0)
    kl_sigma: Tensor | None = None  # (T,) the transition std of FlowGRPO's KL
    log_probs: dict[int, Tensor] = field(default_factory=dict)
    kl: dict[int, float] = field(default_factory=dict)

    def __call__(self, i: int, v: Tensor) -> Tensor:
        _, logp, mean = self.stage.step.forward(
            strategy=self.stage.strategy,
            noise_pred=v,
            sample=self.x[i],
            sigma=self.sigma[i],
            sigma_next=self.sigma_next[i],
            prev_sample=self.x_next[i],
            sigma_max=self.sigma_max,
            eta=self.eta,
            step_index=self.steps[i],
        )
        logp = logp.to(self.stage.logprob_dtype)
        old = self.old_logp[:, i].to(dtype=logp.dtype, device=logp.device)
        adv = self.advantages.detach().to(dtype=logp.dtype, device=logp.device)
        per_sample, _ = _grpo_clip_loss(
            new_logp=logp, old_logp=old, advantages=adv, clip_range=self.clip_range
        )
        loss = per_sample.mean()
        self.log_probs[i] = logp.detach()
        if self.beta > 0.0:
            ref = self.ref_means[:, i : i + 1].to(dtype=mean.dtype, device=mean.device)
            kl = _gaussian_kl_div(mean.unsqueeze(1), ref, self.kl_sigma[i : i + 1]).flatten(2).mean(2).mean()
            self.kl[i] = kl.item()
            loss = loss + self.beta * kl
        return loss * self.scale


class JaggFlowGRPO(FlowGRPO):
    """UniRL's ``FlowGRPO`` whose backward is one JAGG / knots plan (``BackwardSetting``).

    ``backward`` is this repository's ``backward`` config section as a mapping (``jagg.config.BackwardConfig``:
    strategy, group_size, jagg_frac, knots, placement, graph_mode, endpoint_signals, max_rows; measured ``auto``
    routing is not available here: see docs/engine.md, "Measured routing from an outside trainer"), or a
    ``BackwardSetting``. ``backward_fn`` replaces autograd for every backward call (``BackwardFn``). Every other
    argument is FlowGRPO's. Each micro-batch's ``GroupStats`` is kept in ``last_stats`` and its counts are
    reported among the step's metrics."""

    def __init__(
        self,
        *,
        backward: Mapping[str, Any] | BackwardSetting | None = None,
        backward_fn: BackwardFn = autograd_backward,
        **flowgrpo: Any,
    ) -> None:
        super().__init__(**flowgrpo)
        self.setting = replace(_setting(backward), stored_outputs=False, backward_fn=backward_fn)
        self.last_stats: GroupStats | None = None

    def compute_loss_and_backward(
        self,
        *,
        conditions,
        segment,
        advantages: Tensor,
        training_progress: float,
        loss_scale: float,
    ) -> AlgorithmStepResult:
        """FlowGRPO's step with its ``(loss * loss_scale).backward()`` replaced by ``self.setting.backward``."""
        steps = sorted(self._resolve_target_steps(segment))
        if not steps:
            return AlgorithmStepResult(loss=0.0, metrics={}, num_steps_or_tokens=0, has_backward=False)
        conds = typed_conditions(conditions, self.conditions_cls)
        loss = self.segment_loss(conds, segment, steps, advantages, training_progress, loss_scale)
        stats = self.setting.backward(StageVelocity(self.stage, conds, self.params), loss)
        self.last_stats = stats
        return AlgorithmStepResult(
            loss=stats.loss / loss_scale if loss_scale else 0.0,
            metrics=self._metrics(loss, stats),
            num_steps_or_tokens=len(steps),
            has_backward=True,
        )

    def segment_loss(self, conds, segment, steps, advantages, training_progress, loss_scale) -> SegmentLoss:
        """The ``SegmentLoss`` of ``segment``'s trained ``steps``: the tensors ``stage.replay`` reads, in the
        dtypes it reads them (latents as stored, sigmas in float32)."""
        device = torch.device(self.stage.model.device)
        sigmas = segment.sigmas.to(device)
        idx = torch.tensor(steps, device=device)
        beta_terms = {}
        if self.beta > 0.0:
            beta_terms = dict(
                beta=self.beta,
                ref_means=_reference_replay_means(
                    self.stage,
                    self._ref_model,
                    conditions=conds,
                    segment=segment,
                    params=self.params,
                    target_steps=steps,
                ),
                kl_sigma=_transition_sigma(
                    self.stage, segment=segment, target_steps=steps, eta=float(self.params.eta), device=device
                ),
            )
        return SegmentLoss(
            stage=self.stage,
            steps=steps,
            x=torch.stack([segment.latents_at(i).to(device) for i in steps]),
            x_next=torch.stack([segment.latents_at(i + 1).to(device) for i in steps]),
            sigma=sigmas[idx].to(torch.float32),
            sigma_next=sigmas[idx + 1].to(torch.float32),
            sigma_max=sigmas[1].float() if sigmas.shape[0] > 1 else torch.tensor(0.99),
            old_logp=gather_sde_field(segment.sde_logp, segment.sde_indices, steps, field_name="sde_logp"),
            advantages=advantages,
            clip_range=_resolve_clip_range_from_schedule(
                self.clip_range, self.clip_schedule, training_progress
            ),
            eta=float(self.params.eta),
            scale=loss_scale / len(steps),
            **beta_terms,
        )

    def _metrics(self, loss: SegmentLoss, stats: GroupStats) -> dict[str, float]:
        """FlowGRPO's metrics (policy loss, clip range, ratio statistics, KL) and the backward's pass counts."""
        new = torch.stack([loss.log_probs[i] for i in sorted(loss.log_probs)], dim=1)
        old = loss.old_logp.to(dtype=new.dtype, device=new.device)
        adv = loss.advantages.detach().to(new).reshape(-1, 1).expand_as(new)
        per_elem, ratios = _grpo_clip_loss(
            new_logp=new, old_logp=old, advantages=adv, clip_range=loss.clip_range
        )
        metrics = {"policy_loss": float(per_elem.mean()), "clip_range": float(loss.clip_range)}
        metrics |= {k: float(v) for k, v in ratios.items()}
        if loss.beta > 0.0:
            metrics |= {"beta": loss.beta, "kl_ref_mean": sum(loss.kl.values()) / len(loss.kl)}
        counts = ("forward_passes", "forward_passes_with_grad", "backward_passes", "backward_calls")
        return metrics | {f"jagg/{name}": float(getattr(stats, name)) for name in counts}


def _setting(backward: Mapping[str, Any] | BackwardSetting | None) -> BackwardSetting:
    """The ``BackwardSetting`` of ``JaggFlowGRPO``'s ``backward`` argument (None: this repository's default)."""
    if isinstance(backward, BackwardSetting):
        return backward
    config = backward_config(backward or {}, prefix="algorithm.backward")
    setting = config.fixed_setting()
    if setting is None:
        raise ConfigError(
            "algorithm.backward: measured routing (jagg_frac / placement auto) is not available inside UniRL; "
            "measure it once with jagg.engine.routing.calibrate_routing and pass the routing it chose"
        )
    return setting


__all__ = ["JaggFlowGRPO", "SegmentLoss", "StageVelocity"]
