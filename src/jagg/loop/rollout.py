"""One iteration's samples: trajectories sampled in train micro-batches, their scores and advantages.

``Rollout`` is what an update reads; ``sample_micro_batches`` runs ``sample_trajectory`` per micro-batch of
``train.train_batch_size`` samples with the SDE seed of its global micro-batch index (so a rank's share is
sampled exactly as in a single-process run); ``at_steps`` gathers per-step tensors at each sample's trained
steps. ``Trainer.rollout`` draws the prompts, noise and steps and puts them together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.common import renamed_keywords
from jagg.engine.grpo import TrainedSteps
from jagg.engine.sampling import Trajectory, sample_trajectory
from jagg.engine.strategies import Velocity
from jagg.models import TextCond


@dataclass(kw_only=True)
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
    # the trainer's optimizer steps when sampled: the stored outputs are valid while that count is unchanged
    weights_version: int

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


def at_steps(per_step: Tensor, idx: slice, steps: Tensor, offset: int = 0) -> Tensor:
    """(S[+1], n, ...) per-step rollout tensor -> (T, b, ...) at each sample's trained steps (+ offset)."""
    cols = torch.arange(steps.shape[0])[None, :]  # (1, b)
    return per_step[:, idx][steps.T + offset, cols]


@renamed_keywords(keep_outputs="stored_outputs")
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
    for start in range(0, noise.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        index = (first_sample + start) // batch_size  # global micro-batch index
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
