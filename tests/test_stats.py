"""Paired-seed statistics of the reward curves (jagg.stats) against scipy's reference t-tests."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from jagg.stats import area_under_curve, one_sided_below, paired_interval, tost

D = [0.31, -0.12, 0.05, 0.22, -0.03, 0.14]


def test_paired_interval_matches_scipy_t_interval():
    ci = paired_interval(D, 0.95)
    lo, hi = sps.ttest_1samp(D, 0.0).confidence_interval(0.95)
    assert ci.n == 6 and ci.mean == pytest.approx(np.mean(D))
    assert (ci.lo, ci.hi) == (pytest.approx(lo), pytest.approx(hi))
    with pytest.raises(ValueError, match="at least 2"):
        paired_interval([1.0])


def test_one_sided_below_matches_scipy():
    shifted = [d - 0.2 for d in D]
    assert one_sided_below(shifted) == pytest.approx(sps.ttest_1samp(shifted, 0.0, alternative="less").pvalue)


def test_tost_is_two_one_sided_tests_and_agrees_with_the_90_percent_interval():
    margin = 0.3
    eq = tost(D, margin, alpha=0.05)
    p_low = sps.ttest_1samp(D, -margin, alternative="greater").pvalue
    p_high = sps.ttest_1samp(D, margin, alternative="less").pvalue
    assert eq.p == pytest.approx(max(p_low, p_high))
    inside = -margin < eq.interval.lo and eq.interval.hi < margin
    assert eq.equivalent == inside and eq.interval.level == pytest.approx(0.90)
    # a difference centred on the margin is as likely above as below it: p = 1/2, never equivalent
    assert tost([margin + d - np.mean(D) for d in D], margin).p == pytest.approx(0.5)
    assert not tost(D, 0.01).equivalent
    with pytest.raises(ValueError, match="margin must be > 0"):
        tost(D, 0.0)


def test_area_under_curve_is_the_curves_mean_level():
    assert area_under_curve([0, 10, 20], [3.0, 3.0, 3.0]) == pytest.approx(3.0)
    assert area_under_curve([0, 10, 30], [0.0, 1.0, 3.0]) == pytest.approx(1.5)  # linear in x: the midpoint
    with pytest.raises(ValueError):
        area_under_curve([0], [1.0])
