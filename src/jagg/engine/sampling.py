"""Trajectory sampling: run a velocity field down a sigma schedule, recording what GRPO needs.

Each step uses ``jagg.engine.sde.sde_step_with_logprob`` with its own kind ("ode" for deterministic steps, an SDE
kind where the algorithm explores), so DanceGRPO (SDE but the last step), Flow-GRPO-Fast (an SDE window,
ODE elsewhere) and evaluation (all ODE) are one function with different ``kinds``. The deterministic multistep
DPM-Solver++ kinds (``DPM_KINDS``, MixGRPO-Flash after its window) read the previous step's x0 prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from jagg.engine.sde import DPM_KINDS, dpm_solver_pp_step, sde_step_with_logprob
from jagg.engine.strategies import Velocity


@dataclass
class Trajectory:
    """A batch of sampled trajectories (no grad).

    latents:   (S + 1, B, ...) x at every schedule point; latents[i] is the model input of step i,
               latents[i + 1] its sample; latents[-1] is the final clean latent.
    log_probs: (S, B) log-prob of latents[i + 1] under step i (0 for ODE steps).
    sigmas:    (S + 1,) the schedule, from 1 down to 0.
    kinds:     the S step kinds.
    outputs:   (S, B, ...) the model output of every step (``stored_outputs=True``), else None. Before the
               first optimizer step they equal what the update would recompute, so JAGG's intermediate
               signals can come from them with no model forward (``BackwardSetting.backward(..., outputs)``).
    """

    latents: Tensor
    log_probs: Tensor
    sigmas: Tensor
    kinds: tuple[str, ...]
    outputs: Tensor | None = None

    @property
    def final(self) -> Tensor:
        return self.latents[-1]

    @property
    def sde_steps(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k != "ode" and k not in DPM_KINDS]


@torch.no_grad()
def sample_trajectory(
    velocity: Velocity,
    noise: Tensor,
    sigmas: Tensor,
    kinds: Sequence[str],
    *,
    noise_level: float = 0.0,
    generator: torch.Generator | None = None,
    stored_outputs: bool = False,
) -> Trajectory:
    """Integrate from ``noise`` (B, ...) at sigmas[0] = 1 down to sigmas[-1]; step i uses ``kinds[i]``.

    ``stored_outputs``: also return every step's model output (``Trajectory.outputs``).
    """
    n_steps = sigmas.shape[0] - 1
    if len(kinds) != n_steps:
        raise ValueError(f"need one kind per step ({n_steps}), got {len(kinds)}")
    x = noise
    latents, log_probs, outputs = [x], [], []
    x0_prev = None  # the previous step's x0 prediction (the DPM-Solver++ kinds' multistep state)
    multistep = any(k in DPM_KINDS for k in kinds)
    for i in range(n_steps):
        v = velocity(x, sigmas[i])
        if stored_outputs:
            outputs.append(v)
        if kinds[i] in DPM_KINDS:  # deterministic, never trained: log-prob 0 as for ODE steps
            wide = torch.promote_types(x.dtype, torch.float32)
            xw, x0 = x.to(wide), (x.to(wide) - sigmas[i] * v.to(wide))
            x = dpm_solver_pp_step(
                xw, x0, sigmas[i], sigmas[i + 1], kind=kinds[i], x0_prev=x0_prev, sigma_prev=sigmas[i - 1]
            ).to(noise.dtype)
            x0_prev = x0
            latents.append(x)
            log_probs.append(torch.zeros(x.shape[0], dtype=wide, device=x.device))
            continue
        if multistep:
            x0_prev = x.to(torch.promote_types(x.dtype, torch.float32)) - sigmas[i] * v
        kw = dict(kind=kinds[i], noise_level=noise_level)
        step = sde_step_with_logprob(x, v, sigmas[i], sigmas[i + 1], generator=generator, **kw)
        x_next = step.prev_sample.to(noise.dtype)
        log_prob = step.log_prob
        if x_next.dtype != step.prev_sample.dtype:
            # Stored in lower precision: score the *stored* sample so the training-time ratio is exactly 1.
            log_prob = sde_step_with_logprob(
                x, v, sigmas[i], sigmas[i + 1], prev_sample=x_next, **kw
            ).log_prob
        x = x_next
        latents.append(x)
        log_probs.append(log_prob)
    return Trajectory(
        torch.stack(latents),
        torch.stack(log_probs),
        sigmas,
        tuple(kinds),
        torch.stack(outputs) if stored_outputs else None,
    )
