"""Rectified-flow schedules and the SDE sampling step with its log-probability.

Conventions (docs/conventions.md, following Flow-GRPO and DanceGRPO):
    sigma runs from 1 (noise) to 0 (data);  x_sigma = (1 - sigma) x0 + sigma eps;
    the model predicts v ~ eps - x0;  an Euler ODE step is x' = x + v dt with dt = sigma_next - sigma < 0.

The SDE step is the Euler-Maruyama discretisation of the reverse-time SDE with the same marginals:
    mu = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt,   std = g sqrt(|dt|).
Only ``mu`` depends on the model output, and it does so affinely with slope
    b = dt (1 + g^2 (1 - sigma) / (2 sigma)),
which is why JAGG can get dL/dv without a transformer backward (see ``jagg.engine.strategies``).

Departures from the references, all deliberate:
    * DanceGRPO feeds the model ``int(1000 sigma) / 1000``; we keep sigma exact.
    * The log-prob is returned for ODE steps as zeros (ODE steps are never trained).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

SDEKind = Literal["flow_grpo", "dance", "cps", "ode"]
SDE_KINDS: tuple[str, ...] = ("flow_grpo", "dance", "cps", "ode")


@dataclass
class SDEStep:
    """Result of one sampling step: next sample, its log-prob (B,), the mean, the std and Flow-GRPO's std_dev_t."""

    prev_sample: Tensor  # (B, ...) the next (less noisy) latent x_{t_next}
    log_prob: Tensor  # (B,) float32 or float64: mean over non-batch elements
    mean: Tensor  # (B, ...) the Gaussian mean mu
    std: Tensor  # broadcastable to mean; 0 for ODE steps
    # What Flow-GRPO's ``sde_step_with_logprob`` returns as ``std_dev_t`` and its KL divides by: the diffusion
    # coefficient g WITHOUT the sqrt(|dt|) of the step std (flow_grpo, dance), the step std itself (cps); 0 (ode).
    std_dev_t: Tensor | None = None


# --------------------------------------------------------------------------- schedules
def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """Time shift sigma' = s sigma / (1 + (s - 1) sigma) (SD3 / DanceGRPO, docs/conventions.md)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def shifted_linear_sigmas(num_steps: int, shift: float = 3.0, dtype=torch.float64) -> Tensor:
    """DanceGRPO schedule: ``linspace(1, 0, S + 1)`` then the time shift. Returns (S + 1,) ending at 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1, dtype=dtype), shift)


def diffusers_sigmas(
    scheduler_config: dict, num_steps: int, image_seq_len: int, dtype=torch.float64
) -> Tensor:
    """Sigmas of a real model's ``FlowMatchEulerDiscreteScheduler`` (Flux, Qwen-Image), length S + 1.

    Mirrors what the diffusers Flux / Qwen-Image pipelines do: ``sigmas = linspace(1, 1/S, S)`` and a
    dynamic shift ``mu`` interpolated linearly in the image sequence length between
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift). The scheduler itself applies the
    exponential shift and any ``shift_terminal`` stretch, so nothing is re-derived here.
    """
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    cfg = sched.config
    mu = None
    if cfg.get("use_dynamic_shifting", False):
        slope = (cfg["max_shift"] - cfg["base_shift"]) / (
            cfg["max_image_seq_len"] - cfg["base_image_seq_len"]
        )
        mu = cfg["base_shift"] + slope * (image_seq_len - cfg["base_image_seq_len"])
    sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    return sched.sigmas.to(dtype)  # (S + 1,), the scheduler appends the terminal 0


# --------------------------------------------------------------------------- SDE step
def _as_batch(value: Tensor | float, x: Tensor) -> Tensor:
    """Broadcast a scalar or per-sample (B,) time to x's shape (B, 1, 1, ...) in x's dtype/device."""
    t = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    if t.ndim == 0:
        return t
    if t.shape != x.shape[:1]:
        raise ValueError(f"time of shape {tuple(t.shape)} does not match batch {x.shape[0]}")
    return t.view(-1, *([1] * (x.ndim - 1)))


