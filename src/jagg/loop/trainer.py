"""One GRPO training loop for every algorithm, backbone and backward strategy.

    rollout (no grad, SDE where the algorithm explores) -> rewards -> group advantages
    -> [calibrate: measure the backward, with backward.jagg_frac=auto or backward.placement=auto]
    -> update: per micro-batch, its trained steps (``Rollout.at``) and their GRPO loss go through
       ``self.backward.backward`` (a ``BackwardSetting``: one plan of knots; the loop never reads its name)
    -> optimizer step every ``grad_accum`` micro-batches (grad-norm clip, non-finite updates skipped)
    -> metrics (JSONL), periodic held-out evaluation (``jagg.loop.evaluate``), checkpoints.

Follows the DanceGRPO / Flow-GRPO loops (docs/references.md): the per-step loss (``GRPOStepLoss``, built by
``Trainer.grpo_loss``) is the clipped PPO surrogate on the SDE log-prob of the stored next latent, scaled by
1 / (grad_accum * T). Rollouts and updates use the same micro-batches, so until the first optimizer step after
a rollout every ratio is exactly 1. Every random draw of iteration ``it`` comes from the generator
(seed, ``SeedStream.ROLLOUT``, it), which makes a resumed run reproduce the uninterrupted one.

Multi-process (torchrun, FSDP2): every rank draws the same prompts, noise, SDE windows and trained steps for the
whole global batch and keeps its contiguous share (micro-batch k is sampled with the SDE seed (seed_it + k)
wherever it runs, so the rollouts equal a single-process run's); rewards are gathered before the group
advantages. Only rank 0 writes metrics and sample grids; every rank writes its own checkpoint shards;
``train.grad_accum`` counts micro-batches per rank. docs/architecture.md walks through one iteration.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from jagg.common import SeedStream, atomic_write_text, generator, peak_memory_mb
from jagg.config import Config, validate_world_size
from jagg.distributed import DistInfo, full_tensor
from jagg.engine.algorithms import ALGORITHMS
from jagg.engine.grpo import (
    GRPOStepLoss,
    RecordingLoss,
    TrainedSteps,
    group_advantages,
    per_reward_advantages,
)
from jagg.engine.routing import BackwardSetting
from jagg.engine.sde import shifted_linear_sigmas
from jagg.engine.strategies import GroupStats
from jagg.loop.calibration import Probe, calibrator_for, window_losses
from jagg.loop.evaluate import evaluate, swapped_in
from jagg.loop.rewards import build_run_rewards, score_samples
from jagg.loop.rollout import Rollout, sample_micro_batches
from jagg.models import Backbone, Components, TextCond
from jagg.ops.checkpoint import CheckpointWriter, Progress, checkpoint_dir, resume_checkpoint
from jagg.ops.grids import save_grid
from jagg.ops.heartbeat import PhaseWatch
from jagg.ops.trackers import Trackers
from jagg.plugins import build_plugins
from jagg.plugins.base import MicroBatch, Plugin, RunView, UpdateView
from jagg.scale.optimizer import build_optimizer
from jagg.scale.placement import DTYPES, place_backbone


class TrainingAborted(RuntimeError):
    """Too many consecutive non-finite updates; a final checkpoint has been written."""


class Trainer:
    def __init__(self, cfg: Config, comp: Components, run_dir: str | Path) -> None:
        self.cfg, self.comp, self.run_dir = cfg, comp, Path(run_dir)
        train = cfg.train
        self.dist = DistInfo.current()
        validate_world_size(cfg, self.dist.world_size)
        auto_cuda = train.device == "auto" and torch.cuda.is_available()
        self.device = torch.device("cuda" if auto_cuda else train.device)
        self.dtype = DTYPES[train.precision]
        # LoRA, dtypes (frozen LoRA base in the compute dtype, trained weights fp32 under bf16), device, and
        # under FSDP2 the shards of rank 0's weights (jagg.scale.placement)
        self.backbone, self.reference = place_backbone(
            cfg,
            comp.backbone,
            device=self.device,
            dist=self.dist,
            reference=cfg.algorithm.kl_beta > 0,  # unsharded frozen copy (small models; no KL at paper scale)
        )
        self.params = [p for p in self.backbone.parameters() if p.requires_grad]
        optim = cfg.optim
        self.optimizer = build_optimizer(cfg, self.params)  # AdamW; fused with optim.fused
        self.ema = [p.detach().clone() for p in self.params] if optim.ema_decay > 0 else None
        self.algorithm = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
        sampling = cfg.sampling
        self.sigmas = (
            comp.sigmas
            if comp.sigmas is not None
            else shifted_linear_sigmas(sampling.num_steps, sampling.shift)
        )
        self.eval_sigmas = (
            comp.eval_sigmas
            if comp.eval_sigmas is not None
            else shifted_linear_sigmas(sampling.eval_num_steps, sampling.shift)
        )
        self.train_reward, self.eval_rewards = build_run_rewards(cfg, self.device)
        self.iteration = 0
        self.consecutive_skips = 0
        self.weights_version = 0  # optimizer steps applied (skipped ones change no weight)
        self.metrics: list[dict] = []
        self.checkpointed_at: int | None = None  # the iteration of the last checkpoint written or loaded
        # log.async_checkpoint (auto: on CUDA): a save's shards are written while training goes on
        self.checkpoints = CheckpointWriter(
            self.run_dir,
            self.dist,
            keep=cfg.log.keep_checkpoints,
            asynchronous=cfg.log.writes_async(self.device.type),
        )
        # How the update runs its backward: fixed by the config, or measured by the run's calibrator (None until
        # its first measurement; jagg.loop.calibration)
        self.backward: BackwardSetting | None = cfg.backward.fixed_setting()
        self.calibrator = calibrator_for(cfg.backward, self.algorithm, len(self.sigmas) - 1)
        # instruments and controls, each acting at its touch points of the update (jagg.plugins)
        self.plugins = build_plugins(cfg, RunView(self.params, train.seed, self.run_dir, self.dist))
        names = cfg.log.report_to if self.dist.is_main else []  # log.report_to: fed where metrics.jsonl is
        self.trackers = Trackers(names, self.run_dir, cfg.to_dict())
        # per-phase heartbeats / hang stacks of this rank while fit runs (jagg.ops.heartbeat)
        self.watch = PhaseWatch(self.dist.rank, cfg.log.heartbeat_s, cfg.log.phase_timeout_s, self.run_dir)

    # ------------------------------------------------------------------ model calls
    def velocity(self, cond: TextCond, model: Backbone | None = None):
        """``velocity(z, t)`` of ``model`` (default: the trained backbone), autocast under bf16."""
        model = model or self.backbone
        cond = cond.to(self.device)

        def v(z: Tensor, t: Tensor) -> Tensor:
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.dtype == torch.bfloat16):
                out = model.velocity(z, t.to(self.device) if torch.is_tensor(t) else t, cond)
            return out.to(z.dtype)

        return v

    def _noise(self, n: int, gen: torch.Generator) -> Tensor:
        shape = (n, *self.comp.latent_shape)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device, self._latent_dtype)

    @property
    def _latent_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def rollout(self, it: int, stream: SeedStream = SeedStream.ROLLOUT) -> Rollout:
        """Sample N = prompts x images trajectories in train micro-batches, score them, compute advantages.

        Every draw (prompts, initial noise, SDE seeds, trained steps) comes from draw ``it`` of ``stream``:
        training iteration ``it`` by default; drivers take extra rollouts from their own named stream.
        """
        t_start = time.perf_counter()
        self.watch.enter("rollout", it)
        train, algorithm = self.cfg.train, self.cfg.algorithm
        gen = generator(train.seed, stream, it)  # identical draws on every rank
        picks = torch.randint(len(self.comp.train_prompts), (train.prompts_per_iter,), generator=gen)
        all_prompts = [self.comp.train_prompts[i] for i in picks for _ in range(train.images_per_prompt)]
        group_ids = torch.arange(train.prompts_per_iter).repeat_interleave(train.images_per_prompt)
        mine = self.dist.share(len(all_prompts))  # this rank's samples of the global batch
        prompts = all_prompts[mine]
        cond = self.comp.text_encoder.encode_prompts(prompts)
        kinds = self.algorithm.step_kinds(len(self.sigmas) - 1, gen, iteration=it)  # MixGRPO's window
        sigmas, kinds = self.algorithm.rollout_schedule(self.sigmas, kinds)  # MixGRPO-Flash: after it
        if algorithm.init_same_noise:  # DanceGRPO: one x_T per prompt, images differ by their SDE noise
            per_prompt = self._noise(train.prompts_per_iter, gen)
            noise = per_prompt.repeat_interleave(train.images_per_prompt, dim=0)[mine]
        else:
            noise = self._noise(len(all_prompts), gen)[mine]
        sde_seed = int(torch.randint(2**62, (1,), generator=gen))
        traj = sample_micro_batches(
            lambda rows: self.velocity(cond.select(rows)),
            noise,
            sigmas.to(self.device),
            kinds,
            batch_size=train.train_batch_size,
            first_sample=mine.start,
            sde_seed=sde_seed,
            noise_level=algorithm.noise_level,
            keep_outputs=self.cfg.backward.reuse_rollout,
        )
        trained = self.algorithm.trained_steps(list(kinds), len(all_prompts), gen)[mine]
        t_sampled = time.perf_counter()
        self.watch.enter("reward", it)
        images = self.comp.decode(traj.final.float()).cpu()
        evals = self.eval_rewards if self.cfg.log.eval_rewards_on_train else {}  # else: at evaluations only
        rewards, scores = score_samples(images, prompts, self.train_reward, evals)
        rewards = self.dist.gather_cat(rewards)  # (N,): groups may span ranks
        scores = {k: self.dist.gather_cat(v.cpu()) for k, v in scores.items()}
        norm = dict(std_mode=algorithm.adv_std, unbiased=algorithm.adv_unbiased, eps=algorithm.adv_eps)
        if algorithm.adv_aggregation == "per_reward":  # each reward normalised, then weighted (MixGRPO)
            weights = self.cfg.reward.weights
            adv = per_reward_advantages(scores, weights, group_ids, **norm, clip=algorithm.adv_clip)[mine]
        else:
            adv = group_advantages(rewards, group_ids, **norm, clip=algorithm.adv_clip)[mine]
        timing = {"time_sample_s": t_sampled - t_start, "time_reward_s": time.perf_counter() - t_sampled}
        return Rollout(
            prompts=prompts,
            cond=cond,
            traj=traj,
            trained=trained,
            rewards=rewards,
            components=scores,
            advantages=adv,
            timing=timing,
            weights_version=self.weights_version,
        )

    # ------------------------------------------------------------------ update
    def grpo_loss(
        self, ro: Rollout, steps: Tensor | None = None, idx: slice = slice(None), *, scale: float = 1.0
    ) -> GRPOStepLoss:
        """The per-step GRPO loss of the samples ``ro[idx]`` at their trained steps (or ``steps`` (b, T)):
        ``loss.x`` / ``loss.sigma`` (T, b, ...) / (T, b) are the inputs and times, ``loss(i, v)`` the scaled loss
        of the i-th step; with ``algorithm.kl_beta > 0`` the frozen reference model gives the KL term."""
        return self.step_loss(ro.at(idx, self.sigmas.to(self.device), steps), ro, idx, scale=scale)

    def step_loss(
        self, trained: TrainedSteps, ro: Rollout, idx: slice, *, scale: float = 1.0
    ) -> GRPOStepLoss:
        """The per-step GRPO loss of ``trained`` steps of the samples ``ro[idx]`` (their advantages, and the
        frozen reference model's KL term with ``algorithm.kl_beta > 0``)."""
        ref = self.velocity(ro.cond.select(idx), self.reference) if self.reference else None
        return self.cfg.algorithm.step_loss(
            trained, ro.advantages[idx].to(self.device), scale=scale, ref_velocity=ref
        )

    def _micro_batches(self, ro: Rollout) -> list[slice]:
        size = self.cfg.train.train_batch_size
        return [slice(start, start + size) for start in range(0, len(ro.prompts), size)]

    def update(self, ro: Rollout) -> dict:
        """Backward over every micro-batch as ``self.backward`` says; optimizer step every grad_accum.

        The plug-ins (``self.plugins``) act at the touch points (``jagg.plugins.base``): when the update begins,
        before each optimizer step, and with their metrics at the end. Stored outputs are read only while the
        weights are the rollout's (``_update_inputs``).
        """
        train = self.cfg.train
        backward = self.backward.at_window(int(ro.trained[0, 0]))  # routed per window position (MixGRPO)
        view = self._view(ro, backward)
        self.optimizer.zero_grad(set_to_none=True)
        for plugin in self.plugins:
            plugin.begin_update(view)
        total: GroupStats | None = None
        done: list[MicroBatch] = []
        pending: list[MicroBatch] = []  # the micro-batches of the coming optimizer step
        norms, stepped = [], []
        for k, rows in enumerate(view.micro_batches):
            loss, outputs = view.inputs(rows)
            stats = backward.backward(view.velocity(rows), loss, outputs)
            total = stats if total is None else total.merge(stats)
            pending.append(MicroBatch(rows, loss.stats))
            if (k + 1) % train.grad_accum == 0 or k == len(view.micro_batches) - 1:
                norm, ok = self._optimizer_step(view, pending)
                norms.append(norm)
                stepped.append(ok)
                done, pending = done + pending, []
        row = self._update_row([st for batch in done for st in batch.stats], norms, stepped)
        passes = total.backward_passes / len(ro.prompts) * train.train_batch_size
        row |= total.as_metrics() | {"backward_passes_per_sample": passes}
        for plugin in self.plugins:
            row |= plugin.metrics()
        return row

    def _update_row(self, step_stats: list, norms: list[float], stepped: list[bool]) -> dict:
        """The update's loss, PPO statistics (means over every trained step, over every rank) and steps."""
        means = self.dist.reduce_scalars(
            {
                "loss": float(np.mean([st.loss for st in step_stats])),
                "clip_frac": float(np.mean([st.ppo.clip_frac for st in step_stats])),
                "approx_kl": float(np.mean([st.ppo.approx_kl for st in step_stats])),
            }
        )
        finite = any(map(math.isfinite, norms))
        return {
            "loss": means["loss"],
            "grad_norm": float(np.nanmean(norms)) if finite else float("nan"),
            "clip_frac": means["clip_frac"],
            "approx_kl": means["approx_kl"],
            "optimizer_steps": len(stepped),
            "skipped_steps": stepped.count(False),
        }

    def _view(self, ro: Rollout, setting: BackwardSetting) -> UpdateView:
        """What the plug-ins see of the update of ``ro`` under ``setting`` (``jagg.plugins.base.UpdateView``)."""
        return UpdateView(
            iteration=self.iteration,
            params=self.params,
            setting=setting,
            micro_batches=self._micro_batches(ro),
            inputs=functools.partial(self._update_inputs, ro),
            velocity=lambda rows: self.velocity(ro.cond.select(rows)),
            dist=self.dist,
        )

    def _update_inputs(self, ro: Rollout, idx: slice) -> tuple[RecordingLoss, Tensor | None]:
        """The micro-batch's GRPO loss over its T trained steps (scaled 1 / (grad_accum * T)) and its stored
        outputs where they are valid (on the rollout's weights), else None."""
        steps = ro.at(idx, self.sigmas.to(self.device))
        loss = self.grpo_loss(ro, idx=idx, scale=1.0 / (self.cfg.train.grad_accum * len(steps.x)))
        on_rollout_weights = ro.weights_version == self.weights_version and steps.outputs is not None
        return loss.recording(), steps.outputs.to(self.device) if on_rollout_weights else None

    def _optimizer_step(
        self, view: UpdateView | None = None, pending: list[MicroBatch] = ()
    ) -> tuple[float, bool]:
        """The plug-ins' touch point before the step (a control degrades the gradient, then fidelity measures
        it), clip, then step unless the gradient is non-finite (then skip and count). Returns (norm, stepped)."""
        for plugin in self.plugins:
            plugin.before_step(view, pending)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
        norm = float(full_tensor(norm))  # global norm (a DTensor under FSDP2): same on every rank
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.consecutive_skips += 1
            return norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips = 0
        self.weights_version += 1
        if self.ema is not None:
            decay = self.cfg.optim.ema_decay
            with torch.no_grad():
                for e, p in zip(self.ema, self.params):
                    e.mul_(decay).add_(p.detach(), alpha=1 - decay)
        return norm, True

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
        noise = self._noise(len(prompts), gen)
        with swapped_in(self.params, self.ema):
            return evaluate(
                velocity=self.velocity,
                components=self.comp,
                rewards=self.eval_rewards,
                prompts=prompts,
                noise=noise,
                sigmas=self.eval_sigmas.to(self.device),
                dist=self.dist,
            )

    # ------------------------------------------------------------------ one iteration
    def calibrate(self, ro: Rollout, it: int = 0) -> dict:
        """Measure the backward on the first micro-batch of the rollout ``ro`` of iteration ``it`` with the run's
        calibrator and use it from now on (``jagg.loop.calibration``); gradients are left as they were.
        Returns the measurement's metrics and its seconds."""
        t0 = time.perf_counter()
        rows = slice(0, self.cfg.train.train_batch_size)
        velocity = self.velocity(ro.cond.select(rows))
        probe = Probe(
            iteration=it,
            velocity=velocity,
            loss=self.grpo_loss(ro, idx=rows, scale=1.0),
            params=self.params,
            micro_batches=len(self._micro_batches(ro)),
            grad_accum=self.cfg.train.grad_accum,
            window_losses=lambda windows: self._window_losses(velocity, ro, rows, windows, it),
        )
        metrics = self.calibrator.measure(probe)
        self.backward = self.calibrator.setting
        return metrics | {"time_calibrate_s": time.perf_counter() - t0}

    def _window_losses(self, velocity, ro: Rollout, idx: slice, windows: list[range], it: int) -> dict:
        """``window_losses`` of the samples ``ro[idx]``, their SDE noise from ``SeedStream.CALIBRATION``."""
        algorithm, gen = self.cfg.algorithm, generator(self.cfg.train.seed, SeedStream.CALIBRATION, it)
        return window_losses(
            velocity,
            ro.traj,
            idx,
            self.sigmas.to(self.device),
            windows,
            lambda trained: self.step_loss(trained, ro, idx),
            kind=algorithm.sde_kind,
            noise_level=algorithm.noise_level,
            seed=int(torch.randint(2**62, (1,), generator=gen)),
        )

    def train_iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        ro = self.rollout(it)
        t_rollout = time.perf_counter() - t0
        cal = {}
        if self.calibrator is not None and self.calibrator.due(it):
            self.watch.enter("calibrate", it)
            cal = self.calibrate(ro, it)  # time_calibrate_s, outside the rollout and update phases
        t1 = time.perf_counter()
        self.watch.enter("update", it)
        upd = self.update(ro)
        t2 = time.perf_counter()
        row = {
            "iteration": it + 1,
            "reward_mean": ro.rewards.mean().item(),
            "reward_std": ro.rewards.std().item(),
        }
        for name, score in ro.components.items():
            row[f"reward_{name}_mean"], row[f"reward_{name}_std"] = score.mean().item(), score.std().item()
        row.update(upd)
        row.update(cal)
        row.update(ro.timing)
        row.update(
            time_rollout_s=t_rollout,
            time_update_s=t2 - t1,
            time_iteration_s=t2 - t0,
            lr=self.optimizer.param_groups[0]["lr"],
            peak_memory_mb=peak_memory_mb(self.device),
        )
        return row

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        """The run's checkpoint directory (``jagg.ops.checkpoint``: sharded, DCP)."""
        return checkpoint_dir(self.run_dir)

    def save_checkpoint(self) -> None:
        """Start the sharded checkpoint of now (a collective: every rank writes its own shards); it becomes the
        run's checkpoint, atomically, at once or, with ``log.async_checkpoint``, at ``self.checkpoints.finish()``
        (the next save, the end of ``fit``, an abort, a resume)."""
        self.watch.enter("checkpoint", self.iteration)
        progress = Progress(
            iteration=self.iteration,
            consecutive_skips=self.consecutive_skips,
            metrics=self.metrics,
            ema=self.ema,
            components=self._states(),
        )
        self.checkpoints.save(
            model=self.backbone, optimizer=self.optimizer, progress=progress, config=self.cfg.to_dict()
        )
        self.checkpointed_at = self.iteration

    def load_checkpoint(self) -> None:
        """Restore weights, optimizer, EMA, RNG states, counters, metrics and a measured backward from the run's
        newest checkpoint that verifies (each rank reads its shards; the checkpoint may come from another world
        size)."""
        self.checkpoints.finish()  # this trainer's save in flight, if any, is the newest checkpoint
        progress, _ = resume_checkpoint(
            self.run_dir, model=self.backbone, optimizer=self.optimizer, ema=self.ema, dist=self.dist
        )
        self.ema = progress.ema
        self.iteration, self.consecutive_skips = progress.iteration, progress.consecutive_skips
        self.metrics = progress.metrics
        self._load_states(progress.components)
        self.checkpointed_at = self.iteration
        self._write_metrics()

    def _states(self) -> dict[str, dict]:
        """The state of every component that keeps one: the calibrator's measurement, the plug-ins'."""
        states = {p.name: p.state_dict() for p in self.plugins}
        if self.calibrator is not None:
            states["calibration"] = self.calibrator.state_dict()
        return {name: state for name, state in states.items() if state}

    def _load_states(self, states: dict[str, dict]) -> None:
        for plugin in self.plugins:
            plugin.load_state_dict(states.get(plugin.name, {}))
        if self.calibrator is not None:
            self.calibrator.load_state_dict(states.get("calibration", {}))
            self.backward = self.calibrator.setting or self.backward

    def _write_metrics(self) -> None:
        if self.dist.is_main:
            atomic_write_text(
                self.run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in self.metrics)
            )

    # ------------------------------------------------------------------ main loop
    def fit(self, progress: Callable[[dict], None] | None = None) -> list[dict]:
        """Train from ``self.iteration`` to ``train.iterations``; evaluates, logs and checkpoints on the way."""
        log, train = self.cfg.log, self.cfg.train
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.watch.start()
        with self.checkpoints.finishing():  # the last save is complete when fit returns
            if self.iteration == 0 and log.eval_every:
                self._evaluate_and_log(0, {"iteration": 0})
            while self.iteration < train.iterations:
                self._next_iteration(progress)
            if self.checkpointed_at != self.iteration:  # not again when checkpoint_every just wrote it
                self.save_checkpoint()
        self.watch.stop()
        self.trackers.close()
        return self.metrics

    def _next_iteration(self, progress: Callable[[dict], None] | None) -> None:
        """Train, log (evaluate when due), then checkpoint when due or abort after too many skipped steps."""
        log, train = self.cfg.log, self.cfg.train
        row = self.train_iteration(self.iteration)
        self.iteration += 1
        if log.eval_every and (self.iteration % log.eval_every == 0 or self.iteration == train.iterations):
            self._evaluate_and_log(self.iteration, row)
        else:
            self._log(row)
        if progress:
            progress(row)
        if self.consecutive_skips >= train.max_consecutive_skips:
            self.save_checkpoint()
            self.checkpoints.finish()  # complete on every rank before the abort
            self.watch.stop()
            raise TrainingAborted(
                f"{self.consecutive_skips} consecutive optimizer steps had a non-finite loss or gradient "
                f"(train.max_consecutive_skips={train.max_consecutive_skips}); "
                f"last checkpoint: {self.checkpoint_path}"
            )
        if log.checkpoint_every and self.iteration % log.checkpoint_every == 0:
            self.save_checkpoint()

    def _evaluate_and_log(self, it: int, row: dict) -> None:
        self.watch.enter("evaluate", it)
        ev, images, per_sample = self.evaluate(it)
        row.update(ev)
        self._log(row)
        if self.dist.is_main:
            atomic_write_text(self.run_dir / "samples" / f"eval_{it:05d}.json", json.dumps(per_sample))
        weights = self.ema if self.ema is not None else self.params  # what the evaluation sampled
        for plugin in self.plugins:
            plugin.after_evaluation(it, images, weights)
        grid_every = self.cfg.log.grid_every
        if self.dist.is_main and (grid_every == 0 or it % grid_every == 0):
            save_grid(images, self.run_dir / "samples" / f"iter_{it:05d}.png")
            self.trackers.log_images(images, it)

    def _log(self, row: dict) -> None:
        self.metrics.append(row)
        if self.dist.is_main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            self.trackers.log_row(row)
