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
    mixgrpo        one window of ``group_size`` consecutive SDE steps, ODE elsewhere, only the window trained;
                   the window moves with the training iteration (``sample_strategy``, ``MIX_SCHEDULES``), as
                   Tencent-Hunyuan/MixGRPO's ``GRPOTrainingStates`` (MixGRPO, below)

For JAGG the trained steps are sorted by time and cut into consecutive groups of W (``jagg.engine.strategies``);
a Fast window is therefore one group when W >= the window size, and under ``contiguous_groups`` every group is
one of the trajectory's blocks of W consecutive steps.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from jagg.engine.sde import shift_sigmas
from jagg.errors import ConfigError

# DanceGRPO's readings of "which steps are trained" (``algorithm.step_selection``):
#   sorted_subset      per sample a random int(n * timestep_fraction) of the n usable steps (DanceGRPO; the JAGG
#                      groups are then consecutive *trained* steps, which may lie far apart in t)
#   contiguous_groups  the n usable steps cut into n / W blocks of W consecutive steps; per sample a random
#                      int(n / W * timestep_fraction) of the blocks (SchumiDing/eff_grpo, the JAGG authors' code)
STEP_SELECTIONS: tuple[str, ...] = ("sorted_subset", "contiguous_groups")
# What ``backward.strategy: exact`` trains under ``contiguous_groups`` (``algorithm.exact_steps``):
#   structure       the same blocks as every other strategy: exact is then the gradient reference of the
#                   blocks the others aggregate (a quality comparison must train the same steps in every arm)
#   random_singles  as many random single steps (the JAGG authors' DanceGRPO baseline: SchumiDing/eff_grpo's
#                   per-step path). Right for their timing table, where only the step count matters; a baseline
#                   with other trained steps in a quality comparison
# Under sorted_subset and the window algorithms every strategy trains the same steps either way.
EXACT_STEPS: tuple[str, ...] = ("structure", "random_singles")


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

    def step_kinds(self, num_steps: int, gen: torch.Generator, iteration: int = 0) -> list[str]:
        """The kind of each of the ``num_steps`` sampling steps of training iteration ``iteration``'s rollout.

        ``gen`` is that iteration's generator (``SeedStream.ROLLOUT``); only MixGRPO reads ``iteration`` (its
        window moves with it), so every draw stays a function of (seed, iteration)."""
        raise NotImplementedError

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        """(B, T) step indices per sample, ascending in index (i.e. sorted by decreasing sigma)."""
        raise NotImplementedError

    def rollout_schedule(self, sigmas: Tensor, kinds: list[str]) -> tuple[Tensor, list[str]]:
        """The sigmas and kinds the rollout samples with: the run's schedule and ``kinds``, except under
        MixGRPO-Flash (fewer DPM-Solver++ steps after the window; the trained steps keep their index and time)."""
        return sigmas, kinds

    def sampling_kinds(self, kinds: list[str]) -> list[str]:
        """The kinds the rollout samples with: ``kinds`` (what ``trained_steps`` reads), or with
        ``algorithm.sde_steps = [lo, hi)`` the SDE on steps lo..hi-1 and the ODE elsewhere. It swaps the rollout's
        noise and keeps the trained steps (issue 56: a window trained under every step's noise, every step's
        arm under the window's); no draw changes, so the trained steps stay those of the same seed."""
        if not self.cfg.sde_steps:
            return kinds
        lo, hi = self.cfg.sde_steps
        return [self.cfg.sde_kind if lo <= i < hi else "ode" for i in range(len(kinds))]

    @staticmethod
    def trainable(cfg, num_steps: int) -> range:
        """Every step the algorithm may train in a schedule of ``num_steps`` steps."""
        return range(num_steps)

    def windows(self, num_steps: int, iterations: range) -> list[range] | None:
        """The windows a routing per window position is measured for (``jagg.loop.calibration``), or None where
        the trained steps are not one window of consecutive steps shared by the batch and keyed by its first step
        (every algorithm but MixGRPO)."""
        return None


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

    @staticmethod
    def trainable(cfg, num_steps: int) -> range:
        return range(num_steps - 1)

    def step_kinds(self, num_steps: int, gen: torch.Generator, iteration: int = 0) -> list[str]:
        # The last step outputs DanceGRPO's ``pred_original`` (= the ODE step to sigma = 0), see above.
        return [self.cfg.sde_kind] * (num_steps - 1) + ["ode"]

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        n, t = len(kinds) - 1, self.num_trained(self.cfg, len(kinds), self.backward)
        if self.cfg.step_selection == "contiguous_groups" and not self._authors_exact():
            return self._trained_blocks(n, t, batch, gen)
        # sorted_subset, and the authors' exact baseline of contiguous_groups: t single steps at random
        picks = [torch.randperm(n, generator=gen)[:t].sort().values for _ in range(batch)]
        return torch.stack(picks)  # (B, T)

    def _authors_exact(self) -> bool:
        """The exact strategy training random single steps in place of the blocks (``EXACT_STEPS``)."""
        return self.backward.strategy == "exact" and self.cfg.exact_steps == "random_singles"

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

    def step_kinds(self, num_steps: int, gen: torch.Generator, iteration: int = 0) -> list[str]:
        return [self.cfg.sde_kind] * num_steps

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        t = max(1, int(0.99 * len(kinds)))
        return torch.arange(t).expand(batch, t).clone()

    @staticmethod
    def trainable(cfg, num_steps: int) -> range:
        return range(max(1, int(0.99 * num_steps)))


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

    @staticmethod
    def trainable(cfg, num_steps: int) -> range:
        return range(*cfg.sde_window_range)

    def window(self, num_steps: int, gen: torch.Generator) -> range:
        lo, hi = self.cfg.sde_window_range
        start = int(torch.randint(lo, hi - self.cfg.sde_window_size + 1, (1,), generator=gen))
        return range(start, start + self.cfg.sde_window_size)

    def step_kinds(self, num_steps: int, gen: torch.Generator, iteration: int = 0) -> list[str]:
        win = self.window(num_steps, gen)
        return [self.cfg.sde_kind if i in win else "ode" for i in range(num_steps)]

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        win = torch.tensor([i for i, k in enumerate(kinds) if k != "ode"])
        return win.expand(batch, len(win)).clone()


