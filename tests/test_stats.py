"""Paired-seed statistics of the reward curves (jagg.stats) against scipy's reference t-tests."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from jagg.stats import (
    area_under_curve,
    holm,
    minimum_detectable_difference,
    one_sided_above,
    one_sided_below,
    paired_interval,
    paired_t_power,
    sign_flip_test,
    tost,
)

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


def test_one_sided_above_needs_both_tests_and_reports_the_t_tests_power():
    import itertools

    r = one_sided_above(D, alpha=0.05, power=0.8)
    assert r.p_t == pytest.approx(sps.ttest_1samp(D, 0.0, alternative="greater").pvalue)
    flips = [np.dot(s, D) for s in itertools.product([1, -1], repeat=len(D))]
    assert r.p_flip == pytest.approx(np.mean([f >= sum(D) - 1e-12 for f in flips]))
    assert r.sd == pytest.approx(np.std(D, ddof=1))
    assert paired_t_power(r.mdd, r.sd, len(D), 0.05, "greater") == pytest.approx(0.8, abs=1e-9)
    assert r.passed == (r.p_t < 0.05 and r.p_flip < 0.05)
    # four clear gains: the t-test passes, but 4 signs cannot go below 1/16 > 0.05, so the contrast does not
    four = one_sided_above([1.0, 1.1, 0.9, 1.05])
    assert four.p_t < 1e-3 and four.p_flip == 1 / 16 and not four.passed
    assert one_sided_above([1.0, 1.1, 0.9, 1.05, 0.95]).passed  # five: 1/32 < 0.05


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


def _brute_sign_flip(d, alternative):
    """Every sign pattern by itertools, counted one by one (independent of the vectorised bit trick)."""
    import itertools

    obs, hits, total = np.mean(d), 0, 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        m = np.mean([s * x for s, x in zip(signs, d, strict=True)])
        total += 1
        hits += {
            "less": m <= obs + 1e-12,
            "greater": m >= obs - 1e-12,
            "two-sided": abs(m) >= abs(obs) - 1e-12,
        }[alternative]
    return hits / total


@pytest.mark.parametrize("alternative", ["two-sided", "less", "greater"])
def test_sign_flip_test_matches_brute_force_and_scipy(alternative):
    d = [0.31, -0.12, 0.05, 0.22, -0.03, 0.14, 0.4, -0.07]
    p = sign_flip_test(d, alternative)
    assert p == pytest.approx(_brute_sign_flip(d, alternative), abs=1e-15)
    ref = sps.permutation_test(
        (np.asarray(d),),
        np.mean,
        permutation_type="samples",
        n_resamples=np.inf,
        alternative=alternative,
    ).pvalue
    assert p == pytest.approx(ref, abs=1e-12)


def test_sign_flip_test_is_exact_past_sixteen_pairs():
    """n = 18: the split-half count equals brute force over all 2^18 patterns, ties included."""
    rng = np.random.default_rng(0)
    d = np.round(rng.normal(0.05, 0.1, 18), 2)  # rounded, so that many patterns tie with the observed mean
    bits = (np.arange(2**18)[:, None] >> np.arange(18)[None, :]) & 1  # all 2^18 patterns at once
    means, obs = ((1 - 2 * bits) * d[None, :]).mean(axis=1), d.mean()
    brute = {
        "less": np.mean(means <= obs + 1e-12),
        "greater": np.mean(means >= obs - 1e-12),
        "two-sided": np.mean(np.abs(means) >= abs(obs) - 1e-12),
    }
    for alternative, p in brute.items():
        assert sign_flip_test(d, alternative) == pytest.approx(p, abs=1e-15)
    assert sign_flip_test(-np.abs(d) - 0.01, "less") == pytest.approx(2.0**-18)


def test_sign_flip_textbook_cases():
    # all six differences negative: only the observed pattern is as extreme, p = 1/64 one-sided, 2/64 two-sided
    d = [-0.3, -0.1, -0.2, -0.4, -0.05, -0.15]
    assert sign_flip_test(d, "less") == pytest.approx(1 / 64)
    assert sign_flip_test(d, "two-sided") == pytest.approx(2 / 64)
    assert sign_flip_test(d, "greater") == pytest.approx(1.0)
    # five of six differences exactly 0 (the committed DanceGRPO case): the test cannot go below 1/2
    assert sign_flip_test([0, 0, 0, 0, 0, -0.2], "less") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2\\^n"):
        sign_flip_test(np.ones(41))
    with pytest.raises(ValueError, match="alternative"):
        sign_flip_test(d, "below")


def test_holm_matches_the_step_down_definition():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.02]) == pytest.approx([0.02])  # a family of one: unchanged
    # brute force: Holm rejects H_(i) at alpha iff p_(j) <= alpha / (m - j + 1) for every j <= i
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = rng.uniform(0, 0.1, size=6)
        adj = holm(p)
        order = np.argsort(p)
        for alpha in (0.01, 0.05):
            keep = True
            for rank, i in enumerate(order):
                keep = keep and p[i] <= alpha / (6 - rank)
                assert (adj[i] <= alpha) == keep


def test_power_and_minimum_detectable_difference():
    # the noncentral-t power agrees with a Monte Carlo of the paired t-test (400k simulated designs)
    rng = np.random.default_rng(1)
    n, sd, delta = 10, 1.0, 0.9
    x = rng.normal(delta, sd, size=(400_000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(n))
    crit = sps.t.ppf(0.975, n - 1)
    assert paired_t_power(delta, sd, n) == pytest.approx(np.mean(np.abs(t) > crit), abs=3e-3)
    assert paired_t_power(-delta, sd, n, alternative="less") == pytest.approx(
        np.mean(t > sps.t.ppf(0.95, n - 1)),
        abs=3e-3,  # data -x: mean -delta, T = -t < -crit
    )
    # the MDD is where the power is 0.8; it lies just below the textbook (t + t) sd / sqrt(n) approximation
    for n in (3, 6, 12):
        mdd = minimum_detectable_difference(0.24, n)
        assert paired_t_power(mdd, 0.24, n) == pytest.approx(0.8, abs=1e-9)
        approx = (sps.t.ppf(0.975, n - 1) + sps.t.ppf(0.8, n - 1)) * 0.24 / np.sqrt(n)
        assert 0.9 * approx < mdd < 1.1 * approx
    # large n: the normal-theory (z + z) sd / sqrt(n)
    z = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) / np.sqrt(2000)
    assert minimum_detectable_difference(1.0, 2000) == pytest.approx(z, rel=2e-3)
    # one-sided "worse than exact": smaller than the two-sided one; scales with sd; sd 0 detects anything
    assert minimum_detectable_difference(1.0, 6, alternative="less") < minimum_detectable_difference(1.0, 6)
    assert minimum_detectable_difference(2.0, 6) == pytest.approx(2 * minimum_detectable_difference(1.0, 6))
    assert minimum_detectable_difference(0.0, 6) == 0.0
    with pytest.raises(ValueError, match="n >= 2"):
        minimum_detectable_difference(1.0, 1)


def test_dose_location_interpolates_from_the_reference_down():
    from jagg.stats import dose_location

    curve = [(1.0, 0.0), (0.95, -0.1), (0.8, -0.3), (0.5, -0.6)]
    assert dose_location(curve, -0.1) == pytest.approx(0.95)
    assert dose_location(curve, -0.2) == pytest.approx(0.875)
    assert dose_location(curve, -0.45) == pytest.approx(0.65)
    assert dose_location(curve, 0.2) == 1.0  # better than the reference: clamped to it
    assert dose_location(curve, -0.9) == 0.5  # worse than the strongest control: clamped to it
    # not monotone: the first crossing from the reference wins
    assert dose_location([(1.0, 0.0), (0.8, -0.4), (0.5, -0.2)], -0.3) == pytest.approx(0.85)


def test_dose_location_labels_a_value_beyond_the_scale_by_the_side_it_lies_on():
    """Beyond every point of the curve, the end is chosen by the side of the reference the value lies on, not by
    which end is nearer in value. A reward-like curve falls with lower cosine, a divergence-like one rises; a
    value past the reference on its better side is beyond the reference (cosine 1), one past the weakest
    control is beyond it (the lowest cosine)."""
    from jagg.stats import dose_location

    falling = [(1.0, 0.0), (0.95, -0.1), (0.5, -0.6)]
    rising = [(1.0, 0.0), (0.95, 0.4), (0.5, 0.8)]
    for worse in (None, -1):
        assert dose_location(falling, 0.5, worse) == 1.0  # above the reference, curve falls: beyond it
        assert dose_location(falling, -0.7, worse) == 0.5
    for worse in (None, 1):
        assert dose_location(rising, -0.5, worse) == 1.0  # below the reference, curve rises: beyond it
        assert dose_location(rising, 0.9, worse) == 0.5
    # v4's held-out pref AUC on seeds 40-45: the controls' effects are noise just above exact's, so the curve
    # rises and the value nearer in value is the weakest control's; an arm that beats exact by 0.045 was
    # printed <=0.50, one 0.024 below exact >=1.00. The metric's direction (lower is worse) places them.
    noise = [(1.0, 0.0), (0.95, 0.0049), (0.8, 0.0038), (0.5, 0.0022)]
    assert dose_location(noise, 0.045, worse=-1) == 1.0
    assert dose_location(noise, -0.024, worse=-1) == 0.5
    assert dose_location(noise, 0.045) == 0.5  # the curve's own direction, all it has without the metric's
    assert dose_location(noise, 0.003, worse=-1) == pytest.approx(
        1 - 0.003 / 0.0049 * 0.05
    )  # inside: as before
    with pytest.raises(ValueError, match="worse"):
        dose_location(noise, 0.045, worse=0)


def test_located_prints_the_bound_beyond_the_reference_by_name():
    from jagg.stats import Located, located_cosine

    controls = {c: [-(1 - c)] * 5 for c in (0.95, 0.8, 0.5)}
    above = located_cosine(controls, [0.3] * 5, 0.0)
    assert above.cosine == 1.0 and str(above) == ">=1.00 (beyond exact) [>=1.00, >=1.00]"
    assert str(located_cosine(controls, [0.3] * 5, 0.0, name="exact_blocks")).startswith(
        ">=1.00 (beyond exact_b"
    )
    noisy = {0.95: [0.0049] * 5, 0.8: [0.0038] * 5, 0.5: [0.0022] * 5}
    assert str(located_cosine(noisy, [0.045] * 5, 0.0, worse=-1)).startswith(">=1.00 (beyond exact)")
    assert str(located_cosine(noisy, [-0.024] * 5, 0.0, worse=-1)).startswith("<=0.50 [")
    assert str(Located(0.9, 0.5, 1.0, (1.0, 0.95, 0.5))) == "0.90 [<=0.50, >=1.00]"


def test_located_cosine_recovers_a_planted_dose_and_its_interval_covers_it():
    """Controls whose effect is linear in (1 - cosine) plus seed noise, and an arm built as a cosine-0.9
    control: over 40 simulated experiments the points centre on 0.9 and the 95% intervals hold it in most
    (bootstrap intervals with 12 seeds undercover a little); with no noise the interval collapses onto it."""
    from jagg.stats import located_cosine

    rng = np.random.default_rng(1)
    cosines = (0.95, 0.8, 0.5)
    noise = lambda: rng.normal(0, 0.02, 12)  # noqa: E731
    points, covered = [], 0
    for _ in range(40):
        controls = {c: -(1 - c) + noise() for c in cosines}
        loc = located_cosine(controls, -(1 - 0.9) + noise(), reference=0.0, n_boot=400)
        points.append(loc.cosine)
        covered += loc.lo <= 0.9 <= loc.hi
    assert abs(np.mean(points) - 0.9) < 0.01 and covered >= 32
    exact = located_cosine({c: [-(1 - c)] * 5 for c in cosines}, [-0.1] * 5, reference=0.0)
    assert exact.cosine == exact.lo == exact.hi == pytest.approx(0.9)
    assert str(located_cosine({c: [-(1 - c)] * 5 for c in cosines}, [-0.8] * 5, 0.0)).startswith("<=0.50")
