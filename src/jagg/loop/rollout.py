"""One iteration's samples: trajectories sampled in train micro-batches, their scores and advantages.

``Rollout`` is what an update reads; ``sample_micro_batches`` runs ``sample_trajectory`` per micro-batch of
``train.train_batch_size`` samples with the SDE seed of its global micro-batch index (so a rank's share is
sampled exactly as in a single-process run); ``at_steps`` gathers per-step tensors at each sample's trained
steps. ``Sampler`` (what ``Trainer.rollout`` calls) draws the prompts, noise and steps and puts them together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.common import SeedStream, generator
from jagg.config import Config
from jagg.distributed import DistInfo
from jagg.engine.algorithms import Algorithm
from jagg.engine.grpo import TrainedSteps
from jagg.engine.sampling import Trajectory, sample_trajectory
from jagg.engine.sde import shifted_linear_sigmas
from jagg.engine.strategies import Velocity
from jagg.loop.rewards import build_run_rewards, rollout_advantages, score_samples
from jagg.models import Components, TextCond
from jagg.ops.heartbeat import PhaseWatch


@dataclass(kw_only=True)
class Rollout:
    """One iteration's samples. N = prompts_per_iter * images_per_prompt."""

    prompts: list[str]  # (n,) this rank's share (n = N / world size)
    cond: TextCond  # n rows
    traj: Trajectory  # latents (S + 1, n, C, H, W), log_probs (S, n)
    trained: Tensor  # (n, T) trained step indices per sample, ascending
    rewards: Tensor  # (N,) weighted total, global batch (all ranks)
    scores: dict[str, Tensor]  # per-reward scores (N,), global batch
    advantages: Tensor  # (n,) this rank's share
    timing: dict[str, float]  # time_sample_s, time_reward_s
    # the optimizer steps applied when it was sampled (``jagg.scale.optimizer.optimizer_steps``; a skipped step
    # changes no weight): the stored outputs are valid while that count is unchanged
    optimizer_steps: int

    def at(self, idx: slice, sigmas: Tensor, steps: Tensor | None = None) -> TrainedSteps:
        """The trained steps of the samples ``idx`` (or ``steps`` (b, T), ascending, instead of theirs): inputs,
        next latents, times from the schedule ``sigmas`` (S + 1,), old log-probs and stored outputs."""
        steps = self.trained[idx] if steps is None else steps
        traj = self.traj
        return TrainedSteps(
            x=at_steps(traj.latents, idx, steps),
            x_next=at_steps(traj.latents, idx, steps, offset=1),
            sigma=sigmas[steps.T],
            sigma_next=sigmas[steps.T + 1],
            old_log_prob=at_steps(traj.log_probs, idx, steps),
            outputs=None if traj.outputs is None else at_steps(traj.outputs, idx, steps),
        )

    def reward_row(self) -> dict:
        """The metrics of its rewards over the global batch: the training reward's and each reward's mean / std."""
        row = {"reward_mean": self.rewards.mean().item(), "reward_std": self.rewards.std().item()}
        for name, score in self.scores.items():
            row[f"reward_{name}_mean"], row[f"reward_{name}_std"] = score.mean().item(), score.std().item()
        return row


def at_steps(per_step: Tensor, idx: slice, steps: Tensor, offset: int = 0) -> Tensor:
    """(S[+1], n, ...) per-step rollout tensor -> (T, b, ...) at each sample's trained steps (+ offset)."""
    cols = torch.arange(steps.shape[0])[None, :]  # (1, b)
    return per_step[:, idx][steps.T + offset, cols]


def micro_batches(n: int, size: int) -> list[slice]:
    """The micro-batches of ``n`` samples: consecutive rows, ``size`` each (the last may have fewer). A rollout
    samples in them and its update trains on the same ones, so before the first optimizer step every ratio is 1."""
    return [slice(start, start + size) for start in range(0, n, size)]


def sample_micro_batches(
    velocity: Callable[[slice], Velocity],
    noise: Tensor,
    sigmas: Tensor,
    kinds: Sequence[str],
    *,
    batch_size: int,
    first_sample: int,
    sde_seed: int,
    noise_level: float,
    stored_outputs: bool,
) -> Trajectory:
    """``sample_trajectory`` over ``noise`` (n, ...) in micro-batches of ``batch_size``, concatenated.

    ``velocity(rows)`` is the model's velocity for the samples ``rows``; micro-batch k of the global batch
    (``first_sample`` is this rank's first sample) draws its SDE noise from a generator seeded
    ``sde_seed + k`` on the noise's device. ``stored_outputs`` keeps every step's model output too.
    """
    chunks = []
    for rows in micro_batches(noise.shape[0], batch_size):
        index = (first_sample + rows.start) // batch_size  # global micro-batch index
        sde_gen = torch.Generator(device=noise.device).manual_seed(sde_seed + index)
        chunks.append(
            sample_trajectory(
                velocity(rows),
                noise[rows],
                sigmas,
                kinds,
                noise_level=noise_level,
                generator=sde_gen,
                stored_outputs=stored_outputs,
            )
        )
    return Trajectory(
        torch.cat([c.latents for c in chunks], dim=1),
        torch.cat([c.log_probs for c in chunks], dim=1),
        chunks[0].sigmas,
        chunks[0].kinds,
        torch.cat([c.outputs for c in chunks], dim=1) if stored_outputs else None,
    )


