"""The evaluated state as a plug-in of the loop: after every held-out evaluation, this rank's images and its
part of the evaluated weights, so that two runs can be compared without loading a checkpoint
(``paired_divergence``, used by ``experiments/curves.py``).

Config key: ``plugins.eval_state.enabled`` (``EvalStateConfig``; log.save_eval_state before, still read so).
No state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from jagg.plugins.base import Plugin, PluginConfig, RunView


@dataclass(frozen=True, kw_only=True)
class EvalStateConfig(PluginConfig):
    """plugins.eval_state: write samples/eval_<it>.rank<r>.pt at each evaluation, this rank's held-out images
    and evaluated weights (its shards), for the paired divergence of two runs (experiments/curves.py); ~1 MB
    per evaluation here."""

    enabled: bool = False


class EvalState(Plugin):
    name = "eval_state"
    CONFIG = EvalStateConfig

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = Path(run_dir), rank

    @classmethod
    def from_config(cls, cfg, run: RunView) -> EvalState | None:
        return cls(run.run_dir, run.dist.rank) if cfg.plugins.eval_state.enabled else None

    def after_evaluation(self, it: int, images: Tensor, weights: Sequence[Tensor]) -> None:
        """``samples/eval_<it>.rank<r>.pt``: the held-out images and this rank's part of the evaluated weights
        (the EMA where there is one; a DTensor's local shard), float32."""
        local = [(w.to_local() if hasattr(w, "to_local") else w).detach().float().cpu() for w in weights]
        path = self.run_dir / "samples" / f"eval_{it:05d}.rank{self.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"images": images.float().cpu(), "weights": local}, tmp)
        tmp.replace(path)  # a reader never sees half a file


def _eval_states(run_dir: Path) -> dict[int, list[dict]]:
    """``{iteration: [rank 0's state, rank 1's, ...]}`` of the run's ``samples/eval_<it>.rank<r>.pt``
    (``plugins.eval_state.enabled``)."""
    found: dict[int, dict[int, Path]] = {}
    for path in (Path(run_dir) / "samples").glob("eval_*.rank*.pt"):
        it, rank = path.name[5:-3].split(".rank")
        found.setdefault(int(it), {})[int(rank)] = path
    return {
        it: [torch.load(ranks[r], weights_only=True) for r in sorted(ranks)] for it, ranks in found.items()
    }


def _sq_dist(a: list[dict], b: list[dict], key: str) -> float:
    """The squared distance of two runs' ``key`` (images or weights) over every rank's part, float64."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        xs, ys = (x[key], y[key]) if key == "weights" else ([x[key]], [y[key]])
        total += sum(float(((u.double() - v.double()) ** 2).sum()) for u, v in zip(xs, ys, strict=True))
    return total


def paired_divergence(
    run_dir: Path, exact_dir: Path, by_evaluation: bool = False
) -> dict[int, dict[str, float]]:
    """How far a run has moved from exact's run of the same seed, at each evaluation both saved:

        div_weights_rel = ||theta_run - theta_exact|| / ||theta_exact - theta_0||
        div_samples_rel = ||x_run - x_exact|| / ||x_exact - x_0||   (all held-out images, same noise)

    with theta_0 and x_0 exact's evaluation at iteration 0 (the base model, identical for every arm). 0 for
    exact itself; runs are deterministic, so no evaluation noise enters. NaN where exact has not moved yet
    (iteration 0). A difference grows once two runs' rollouts differ: protocol version 4's pilot found every
    non-exact arm near 1 (docs/decisions.md 24).

    Evaluations are paired by iteration, or with ``by_evaluation`` by their order: the k-th evaluation of each
    run, for runs evaluated at the same fractions of a budget with different iterations (an equal-cost
    recipe, ``experiments/equal_cost.py``). Keyed by this run's iteration."""
    mine, exact = _eval_states(run_dir), _eval_states(exact_dir)
    if 0 not in exact:
        raise FileNotFoundError(f"{exact_dir}: no samples/eval_00000.rank*.pt (plugins.eval_state.enabled)")
    if by_evaluation and len(mine) != len(exact):
        raise ValueError(
            f"{run_dir}: {len(mine)} evaluations against {len(exact)} of {exact_dir}: pairing by evaluation "
            "needs both runs evaluated at the same fractions of their budgets"
        )
    pairs = (
        zip(sorted(mine), sorted(exact))
        if by_evaluation
        else ((i, i) for i in sorted(set(mine) & set(exact)))
    )
    out = {}
    for it, ref_it in pairs:
        row = {}
        for key, name in (("weights", "div_weights_rel"), ("images", "div_samples_rel")):
            moved = _sq_dist(exact[ref_it], exact[0], key)
            row[name] = (_sq_dist(mine[it], exact[ref_it], key) / moved) ** 0.5 if moved > 0 else float("nan")
        out[it] = row
    return out
