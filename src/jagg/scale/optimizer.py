"""The trainer's optimizer: AdamW over the trainable parameters, torch's multi-tensor (foreach) implementation by
default, the fused one with ``optim.fused: true``.

Fused AdamW runs one kernel per parameter group chunk with no temporaries (the foreach step holds about one copy
of the trained shards while it runs: the memory plan's ``AdamW step temporaries``). It needs every parameter on
a device torch has fused kernels for (CUDA, CPU, ...) in a floating dtype; ``check_fused`` tries one step on the
run's device and master dtype before the model loads, so an unsupported combination fails as a one-line
``ConfigError`` naming the key instead of after the weights are loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from jagg.config import Config, OptimConfig
from jagg.errors import ConfigError


def build_optimizer(cfg: Config, params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with ``cfg.optim``'s settings; ``fused=None`` (foreach where torch supports it) unless
    ``optim.fused``. ``ConfigError`` when torch refuses the fused implementation for these parameters (it
    checks their devices and dtypes at the first step: ``check_fused`` takes one before the model loads)."""
    o = cfg.optim
    try:
        return torch.optim.AdamW(
            params,
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True if o.fused else None,
        )
    except RuntimeError as err:
        if not o.fused:
            raise
        raise ConfigError(
            f"optim.fused=true is not supported here ({_first_line(err)}); set optim.fused=false"
        ) from err


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def check_fused(cfg: Config, device: torch.device) -> None:
    """With ``optim.fused``: one fused AdamW step on a one-element parameter of the run's master dtype on
    ``device``; ``ConfigError`` (one line) where torch has no fused kernel for it."""
    if not cfg.optim.fused:
        return
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    from jagg.scale.placement import parameter_dtypes

    supported = _get_fused_kernels_supported_devices()
    if device.type not in supported:
        raise ConfigError(
            f"optim.fused=true: torch has no fused AdamW for device {device.type!r} (only {supported}); "
            "set optim.fused=false"
        )
    dtype = parameter_dtypes(cfg.train.precision)[0]
    p = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    p.grad = torch.ones_like(p)
    try:
        build_optimizer(cfg, [p]).step()
    except RuntimeError as err:
        raise ConfigError(
            f"optim.fused=true: fused AdamW failed on {device.type} / {dtype} ({_first_line(err)}); "
            "set optim.fused=false"
        ) from err


@torch.no_grad()
def update_ema(ema: list[torch.Tensor], params: Iterable[torch.nn.Parameter], decay: float) -> None:
    """``ema <- decay * ema + (1 - decay) * params``, in place (the weights evaluations use, ``optim.ema_decay``)."""
    for e, p in zip(ema, params):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)


def ema_decay_at(optim: OptimConfig, step: int) -> float | None:
    """The EMA decay to apply after optimizer step ``step`` (1 = the run's first), or None when none is due.

    ``optim.ema_every`` k, ``optim.ema_warmup`` and ``optim.ema_repeats`` r follow Flow-GRPO's
    ``EMAModuleWrapper.step(params, global_step)`` (yifan123/flow_grpo @ ac4c86e ``flow_grpo/ema.py:33-49``),
    called with the count of optimizer steps done (``scripts/train_sd3.py:952-955``): due when
    ``(step + 1) % k == 0`` (steps 7, 15, 23, ... for k = 8), at decay ``min((1 + step) / (10 + step),
    ema_decay)`` with the warm-up, else ``ema_decay``. Their call sits in the micro-batch loop, so at a due step
    it runs once per micro-batch until the next optimizer step, on unchanged weights: r applications of d are
    one of d ** r (``ema <- p + d^r (ema - p)``). k = 1, no warm-up, r = 1: after every step at ``ema_decay``."""
    if optim.ema_decay <= 0 or (step + 1) % optim.ema_every != 0:
        return None
    decay = min((1 + step) / (10 + step), optim.ema_decay) if optim.ema_warmup else optim.ema_decay
    return decay**optim.ema_repeats


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps AdamW has applied (its per-parameter ``step``: checkpointed with its state, so the EMA's
    cadence goes on across a resume); 0 before the first."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if "step" in optimizer.state.get(p, {}):
                return int(optimizer.state[p]["step"])
    return 0
