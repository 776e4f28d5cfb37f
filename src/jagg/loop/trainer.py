"""One GRPO training loop for every algorithm, backbone and backward strategy.

    rollout (no grad, SDE where the algorithm explores) -> rewards -> group advantages
    -> update: per micro-batch, the trained steps of each sample go through ``trajectory_backward``
       (the backward strategy and ``jagg_frac`` routing live there; this loop never looks at the name)
    -> optimizer step every ``grad_accum`` micro-batches (grad-norm clip, non-finite updates skipped)
    -> metrics (JSONL), periodic held-out evaluation (ODE sampling, every eval reward), checkpoints.

Follows the DanceGRPO / Flow-GRPO loops (docs/references.md): the per-step loss (``GRPOStepLoss``, built by
``Trainer.grpo_loss``) is the clipped PPO surrogate on the SDE log-prob of the stored next latent, scaled by
1 / (grad_accum * T). Rollouts and updates use the same micro-batches, so before the first optimizer step of an
iteration every ratio is exactly 1. Every random draw of iteration ``it`` comes from the generator (seed, ``SeedStream.ROLLOUT``, it)
(``jagg.common.generator``), which makes a resumed run reproduce the uninterrupted one.

Multi-process (torchrun, FSDP2): every rank draws the same prompts, noise, SDE windows and trained steps for the
whole global batch and keeps its contiguous share (micro-batch k of the global batch is sampled with the SDE
seed (seed_it + k) wherever it runs, so the rollouts equal a single-process run's). Rewards are gathered
before the group advantages, so a prompt group may span ranks. The backbone is sharded per block after LoRA
is applied, each rank receiving its shards of rank 0's weights (``placement``); the backward strategies are
unchanged (FSDP2 reduce-scatters on each backward). Only rank 0 writes metrics and sample grids; every rank
writes its own shards of a checkpoint; ``train.grad_accum`` counts micro-batches per rank.

Elsewhere in this layer: the model parts (``components``), where the trained model lives (``placement``), the
rewards and their device (``rewards``), sharded checkpoint state (``checkpoint``), the weights' export
(``export``), sample grids (``grids``).
"""

from __future__ import annotations

import json
import math
import resource
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from jagg.common import SeedStream, atomic_write_text, generator
from jagg.config import BackwardConfig, Config, validate_world_size
from jagg.engine.algorithms import ALGORITHMS
from jagg.engine.control import degrade_gradients, fixed_direction
from jagg.engine.diagnostics import group_gradient_cosines, route_by_cosine
from jagg.engine.grpo import GRPOStepLoss, group_advantages
from jagg.engine.sampling import Trajectory, sample_trajectory
from jagg.engine.sde import shifted_linear_sigmas
from jagg.engine.strategies import GroupStats, group_cost, plan_groups, trajectory_backward
from jagg.loop.checkpoint import Progress, checkpoint_dir, find_checkpoint, load_checkpoint, save_checkpoint
from jagg.loop.grids import save_grid
from jagg.loop.placement import DTYPES, place_backbone
from jagg.loop.rewards import build_run_reward
from jagg.models import Backbone, Components, TextCond
from jagg.rewards import Reward, WeightedRewards
from jagg.scale.distributed import DistInfo, full_tensor


class TrainingAborted(RuntimeError):
    """Too many consecutive non-finite updates; a final checkpoint has been written."""


@dataclass
class Rollout:
    """One iteration's samples. N = prompts_per_iter * images_per_prompt."""

    prompts: list[str]  # (n,) this rank's share (n = N / world size)
    cond: TextCond  # n rows
    traj: Trajectory  # latents (S + 1, n, C, H, W), log_probs (S, n)
    trained: Tensor  # (n, T) trained step indices per sample, ascending
    rewards: Tensor  # (N,) weighted total, global batch (all ranks)
    components: dict[str, Tensor]  # per-reward scores (N,), global batch
    advantages: Tensor  # (n,) this rank's share
    timing: dict[str, float]  # time_sample_s, time_reward_s


