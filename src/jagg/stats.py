"""Small-sample statistics for paired comparisons of training runs (seeds shared across strategies).

Each comparison is over seeds: d_k = metric(strategy, seed k) - metric(exact, seed k). With a handful of seeds
the t distribution is the honest reference (no normal approximation), so every interval and test here uses
Student's t with n - 1 degrees of freedom:

    paired_interval   mean of d with a two-sided (1 - alpha) confidence interval
    tost              equivalence within +-margin: two one-sided tests (Schuirmann 1987); equivalent at level
                      alpha exactly when the (1 - 2 alpha) interval lies inside (-margin, margin)
    one_sided_below   H1: mean d < 0 (e.g. "the endpoints-only ablation ends below exact")
    sign_flip_test    the exact paired permutation test: all 2^n sign flips of d (no normality assumed)
    one_sided_above   H1: mean d > 0 by the t-test and the sign-flip test together, with the t-test's power
                      at the paired SD it saw (how the repository decides a pre-registered contrast)
    holm              Holm's step-down adjustment of a family of p-values (Holm 1979)
    minimum_detectable_difference
                      the smallest true mean difference a paired t-test detects with the given power
                      (noncentral t), from the paired standard deviation and n
    area_under_curve  trapezoidal mean of a metric over its evaluation iterations (one number per run)
    dose_location     where a value falls on a dose-response curve (effect against a control's cosine)
    located_cosine    that location with a bootstrap interval over the seeds ("behaves like a cosine-c
                      gradient")

The t quantiles, p-values and the noncentral t come from ``scipy.stats`` (tested against it).

Layer: plumbing beside ``jagg.common`` (numpy and scipy only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _t():
    from scipy import stats  # imported lazily: only the reports need it

    return stats.t


def _ttest(d: np.ndarray, popmean: float, alternative: str) -> float:
    """p-value of scipy's one-sample t-test of ``d`` against ``popmean`` (d has a nonzero spread)."""
    from scipy import stats

    return float(stats.ttest_1samp(d, popmean, alternative=alternative).pvalue)


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
    if ci.se == 0:
        p = 0.0 if abs(ci.mean) < margin else 1.0
    else:
        d = np.asarray(diffs, dtype=float)
        p_low = _ttest(d, -margin, "greater")  # H0: mean <= -margin
        p_high = _ttest(d, margin, "less")  # H0: mean >= +margin
        p = max(p_low, p_high)
    return Equivalence(margin, p, ci, alpha)


def one_sided_below(diffs: Sequence[float]) -> float:
    """p-value of the one-sided t-test H0: mean >= 0 against H1: mean < 0."""
    ci = paired_interval(diffs)
    if ci.se == 0:
        return 0.0 if ci.mean < 0 else 1.0
    return _ttest(np.asarray(diffs, dtype=float), 0.0, "less")


ALTERNATIVES = ("two-sided", "less", "greater")


