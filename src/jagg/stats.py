"""Small-sample statistics for paired comparisons of training runs (seeds shared across strategies).

Each comparison is over seeds: d_k = metric(strategy, seed k) - metric(exact, seed k). With a handful of seeds
the t distribution is the honest reference (no normal approximation), so every interval and test here uses
Student's t with n - 1 degrees of freedom:

    paired_interval   mean of d with a two-sided (1 - alpha) confidence interval
    tost              equivalence within +-margin: two one-sided tests (Schuirmann 1987); equivalent at level
                      alpha exactly when the (1 - 2 alpha) interval lies inside (-margin, margin)
    one_sided_below   H1: mean d < 0 (e.g. "the endpoints-only ablation ends below exact")
    area_under_curve  trapezoidal mean of a metric over its evaluation iterations (one number per run)

Layer: plumbing beside ``jagg.common`` (numpy and scipy only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _t():
    from scipy import stats  # scipy comes with scikit-learn; imported lazily (only the reports need it)

    return stats.t


@dataclass(frozen=True)
class PairedInterval:
    """Mean paired difference over n seeds, its standard error and a two-sided confidence interval."""

    n: int
    mean: float
    se: float
    lo: float
    hi: float
    level: float

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> PairedInterval:
    """Mean of ``diffs`` with its Student-t confidence interval at ``level`` (needs n >= 2)."""
    d = np.asarray(diffs, dtype=float)
    n = d.size
    if n < 2:
        raise ValueError(f"a paired interval needs at least 2 differences, got {n}")
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    half = float(_t().ppf(0.5 + level / 2, n - 1)) * se
    return PairedInterval(n, mean, se, mean - half, mean + half, level)


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests against +-margin: ``p`` is the larger of the two p-values."""

    margin: float
    p: float
    interval: PairedInterval  # the (1 - 2 alpha) interval, inside (-margin, margin) iff equivalent
    alpha: float

    @property
    def equivalent(self) -> bool:
        return self.p < self.alpha


def tost(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """Equivalence of the mean difference to 0 within ``margin`` (> 0) at level ``alpha``."""
    if not margin > 0:
        raise ValueError(f"equivalence margin must be > 0, got {margin}")
    ci = paired_interval(diffs, 1 - 2 * alpha)
    t = _t()
    if ci.se == 0:
        p = 0.0 if abs(ci.mean) < margin else 1.0
    else:
        p_low = float(t.sf((ci.mean + margin) / ci.se, ci.n - 1))  # H0: mean <= -margin
        p_high = float(t.cdf((ci.mean - margin) / ci.se, ci.n - 1))  # H0: mean >= +margin
        p = max(p_low, p_high)
    return Equivalence(margin, p, ci, alpha)


def one_sided_below(diffs: Sequence[float]) -> float:
    """p-value of the one-sided t-test H0: mean >= 0 against H1: mean < 0."""
    ci = paired_interval(diffs)
    if ci.se == 0:
        return 0.0 if ci.mean < 0 else 1.0
    return float(_t().cdf(ci.mean / ci.se, ci.n - 1))


def area_under_curve(x: Sequence[float], y: Sequence[float]) -> float:
    """Trapezoidal area of y(x) divided by the span of x: the curve's mean level (x sorted ascending)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 2:
        raise ValueError("area_under_curve needs at least two points")
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))