def diffusion_coefficient(kind: str, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
    """g(sigma) of the SDE: Flow-GRPO ``a sqrt(sigma / (1 - sigma))`` or DanceGRPO's constant ``eta``.

    Flow-GRPO uses the *second* schedule entry in the denominator when sigma == 1; at the first step that
    entry is ``sigma_next``, so no extra argument is needed.
    """
    if kind == "flow_grpo":
        denom = 1 - torch.where(sigma >= 1, sigma_next, sigma)
        return noise_level * torch.sqrt(sigma / denom)
    if kind == "dance":
        return torch.full_like(sigma, float(noise_level))
    raise ValueError(f"no diffusion coefficient for kind {kind!r}")


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(sample; mean, std^2), averaged over all non-batch elements (one value per sample)."""
    log_density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(dim=1)


def sde_step_with_logprob(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    kind: str,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStep:
    """One denoising step from ``sigma`` to ``sigma_next`` and the log-prob of the resulting sample.

    Args:
        x: (B, ...) current latent. v: (B, ...) model output at (x, sigma).
        sigma, sigma_next: scalars or per-sample (B,) times with sigma > sigma_next.
        kind: "flow_grpo" | "dance" | "cps" | "ode" (formulas in docs/conventions.md).
        noise_level: a (Flow-GRPO sde and CPS) or eta (DanceGRPO); ignored for "ode".
        prev_sample: if given, the log-prob of this stored sample is computed instead of drawing one.
        generator: RNG for the fresh noise when ``prev_sample`` is None.

    The math runs in float32 or wider (bf16 overflows in the log-prob); outputs keep that dtype.
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"kind must be one of {SDE_KINDS}, got {kind!r}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, v = x.to(dtype), v.to(dtype)
    sig, sig_next = _as_batch(sigma, x), _as_batch(sigma_next, x)
    dt = sig_next - sig  # < 0

    if kind == "ode":
        mean, std = x + v * dt, torch.zeros_like(sig)
    elif kind == "cps":
        # Coefficients-preserving sampling (Flow-GRPO CPS): re-noise the predicted x0 to sigma_next.
        std = sig_next * math.sin(noise_level * math.pi / 2)
        x0_hat, x1_hat = x - sig * v, x + (1 - sig) * v
        mean = (1 - sig_next) * x0_hat + torch.sqrt(sig_next**2 - std**2) * x1_hat
    else:
        g = diffusion_coefficient(kind, sig, sig_next, noise_level)
        mean = x * (1 + g**2 * dt / (2 * sig)) + v * (1 + g**2 * (1 - sig) / (2 * sig)) * dt
        std = g * torch.sqrt(-dt)
    std_dev_t = g if kind in ("flow_grpo", "dance") else std

    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, dtype=dtype, device=x.device)
        prev_sample = mean + std * noise
    prev_sample = prev_sample.to(dtype)

    if kind == "ode":
        log_prob = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    elif kind == "cps":
        # Flow-GRPO CPS drops the constants and the 1 / (2 std^2) factor.
        log_prob = -((prev_sample - mean) ** 2).flatten(1).mean(dim=1)
    else:
        log_prob = gaussian_log_prob(prev_sample, mean, std)
    return SDEStep(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std, std_dev_t=std_dev_t)


# --------------------------------------------------------------------------- DPM-Solver++ (MixGRPO-Flash)
# Deterministic multistep DPM-Solver++ steps on the rectified-flow path (alpha = 1 - sigma), the kinds MixGRPO-Flash
# samples with after its SDE window (jagg.engine.algorithms.MixGRPO): first order (DDIM), second order with the
# midpoint or Heun correction. Tencent-Hunyuan/MixGRPO fastvideo/utils/sampling_utils.py :
# dpm_solver_first_order_update / multistep_dpm_solver_second_order_update (dpm_algorithm_type "dpmsolver++",
# sde_solver False). They need the previous step's x0 prediction, so ``sample_trajectory`` runs them.
DPM_KINDS: tuple[str, ...] = ("dpm1", "dpm2_midpoint", "dpm2_heun")


def _dpm_lambda(sigma: Tensor) -> Tensor:
    """log(alpha / sigma) with alpha = 1 - sigma: -inf at sigma = 1, +inf at sigma = 0 (both handled below)."""
    return torch.log(1 - sigma) - torch.log(sigma)


def dpm_solver_pp_step(
    x: Tensor, x0: Tensor, sigma: Tensor, sigma_next: Tensor, *, kind: str, x0_prev=None, sigma_prev=None
) -> Tensor:
    """One deterministic DPM-Solver++ step from ``sigma`` to ``sigma_next`` (``kind`` in ``DPM_KINDS``).

    ``x0`` = x - sigma v is this step's data prediction, ``x0_prev`` / ``sigma_prev`` the previous step's (second
    order only). The last step to sigma = 0 returns x0 (h = inf); a previous point at sigma = 1 (lambda = -inf)
    makes the second-order term vanish, as in the reference's float arithmetic.
    """
    if kind not in DPM_KINDS:
        raise ValueError(f"kind must be one of {DPM_KINDS}, got {kind!r}")
    lam, lam_next = _dpm_lambda(sigma), _dpm_lambda(sigma_next)
    h = lam_next - lam
    alpha_next = 1 - sigma_next
    out = (sigma_next / sigma) * x - (alpha_next * (torch.exp(-h) - 1.0)) * x0
    if kind == "dpm1":
        return out
    r0 = (lam - _dpm_lambda(sigma_prev)) / h
    d1 = (1.0 / r0) * (x0 - x0_prev)
    if kind == "dpm2_midpoint":
        return out - 0.5 * (alpha_next * (torch.exp(-h) - 1.0)) * d1
    return out + (alpha_next * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
