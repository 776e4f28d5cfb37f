"""The engine's config sections: ``sampling:`` (``SamplingConfig``: the rollout's schedule), ``algorithm:``
(``AlgorithmConfig``) and ``backward:`` (``BackwardConfig``),
each with its defaults and its checks, read and composed into a run's config by ``jagg.config``.

``backward:`` holds the routing keys (strategy, W, ``jagg_frac``, knots, how the graphs run) and the keys of the
calibrators that measure a routing at run time: each calibrator declares its own (``jagg.engine.routing``'s
``CALIBRATIONS``: ``GroupsCalibrationConfig``, ...), and ``CalibrationKeys`` composes them, each key once, as
flat keys of the section (their paths predate the calibrators' configs, and run directories store them so).
An outside trainer (``jagg.integrations.unirl``) reads the same section through ``jagg.config.backward_config``.

Layer: the engine's; it imports the engine's registries and ``jagg.errors`` / ``jagg.common`` only.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from jagg.common import auto_field
from jagg.engine.algorithms import ALGORITHMS, EXACT_STEPS, STEP_SELECTIONS, validate_sde_steps
from jagg.engine.grpo import ADV_AGGREGATIONS, KL_STD, GRPOStepLoss, TrainedSteps
from jagg.engine.knots import PLACEMENTS, Knots
from jagg.engine.routing import CALIBRATIONS, BackwardSetting, Routing, validate_routing
from jagg.engine.sde import SDE_KINDS
from jagg.engine.strategies import GraphRun
from jagg.errors import ConfigError, require


@dataclass(kw_only=True)
class SamplingConfig:
    num_steps: int = 16
    shift: float = 3.0  # shifted-linear schedule (DanceGRPO); real models use their scheduler
    latent_size: int = 16  # latent height = width (must be even: 2x2 packing)
    # latent width where it differs from the height (model.source=pretrained: Wan's 480x832 video, 60 x 104); null:
    # square, latent_size
    latent_width: int | None = None
    latent_frames: int = 1  # Wan: latent frames F of a video, (frames - 1) / 4 + 1 (81 frames: 21); else 1
    eval_num_steps: int = 16
    schedule: str = "shift"  # shift (shifted linear, DanceGRPO) | scheduler (the model's diffusers scheduler)

    def validate(self, model) -> None:
        """Ranges, and what the run's ``model`` section (its ``source`` and ``backbone``) allows; ``ConfigError``
        naming the key and what is allowed."""
        require(
            self.schedule in ("shift", "scheduler"),
            f"sampling.schedule must be shift|scheduler, got {self.schedule!r}",
        )
        require(
            self.schedule == "shift" or model.source == "pretrained",
            f"sampling.schedule=scheduler needs model.source=pretrained (a diffusers scheduler), got {model.source!r}",
        )
        require(self.num_steps >= 2, f"sampling.num_steps must be >= 2, got {self.num_steps}")
        require(
            self.eval_num_steps >= 1,
            f"sampling.eval_num_steps must be >= 1, got {self.eval_num_steps}",
        )
        require(self.shift > 0, f"sampling.shift must be > 0, got {self.shift}")
        require(
            self.latent_size >= 2 and self.latent_size % 2 == 0,
            f"sampling.latent_size must be even and >= 2, got {self.latent_size}",
        )
        require(
            self.latent_width is None
            or (self.latent_width >= 2 and self.latent_width % 2 == 0 and model.source == "pretrained"),
            "sampling.latent_width must be null or an even integer >= 2 (model.source=pretrained only), got "
            f"{self.latent_width!r}",
        )
        require(
            self.latent_frames >= 1 and (model.backbone == "wan" or self.latent_frames == 1),
            f"sampling.latent_frames must be >= 1 for model.backbone=wan and 1 otherwise, got {self.latent_frames}",
        )
        # Wan's hub scheduler is a UniPC multistep one, which the Euler / SDE steps here do not run: the shifted
        # linear schedule (sampling.shift) is the one Wan GRPO recipes sample with
        require(
            model.backbone != "wan" or self.schedule == "shift",
            f"sampling.schedule must be shift for model.backbone=wan (its scheduler is UniPC), got {self.schedule!r}",
        )


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "dancegrpo"  # dancegrpo | flowgrpo_fast | flowgrpo | mixgrpo
    sde_kind: str = "dance"  # dance | flow_grpo | cps
    noise_level: float = 0.3  # eta (dance) or a (flow_grpo, cps)
    timestep_fraction: float = 0.6  # DanceGRPO: fraction of the S-1 steps trained per sample
    # DanceGRPO, which steps are trained (jagg.engine.algorithms.STEP_SELECTIONS):
    #   sorted_subset      per sample a random int((S-1) * timestep_fraction) single steps, sorted (DanceGRPO)
    #   contiguous_groups  the S-1 steps cut into blocks of W = backward.group_size consecutive steps (S-1 must
    #                      be a multiple of W); per sample a random int((S-1)/W * timestep_fraction) whole blocks,
    #                      each one JAGG group (the JAGG authors' code)
    step_selection: str = "sorted_subset"
    # what backward.strategy=exact trains under contiguous_groups (jagg.engine.algorithms.EXACT_STEPS):
    #   structure       the same blocks as every other strategy (the gradient reference of a quality comparison)
    #   random_singles  as many random single steps: the JAGG authors' exact baseline (their per-step path), a
    #                   baseline with other trained steps
    exact_steps: str = "structure"
    sde_window_size: int = 3  # Flow-GRPO-Fast: consecutive SDE steps per rollout
    # Flow-GRPO-Fast: the window start is drawn uniformly in [lo, hi - size], so the window lies in [lo, hi)
    sde_window_range: list[int] = field(default_factory=lambda: [0, 3])
    # MixGRPO (jagg.engine.algorithms.MixGRPO; Tencent-Hunyuan/MixGRPO's argument names): a window of group_size
    # consecutive SDE steps (the SDE window, not backward.group_size = W), ODE elsewhere, moved with the training
    # iteration by sample_strategy: progressive | random | decay | exp_decay (MIX_SCHEDULES)
    group_size: int = 4
    sample_strategy: str = "progressive"
    iters_per_group: int = 25  # progressive: iterations at each window position
    prog_overlap_step: int = 1  # progressive: steps the window moves (their --prog_overlap off = group_size)
    max_iters_per_group: int = 10  # decay: iterations at start 0, decaying linearly to ...
    min_iters_per_group: int = 1  # ... this at the last position
    exp_decay_thre_timestep: int = 13  # exp_decay: iters_per_group exp(-k relu(start - thre)) iterations
    exp_decay_k: float = 0.1
    # MixGRPO-Flash: after the window, none (Euler ODE on the run's schedule) | dpmsolver++ (deterministic
    # DPM-Solver++ of dpm_solver_order, midpoint | heun, on int((S - last window step) * ratio) schedule points;
    # needs sampling.schedule=shift and sample_strategy=progressive)
    dpm_algorithm_type: str = "none"
    dpm_post_compress_ratio: float = 0.4
    dpm_solver_order: int = 2
    dpm_solver_type: str = "midpoint"
    init_same_noise: bool = False  # one initial noise per prompt group (DanceGRPO's --init_same_noise)
    clip_range: float = 1e-4
    adv_clip: float = 5.0
    adv_eps: float = 1e-8
    adv_unbiased: bool = True
    adv_std: str = "group"  # group | global
    # several training rewards (jagg.engine.grpo.ADV_AGGREGATIONS): weighted_sum (normalise the weighted sum) |
    # per_reward (normalise each reward within its group, then sum with reward.weights: MixGRPO's advantage_aggr)
    adv_aggregation: str = "weighted_sum"
    kl_beta: float = 0.0
    kl_std: str = "flow_grpo"  # flow_grpo (Flow-GRPO's std_dev_t, no sqrt(dt)) | step (exact step KL)
    # multiplies the advantages before their clamp (adv_clip): 0.75 reproduces MixGRPO's run as launched, whose
    # failing UnifiedReward took a quarter of the weight at advantage 0 (docs/references.md, MixGRPO)
    adv_scale: float = 1.0
    # [lo, hi): the rollout samples steps lo..hi-1 with the SDE and every other step with the ODE, whichever steps
    # the algorithm trains (empty: the algorithm's own SDE steps). Each step it may train must lie inside: an ODE
    # step has no sampling density (jagg.engine.algorithms.Algorithm.sampling_kinds; issue 56's noise swaps)
    sde_steps: list[int] = field(default_factory=list)

    def step_loss(
        self, steps: TrainedSteps, advantages, *, scale: float = 1.0, ref_velocity=None
    ) -> GRPOStepLoss:
        """THE per-step GRPO loss of ``steps`` under this algorithm's objective (SDE kind and noise, clip range,
        KL against ``ref_velocity`` when given and ``kl_beta > 0``), scaled by ``scale``."""
        return GRPOStepLoss.of(
            steps,
            advantages,
            kind=self.sde_kind,
            noise_level=self.noise_level,
            clip_range=self.clip_range,
            kl_beta=self.kl_beta if ref_velocity is not None else 0.0,
            kl_std=self.kl_std,
            ref_velocity=ref_velocity,
            scale=scale,
        )

    def validate(self, sampling, backward: BackwardConfig) -> None:
        """Ranges and consistency against the run's ``sampling`` section (its ``num_steps`` and ``schedule``)
        and ``backward``; ``ConfigError`` naming the key and what is allowed."""
        require(
            self.name in ALGORITHMS,
            f"algorithm.name must be one of {sorted(ALGORITHMS)}, got {self.name!r}",
        )
        require(
            self.sde_kind in SDE_KINDS and self.sde_kind != "ode",
            f"algorithm.sde_kind must be dance|flow_grpo|cps, got {self.sde_kind!r}",
        )
        require(self.noise_level > 0, f"algorithm.noise_level must be > 0, got {self.noise_level}")
        require(
            0 < self.timestep_fraction <= 1,
            f"algorithm.timestep_fraction must be in (0, 1], got {self.timestep_fraction}",
        )
        require(self.clip_range > 0, f"algorithm.clip_range must be > 0, got {self.clip_range}")
        require(self.adv_clip > 0, f"algorithm.adv_clip must be > 0, got {self.adv_clip}")
        require(
            self.adv_std in ("group", "global"),
            f"algorithm.adv_std must be group|global, got {self.adv_std!r}",
        )
        require(
            self.adv_aggregation in ADV_AGGREGATIONS,
            f"algorithm.adv_aggregation must be one of {list(ADV_AGGREGATIONS)}, got {self.adv_aggregation!r}",
        )
        require(self.kl_beta >= 0, f"algorithm.kl_beta must be >= 0, got {self.kl_beta}")
        require(
            isinstance(self.adv_scale, int | float) and 0 < self.adv_scale <= 1e3,
            f"algorithm.adv_scale must be a number in (0, 1000], got {self.adv_scale!r}",
        )
        require(
            self.kl_std in KL_STD,
            f"algorithm.kl_std must be one of {list(KL_STD)}, got {self.kl_std!r}",
        )
        require(
            self.step_selection in STEP_SELECTIONS,
            f"algorithm.step_selection must be one of {list(STEP_SELECTIONS)}, got {self.step_selection!r}",
        )
        require(
            self.exact_steps in EXACT_STEPS,
            f"algorithm.exact_steps must be one of {list(EXACT_STEPS)}, got {self.exact_steps!r}",
        )
        require(
            self.step_selection == "sorted_subset" or self.name == "dancegrpo",
            f"algorithm.step_selection={self.step_selection} applies to algorithm.name=dancegrpo only, "
            f"got {self.name!r}",
        )
        ALGORITHMS[self.name].validate(self, sampling.num_steps, backward)
        validate_sde_steps(self, sampling.num_steps)
        require(
            self.name != "mixgrpo" or self.dpm_algorithm_type == "none" or sampling.schedule == "shift",
            f"algorithm.dpm_algorithm_type={self.dpm_algorithm_type} (MixGRPO-Flash) rebuilds the shifted-linear "
            f"schedule after the window: needs sampling.schedule=shift, got {sampling.schedule!r}",
        )


def _engine_default(name: str):
    """The default of a ``BackwardSetting`` field: the engine writes it once (``GraphRun``), the config reads it."""
    return {f.name: f.default for f in dataclasses.fields(BackwardSetting)}[name]


def _calibration_keys() -> list[tuple]:
    """The calibrators' keys (``CALIBRATIONS``), each once: (name, type, field) for ``make_dataclass``."""
    keys = {}
    for config in CALIBRATIONS.values():
        hints = typing.get_type_hints(config)
        for f in dataclasses.fields(config):
            keys.setdefault(
                f.name, (f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory))
            )
    return list(keys.values())


