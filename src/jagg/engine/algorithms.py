"""GRPO algorithms differ only in which sampling steps are stochastic and which are trained.

    dancegrpo      steps 0..S-2 SDE (eta); per sample a random ``timestep_fraction`` of them is trained. The
                   last step is deterministic and never trained: DanceGRPO (XueZeyue/DanceGRPO) decodes the
                   last step's x0 prediction ``x - sigma v`` rather than its noisy sample, and with
                   sigma_S = 0 that prediction *is* the Euler ODE step, so its noise never reaches the image
    flowgrpo       all steps SDE; the first int(0.99 S) steps trained in order (Flow-GRPO, yifan123/flow_grpo)
    flowgrpo_fast  one window of ``sde_window_size`` SDE steps drawn inside ``sde_window_range`` per rollout,
                   ODE before and after it; only the window is trained (Flow-GRPO-Fast)

For JAGG the trained steps are sorted by time and cut into consecutive groups of W (``jagg.engine.strategies``);
a Fast window is therefore one group when W >= the window size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg.errors import ConfigError


class Algorithm:
    """Which steps are SDE (sampling) and which are trained (update), for a batch of B rollouts."""

    name = ""

    def __init__(self, cfg) -> None:  # cfg: jagg.config.AlgorithmConfig
        self.cfg = cfg

    @staticmethod
    def validate(cfg, num_steps: int) -> None:
        """Raise ``ConfigError`` for settings that do not fit a schedule of ``num_steps`` steps."""

    def step_kinds(self, num_steps: int, gen: torch.Generator) -> list[str]:
        raise NotImplementedError

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        """(B, T) step indices per sample, ascending in index (i.e. sorted by decreasing sigma)."""
        raise NotImplementedError


class DanceGRPO(Algorithm):
    name = "dancegrpo"

    @staticmethod
    def num_trained(cfg, num_steps: int) -> int:
        return int((num_steps - 1) * cfg.timestep_fraction)

    @staticmethod
    def validate(cfg, num_steps: int) -> None:
        if DanceGRPO.num_trained(cfg, num_steps) < 1:
            raise ConfigError(
                f"algorithm.timestep_fraction={cfg.timestep_fraction} trains no step of {num_steps - 1}; "
                "allowed: (sampling.num_steps - 1) * timestep_fraction >= 1"
            )

    def step_kinds(self, num_steps: int, gen: torch.Generator) -> list[str]:
        # The last step outputs DanceGRPO's ``pred_original`` (= the ODE step to sigma = 0), see above.
        return [self.cfg.sde_kind] * (num_steps - 1) + ["ode"]

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        n, t = len(kinds) - 1, self.num_trained(self.cfg, len(kinds))
        picks = [torch.randperm(n, generator=gen)[:t].sort().values for _ in range(batch)]
        return torch.stack(picks)  # (B, T)


class FlowGRPO(Algorithm):
    name = "flowgrpo"

    def step_kinds(self, num_steps: int, gen: torch.Generator) -> list[str]:
        return [self.cfg.sde_kind] * num_steps

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        t = max(1, int(0.99 * len(kinds)))
        return torch.arange(t).expand(batch, t).clone()


class FlowGRPOFast(Algorithm):
    name = "flowgrpo_fast"

    @staticmethod
    def validate(cfg, num_steps: int) -> None:
        rng, size = cfg.sde_window_range, cfg.sde_window_size
        ok = len(rng) == 2 and size >= 1 and rng[0] >= 0 and rng[1] <= num_steps and rng[1] - rng[0] >= size
        if not ok:
            raise ConfigError(
                f"algorithm.sde_window_range={cfg.sde_window_range} with sde_window_size={size} is outside the "
                f"schedule; allowed: [lo, hi] with 0 <= lo, hi <= sampling.num_steps={num_steps}, hi - lo >= size >= 1"
            )

    def window(self, num_steps: int, gen: torch.Generator) -> range:
        lo, hi = self.cfg.sde_window_range
        start = int(torch.randint(lo, hi - self.cfg.sde_window_size + 1, (1,), generator=gen))
        return range(start, start + self.cfg.sde_window_size)

    def step_kinds(self, num_steps: int, gen: torch.Generator) -> list[str]:
        win = self.window(num_steps, gen)
        return [self.cfg.sde_kind if i in win else "ode" for i in range(num_steps)]

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        win = torch.tensor([i for i, k in enumerate(kinds) if k != "ode"])
        return win.expand(batch, len(win)).clone()


ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (DanceGRPO, FlowGRPO, FlowGRPOFast)}