def _at_steps(per_step: Tensor, idx: slice, steps: Tensor, offset: int = 0) -> Tensor:
    """(S[+1], n, ...) per-step rollout tensor -> (T, b, ...) at each sample's trained steps (+ offset)."""
    cols = torch.arange(steps.shape[0])[None, :]  # (1, b)
    return per_step[:, idx][steps.T + offset, cols]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Trainer:
    def __init__(self, cfg: Config, comp: Components, run_dir: str | Path) -> None:
        self.cfg, self.comp, self.run_dir = cfg, comp, Path(run_dir)
        t = cfg.train
        self.dist = DistInfo.current()
        validate_world_size(cfg, self.dist.world_size)
        self.device = torch.device("cuda" if t.device == "auto" and torch.cuda.is_available() else t.device)
        self.dtype = DTYPES[t.precision]
        # LoRA, dtypes (frozen LoRA base in the compute dtype, trained weights fp32 under bf16), device, and
        # under FSDP2 the shards of rank 0's weights (jagg.loop.placement)
        self.backbone, self.reference = place_backbone(
            cfg,
            comp.backbone,
            device=self.device,
            dist=self.dist,
            reference=cfg.algorithm.kl_beta > 0,  # unsharded frozen copy (small models; no KL at paper scale)
        )
        self.params = [p for p in self.backbone.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        self.ema = [p.detach().clone() for p in self.params] if o.ema_decay > 0 else None
        # train.control_cosine (positive control): one direction per run, a function of the seed (resume-safe)
        c = t.control_cosine
        self.control = (
            None if c is None else fixed_direction(self.params, generator(t.seed, SeedStream.CONTROL))
        )
        self.algorithm = ALGORITHMS[cfg.algorithm.name](cfg.algorithm)
        s = cfg.sampling
        self.sigmas = comp.sigmas if comp.sigmas is not None else shifted_linear_sigmas(s.num_steps, s.shift)
        self.eval_sigmas = (
            comp.eval_sigmas
            if comp.eval_sigmas is not None
            else shifted_linear_sigmas(s.eval_num_steps, s.shift)
        )
        self.train_reward = WeightedRewards(
            {n: self._build_reward(n) for n in cfg.reward.weights}, dict(cfg.reward.weights)
        )
        self.eval_rewards: dict[str, Reward] = {
            n: self.train_reward.rewards.get(n) or self._build_reward(n) for n in cfg.reward.eval
        }
        self.iteration = 0
        self.consecutive_skips = 0
        self.metrics: list[dict] = []
        # backward.jagg_frac=auto: the routing per group position; backward.group_size=auto: W. Set by calibrate.
        self.routing: list[bool] | None = None
        b = cfg.backward
        self.group_size: int | None = None if b.calibrated else b.candidate_group_sizes[0]

    # ------------------------------------------------------------------ setup helpers
    def _build_reward(self, name: str) -> Reward:
        """Reward ``name`` with reward.kwargs[name], on the training device when it takes one."""
        return build_run_reward(name, self.cfg.reward.kwargs.get(name, {}), self.device)

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
        t, a = self.cfg.train, self.cfg.algorithm
        gen = generator(t.seed, stream, it)  # identical draws on every rank
        picks = torch.randint(len(self.comp.train_prompts), (t.prompts_per_iter,), generator=gen)
        all_prompts = [self.comp.train_prompts[i] for i in picks for _ in range(t.images_per_prompt)]
        group_ids = torch.arange(t.prompts_per_iter).repeat_interleave(t.images_per_prompt)
        mine = self.dist.share(len(all_prompts))  # this rank's samples of the global batch
        prompts = all_prompts[mine]
        cond = self.comp.text_encoder.encode_prompts(prompts)
        kinds = self.algorithm.step_kinds(len(self.sigmas) - 1, gen)
        if a.init_same_noise:  # DanceGRPO's init_same_noise: one x_T per prompt, images differ by SDE noise
            noise = self._noise(t.prompts_per_iter, gen).repeat_interleave(t.images_per_prompt, dim=0)[mine]
        else:
            noise = self._noise(len(all_prompts), gen)[mine]
        sde_seed = int(torch.randint(2**62, (1,), generator=gen))
        chunks = []
        for start in range(0, len(prompts), t.train_batch_size):
            idx = slice(start, start + t.train_batch_size)
            chunk = (mine.start + start) // t.train_batch_size  # global micro-batch index
            sde_gen = torch.Generator(device=self.device).manual_seed(sde_seed + chunk)
            chunks.append(
                sample_trajectory(
                    self.velocity(cond.select(idx)),
                    noise[idx],
                    self.sigmas.to(self.device),
                    kinds,
                    noise_level=a.noise_level,
                    generator=sde_gen,
                    keep_outputs=self.cfg.backward.reuse_rollout,
                )
            )
        traj = Trajectory(
            torch.cat([c.latents for c in chunks], dim=1),
            torch.cat([c.log_probs for c in chunks], dim=1),
            chunks[0].sigmas,
            chunks[0].kinds,
            torch.cat([c.outputs for c in chunks], dim=1) if self.cfg.backward.reuse_rollout else None,
        )
        trained = self.algorithm.trained_steps(list(kinds), len(all_prompts), gen)[mine]
        t_sampled = time.perf_counter()
        images = self.comp.decode(traj.final.float()).cpu()
        rewards = self.train_reward(images, prompts)
        scores = dict(self.train_reward.components)
        for name, fn in self.eval_rewards.items():  # e.g. attribute accuracy of the training samples
            if name not in scores:
                scores[name] = fn(images, prompts).float()
        rewards = self.dist.gather_cat(rewards)  # (N,): groups may span ranks
        scores = {k: self.dist.gather_cat(v.cpu()) for k, v in scores.items()}
        adv = group_advantages(
            rewards, group_ids, std_mode=a.adv_std, unbiased=a.adv_unbiased, eps=a.adv_eps, clip=a.adv_clip
        )[mine]
        timing = {"time_sample_s": t_sampled - t_start, "time_reward_s": time.perf_counter() - t_sampled}
        return Rollout(prompts, cond, traj, trained, rewards, scores, adv, timing)

    # ------------------------------------------------------------------ update
    def grpo_loss(
        self,
        ro: Rollout,
        steps: Tensor,
        idx: slice = slice(None),
        *,
        scale: float = 1.0,
        log: list | None = None,
    ) -> GRPOStepLoss:
        """The per-step GRPO loss of the samples ``ro[idx]`` at their trained steps ``steps`` (b, T) (ascending).

        ``loss.x`` / ``loss.sigma`` (T, b, ...) / (T, b) are the model inputs and times of the trained steps;
        ``loss(i, v)`` is the scaled loss of the i-th; with ``algorithm.kl_beta > 0`` the frozen reference
        model gives the KL term. ``log`` (default: a new list) collects ``(loss, PPOStats)`` per call.
        """
        a = self.cfg.algorithm
        lat = ro.traj.latents
        sig = self.sigmas.to(self.device)
        return GRPOStepLoss(
            x=_at_steps(lat, idx, steps),
            x_next=_at_steps(lat, idx, steps, offset=1),
            sigma=sig[steps.T],
            sigma_next=sig[steps.T + 1],
            old_log_prob=_at_steps(ro.traj.log_probs, idx, steps),
            advantages=ro.advantages[idx].to(self.device),
            kind=a.sde_kind,
            noise_level=a.noise_level,
            clip_range=a.clip_range,
            kl_beta=a.kl_beta if self.reference is not None else 0.0,
            kl_std=a.kl_std,
            ref_velocity=self.velocity(ro.cond.select(idx), self.reference) if self.reference else None,
            scale=scale,
            log=[] if log is None else log,
        )

    def update(self, ro: Rollout, backward: BackwardConfig | None = None) -> dict:
        """Backward over every micro-batch with the configured strategy; optimizer step every grad_accum.

        ``backward`` overrides ``cfg.backward`` (used by the side-by-side timing driver).

        Stored outputs (``backward.reuse_rollout``): until the iteration's first optimizer step the weights are
        the rollout's and the micro-batches are the rollout's, so the rollout's model outputs are exactly what
        a forward would recompute; the strategy then takes its intermediate signals from them (no forward).
        After the first optimizer step nothing stored is read.
        """
        t, b = self.cfg.train, backward or self.cfg.backward
        n = len(ro.prompts)
        starts = list(range(0, n, t.train_batch_size))
        ppo_log: list = []
        total: GroupStats | None = None
        onpolicy_dev, grad_norms, skipped, stepped = 0.0, [], 0, 0
        self.optimizer.zero_grad(set_to_none=True)
        for k, start in enumerate(starts):
            idx = slice(start, start + t.train_batch_size)
            steps = ro.trained[idx]  # (b, T)
            scale = 1.0 / (t.grad_accum * steps.shape[1])
            loss = self.grpo_loss(ro, steps, idx, scale=scale, log=ppo_log)
            reuse = b.reuse_rollout and stepped == 0 and ro.traj.outputs is not None
            stats = trajectory_backward(
                self.velocity(ro.cond.select(idx)),
                loss.x,
                loss.sigma,
                loss,
                strategy=b.strategy,
                group_size=self.group_size if backward is None else b.group_size,
                jagg_frac=1.0 if b.jagg_frac == "auto" else b.jagg_frac,
                routing=self.routing if b.jagg_frac == "auto" else None,
                endpoints=b.endpoints,
                outputs=_at_steps(ro.traj.outputs, idx, steps).to(self.device) if reuse else None,
            )
            total = stats if total is None else total.merge(stats)
            if stepped == 0:
                onpolicy_dev = max(onpolicy_dev, max(st.ratio_max_dev for _, st in ppo_log))
            if (k + 1) % t.grad_accum == 0 or k == len(starts) - 1:
                norm, ok = self._optimizer_step()
                grad_norms.append(norm)
                skipped += int(not ok)
                stepped += 1
        losses = [loss for loss, _ in ppo_log]
        means = self.dist.reduce_scalars(
            {
                "loss": float(np.mean(losses)),
                "clip_frac": float(np.mean([st.clip_frac for _, st in ppo_log])),
                "approx_kl": float(np.mean([st.approx_kl for _, st in ppo_log])),
            }
        )
        return {
            "loss": means["loss"],
            "grad_norm": float(np.nanmean(grad_norms))
            if any(map(math.isfinite, grad_norms))
            else float("nan"),
            "clip_frac": means["clip_frac"],
            "approx_kl": means["approx_kl"],
            "onpolicy_ratio_max_dev": self.dist.reduce_scalars({"d": onpolicy_dev}, "max")["d"],
            "optimizer_steps": stepped,
            "skipped_steps": skipped,
            "forward_passes": total.forward_passes,
            "forward_passes_with_grad": total.forward_passes_with_grad,
            "forward_calls": total.forward_calls,
            "forwards_skipped": total.forwards_skipped,
            "backward_passes": total.backward_passes,
            "backward_graphs": total.backward_graphs,
            "backward_calls": total.backward_calls,
            "backward_passes_per_sample": total.backward_passes / n * t.train_batch_size,
            "time_forward_s": total.time_forward_s,
            "time_backward_s": total.time_backward_s,
        }

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, then step unless the gradient is non-finite (then skip and count). Returns (norm, stepped)."""
        if self.control is not None:
            degrade_gradients(self.params, self.control, self.cfg.train.control_cosine)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
        norm = float(full_tensor(norm))  # global norm (a DTensor under FSDP2): same on every rank
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.consecutive_skips += 1
            return norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consecutive_skips = 0
        if self.ema is not None:
            d = self.cfg.optim.ema_decay
            with torch.no_grad():
                for e, p in zip(self.ema, self.params):
                    e.mul_(d).add_(p.detach(), alpha=1 - d)
        return norm, True

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, it: int) -> tuple[dict, Tensor, dict]:
        """ODE samples on held-out prompts (fixed noise), scored by every eval reward (EMA weights if any).

        Returns the metrics row (mean / std per reward), rank 0's images and the per-sample scores
        ``{"prompts": [...], reward: [...]}``; the noise is the same at every evaluation, so per-sample
        scores of two evaluations are paired (``experiments/world_rl_report.py`` uses that).

        Multi-process: each rank samples an equal share (padded by repeating its last prompt, so every rank
        runs the same number of sharded forwards); scores are gathered, images are rank 0's share.
        """
        lg = self.cfg.log
        all_prompts = [
            p for p in self.comp.eval_prompts[: lg.eval_prompts] for _ in range(lg.eval_images_per_prompt)
        ]
        gen = generator(self.cfg.train.seed, SeedStream.EVAL)  # the same noise at every evaluation
        noise = self._noise(len(all_prompts), gen)
        rows = self._eval_rows(len(all_prompts))
        idx = [i if i >= 0 else -i - 1 for i in rows]  # padding rows repeat a real one
        prompts, noise = [all_prompts[i] for i in idx], noise[idx]  # this rank's share
        cond = self.comp.text_encoder.encode_prompts(prompts)
        sig = self.eval_sigmas.to(self.device)
        with self._ema_weights():
            finals = [
                sample_trajectory(
                    self.velocity(cond.select(slice(i, i + 32))),
                    noise[i : i + 32],
                    sig,
                    ["ode"] * (len(sig) - 1),
                ).final
                for i in range(0, len(prompts), 32)
            ]
        images = self.comp.decode(torch.cat(finals).float()).cpu()
        keep = self.dist.gather_cat(torch.tensor(rows)) >= 0  # drop the padding rows
        out, per_sample = {}, {"prompts": all_prompts}
        for name, fn in self.eval_rewards.items():
            score = self.dist.gather_cat(fn(images, prompts).float().cpu())[keep]
            out[f"eval_{name}_mean"] = score.mean().item()
            out[f"eval_{name}_std"] = score.std().item() if len(score) > 1 else 0.0
            per_sample[name] = score.tolist()
        return out, images[torch.tensor(rows) >= 0], per_sample

    def _eval_rows(self, n: int) -> list[int]:
        """This rank's eval sample indices, padded to ceil(n / world) with -(index + 1) markers."""
        w, r = self.dist.world_size, self.dist.rank
        if w == 1:
            return list(range(n))
        per = math.ceil(n / w)
        real = list(range(r * per, min(n, (r + 1) * per)))
        return real + [-(real[-1] + 1) if real else -n] * (per - len(real))

    @contextmanager
    def _ema_weights(self):
        """Temporarily load the EMA weights (no-op without EMA); the trained weights come back after."""
        if self.ema is None:
            yield
            return
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, e in zip(self.params, self.ema):
                p.copy_(e)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    # ------------------------------------------------------------------ one iteration
    def calibrate(self, ro: Rollout) -> dict:
        """Measure, on the rollout's first micro-batch, the cosine between each group position's
        ``backward.strategy`` gradient and its exact gradient over the trainable parameters
        (``group_gradient_cosines``, the function ``make cosine`` uses; sharded dot products under FSDP2) and
        route by it (``route_by_cosine``):

        * ``backward.jagg_frac=auto``: a position uses the strategy where its cosine is at least
          ``backward.min_cosine``, exact elsewhere.
        * ``backward.group_size=auto`` (needs jagg_frac=auto): every W in ``backward.group_sizes`` is measured
          and routed that way, and the W whose routed update the cost model (``group_cost``: forwards +
          2 x backwards) predicts cheapest is kept (ties: the smaller W, closer to exact). Every JAGG group of
          every candidate has passed the cosine test, so W is chosen by cost among gradients of known quality.

        Returns the metrics (cosines and routing of the kept W, W, and per candidate cosines / routing /
        predicted cost when W is auto, seconds); gradients are left as they were."""
        b = self.cfg.backward
        t0 = time.perf_counter()
        idx = slice(0, self.cfg.train.train_batch_size)
        steps = ro.trained[idx]
        loss = self.grpo_loss(ro, steps, idx, scale=1.0)
        velocity = self.velocity(ro.cond.select(idx))
        reuse = b.reuse_rollout and ro.traj.outputs is not None
        candidates = {}
        for w in b.candidate_group_sizes:
            cosines = group_gradient_cosines(
                velocity,
                loss.x,
                loss.sigma,
                loss,
                self.params,
                group_size=w,
                strategies=(b.strategy,),
                endpoints=b.endpoints,
            )
            measured = route_by_cosine(cosines, b.min_cosine, b.strategy)
            plans = plan_groups(steps.shape[1], w, 1.0, b.strategy, measured)
            cost = sum(group_cost(len(p.steps), p.strategy, b.endpoints, reuse).time() for p in plans)
            candidates[w] = (cosines, [p.strategy != "exact" for p in plans], cost)
        w = min(candidates, key=lambda k: (candidates[k][2], k))
        cosines, self.routing, _ = candidates[w]
        self.group_size = w
        row = {
            "calibration_cosines": [c.cosine for c in cosines],
            "routing": [b.strategy if r else "exact" for r in self.routing],
            "group_size": w,
        }
        if b.group_size == "auto":
            row["calibration_by_group_size"] = {
                str(k): {"cosines": [c.cosine for c in cs], "routing": r, "predicted_cost": cost}
                for k, (cs, r, cost) in candidates.items()
            }
        return row | {"time_calibrate_s": time.perf_counter() - t0}

    def train_iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        ro = self.rollout(it)
        t_rollout = time.perf_counter() - t0
        b, cal = self.cfg.backward, {}
        if b.calibrated and (self.group_size is None or self.routing is None or it % b.calibrate_every == 0):
            cal = self.calibrate(ro)  # reported as time_calibrate_s, outside the rollout and update phases
        t1 = time.perf_counter()
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
            peak_memory_mb=_peak_memory_mb(self.device),
        )
        return row

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        """The run's checkpoint directory (``jagg.loop.checkpoint``: sharded, DCP)."""
        return checkpoint_dir(self.run_dir)

    def save_checkpoint(self) -> None:
        """Atomically write the sharded checkpoint; a collective: every rank writes its own shards."""
        progress = Progress(
            self.iteration, self.consecutive_skips, self.metrics, self.ema, self.routing, self.group_size
        )
        save_checkpoint(
            self.run_dir,
            model=self.backbone,
            optimizer=self.optimizer,
            progress=progress,
            config=self.cfg.to_dict(),
            dist=self.dist,
        )

    def load_checkpoint(self) -> None:
        """Restore weights, optimizer, EMA, RNG states, counters and metrics from the run's checkpoint
        (each rank reads its shards; the checkpoint may come from another world size)."""
        path = find_checkpoint(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.run_dir}")
        progress = load_checkpoint(
            path, model=self.backbone, optimizer=self.optimizer, ema=self.ema, dist=self.dist
        )
        self.ema = progress.ema
        self.iteration, self.consecutive_skips = progress.iteration, progress.consecutive_skips
        self.metrics, self.routing = progress.metrics, progress.routing
        self.group_size = progress.group_size or self.group_size
        self._write_metrics()

    def _write_metrics(self) -> None:
        if self.dist.is_main:
            atomic_write_text(
                self.run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in self.metrics)
            )

    # ------------------------------------------------------------------ main loop
    def fit(self, progress: Callable[[dict], None] | None = None) -> list[dict]:
        """Train from ``self.iteration`` to ``train.iterations``; evaluates, logs and checkpoints on the way."""
        lg, t = self.cfg.log, self.cfg.train
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.iteration == 0 and lg.eval_every:
            self._evaluate_and_log(0, {"iteration": 0})
        while self.iteration < t.iterations:
            row = self.train_iteration(self.iteration)
            self.iteration += 1
            if lg.eval_every and (self.iteration % lg.eval_every == 0 or self.iteration == t.iterations):
                self._evaluate_and_log(self.iteration, row)
            else:
                self._log(row)
            if progress:
                progress(row)
            if self.consecutive_skips >= t.max_consecutive_skips:
                self.save_checkpoint()
                raise TrainingAborted(
                    f"{self.consecutive_skips} consecutive optimizer steps had a non-finite loss or gradient "
                    f"(train.max_consecutive_skips={t.max_consecutive_skips}); last checkpoint: {self.checkpoint_path}"
                )
            if lg.checkpoint_every and self.iteration % lg.checkpoint_every == 0:
                self.save_checkpoint()
        self.save_checkpoint()
        return self.metrics

    def _evaluate_and_log(self, it: int, row: dict) -> None:
        ev, images, per_sample = self.evaluate(it)
        row.update(ev)
        self._log(row)
        if self.dist.is_main:
            atomic_write_text(self.run_dir / "samples" / f"eval_{it:05d}.json", json.dumps(per_sample))
        grid_every = self.cfg.log.grid_every
        if self.dist.is_main and (grid_every == 0 or it % grid_every == 0):
            save_grid(images, self.run_dir / "samples" / f"iter_{it:05d}.png")

    def _log(self, row: dict) -> None:
        self.metrics.append(row)
        if self.dist.is_main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
