"""GRPO algorithms differ only in which sampling steps are stochastic and which are trained.

    dancegrpo      steps 0..S-2 SDE (eta); per sample a random ``timestep_fraction`` of them is trained. The
                   last step is deterministic and never trained: DanceGRPO (XueZeyue/DanceGRPO) decodes the
                   last step's x0 prediction ``x - sigma v`` rather than its noisy sample, and with
                   sigma_S = 0 that prediction *is* the Euler ODE step, so its noise never reaches the image.
                   ``step_selection`` says which steps (``STEP_SELECTIONS``): a random subset of single steps
                   (``sorted_subset``, DanceGRPO) or random whole blocks of W consecutive steps
                   (``contiguous_groups``, the JAGG authors' code)
    flowgrpo       all steps SDE; the first int(0.99 S) steps trained in order (Flow-GRPO, yifan123/flow_grpo)
    flowgrpo_fast  one window of ``sde_window_size`` SDE steps drawn inside ``sde_window_range`` per rollout,
                   ODE before and after it; only the window is trained (Flow-GRPO-Fast)

For JAGG the trained steps are sorted by time and cut into consecutive groups of W (``jagg.engine.strategies``);
a Fast window is therefore one group when W >= the window size, and under ``contiguous_groups`` every group is
one of the trajectory's blocks of W consecutive steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg.errors import ConfigError

# DanceGRPO's readings of "which steps are trained" (``algorithm.step_selection``):
#   sorted_subset      per sample a random int(n * timestep_fraction) of the n usable steps (DanceGRPO; the JAGG
#                      groups are then consecutive *trained* steps, which may lie far apart in t)
#   contiguous_groups  the n usable steps cut into n / W blocks of W consecutive steps; per sample a random
#                      int(n / W * timestep_fraction) of the blocks (SchumiDing/eff_grpo, the JAGG authors' code)
STEP_SELECTIONS: tuple[str, ...] = ("sorted_subset", "contiguous_groups")


class Algorithm:
    """Which steps are SDE (sampling) and which are trained (update), for a batch of B rollouts.

    ``backward`` (a ``jagg.config.BackwardConfig``: ``group_size``, ``strategy``) is read only by step selections
    that depend on the group structure (DanceGRPO's ``contiguous_groups``).
    """

    name = ""

    def __init__(self, cfg, backward=None) -> None:  # cfg: jagg.config.AlgorithmConfig
        self.cfg = cfg
        self.backward = backward

    @staticmethod
    def validate(cfg, num_steps: int, backward=None) -> None:
        """Raise ``ConfigError`` for settings that do not fit a schedule of ``num_steps`` steps."""

    def step_kinds(self, num_steps: int, gen: torch.Generator) -> list[str]:
        raise NotImplementedError

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        """(B, T) step indices per sample, ascending in index (i.e. sorted by decreasing sigma)."""
        raise NotImplementedError


class DanceGRPO(Algorithm):
    name = "dancegrpo"

    @staticmethod
    def num_trained(cfg, num_steps: int, backward=None) -> int:
        """T per sample: int(n * fraction) of the n = S - 1 usable steps, or whole blocks of W (see above)."""
        usable = num_steps - 1
        if cfg.step_selection == "contiguous_groups":
            w = int(backward.group_size)
            return int(usable // w * cfg.timestep_fraction) * w
        return int(usable * cfg.timestep_fraction)

    @staticmethod
    def validate(cfg, num_steps: int, backward=None) -> None:
        if cfg.step_selection == "contiguous_groups":
            DanceGRPO._validate_blocks(cfg, num_steps, backward)
        if DanceGRPO.num_trained(cfg, num_steps, backward) >= 1:
            return
        if cfg.step_selection == "contiguous_groups":
            raise ConfigError(
                f"algorithm.timestep_fraction={cfg.timestep_fraction} trains no block of "
                f"{(num_steps - 1) // backward.group_size}; allowed: "
                "(sampling.num_steps - 1) / backward.group_size * timestep_fraction >= 1"
            )
        raise ConfigError(
            f"algorithm.timestep_fraction={cfg.timestep_fraction} trains no step of {num_steps - 1}; "
            "allowed: (sampling.num_steps - 1) * timestep_fraction >= 1"
        )

    @staticmethod
    def _validate_blocks(cfg, num_steps: int, backward) -> None:
        """contiguous_groups needs an integer W that divides the S - 1 usable steps."""
        size = None if backward is None else backward.group_size
        shown = "'auto'" if size is None else repr(size)  # None is the config's `auto`
        if not isinstance(size, int) or isinstance(size, bool) or size < 2:
            raise ConfigError(
                "algorithm.step_selection=contiguous_groups cuts the trajectory into blocks of W = "
                f"backward.group_size, which must then be an integer >= 2, got {shown}"
            )
        if (num_steps - 1) % size:
            raise ConfigError(
                f"algorithm.step_selection=contiguous_groups: the sampling.num_steps - 1 = {num_steps - 1} usable "
                f"steps do not divide into blocks of backward.group_size = {size}; allowed: sampling.num_steps - 1 "
                f"a multiple of backward.group_size (e.g. sampling.num_steps={-(-(num_steps - 1) // size) * size + 1})"
            )

    def step_kinds(self, num_steps: int, gen: torch.Generator) -> list[str]:
        # The last step outputs DanceGRPO's ``pred_original`` (= the ODE step to sigma = 0), see above.
        return [self.cfg.sde_kind] * (num_steps - 1) + ["ode"]

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        n, t = len(kinds) - 1, self.num_trained(self.cfg, len(kinds), self.backward)
        if self.cfg.step_selection == "contiguous_groups" and self.backward.strategy != "exact":
            return self._trained_blocks(n, t, batch, gen)
        # sorted_subset, and the exact baseline of contiguous_groups: t single steps at random
        picks = [torch.randperm(n, generator=gen)[:t].sort().values for _ in range(batch)]
        return torch.stack(picks)  # (B, T)

    def _trained_blocks(self, n: int, t: int, batch: int, gen: torch.Generator) -> Tensor:
        """(B, T): per sample t / W random blocks of W consecutive steps out of the n / W, sorted by time."""
        w = int(self.backward.group_size)
        offsets = torch.arange(w)
        picks = [
            (torch.randperm(n // w, generator=gen)[: t // w].sort().values[:, None] * w + offsets).flatten()
            for _ in range(batch)
        ]
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
    def validate(cfg, num_steps: int, backward=None) -> None:
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