# MixGRPO's window schedules (``algorithm.sample_strategy``, their ``GRPOTrainingStates.sample_strategy``):
#   progressive  start at step 0, stay ``iters_per_group`` iterations, move by ``prog_overlap_step``; after the
#                last position (S - 2) roll back to 0 (their --prog_overlap --roll_back, on in every script)
#   random       iteration 0 at step 0, then a uniform start in [0, S - 2 - group_size] per iteration
#   decay        progressive, staying int(max (1 - p) + min p) >= min iterations at start p (S - 2)
#                (``max_iters_per_group``, ``min_iters_per_group``)
#   exp_decay    progressive, staying ceil(iters_per_group exp(-k relu(start - thre))) iterations
#                (``exp_decay_k``, ``exp_decay_thre_timestep``)
MIX_SCHEDULES: tuple[str, ...] = ("progressive", "random", "decay", "exp_decay")
# MixGRPO-Flash (``algorithm.dpm_algorithm_type``): after the window, the Euler ODE steps (none) or fewer
# deterministic DPM-Solver++ steps on a compressed schedule (MixGRPO.rollout_schedule)
MIX_POST_SOLVERS: tuple[str, ...] = ("none", "dpmsolver++")


class MixGRPO(Algorithm):
    """MixGRPO (Tencent-Hunyuan/MixGRPO e5cdd6a, ``fastvideo/utils/grpo_states.py`` and ``train_grpo_flux.py``).

    Iteration ``it`` trains the window ``range(start, min(start + group_size, S - 2))`` (their
    ``get_current_timesteps`` with ``max_timesteps = sampling_steps - 2``): those steps are SDE (their
    ``determistic[i] = False``), every other step is an Euler ODE step, and the window is trained in order.
    ``start`` is their ``cur_timestep`` after ``it`` calls of ``update_iteration`` (their loop reads the window,
    then updates), computed here from ``it`` alone so that a resumed run draws the same windows.

    Departures (docs/decisions.md): their ``random`` schedule draws from an unseeded numpy generator, ours from
    the iteration's generator; at the position start = S - 2 their window is empty (a rollout that trains
    nothing, before the roll back): here it is the window at 0, where their schedule goes next. Clipping
    instead of rolling back (their ``roll_back=False``, in no script) would leave that empty window forever
    and is not offered.
    """

    name = "mixgrpo"

    @staticmethod
    def last_start(num_steps: int) -> int:
        """Their ``max_timesteps = sampling_steps - 2``: the window never reaches it (the bound is exclusive)."""
        return num_steps - 2

    @staticmethod
    def validate(cfg, num_steps: int, backward=None) -> None:
        if cfg.sample_strategy not in MIX_SCHEDULES:
            raise ConfigError(
                f"algorithm.sample_strategy must be one of {list(MIX_SCHEDULES)}, got {cfg.sample_strategy!r}"
            )
        checks = (
            ("group_size", cfg.group_size >= 1, ">= 1"),
            ("iters_per_group", cfg.iters_per_group >= 1, ">= 1"),
            ("prog_overlap_step", cfg.prog_overlap_step >= 0, ">= 0"),
            ("min_iters_per_group", cfg.min_iters_per_group >= 1, ">= 1"),
            (
                "max_iters_per_group",
                cfg.max_iters_per_group >= cfg.min_iters_per_group,
                ">= min_iters_per_group",
            ),
            ("exp_decay_k", cfg.exp_decay_k >= 0, ">= 0"),
            ("exp_decay_thre_timestep", cfg.exp_decay_thre_timestep >= 0, ">= 0"),
        )
        for key, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"algorithm.{key} must be {allowed}, got {getattr(cfg, key)!r}")
        if cfg.dpm_algorithm_type not in MIX_POST_SOLVERS:
            raise ConfigError(
                f"algorithm.dpm_algorithm_type must be one of {list(MIX_POST_SOLVERS)}, got {cfg.dpm_algorithm_type!r}"
            )
        flash = (
            ("dpm_post_compress_ratio", 0 < cfg.dpm_post_compress_ratio <= 1, "in (0, 1]"),
            ("dpm_solver_order", cfg.dpm_solver_order in (1, 2), "1 or 2"),
            ("dpm_solver_type", cfg.dpm_solver_type in ("midpoint", "heun"), "midpoint or heun"),
        )
        for key, ok, allowed in flash:
            if not ok:
                raise ConfigError(f"algorithm.{key} must be {allowed}, got {getattr(cfg, key)!r}")
        if cfg.dpm_algorithm_type != "none" and cfg.sample_strategy != "progressive":
            raise ConfigError(
                f"algorithm.dpm_algorithm_type={cfg.dpm_algorithm_type} (MixGRPO-Flash) needs "
                f"algorithm.sample_strategy=progressive, as MixGRPO's code asserts; got {cfg.sample_strategy!r}"
            )
        if num_steps < 3:
            raise ConfigError(
                f"algorithm.name=mixgrpo trains steps [0, sampling.num_steps - 2), none of {num_steps}; "
                "allowed: sampling.num_steps >= 3"
            )
        if cfg.sample_strategy == "random" and cfg.group_size > num_steps - 2:
            raise ConfigError(
                f"algorithm.group_size={cfg.group_size} does not fit the {num_steps - 2} trainable steps of "
                f"sampling.num_steps={num_steps} for sample_strategy=random; allowed: 1 <= group_size <= "
                "sampling.num_steps - 2"
            )
        MixGRPO._validate_window_routing(cfg, backward)

    @staticmethod
    def _validate_window_routing(cfg, backward) -> None:
        """Measured routing (``backward.jagg_frac: auto``) is per window position, the window one group: W must
        be an integer that holds the whole window."""
        if backward is None or not getattr(backward, "calibrated", False) or backward.strategy == "knots":
            return
        size = backward.group_size
        if not isinstance(size, int) or size < cfg.group_size:
            shown = "'auto'" if size is None else repr(size)
            raise ConfigError(
                "algorithm.name=mixgrpo with backward.jagg_frac=auto routes each window position as one group: "
                f"backward.group_size must be an integer >= algorithm.group_size={cfg.group_size}, got {shown}"
            )

    def dwell(self, start: int, num_steps: int) -> int:
        """Iterations the window stays at ``start`` (their ``iters_per_group`` or its decayed forms)."""
        cfg = self.cfg
        if cfg.sample_strategy == "decay":  # get_dynamic_iters_per_group
            progress = start / self.last_start(num_steps)
            mixed = int(cfg.max_iters_per_group * (1 - progress) + cfg.min_iters_per_group * progress)
            return max(cfg.min_iters_per_group, mixed)
        if cfg.sample_strategy == "exp_decay":  # get_exp_decay_iters_per_group
            relu = max(0, start - cfg.exp_decay_thre_timestep)
            return max(1, math.ceil(cfg.iters_per_group * math.exp(-cfg.exp_decay_k * relu)))
        return cfg.iters_per_group

    def window_start(self, iteration: int, num_steps: int, gen: torch.Generator) -> int:
        """The window's first step at training iteration ``iteration`` (their ``cur_timestep``)."""
        last = self.last_start(num_steps)
        if self.cfg.sample_strategy == "random":
            if iteration == 0:  # their initial state: the first window is read before the first update
                return 0
            return int(torch.randint(0, last - self.cfg.group_size + 1, (1,), generator=gen))
        step = self.cfg.prog_overlap_step
        if step == 0:  # MixGRPO-Flash*: the window never moves
            return 0
        # one cycle visits 0, step, 2 step, ... <= S - 2, then rolls back to 0 (roll_back_start)
        positions = range(0, last + 1, step)
        left = iteration % sum(self.dwell(p, num_steps) for p in positions)
        for start in positions:
            stay = self.dwell(start, num_steps)
            if left < stay:
                return start
            left -= stay
        raise AssertionError("unreachable: left < the cycle length")

    def window(self, iteration: int, num_steps: int, gen: torch.Generator | None) -> range:
        """The trained steps of ``iteration`` (``window_at`` its start); ``gen`` is read by ``random`` only."""
        return self.window_at(self.window_start(iteration, num_steps, gen), num_steps)

    def window_at(self, start: int, num_steps: int) -> range:
        """The window at ``start``: ``range(start, min(start + group_size, S - 2))``, never empty."""
        last = self.last_start(num_steps)
        if start >= last:  # their empty window (start == S - 2): the window at 0 (see the class docstring)
            start = 0
        return range(start, min(start + self.cfg.group_size, last))

    def windows(self, num_steps: int, iterations: range) -> list[range]:
        """Every window trained during ``iterations``, once each, by first step. The progressive schedules are a
        function of the iteration; ``random`` draws its start from the rollout's generator, which only the
        rollout replays, so every start it can draw (0 .. S - 2 - group_size) is returned."""
        if self.cfg.sample_strategy == "random":
            starts = set(range(self.last_start(num_steps) - self.cfg.group_size + 1))
        else:
            starts = {self.window(it, num_steps, None).start for it in iterations}
        return [self.window_at(start, num_steps) for start in sorted(starts)]

    def step_kinds(self, num_steps: int, gen: torch.Generator, iteration: int = 0) -> list[str]:
        win = self.window(iteration, num_steps, gen)
        return [self.cfg.sde_kind if i in win else "ode" for i in range(num_steps)]

    def trained_steps(self, kinds: list[str], batch: int, gen: torch.Generator) -> Tensor:
        win = torch.tensor([i for i, k in enumerate(kinds) if k == self.cfg.sde_kind])
        return win.expand(batch, len(win)).clone()

    def rollout_schedule(self, sigmas: Tensor, kinds: list[str]) -> tuple[Tensor, list[str]]:
        """MixGRPO-Flash (``dpm_algorithm_type: dpmsolver++``, their ``dpm_apply_strategy="post"``): after the
        window's last step ``l`` the schedule is rebuilt with ``n = int(max((S - l) * dpm_post_compress_ratio, 1))``
        points ``shift(linspace(t_{l+1}, 0, n))`` (t the unshifted times ``linspace(1, 0, S + 1)``), sampled with
        deterministic DPM-Solver++ of ``dpm_solver_order`` (first order at the final step, as their
        ``lower_order_final``). ``run_sample_step`` in Tencent-Hunyuan/MixGRPO fastvideo/utils/sampling_utils.py.

        The shift is read back from the shifted-linear schedule (``sampling.schedule=shift``, checked by the
        config); a schedule that is not shifted-linear is refused. With n = 1 their schedule ends at sigma_{l+1},
        not at 0; kept as theirs."""
        if self.cfg.dpm_algorithm_type == "none":
            return sigmas, kinds
        num_steps = len(kinds)
        last = max(i for i, k in enumerate(kinds) if k == self.cfg.sde_kind)
        times = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        s1, t1 = float(sigmas[1]), float(times[1])
        shift = s1 * (1 - t1) / (t1 * (1 - s1))  # sigma = s t / (1 + (s - 1) t), inverted at the first step
        if not torch.allclose(sigmas.double(), shift_sigmas(times, shift), rtol=0, atol=1e-9):
            raise ValueError(
                "MixGRPO-Flash rebuilds a shifted-linear schedule; got another (sampling.schedule)"
            )
        n_post = int(max((num_steps - last) * self.cfg.dpm_post_compress_ratio, 1))
        post = shift_sigmas(torch.linspace(float(times[last + 1]), 0.0, n_post, dtype=torch.float64), shift)
        # post[0] is sigma_{l+1} up to rounding: keep the run's value, so the update's times are the rollout's
        flash = torch.cat([sigmas[: last + 2].double(), post[1:]]).to(sigmas.dtype)
        n_dpm = n_post - 1  # steps after the window
        order = f"dpm2_{self.cfg.dpm_solver_type}" if self.cfg.dpm_solver_order == 2 else "dpm1"
        post_kinds = [order] * (n_dpm - 1) + ["dpm1"] if n_dpm else []  # lower_order_final
        return flash, list(kinds[: last + 1]) + post_kinds


ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (DanceGRPO, FlowGRPO, FlowGRPOFast, MixGRPO)}


