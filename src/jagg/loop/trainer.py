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
from jagg.engine.control import PositiveControl
from jagg.engine.grpo import (
    GRPOStepLoss,
    RecordingLoss,
    StepStats,
    TrainedSteps,
    group_advantages,
    per_reward_advantages,
)
from jagg.engine.routing import BackwardSetting
from jagg.engine.sde import shifted_linear_sigmas
from jagg.engine.strategies import GroupStats
from jagg.loop.calibration import (
    calibration_windows,
    measure_setting,
    measure_windows,
    record,
    restore,
    window_losses,
)
from jagg.loop.evaluate import evaluate, swapped_in
from jagg.loop.fidelity import FidelityRecord
from jagg.loop.rewards import build_run_rewards, score_samples
from jagg.loop.rollout import Rollout, sample_micro_batches
from jagg.models import Backbone, Components, TextCond
from jagg.ops.checkpoint import CheckpointWriter, Progress, checkpoint_dir, resume_checkpoint
from jagg.ops.grids import save_grid
from jagg.ops.heartbeat import PhaseWatch
from jagg.ops.trackers import Trackers
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
        # train.control_cosine (positive control): its directions are functions of the seed (resume-safe)
        self.control = (
            None
            if train.control_cosine is None
            else PositiveControl(
                self.params,
                train.control_cosine,
                train.control_direction,
                lambda i: generator(train.seed, SeedStream.CONTROL, i),
            )
        )
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
        # How the update runs its backward: fixed by the config, or (backward.jagg_frac=auto) None until
        # ``calibrate`` has measured the routing.
        self.backward: BackwardSetting | None = cfg.backward.fixed_setting()
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

        Stored outputs (``backward.reuse_rollout``) are read only while the weights are the rollout's (no
        optimizer step since it was sampled: ``Rollout.weights_version``): they are then exactly what a forward
        would recompute. ``onpolicy_ratio_max_dev`` is the largest |ratio - 1| before the first optimizer step:
        exactly 0 on the rollout's weights.
        """
        train = self.cfg.train
        batches = self._micro_batches(ro)
        step_stats: list[StepStats] = []
        total: GroupStats | None = None
        onpolicy_dev, grad_norms, skipped, stepped = 0.0, [], 0, 0
        self.optimizer.zero_grad(set_to_none=True)
        if self.control is not None:
            self.control.start_iteration(self.iteration)
        backward = self.backward.at_window(int(ro.trained[0, 0]))  # routed per window position (MixGRPO)
        fidelity = self._fidelity_record(ro, batches[0], backward)
        pending: list[slice] = []  # the micro-batches of the coming optimizer step
        for k, idx in enumerate(batches):
            loss, outputs = self._update_inputs(ro, idx)
            stats = backward.backward(self.velocity(ro.cond.select(idx)), loss, outputs)
            total = stats if total is None else total.merge(stats)
            step_stats += loss.stats
            pending.append(idx)
            if stepped == 0:
                onpolicy_dev = max(onpolicy_dev, max(st.ppo.ratio_max_dev for st in step_stats))
            if (k + 1) % train.grad_accum == 0 or k == len(batches) - 1:
                exact = functools.partial(self._exact_update, ro, pending)
                compare = (
                    None if fidelity is None else functools.partial(fidelity.measure_step, self.params, exact)
                )
                norm, ok = self._optimizer_step(compare)
                grad_norms.append(norm)
                skipped += int(not ok)
                stepped += 1
                pending = []
        means = self.dist.reduce_scalars(
            {
                "loss": float(np.mean([st.loss for st in step_stats])),
                "clip_frac": float(np.mean([st.ppo.clip_frac for st in step_stats])),
                "approx_kl": float(np.mean([st.ppo.approx_kl for st in step_stats])),
            }
        )
        finite = any(map(math.isfinite, grad_norms))
        return {
            "loss": means["loss"],
            "grad_norm": float(np.nanmean(grad_norms)) if finite else float("nan"),
            "clip_frac": means["clip_frac"],
            "approx_kl": means["approx_kl"],
            "onpolicy_ratio_max_dev": self.dist.reduce_scalars({"d": onpolicy_dev}, "max")["d"],
            "optimizer_steps": stepped,
            "skipped_steps": skipped,
            **total.as_metrics(),
            "backward_passes_per_sample": total.backward_passes / len(ro.prompts) * train.train_batch_size,
            **({} if fidelity is None else fidelity.row()),
        }

    def _update_inputs(self, ro: Rollout, idx: slice) -> tuple[RecordingLoss, Tensor | None]:
        """The micro-batch's GRPO loss over its T trained steps (scaled 1 / (grad_accum * T)) and its stored
        outputs where they are valid (on the rollout's weights), else None."""
        steps = ro.at(idx, self.sigmas.to(self.device))
        loss = self.grpo_loss(ro, idx=idx, scale=1.0 / (self.cfg.train.grad_accum * len(steps.x)))
        on_rollout_weights = ro.weights_version == self.weights_version and steps.outputs is not None
        return loss.recording(), steps.outputs.to(self.device) if on_rollout_weights else None

    def _fidelity_record(self, ro: Rollout, idx: slice, backward: BackwardSetting) -> FidelityRecord | None:
        """At a ``log.fidelity_every`` iteration: a record with the block cosines of micro-batch ``idx``
        measured (its optimizer steps are measured as they come); else None."""
        every = self.cfg.log.fidelity_every
        if not every or self.iteration % every:
            return None
        fidelity = FidelityRecord()
        loss, outputs = self._update_inputs(ro, idx)
        fidelity.measure_blocks(backward, self.velocity(ro.cond.select(idx)), loss.loss, self.params, outputs)
        return fidelity

    def _exact_update(self, ro: Rollout, batches: list[slice]) -> None:
        """Exact's backward of ``batches`` at the current weights, added to ``.grad`` (the fidelity's shadow)."""
        for idx in batches:
            loss, _ = self._update_inputs(ro, idx)
            self.backward.exact.backward(self.velocity(ro.cond.select(idx)), loss.loss)

    def _optimizer_step(self, compare: Callable[[], None] | None = None) -> tuple[float, bool]:
        """Degrade (positive control), measure (``compare``, at a fidelity iteration), clip, then step unless
        the gradient is non-finite (then skip and count). Returns (norm, stepped)."""
        if self.control is not None:
            self.control.apply()
        if compare is not None:
            compare()
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
        """Measure the backward on the rollout ``ro`` of iteration ``it``, first micro-batch, and use it
        (``jagg.loop.calibration``: the routing of groups under ``backward.jagg_frac=auto``, per window position
        under MixGRPO, the knots' placement under ``backward.placement=auto``); gradients are left as they were.
        Returns the measurement's metrics and its seconds."""
        t0 = time.perf_counter()
        backward, idx = self.cfg.backward, slice(0, self.cfg.train.train_batch_size)
        velocity = self.velocity(ro.cond.select(idx))
        windows = calibration_windows(backward, self.algorithm, len(self.sigmas) - 1, it)
        if windows is None:
            self.backward, metrics = measure_setting(
                backward,
                velocity,
                self.grpo_loss(ro, idx=idx, scale=1.0),
                self.params,
                micro_batches=len(self._micro_batches(ro)),
                grad_accum=self.cfg.train.grad_accum,
            )
        else:
            losses = self._window_losses(velocity, ro, idx, windows, it)
            self.backward, metrics = measure_windows(backward, velocity, losses, self.params)
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
        backward, cal = self.cfg.backward, {}
        if backward.calibrated and (self.backward is None or it % backward.calibrate_every == 0):
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
            **record(self.backward),
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
        self.backward = restore(self.cfg.backward, progress) or self.backward
        self.checkpointed_at = self.iteration
        self._write_metrics()

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
        if self.cfg.log.save_eval_state:
            self._save_eval_state(it, images)
        grid_every = self.cfg.log.grid_every
        if self.dist.is_main and (grid_every == 0 or it % grid_every == 0):
            save_grid(images, self.run_dir / "samples" / f"iter_{it:05d}.png")
            self.trackers.log_images(images, it)

    def _save_eval_state(self, it: int, images: Tensor) -> None:
        """``samples/eval_<it>.rank<r>.pt``: this rank's held-out images and its part of the evaluated weights
        (the EMA where there is one; a DTensor's local shard), float32. Two runs' files give the paired
        divergence of their samples and weights (``experiments/curves.py``) without loading a checkpoint."""
        weights = self.ema if self.ema is not None else self.params
        local = [(w.to_local() if hasattr(w, "to_local") else w).detach().float().cpu() for w in weights]
        path = self.run_dir / "samples" / f"eval_{it:05d}.rank{self.dist.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"images": images.float().cpu(), "weights": local}, tmp)
        tmp.replace(path)  # a reader never sees half a file

    def _log(self, row: dict) -> None:
        self.metrics.append(row)
        if self.dist.is_main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            self.trackers.log_row(row)