def sign_flip_test(diffs: Sequence[float], alternative: str = "two-sided", max_exact: int = 40) -> float:
    """Exact p-value of the paired sign-flip permutation test of mean d = 0 (Fisher 1935; Good 2005, 3.1).

    Under H0 each d_k is as likely to have either sign, so the observed mean is compared with the means of
    all 2^n sign patterns (the observed one included): ``less`` counts patterns with a mean <= the observed,
    ``greater`` >=, ``two-sided`` |mean| >= |observed| (equal to twice the smaller one-sided p, the flip
    distribution being symmetric). Exact for n <= ``max_exact``; larger n raises. Ties within 1e-12 count.
    """
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    d = np.asarray(diffs, dtype=float)
    n = d.size
    if not 1 <= n <= max_exact:
        raise ValueError(f"sign_flip_test enumerates 2^n flips: needs 1 <= n <= {max_exact}, got {n}")
    # meet in the middle: every pattern's sum is a + b, a from the first half's 2^h sign sums and b from the
    # second half's (sorted), so counting the patterns beyond a threshold costs 2^h binary searches, not 2^n
    a, b = _sign_sums(d[: n // 2]), np.sort(_sign_sums(d[n // 2 :]))
    obs, tol = d.sum(), n * 1e-12 * max(1.0, float(np.abs(d).max()))

    def at_least(x: float) -> int:  # patterns with a sum >= x
        return int((b.size - np.searchsorted(b, x - a, side="left")).sum())

    def at_most(x: float) -> int:  # patterns with a sum <= x
        return int(np.searchsorted(b, x - a, side="right").sum())

    if alternative == "less":
        hits = at_most(obs + tol)
    elif alternative == "greater":
        hits = at_least(obs - tol)
    else:
        thr = abs(obs) - tol
        hits = 2**n if thr <= 0 else at_least(thr) + at_most(-thr)
    return hits / 2**n


@dataclass(frozen=True)
class OneSided:
    """H1: mean d > 0 by two tests that must both pass, and the effect the t-test detects at ``power``."""

    p_t: float  # one-sided t-test
    p_flip: float  # one-sided sign-flip test (no normality assumed)
    alpha: float
    sd: float  # paired standard deviation
    mdd: float  # minimum_detectable_difference(sd, n, alpha, power, "greater")

    @property
    def passed(self) -> bool:
        return self.p_t < self.alpha and self.p_flip < self.alpha


def one_sided_above(diffs: Sequence[float], alpha: float = 0.05, power: float = 0.8) -> OneSided:
    """Both one-sided tests of mean ``diffs`` > 0, required together: the t-test is the more powerful where the
    differences are near normal, the sign-flip test holds without that, so a claim passes both. Needs n >= 2."""
    d = [float(x) for x in diffs]
    sd = float(np.std(d, ddof=1))
    mdd = minimum_detectable_difference(sd, len(d), alpha, power, "greater")
    return OneSided(one_sided_below([-x for x in d]), sign_flip_test(d, "greater"), alpha, sd, mdd)


def _sign_sums(d: np.ndarray) -> np.ndarray:
    """The sums of d under all 2^len(d) sign patterns."""
    bits = (np.arange(2**d.size)[:, None] >> np.arange(d.size)[None, :]) & 1
    return ((1 - 2 * bits) * d[None, :]).sum(axis=1)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (Holm 1979).

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)). Rejecting
    where the adjusted p < alpha controls the family-wise error rate at alpha under any dependence.
    """
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return [float(x) for x in out]


def paired_t_power(
    delta: float, sd: float, n: int, alpha: float = 0.05, alternative: str = "two-sided"
) -> float:
    """Power of the paired t-test at level ``alpha`` when the true mean difference is ``delta``.

    T = mean / (s / sqrt(n)) follows a noncentral t with n - 1 degrees of freedom and noncentrality
    delta sqrt(n) / sd; ``less`` tests H1: mean < 0 (power against delta < 0), ``greater`` the mirror image.
    """
    from scipy import stats

    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    df, nc = n - 1, delta * math.sqrt(n) / sd

    def sf(x: float, nc: float) -> float:  # P(T > x); scipy's nct returns nan far in a tail: 0 or 1 there
        v = float(stats.nct.sf(x, df, nc))
        return v if math.isfinite(v) else float(nc > x)

    if alternative == "two-sided":
        crit = stats.t.ppf(1 - alpha / 2, df)
        return sf(crit, nc) + sf(crit, -nc)  # P(T < -crit | nc) = P(T > crit | -nc)
    crit = stats.t.ppf(1 - alpha, df)
    return sf(crit, nc if alternative == "greater" else -nc)


def minimum_detectable_difference(
    sd: float, n: int, alpha: float = 0.05, power: float = 0.8, alternative: str = "two-sided"
) -> float:
    """The smallest |true mean difference| a paired t-test on n pairs with paired SD ``sd`` detects with
    probability ``power`` at level ``alpha`` (solved on the noncentral t, ``paired_t_power``).

    Close to (t_{1-alpha/2, n-1} + t_{power, n-1}) sd / sqrt(n) (Cohen 1988, ch. 2) and, for large n, to
    (z_{1-alpha/2} + z_{power}) sd / sqrt(n). ``sd`` = 0 gives 0; needs n >= 2.
    """
    from scipy import optimize

    if n < 2:
        raise ValueError(f"a paired design needs n >= 2, got {n}")
    if not 0 < power < 1 or not 0 < alpha < 1:
        raise ValueError(f"power and alpha must be in (0, 1), got power {power}, alpha {alpha}")
    if sd == 0:
        return 0.0
    signed = -1.0 if alternative == "less" else 1.0

    def gap(delta: float) -> float:
        return paired_t_power(signed * delta, sd, n, alpha, alternative) - power

    sides = 2 if alternative == "two-sided" else 1
    df = n - 1
    hi = 2 * (_t().ppf(1 - alpha / sides, df) + _t().ppf(power, df)) * sd / math.sqrt(n)  # 2 x Cohen's
    while gap(hi) < 0:
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-12 * sd))


def area_under_curve(x: Sequence[float], y: Sequence[float]) -> float:
    """Trapezoidal area of y(x) divided by the span of x: the curve's mean level (x sorted ascending)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 2:
        raise ValueError("area_under_curve needs at least two points")
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))