def validate_sde_steps(cfg, num_steps: int) -> None:
    """``algorithm.sde_steps`` (``Algorithm.sampling_kinds``): empty, or [lo, hi) inside the schedule covering
    every step the algorithm may train. A trained ODE step would have no sampling density: its stored log-prob
    is 0 and the SDE's log-prob of a deterministic sample is not a policy's, so its ratio would be meaningless.
    MixGRPO's window moves and sets its own SDE steps (and MixGRPO-Flash its solver after them): refused."""
    if not cfg.sde_steps:
        return
    span = cfg.sde_steps
    if cfg.name == "mixgrpo":
        raise ConfigError(
            "algorithm.sde_steps does not apply to algorithm.name=mixgrpo (its window sets the SDE steps)"
        )
    need = ALGORITHMS[cfg.name].trainable(cfg, num_steps)
    ok = len(span) == 2 and 0 <= span[0] < span[1] <= num_steps
    if not ok or need.start < span[0] or need.stop > span[1]:
        raise ConfigError(
            f"algorithm.sde_steps={list(span)} must be [lo, hi] with 0 <= lo < hi <= sampling.num_steps="
            f"{num_steps} covering every step {cfg.name} may train (steps {need.start}..{need.stop - 1}): "
            f"allowed lo <= {need.start}, hi >= {need.stop}"
        )
