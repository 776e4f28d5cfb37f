"""One GRPO training loop for every algorithm, backbone and backward strategy.

    rollout (no grad; SDE where the algorithm explores) -> rewards -> group advantages
    -> [calibrate: the run's calibrator measures the backward when due, ``jagg.loop.calibration``]
    -> update: each micro-batch's GRPO loss over its trained steps (``Rollout.at``) goes through the backward
       setting (``self.setting``, a ``BackwardSetting``: one plan of knots), an optimizer step every
       ``grad_accum`` micro-batches; the plug-ins (``jagg.plugins``) act at its touch points
    -> metrics, held-out evaluation, checkpoints when due.

Follows the DanceGRPO / Flow-GRPO loops (docs/references.md). Rollouts and updates use the same micro-batches, so
until the first optimizer step every PPO ratio is exactly 1. Every draw of iteration ``it`` comes from the
generator (seed, ``SeedStream.ROLLOUT``, it), so a resumed run reproduces the uninterrupted one. Under torchrun
(FSDP2) every rank draws the whole global batch and keeps its contiguous share; rewards are gathered before the
advantages; rank 0 writes the logs, every rank its checkpoint shards. docs/architecture.md walks one iteration.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from jagg.common import SeedStream, generator
from jagg.config import Config, validate_world_size
from jagg.distributed import DistInfo, full_tensor
from jagg.engine.algorithms import ALGORITHMS
from jagg.engine.grpo import GRPOStepLoss, StepStats
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import GroupStats
from jagg.loop.calibration import Probe, calibrator_for
from jagg.loop.evaluate import evaluate, swapped_in
from jagg.loop.rollout import Rollout, Sampler, micro_batches, schedules
from jagg.models import Backbone, BoundVelocity, Components, TextCond
from jagg.ops.checkpoint import CheckpointWriter, Progress, checkpoint_dir, resume_checkpoint
from jagg.ops.heartbeat import PhaseWatch
from jagg.ops.trackers import RunLog
from jagg.plugins import build_plugins
from jagg.plugins.base import MicroBatch, Plugin, RunView, UpdateView
from jagg.scale.optimizer import build_optimizer, ema_decay_at, optimizer_steps, update_ema
from jagg.scale.placement import DTYPES, place_backbone


class TrainingAborted(RuntimeError):
    """Too many consecutive non-finite updates; a final checkpoint has been written."""

    def __init__(self, skips: int, limit: int, checkpoint: Path) -> None:
        super().__init__(
            f"{skips} consecutive optimizer steps had a non-finite loss or gradient "
            f"(train.max_consecutive_skips={limit}); last checkpoint: {checkpoint}"
        )


class Trainer:
    def __init__(self, cfg: Config, comp: Components, run_dir: str | Path) -> None:
        self.cfg, self.comp, self.run_dir = cfg, comp, Path(run_dir)
        train = cfg.train
        self.dist = DistInfo.current()
        validate_world_size(cfg, self.dist.world_size)
        auto_cuda = train.device == "auto" and torch.cuda.is_available()
        self.device = torch.device("cuda" if auto_cuda else train.device)
        self.dtype = DTYPES[train.precision]
        # LoRA, dtypes (frozen LoRA base in the compute dtype, trained weights fp32 under bf16), device, under
        # FSDP2 the shards of rank 0's weights, and with a KL term an unsharded frozen reference copy (small
        # models; no KL at paper scale): jagg.scale.placement
        self.backbone, self.reference = place_backbone(
            cfg, comp.backbone, device=self.device, dist=self.dist, reference=cfg.algorithm.kl_beta > 0
        )
        self.params = [p for p in self.backbone.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, self.params)  # AdamW; fused with optim.fused
        self.ema = [p.detach().clone() for p in self.params] if cfg.optim.ema_decay > 0 else None
        self.algorithm = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
        self.sigmas, self.eval_sigmas = schedules(comp, cfg)
        self.iteration, self.consecutive_skips = 0, 0
        self.checkpointed_at: int | None = None  # the iteration of the last checkpoint written or loaded
        self.checkpoints = CheckpointWriter(
            self.run_dir,
            self.dist,
            keep=cfg.log.keep_checkpoints,
            # log.async_checkpoint (auto: on CUDA): a save's shards are written while training goes on
            asynchronous=cfg.log.writes_async(self.device.type),
            timeout_s=train.dist_timeout_s,
        )
        # How the update runs its backward: fixed by the config, or measured by the run's calibrator (None until
        # its first measurement; jagg.loop.calibration)
        self.setting: BackwardSetting | None = cfg.backward.fixed_setting()
        self.calibrator = calibrator_for(cfg.backward, self.algorithm, len(self.sigmas) - 1, train.seed)
        # instruments, controls and the calibrator, each acting at its touch points of the update (jagg.plugins):
        # the one list; whatever is in it when a checkpoint is written is checkpointed (drivers append their own)
        run = RunView(self.params, train.seed, self.run_dir, self.dist, self.device, self.optimizer)
        self.plugins = build_plugins(cfg, run) + ([self.calibrator] if self.calibrator else [])
        # metrics.jsonl, trackers (log.report_to), per-sample scores and grids of evaluations (rank 0)
        self.run_log = RunLog(
            self.run_dir, self.dist.is_main, cfg.log.report_to, cfg.to_dict(), cfg.log.grid_every
        )
        # per-phase heartbeats / hang stacks of this rank while fit runs (jagg.ops.heartbeat)
        self.watch = PhaseWatch(self.dist.rank, cfg.log.heartbeat_s, cfg.log.phase_timeout_s, self.run_dir)
        self.sampler = Sampler(
            cfg, comp, self.algorithm, self.sigmas, self.velocity, self.dist, self.device, self.watch
        )

    # ------------------------------------------------------------------ model calls and rollouts
    def velocity(self, cond: TextCond, model: Backbone | None = None) -> BoundVelocity:
        """``velocity(z, t)`` of ``model`` (default: the trained backbone), autocast under bf16: its ``bind``, so
        the velocity declares the model's expert switches (Wan2.2-A14B) to the plan of every update."""
        bf16 = self.dtype == torch.bfloat16
        return (model or self.backbone).bind(cond.to(self.device), autocast=torch.bfloat16 if bf16 else None)

    def rollout(self, it: int, stream: SeedStream = SeedStream.ROLLOUT) -> Rollout:
        """The rollout of draw ``it`` of ``stream`` on the current weights (``jagg.loop.rollout.Sampler``):
        training iteration ``it`` by default; drivers take extra rollouts from their own named stream."""
        self.watch.enter("rollout", it)
        return self.sampler(it, stream, optimizer_steps(self.optimizer))

    # ------------------------------------------------------------------ update
    def grpo_loss(
        self, ro: Rollout, steps: Tensor | None = None, idx: slice = slice(None), *, scale: float = 1.0
    ) -> GRPOStepLoss:
        """The per-step GRPO loss of the samples ``ro[idx]`` at their trained steps (or ``steps`` (b, T)), held
        whole in ``loss.steps`` (``Rollout.at``): ``loss.x`` / ``loss.sigma`` (T, b, ...) / (T, b) are the inputs
        and times, ``loss(i, v)`` the scaled loss of the i-th step; with ``algorithm.kl_beta > 0`` the frozen
        reference model gives the KL term."""
        trained = ro.at(idx, self.sigmas.to(self.device), steps)
        ref = self.velocity(ro.cond.select(idx), self.reference) if self.reference else None
        return self.cfg.algorithm.step_loss(
            trained, ro.advantages[idx].to(self.device), scale=scale, ref_velocity=ref
        )

    def update(self, ro: Rollout) -> dict:
        """Backward over every micro-batch as ``self.setting`` says; optimizer step every grad_accum.

        The plug-ins (``self.plugins``) act at the touch points (``jagg.plugins.base``): when the update begins,
        before each optimizer step, and with their metrics at the end. Stored outputs are read only while the
        weights are the rollout's (``_update_inputs``).
        """
        train = self.cfg.train
        setting = self.setting.at_window(int(ro.trained[0, 0]))  # routed per window position (MixGRPO)
        view = self._view(ro, setting)
        self.optimizer.zero_grad(set_to_none=True)
        for plugin in self.plugins:
            plugin.begin_update(view)
        total: GroupStats | None = None
        step_stats: list[StepStats] = []  # one per trained step of every micro-batch
        pending: list[MicroBatch] = []  # the micro-batches of the coming optimizer step
        steps: list[tuple[float, bool]] = []  # (gradient norm, stepped) per optimizer step
        for k, rows in enumerate(view.micro_batches):
            loss, outputs = view.inputs(rows)
            loss = loss.recording()  # keeps each step's StepStats for the row and the plug-ins
            stats = setting.backward(view.velocity(rows), loss, outputs)
            total = stats if total is None else total.merge(stats)
            step_stats += loss.stats
            pending.append(MicroBatch(rows, loss.stats))
            if (k + 1) % train.grad_accum == 0 or k == len(view.micro_batches) - 1:
                steps.append(self._optimizer_step(view, pending))
                pending = []
        row = self._update_row(step_stats, steps)
        passes = total.backward_passes / len(ro.prompts) * train.train_batch_size
        row |= total.as_metrics() | {"backward_passes_per_sample": passes}
        for plugin in self.plugins:
            row |= plugin.metrics()
        return row

    def _update_row(self, step_stats: list[StepStats], steps: list[tuple[float, bool]]) -> dict:
        """The update's loss and PPO statistics (means over every trained step and rank) and its steps."""
        norms = [norm for norm, _ in steps]
        grad_norm = float(np.nanmean(norms)) if any(map(math.isfinite, norms)) else float("nan")
        skipped = sum(not stepped for _, stepped in steps)
        means = self.dist.reduce_scalars(StepStats.means(step_stats))
        return means | {"grad_norm": grad_norm, "optimizer_steps": len(steps), "skipped_steps": skipped}

    def _view(self, ro: Rollout, setting: BackwardSetting) -> UpdateView:
        """What the plug-ins see of the update of ``ro`` under ``setting`` (``jagg.plugins.base.UpdateView``)."""
        return UpdateView(
            iteration=self.iteration,
            params=self.params,
            setting=setting,
            micro_batches=micro_batches(len(ro.prompts), self.cfg.train.train_batch_size),
            inputs=functools.partial(self._update_inputs, ro),
            velocity=lambda rows: self.velocity(ro.cond.select(rows)),
            dist=self.dist,
        )

    def _update_inputs(self, ro: Rollout, idx: slice) -> tuple[GRPOStepLoss, Tensor | None]:
        """The micro-batch's GRPO loss over its T trained steps (scaled 1 / (grad_accum * T)) and its stored
        outputs where they are valid (on the rollout's weights), else None."""
        loss = self.grpo_loss(ro, idx=idx, scale=1.0 / (self.cfg.train.grad_accum * ro.trained.shape[1]))
        outputs = loss.steps.outputs
        on_rollout_weights = ro.optimizer_steps == optimizer_steps(self.optimizer) and outputs is not None
        return loss, outputs.to(self.device) if on_rollout_weights else None

    def _optimizer_step(self, view: UpdateView, pending: list[MicroBatch]) -> tuple[float, bool]:
        """The plug-ins' touch point before the step (a control degrades the gradient, then fidelity measures
        it), clip, then step unless the gradient is non-finite (then skip and count). Returns (norm, stepped)."""
        for plugin in self.plugins:
            plugin.before_step(view, pending)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
        norm = float(full_tensor(norm))  # global norm (a DTensor under FSDP2): same on every rank
        stepped = math.isfinite(norm)
        if stepped:
            self.optimizer.step()
            decay = ema_decay_at(self.cfg.optim, optimizer_steps(self.optimizer))  # None: no EMA, or not due
            if self.ema is not None and decay is not None:
                update_ema(self.ema, self.params, decay)
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips = 0 if stepped else self.consecutive_skips + 1
        return norm, stepped

    def plugin(self, name: str) -> Plugin | None:
        """The run's plug-in called ``name`` (``jagg.plugins.PLUGINS``), or None where the config leaves it off."""
        return next((p for p in self.plugins if p.name == name), None)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, it: int) -> tuple[dict, Tensor, dict]:
        """ODE samples on held-out prompts (fixed noise), scored by every eval reward (EMA weights if any).

        Returns the metrics row (mean / std per reward), rank 0's images and the per-sample scores
        (``jagg.loop.evaluate.evaluate``).
        """
        log = self.cfg.log
        eval_prompts = self.comp.eval_prompts[: log.eval_prompts]
        prompts = [p for p in eval_prompts for _ in range(log.eval_images_per_prompt)]
        gen = generator(self.cfg.train.seed, SeedStream.EVAL)  # the same noise at every evaluation
        noise = self.sampler.noise(len(prompts), gen)
        with swapped_in(self.params, self.ema):
            return evaluate(
                velocity=self.velocity,
                components=self.comp,
                rewards=self.sampler.eval_rewards,  # the held-out judges (the training reward's too)
                prompts=prompts,
                noise=noise,
                sigmas=self.eval_sigmas.to(self.device),
                dist=self.dist,
            )

    # ------------------------------------------------------------------ one iteration
    def calibrate(self, ro: Rollout, it: int = 0) -> dict:
        """Measure the backward on ``probe(ro, it)`` with the run's calibrator and use it from now on (gradients
        are left as they were); returns the measurement's metrics and its seconds."""
        self.watch.enter("calibrate", it)
        t0 = time.perf_counter()
        metrics = self.calibrator.measure(self.probe(ro, it))
        self.setting = self.calibrator.setting
        return metrics | {"time_calibrate_s": time.perf_counter() - t0}

    def probe(self, ro: Rollout, it: int) -> Probe:
        """What the calibrator measures from: the first micro-batch of ``ro``, the rollout of iteration ``it``."""
        rows = slice(0, self.cfg.train.train_batch_size)
        return Probe(
            iteration=it,
            velocity=self.velocity(ro.cond.select(rows)),
            loss=self.grpo_loss(ro, idx=rows),
            params=self.params,
            micro_batches=len(micro_batches(len(ro.prompts), self.cfg.train.train_batch_size)),
            grad_accum=self.cfg.train.grad_accum,
            traj=ro.traj,
            rows=rows,
            sigmas=self.sigmas.to(self.device),
        )

    def train_iteration(self, it: int) -> dict:
        """Rollout, calibration when due (its own time, outside the rollout and update phases), update: the row."""
        t0 = time.perf_counter()
        ro = self.rollout(it)
        t1 = time.perf_counter()
        cal = self.calibrate(ro, it) if self.calibrator is not None and self.calibrator.due(it) else {}
        t2 = time.perf_counter()
        self.watch.enter("update", it)
        row = {"iteration": it + 1, **ro.reward_row(), **self.update(ro), **cal, **ro.timing}
        t3 = time.perf_counter()
        times = {"time_rollout_s": t1 - t0, "time_update_s": t3 - t2, "time_iteration_s": t3 - t0}
        return row | times | {"lr": self.optimizer.param_groups[0]["lr"]}

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        """The run's checkpoint directory (``jagg.ops.checkpoint``: sharded, DCP)."""
        return checkpoint_dir(self.run_dir)

    def save_checkpoint(self) -> None:
        """Start the sharded checkpoint of now (a collective: every rank writes its shards, every plug-in's state
        goes in); it becomes the run's checkpoint, atomically, at once or (``log.async_checkpoint``) at
        ``self.checkpoints.poll()`` / ``.finish()`` once every rank's write is done."""
        self.watch.enter("checkpoint", self.iteration)
        progress = Progress(
            iteration=self.iteration,
            consecutive_skips=self.consecutive_skips,
            metrics=self.metrics,
            ema=self.ema,
            plugins={p.name: p.state_dict() for p in self.plugins},
        )
        if len(progress.plugins) != len(self.plugins):  # one state per name
            raise ValueError(f"two plug-ins share a name: {[p.name for p in self.plugins]}")
        self.checkpoints.save(
            model=self.backbone, optimizer=self.optimizer, progress=progress, config=self.cfg.to_dict()
        )
        self.checkpointed_at = self.iteration

    def load_checkpoint(self) -> None:
        """Restore weights, optimizer, EMA, RNG states, counters, metrics and every plug-in's state from the run's
        newest checkpoint that verifies (each rank its shards; it may come from another world size)."""
        self.checkpoints.finish()  # this trainer's save in flight, if any, is the newest checkpoint
        progress, _ = resume_checkpoint(
            self.run_dir, model=self.backbone, optimizer=self.optimizer, ema=self.ema, dist=self.dist
        )
        self._apply_optim_config()
        self.ema = progress.ema
        self.iteration, self.consecutive_skips = progress.iteration, progress.consecutive_skips
        for plugin in self.plugins:
            plugin.load_state_dict(progress.plugins.get(plugin.name, {}))
        if self.calibrator is not None:
            self.setting = self.calibrator.setting or self.setting
        self.checkpointed_at = self.iteration
        self.run_log.restart(progress.metrics)

    def _apply_optim_config(self) -> None:
        """The config's AdamW hyperparameters on the restored optimizer: loading its state dict brings back the
        checkpoint's ``param_groups`` (lr, weight decay, betas, eps), so without this a resume with
        ``--allow-config-change optim.lr=...`` would go on with the old values. Equal values change nothing."""
        o = self.cfg.optim
        for group in self.optimizer.param_groups:
            group.update(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)

    # ------------------------------------------------------------------ main loop
    def fit(
        self,
        progress: Callable[[dict], None] | None = None,
        before_iteration: Callable[[int], None] | None = None,
    ) -> list[dict]:
        """Train from ``self.iteration`` to ``train.iterations``; evaluates, logs and checkpoints on the way.
        ``before_iteration(it)`` runs before each iteration, after the previous one's evaluation and save (the
        CLI stops there on a scheduler's signal: at the end of the phase the signal arrived in)."""
        train = self.cfg.train
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.watch.start()
        with self.checkpoints.finishing():  # the last save is complete when fit returns
            if self.iteration == 0 and self._evaluates_after(0):
                self._evaluate_and_log(0, {"iteration": 0})
            while self.iteration < train.iterations:
                if before_iteration:
                    before_iteration(self.iteration)
                self._next_iteration(progress)
            if self.checkpointed_at != self.iteration:  # not again when checkpoint_every just wrote it
                self.save_checkpoint()
        self.watch.stop()
        self.run_log.close()
        return self.metrics

    def _next_iteration(self, progress: Callable[[dict], None] | None) -> None:
        """Train, log (evaluate when due), then checkpoint when due or abort after too many skipped steps."""
        log, train = self.cfg.log, self.cfg.train
        row = self.train_iteration(self.iteration)
        self.iteration += 1
        if self._evaluates_after(self.iteration):
            self._evaluate_and_log(self.iteration, row)
        else:
            self.run_log.append(row)
        if progress:
            progress(row)
        if self.consecutive_skips >= train.max_consecutive_skips:
            self.save_checkpoint()
            self.checkpoints.finish()  # complete on every rank before the abort
            self.watch.stop()
            raise TrainingAborted(self.consecutive_skips, train.max_consecutive_skips, self.checkpoint_path)
        if log.checkpoint_every and self.iteration % log.checkpoint_every == 0:
            self.save_checkpoint()

    def _evaluates_after(self, it: int) -> bool:
        """Whether iteration ``it`` ends with an evaluation: every ``log.eval_every`` (and the last), and each
        of ``log.eval_at``; iteration 0 is the base model."""
        log = self.cfg.log
        every = log.eval_every and (it % log.eval_every == 0 or it == self.cfg.train.iterations)
        return bool(every) or it in log.eval_at

    def _evaluate_and_log(self, it: int, row: dict) -> None:
        """Evaluate, log ``row`` with the scores, write the samples, then the plug-ins' touch point."""
        self.watch.enter("evaluate", it)
        ev, images, per_sample = self.evaluate(it)
        row.update(ev)
        self.run_log.append(row)
        self.run_log.evaluation(it, per_sample, images)
        weights = self.ema if self.ema is not None else self.params  # what the evaluation sampled
        for plugin in self.plugins:
            plugin.after_evaluation(it, images, weights)

    @property
    def metrics(self) -> list[dict]:
        """Every row logged so far (a resumed run's include the checkpoint's)."""
        return self.run_log.rows