class Sampler:
    """How a run collects its rollouts, bound once: every draw of an iteration (prompts, initial noise, SDE seeds,
    trained steps) from one generator, identical on every rank; this rank's share sampled in train micro-batches,
    decoded and scored; rewards gathered over the ranks (groups may span them), then the advantages."""

    def __init__(
        self,
        cfg: Config,
        comp: Components,
        algorithm: Algorithm,
        sigmas: Tensor,
        velocity: Callable[[TextCond], Velocity],
        dist: DistInfo,
        device: torch.device,
        watch: PhaseWatch,
    ) -> None:
        self.cfg, self.comp, self.algorithm, self.sigmas = cfg, comp, algorithm, sigmas
        self.velocity, self.dist, self.device, self.watch = velocity, dist, device, watch
        # the training reward (weighted) and the held-out judges, each built once on the run's device
        self.train_reward, self.eval_rewards = build_run_rewards(cfg, device)
        self.latent_dtype = torch.float64 if cfg.train.precision == "fp64" else torch.float32

    def noise(self, n: int, gen: torch.Generator) -> Tensor:
        """(n, C, H, W) standard-normal latents from ``gen``, drawn in float32 on the CPU (the same on every
        device), in the run's latent dtype on its device."""
        shape = (n, *self.comp.latent_shape)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device, self.latent_dtype)

    @torch.no_grad()
    def __call__(self, it: int, stream: SeedStream, optimizer_steps: int) -> Rollout:
        """N = prompts x images trajectories of draw ``it`` of ``stream``, scored, with their advantages."""
        t_start = time.perf_counter()
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
            per_prompt = self.noise(train.prompts_per_iter, gen)
            noise = per_prompt.repeat_interleave(train.images_per_prompt, dim=0)[mine]
        else:
            noise = self.noise(len(all_prompts), gen)[mine]
        sde_seed = int(torch.randint(2**62, (1,), generator=gen))
        traj = sample_micro_batches(
            lambda rows: self.velocity(cond.select(rows)),
            noise,
            sigmas.to(self.device),
            self.algorithm.sampling_kinds(
                kinds
            ),  # algorithm.sde_steps swaps the noise, not the trained steps
            batch_size=train.train_batch_size,
            first_sample=mine.start,
            sde_seed=sde_seed,
            noise_level=algorithm.noise_level,
            stored_outputs=self.cfg.backward.stored_outputs,
        )
        trained = self.algorithm.trained_steps(list(kinds), len(all_prompts), gen)[mine]
        t_sampled = time.perf_counter()
        self.watch.enter("reward", it)
        images = self.comp.decode(traj.final.float()).cpu()
        evals = self.eval_rewards if self.cfg.log.eval_rewards_on_train else {}  # else: at evaluations only
        rewards, scores = score_samples(images, prompts, self.train_reward, evals)
        rewards = self.dist.gather_cat(rewards)  # (N,): groups may span ranks
        scores = {k: self.dist.gather_cat(v.cpu()) for k, v in scores.items()}
        return Rollout(
            prompts=prompts,
            cond=cond,
            traj=traj,
            trained=trained,
            rewards=rewards,
            scores=scores,
            advantages=rollout_advantages(self.cfg, rewards, scores, group_ids)[mine],
            timing={"time_sample_s": t_sampled - t_start, "time_reward_s": time.perf_counter() - t_sampled},
            optimizer_steps=optimizer_steps,
        )


def schedules(comp: Components, cfg: Config) -> tuple[Tensor, Tensor]:
    """The training and evaluation schedules (S + 1,): the pipeline's where it has them (real models), else the
    shifted linear schedule of ``sampling.num_steps`` / ``sampling.eval_num_steps``."""
    s = cfg.sampling
    train = comp.sigmas if comp.sigmas is not None else shifted_linear_sigmas(s.num_steps, s.shift)
    held_out = (
        comp.eval_sigmas if comp.eval_sigmas is not None else shifted_linear_sigmas(s.eval_num_steps, s.shift)
    )
    return train, held_out