def dose_location(curve: Sequence[tuple[float, float]], value: float, worse: int | None = None) -> float:
    """The dose (a control's cosine) at which the piecewise-linear ``curve`` of (cosine, effect) points reaches
    ``value``, walking from the highest cosine (the reference: cosine 1, its own effect) down; the first
    crossing counts.

    A value beyond every point of the curve gives an end of the scale, chosen by the side of the reference it
    lies on (the caller reports it as a bound): on the better side, the reference's cosine ("beyond the
    reference"); on the worse side, the lowest cosine ("beyond the weakest control"). ``worse`` says which
    side is worse: -1 where a lower effect is worse (a reward), +1 where a higher one is (a divergence, an
    error); None takes it from the curve itself, worse being the side of the lowest-cosine control's effect
    relative to the reference's (lower on a tie). A caller that knows its metric's direction should pass it:
    where the controls' effects are noise around the reference, the curve's own direction can point the
    wrong way and put an arm that beats the reference beyond the weakest control."""
    pts = sorted(curve, reverse=True)
    for (c0, e0), (c1, e1) in zip(pts, pts[1:]):
        if min(e0, e1) <= value <= max(e0, e1):
            return c0 if e1 == e0 else c0 + (value - e0) / (e1 - e0) * (c1 - c0)
    (top, ref), (bottom, weakest) = pts[0], pts[-1]
    if worse is None:
        worse = 1 if weakest > ref else -1
    elif worse not in (-1, 1):
        raise ValueError(f"worse must be -1, +1 or None, got {worse}")
    return top if (value - ref) * worse < 0 else bottom


@dataclass(frozen=True)
class Located:
    """An arm placed on a dose-response scale: the cosine whose control has its effect, with an interval. An
    end of the scale is a bound: ``>=1.00 (beyond exact)`` on the reference's better side, ``<=0.50`` past the
    weakest control."""

    cosine: float
    lo: float
    hi: float
    scale: tuple[float, ...]  # the cosines of the scale, 1 (the reference) included
    reference: str = "exact"  # the reference's name, for the bound at its end

    def __str__(self) -> str:
        def fmt(c: float) -> str:  # an end of the scale is a bound, not a value
            return (
                f"<={c:.2f}"
                if c == min(self.scale)
                else (f">={c:.2f}" if c == max(self.scale) else f"{c:.2f}")
            )

        beyond = f" (beyond {self.reference})" if self.cosine == max(self.scale) else ""
        return f"{fmt(self.cosine)}{beyond} [{fmt(self.lo)}, {fmt(self.hi)}]"


def located_cosine(
    controls: dict[float, Sequence[float]],
    arm: Sequence[float],
    reference: float,
    level: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    worse: int | None = None,
    name: str = "exact",
) -> Located:
    """Where ``arm``'s mean effect falls on the controls' mean effects against their cosines.

    ``controls`` maps each control's cosine to its per-seed effects and ``arm`` holds the arm's, all indexed by
    the same seeds; ``reference`` is the reference's own effect (at cosine 1: 0 for a difference to exact) and
    ``name`` its name; ``worse`` the side of a worse effect, as in dose_location (None: the curve's own).
    The interval is the percentile bootstrap over seeds, resampled jointly for every control and the arm, so it
    carries the scale's uncertainty as well as the arm's.
    """
    table = np.array([list(v) for v in controls.values()] + [list(arm)], dtype=float)
    cosines = list(controls)

    def place(cols: np.ndarray) -> float:
        means = table[:, cols].mean(axis=1)
        return dose_location([(1.0, reference), *zip(cosines, means[:-1])], float(means[-1]), worse)

    rng = np.random.default_rng(seed)
    n = table.shape[1]
    boot = [place(rng.integers(0, n, n)) for _ in range(n_boot)]
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return Located(place(np.arange(n)), float(lo), float(hi), (1.0, *cosines), name)