# The calibrators' keys as fields of the backward section (its base class), composed from their configs
CalibrationKeys = dataclasses.make_dataclass("CalibrationKeys", _calibration_keys(), kw_only=True)
CalibrationKeys.__module__ = __name__


@dataclass(kw_only=True)
class BackwardConfig(CalibrationKeys):
    """The ``backward:`` section: the routing keys below, and the calibrators' keys composed from
    ``CALIBRATIONS`` (``CalibrationKeys``)."""

    # exact | jagg | endpoints | uniform | jagg_index (alpha_j = j / (W - 1)) | knots (shared knots, below)
    strategy: str = "jagg"
    # W; None (YAML `auto`): chosen from `group_sizes` at each calibration (see below)
    group_size: int | None = auto_field(3, "an integer >= 2 or 'auto'")
    # leading fraction of groups on `strategy`; None (YAML `auto`): routed by measured cosines (see below)
    jagg_frac: float | None = auto_field(0.6, "a number in [0, 1] or 'auto'")
    # how the knot graphs are built (GRAPH_MODES): batched | joint (paper-literal) | sequential (one graph alive);
    # the old key backward.endpoints still reads as this one
    graph_mode: str = _engine_default("graph_mode")
    # graph (endpoint signals from the graph-building forwards) | nograd (the authors' code: W + 2 forwards)
    endpoint_signals: str = _engine_default("endpoint_signals")
    # intermediate signals from the rollout's stored outputs while the weights are the rollout's; the old key
    # backward.reuse_rollout still reads as this one
    stored_outputs: bool = _engine_default("stored_outputs")
    # strategy knots: K shared knots over each micro-batch's trained steps (jagg.engine.knots), placed by a rule
    # (index | time | low_noise) or measured (YAML `auto`: the rule whose gradient is closest to exact, measured
    # at iteration 0 and every calibrate_every iterations)
    knots: int = 4
    placement: str | None = auto_field("low_noise", f"one of {[*PLACEMENTS, 'auto']}")
    # at most this many rows (samples x knots) per stacked knot forward, for memory; null: a whole block at once
    max_rows: int | None = None

    @property
    def calibrated(self) -> bool:
        """Whether the trainer measures cosines at run time (jagg_frac auto, group_size may be auto too;
        knots: placement auto)."""
        if self.strategy == "knots":
            return self.placement is None
        return self.strategy != "exact" and self.jagg_frac is None

    @property
    def candidate_group_sizes(self) -> list[int]:
        """The group sizes a run may use: ``group_sizes`` under group_size=auto, else ``[group_size]``."""
        return sorted(set(self.group_sizes)) if self.group_size is None else [self.group_size]

    def fixed_setting(self) -> BackwardSetting | None:
        """The run's backward when nothing is measured (None under jagg_frac=auto: ``calibrate_routing``
        decides). The exact strategy with jagg_frac=auto routes nothing, so it is fixed too."""
        if self.calibrated:
            return None
        if self.strategy == "knots":
            return self.setting(Knots(count=self.knots, placement=self.placement))
        routing = Routing(
            strategy=self.strategy,
            group_size=self.candidate_group_sizes[0],
            jagg_frac=1.0 if self.jagg_frac is None else self.jagg_frac,
        )
        return self.setting(routing)

    def planned_setting(self) -> BackwardSetting:
        """The backward a plan without measurements assumes (``--dry-run``, the memory figures, plan-check):
        the fixed setting, or under ``auto`` the largest candidate W with every group routed to the strategy
        (knots: K knots, placed low_noise; the cost does not depend on where)."""
        if self.strategy == "knots":
            return self.setting(Knots(count=self.knots, placement=self.placement or "low_noise"))
        routing = Routing(
            strategy=self.strategy,
            group_size=max(self.candidate_group_sizes),
            jagg_frac=1.0 if self.jagg_frac is None else self.jagg_frac,
        )
        return self.setting(routing)

    def setting(self, routing: Routing | Knots) -> BackwardSetting:
        """``routing`` with this config's graph mode, stored-output rule, endpoint-signal source and row bound."""
        return BackwardSetting(
            routing=routing,
            graph_mode=self.graph_mode,
            stored_outputs=self.stored_outputs,
            endpoint_signals=self.endpoint_signals,
            max_rows=self.max_rows,
        )

    def validate(self) -> None:
        """Ranges and consistency; each calibrator's keys by its own config; ``ConfigError`` naming the key."""
        require(
            self.group_size is not None or self.jagg_frac is None,
            "backward.group_size=auto chooses W by the measured routing: set backward.jagg_frac=auto too "
            f"(got jagg_frac={self.jagg_frac!r})",
        )
        for calibration in dict.fromkeys(CALIBRATIONS.values()):  # each calibrator's keys, its own checks
            calibration.of(self).validate()
        frac = 1.0 if self.jagg_frac is None else self.jagg_frac
        try:  # the one routing validator (the engine's)
            for w in self.candidate_group_sizes:
                validate_routing(w, frac, self.strategy)
            GraphRun(graph_mode=self.graph_mode, endpoint_signals=self.endpoint_signals)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        require(
            isinstance(self.knots, int) and self.knots >= 2,
            f"backward.knots must be an integer >= 2, got {self.knots!r}",
        )
        require(
            self.placement is None or self.placement in PLACEMENTS,
            f"backward.placement must be one of {[*PLACEMENTS, 'auto']}, got {self.placement!r}",
        )
        require(
            self.max_rows is None or self.max_rows >= 1,
            f"backward.max_rows must be an integer >= 1 or null, got {self.max_rows!r}",
        )
