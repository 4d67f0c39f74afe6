"""Tests for tf_pxg.audit.CanaryScoreAuditor against the definitions.

The reference values are computed here independently of the module: the
one-run p-value term by term with `scipy.stats.binom.pmf`, the root by
bisection, the guess rules by explicit comparisons over every k, the
Clopper-Pearson bounds with `scipy.stats.binomtest`, the AUROC with
`scipy.stats.mannwhitneyu`.
"""

import math

import numpy as np
import pytest
from scipy import stats

from tf_pxg import audit
from tf_pxg.audit import CanaryScoreAuditor
from tf_pxg.audit import one_run_epsilon
from tf_pxg.audit import one_run_p_value


# Reference implementations ----------------------------------------------------


def _ref_p_value(m, r, v, eps, delta):
  """Steinke et al. (2023), Thm 5.2 / App. D, term by term."""
  q = math.exp(eps) / (1 + math.exp(eps))
  pmf = stats.binom.pmf(np.arange(r + 1), r, q)   # P[Bin(r, q) = w]
  beta = float(np.sum(pmf[v:]))
  alpha = 0.0
  for i in range(1, v + 1):
    alpha = max(alpha, float(np.sum(pmf[v - i:v])) / i)
  return min(1.0, beta + 2 * m * delta * alpha)


def _ref_epsilon(m, r, v, a, delta):
  """sup{eps : p(eps) <= a} by bisection on [0, 64]."""
  if v == 0 or _ref_p_value(m, r, v, 0.0, delta) > a:
    return 0.0
  lo, hi = 0.0, 64.0
  for _ in range(48):
    mid = (lo + hi) / 2
    if _ref_p_value(m, r, v, mid, delta) <= a:
      lo = mid
    else:
      hi = mid
  return lo


def _ref_one_run(s_in, s_out, significance, delta, one_sided):
  """Every rule k of the family, by explicit comparisons."""
  scores = np.concatenate([s_in, s_out])
  member = np.r_[np.ones(len(s_in), bool), np.zeros(len(s_out), bool)]
  m = len(scores)
  thresholds = np.unique(scores)

  def top(k):  # the largest tie-complete set {s >= t} of size <= k
    sets = [scores >= t for t in thresholds if np.sum(scores >= t) <= k]
    return max(sets, key=np.sum) if sets else np.zeros(m, bool)

  def bottom(k):  # the largest tie-complete set {s <= t} of size <= k
    sets = [scores <= t for t in thresholds if np.sum(scores <= t) <= k]
    return max(sets, key=np.sum) if sets else np.zeros(m, bool)

  best = 0.0
  if one_sided:
    a = significance / m
    for k in range(1, m + 1):
      guess = top(k)
      v = int(np.sum(guess & member))
      best = max(best, _ref_epsilon(m, k, v, a, delta))
  else:
    a = significance / (m // 2)
    for k in range(1, m // 2 + 1):
      v = int(np.sum(top(k) & member) + np.sum(bottom(k) & ~member))
      best = max(best, _ref_epsilon(m, 2 * k, v, a, delta))
  return best


# The p-value and the root ------------------------------------------------------


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (10, 10, 10, 0.0, 0.0),
    (10, 8, 6, 1.0, 0.0),
    (100, 40, 35, 2.0, 1e-3),
    (100, 50, 50, 3.0, 1e-4),
    (1000, 500, 400, 1.5, 1e-5),
    (20, 5, 0, 1.0, 0.1),
])
def test_p_value_equals_the_definition(m, r, v, eps, delta):
  got = one_run_p_value(m, r, v, eps, delta)
  want = _ref_p_value(m, r, v, eps, delta)
  assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_p_value_hand_cases():
  # eps = 0: a fair coin per guess; 10 of 10 right has probability 2^-10.
  assert one_run_p_value(10, 10, 10, 0.0) == pytest.approx(2.0**-10)
  # 9 of 10 or better: 11 / 1024.
  assert one_run_p_value(10, 10, 9, 0.0) == pytest.approx(11 / 1024)
  # delta term with v = 1, r = 1: alpha = P[Bin(1, q) = 0] = 1 - q.
  q = 1 / (1 + math.exp(-1.0))
  assert one_run_p_value(50, 1, 1, 1.0, 1e-3) == pytest.approx(
      q + 2 * 50 * 1e-3 * (1 - q))


@pytest.mark.parametrize("m,r,v,a,delta", [
    (100, 50, 50, 0.05 / 100, 0.0),
    (100, 50, 45, 0.05 / 100, 0.0),
    (200, 80, 70, 0.01, 1e-4),
    (1000, 500, 499, 0.05 / 1000, 1e-6),
])
def test_one_run_epsilon_is_the_root(m, r, v, a, delta):
  got = one_run_epsilon(m, r, v, a, delta)
  assert got == pytest.approx(_ref_epsilon(m, r, v, a, delta), abs=1e-6)
  assert got > 0.5
  assert one_run_p_value(m, r, v, got, delta) <= a * (1 + 1e-6)
  assert one_run_p_value(m, r, v, got + 1e-4, delta) > a


def test_all_correct_closed_form():
  # delta = 0, v = r: q^r = a, eps = logit(a^(1/r)).
  for r, a in [(10, 0.05), (100, 1e-3), (500, 5e-5)]:
    q = a**(1 / r)
    assert one_run_epsilon(1000, r, r, a) == pytest.approx(
        math.log(q / (1 - q)), abs=1e-7)


# The maximisation over guess rules ---------------------------------------------


def _synthetic(seed, n_in, n_out, shift, ties=False):
  rng = np.random.default_rng(seed)
  s_in = rng.normal(shift, 1.0, n_in)
  s_out = rng.normal(0.0, 1.0, n_out)
  if ties:
    s_in, s_out = np.round(s_in), np.round(s_out)
  return s_in, s_out


CASES = [(0, 20, 20, 3.0, False), (1, 15, 25, 2.0, False),
         (2, 30, 30, 1.0, True), (3, 24, 16, 4.0, True)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("one_sided", [True, False])
@pytest.mark.parametrize("delta", [0.0, 1e-4])
def test_epsilon_one_run_equals_brute_force(case, one_sided, delta):
  s_in, s_out = _synthetic(*case)
  got = CanaryScoreAuditor(s_in, s_out).epsilon_one_run(0.05, delta,
                                                        one_sided=one_sided)
  want = _ref_one_run(s_in, s_out, 0.05, delta, one_sided)
  assert got == pytest.approx(want, abs=1e-6)


def test_some_case_gives_a_positive_bound():
  # The brute-force comparisons above must not all be 0 = 0.
  s_in, s_out = _synthetic(*CASES[0])
  assert CanaryScoreAuditor(s_in, s_out).epsilon_one_run() > 0.5


def test_bound_grows_with_m_for_separated_scores():
  # All in above all out: the best one-sided rule guesses the m/2 "in"
  # ones, all right, at a = 0.05 / m: eps = logit((0.05 / m)^(2 / m)),
  # which grows like ln(m / (2 ln(m / 0.05))).
  bounds = []
  for m in (20, 100, 400, 2000):
    auditor = CanaryScoreAuditor(np.arange(m // 2) + m, np.arange(m // 2))
    q = (0.05 / m)**(2 / m)
    got = auditor.epsilon_one_run()
    assert got == pytest.approx(math.log(q / (1 - q)), abs=1e-6)
    # Two-sided: r = m guesses, all right, at a = 0.05 / (m / 2).
    q2 = (0.05 / (m // 2))**(1 / m)
    assert auditor.epsilon_one_run(one_sided=False) == pytest.approx(
        math.log(q2 / (1 - q2)), abs=1e-6)
    bounds.append(got)
  assert all(b < c for b, c in zip(bounds, bounds[1:]))
  assert bounds[0] < 1.0 and bounds[-1] > 4.0


def test_random_scores_give_about_zero():
  # Same distribution in and out: the mechanism is 0-DP in the canaries,
  # so P[bound > 0] <= 0.05 for each seed.
  one, two, cp = [], [], []
  for seed in range(20):
    s_in, s_out = _synthetic(100 + seed, 250, 250, 0.0)
    auditor = CanaryScoreAuditor(s_in, s_out)
    one.append(auditor.epsilon_one_run())
    two.append(auditor.epsilon_one_run(one_sided=False))
    cp.append(auditor.epsilon_clopper_pearson())
  assert sum(b > 0 for b in one + two) <= 3
  assert max(one + two) < 0.5
  assert max(cp) < 1.0


def test_delta_lowers_the_bound():
  s_in, s_out = _synthetic(5, 200, 200, 3.0)
  auditor = CanaryScoreAuditor(s_in, s_out)
  b0, b1, b2 = (auditor.epsilon_one_run(delta=d) for d in (0, 1e-5, 1e-4))
  assert b0 > b1 > b2 >= 0 and b0 > 1


def test_ties_are_never_split_by_membership():
  # Every score equal: no rule can tell in from out, whatever the order
  # in which the arrays list them (a split by array order would guess the
  # first array's canaries and be all right).
  auditor = CanaryScoreAuditor(np.zeros(25), np.zeros(25))
  assert auditor.epsilon_one_run() == 0.0
  assert auditor.epsilon_one_run(one_sided=False) == 0.0
  assert auditor.epsilon_clopper_pearson(one_sided=False) == 0.0
  assert auditor.auroc() == 0.5
  # Tied groups stay whole: 2 in + 2 out tied on top leave precision 1/2.
  auditor = CanaryScoreAuditor([5.0, 5.0] + [1.0] * 8, [5.0, 5.0] + [0.0] * 8)
  assert auditor.tpr_at_fpr(0.0) == 0.0


# Clopper-Pearson, TPR at FPR, AUROC --------------------------------------------


def _cp(k, n, a, side):
  ci = stats.binomtest(int(k), int(n)).proportion_ci(
      confidence_level=1 - 2 * a, method="exact")
  return ci.low if side == "low" else ci.high


@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("one_sided", [True, False])
def test_clopper_pearson_equals_brute_force(case, one_sided):
  s_in, s_out = _synthetic(*case)
  delta = 1e-3
  m = len(s_in) + len(s_out)
  a = 0.05 / (2 * (m if one_sided else 2 * m))
  best = 0.0
  for t in np.unique(np.r_[s_in, s_out]):
    tp, fp = np.sum(s_in >= t), np.sum(s_out >= t)
    rules = [(tp, len(s_in), fp, len(s_out))]
    if not one_sided:
      rules.append((len(s_out) - fp, len(s_out), len(s_in) - tp, len(s_in)))
    for k_hit, n_hit, k_false, n_false in rules:
      lo = _cp(k_hit, n_hit, a, "low") if k_hit > 0 else 0.0
      hi = _cp(k_false, n_false, a, "high") if k_false < n_false else 1.0
      if lo > delta and hi > 0:
        best = max(best, math.log((lo - delta) / hi))
  got = CanaryScoreAuditor(s_in, s_out).epsilon_clopper_pearson(
      0.05, delta, one_sided=one_sided)
  assert got == pytest.approx(best, abs=1e-7)
  if case[3] >= 3.0:
    assert got > 0.5


@pytest.mark.parametrize("case", CASES)
def test_auroc_is_mann_whitney(case):
  s_in, s_out = _synthetic(*case)
  u = stats.mannwhitneyu(s_in, s_out).statistic
  assert CanaryScoreAuditor(s_in, s_out).auroc() == pytest.approx(
      u / (len(s_in) * len(s_out)), abs=1e-12)


def test_tpr_at_fpr():
  s_in = np.array([10., 9., 7., 5., 3.])
  s_out = np.array([8., 6., 4., 2.])
  auditor = CanaryScoreAuditor(s_in, s_out)
  # At fpr = 0 only the rule "s >= 9" (2 of 5 in) has no false positive.
  assert auditor.tpr_at_fpr(0.0) == pytest.approx(2 / 5)
  assert auditor.tpr_at_fpr(0.25) == pytest.approx(3 / 5)   # s >= 7
  # Randomising half-half between s >= 7 (fpr 1/4, tpr 3/5) and s >= 5
  # (2/4, 4/5) beats every threshold at fpr 3/8 (s >= 6: 3/5).
  assert auditor.tpr_at_fpr(0.375) == pytest.approx(0.7)
  assert auditor.tpr_at_fpr(1.0) == pytest.approx(1.0)
  # Brute force on random scores: the best mixture of two threshold rules.
  s_in, s_out = _synthetic(9, 30, 40, 1.0)
  auditor = CanaryScoreAuditor(s_in, s_out)
  ts = np.r_[np.unique(np.r_[s_in, s_out]), np.inf]
  pts = [(np.mean(s_out >= t), np.mean(s_in >= t)) for t in ts]
  for fpr in (0.0, 0.03, 0.1, 0.25, 0.5, 0.8):
    best = 0.0
    for f1, t1 in pts:
      for f2, t2 in pts:
        if f1 <= fpr <= f2:
          w = 1.0 if f2 == f1 else (f2 - fpr) / (f2 - f1)
          best = max(best, w * t1 + (1 - w) * t2)
    assert auditor.tpr_at_fpr(fpr) == pytest.approx(best, abs=1e-12)


# Errors -------------------------------------------------------------------------


def test_errors_say_what_to_do():
  with pytest.raises(ValueError, match="use more canaries"):
    CanaryScoreAuditor([], [1.0])
  with pytest.raises(ValueError, match="non-finite"):
    CanaryScoreAuditor([np.nan], [1.0])
  auditor = CanaryScoreAuditor([1.0, 2.0], [0.0])
  with pytest.raises(ValueError, match="significance"):
    auditor.epsilon_one_run(significance=0.0)
  with pytest.raises(ValueError, match="delta"):
    auditor.epsilon_clopper_pearson(delta=1.0)
  with pytest.raises(ValueError, match="fpr"):
    auditor.tpr_at_fpr(1.5)
  with pytest.raises(ValueError, match="v <= r <= m"):
    one_run_p_value(5, 6, 1, 1.0)


# The Gaussian f-DP one-run bound and the threshold strategies -------------------
#
# Reference numbers: jax-privacy 2.0.0 (the PyPI wheel; its
# jax_privacy/auditing.py has sha256 7dfd026f...accd04), computed once on
# 2026-12-02 by loading that file alone with dp-accounting 0.6.0, NumPy and
# SciPy (no JAX needed), outside this repository:
#   * per rule: `auditing._epsilon_one_run_fdp(0, m, r, v, a, delta)`;
#   * on scores: for our label-independent family, the maximum of that
#     function over the tie-complete top sets {s >= t} at a = 0.05 / m; for
#     one threshold t, `CanaryScoreAuditor(s_in, s_out).epsilon_one_run_fdp(
#     0.05, delta, threshold_strategy=Explicit(t))` and the same with
#     `epsilon_one_run` (the ε-DP bound).
# jax-privacy is not a dependency: only these numbers are kept.

_JAXP_RULES = [  # (m, r, v, a, delta) -> bound
    ((200, 50, 48, 0.05 / 200, 1e-5), 1.6009367650319093),
    ((1000, 300, 280, 5e-5, 1e-5), 2.039430934421148),
    ((100, 10, 10, 0.05, 1e-6), 1.8448412802791523),
    ((500, 250, 200, 0.01, 1e-3), 1.0709136479064636),
    ((50, 20, 15, 0.05, 1e-5), 0.27936897246080955),
]

# (seed, n_in, n_out, shift, delta): family f-DP, Explicit(median of s_in)
# f-DP, Explicit ε-DP.
_JAXP_SCORES = [
    ((0, 100, 100, 2.0, 1e-5), 2.608975, 5.120929, 2.779048),
    ((1, 250, 250, 3.0, 1e-5), 3.368374, 5.776906, 3.248333),
    ((2, 500, 500, 1.0, 1e-5), 0.989399, 1.34731, 0.803263),
    ((3, 60, 40, 4.0, 1e-6), 3.401871, 4.820057, 2.253369),
    ((4, 200, 200, 0.0, 1e-5), 0.0, 0.0, 0.0),
    ((5, 1000, 1000, 2.5, 1e-5), 4.061275, 6.671836, 3.979841),
]


def _rounded_scores(seed, n_in, n_out, shift):
  rng = np.random.default_rng(seed)
  return (np.round(rng.normal(shift, 1.0, n_in), 3),
          np.round(rng.normal(0.0, 1.0, n_out), 3))


@pytest.mark.parametrize("args,want", _JAXP_RULES)
def test_fdp_rule_equals_jax_privacy(args, want):
  assert audit.one_run_epsilon_fdp(*args) == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("case,family,explicit,explicit_eps", _JAXP_SCORES)
def test_fdp_on_scores_equals_jax_privacy(case, family, explicit,
                                          explicit_eps):
  seed, n_in, n_out, shift, delta = case
  s_in, s_out = _rounded_scores(seed, n_in, n_out, shift)
  auditor = CanaryScoreAuditor(s_in, s_out)
  t = audit.Explicit(float(np.median(s_in)))
  assert auditor.epsilon_one_run_fdp(0.05, delta) == pytest.approx(
      family, abs=2e-6)
  assert auditor.epsilon_one_run_fdp(
      0.05, delta, threshold_strategy=t) == pytest.approx(explicit, abs=2e-6)
  assert auditor.epsilon_one_run(
      0.05, delta, threshold_strategy=t) == pytest.approx(explicit_eps,
                                                          abs=2e-6)


def test_fdp_is_tighter_than_epsilon_dp_for_gaussian_scores():
  s_in, s_out = _rounded_scores(1, 250, 250, 3.0)
  auditor = CanaryScoreAuditor(s_in, s_out)
  assert auditor.epsilon_one_run_fdp(0.05, 1e-5) > auditor.epsilon_one_run(
      0.05, 1e-5) > 0


def test_fdp_bound_holds_for_the_gaussian_mechanism():
  """The claim is true (scores of a μ(ε, δ)-GDP mechanism, the worst case
  of the claim): the bound must stay below ε in at least 1 - significance
  of the runs. 40 seeded runs at significance 0.1: the bound exceeded ε in
  none of them (Binomial(40, 0.1) would exceed 12 with probability < 1e-3)."""
  eps, delta = 2.0, 1e-5
  mu = audit.gaussian_mu(eps, delta)
  over = 0
  for seed in range(40):
    rng = np.random.default_rng(seed)
    member = rng.random(200) < 0.5
    scores = rng.standard_normal(200) + mu * member
    auditor = CanaryScoreAuditor(scores[member], scores[~member])
    over += auditor.epsilon_one_run_fdp(
        0.1, delta, threshold_strategy=audit.Split(seed=seed)) > eps
  assert over <= 12


def test_gaussian_mu_and_profile():
  mu = audit.gaussian_mu(1.0, 1e-5)
  from tf_pxg.audit import fdp  # noqa: PLC0415
  assert fdp.gaussian_delta(mu, 1.0) == pytest.approx(1e-5, rel=1e-6)
  assert audit.gaussian_mu(2.0, 1e-5) > mu


def test_gdp_covers():
  import dp_accounting  # noqa: PLC0415
  event = dp_accounting.GaussianDpEvent(2.0)       # exactly 0.5-GDP
  # The Gaussian mechanism's own (ε, δ) claim: covered; a claim of a
  # smaller ε (a stronger claim than the mechanism meets): not covered.
  eps_true = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(
      1e-5)
  assert audit.gdp_covers(event, eps_true * 1.01, 1e-5)
  assert not audit.gdp_covers(event, eps_true * 0.8, 1e-5)


def test_split_strategies():
  s_in, s_out = _rounded_scores(1, 250, 250, 3.0)
  auditor = CanaryScoreAuditor(s_in, s_out)
  for bound in (auditor.epsilon_one_run, auditor.epsilon_one_run_fdp):
    split = bound(0.05, 1e-5, threshold_strategy=audit.Split(seed=3))
    again = bound(0.05, 1e-5, threshold_strategy=audit.Split(seed=3))
    multi = bound(0.05, 1e-5, threshold_strategy=audit.MultiSplit(
        num_samples=5, seed=3))
    assert split == again > 0 and multi > 0
  # Scores that carry no information: nothing refuted.
  s_in, s_out = _rounded_scores(4, 200, 200, 0.0)
  null = CanaryScoreAuditor(s_in, s_out)
  assert null.epsilon_one_run_fdp(
      0.05, 1e-5, threshold_strategy=audit.MultiSplit(num_samples=5,
                                                      seed=0)) == 0.0


def _ref_tie_complete(scores, k, top):
  """The largest set {s >= t} (top) or {s <= t} (bottom) with at most k
  members, over every distinct score t (empty if none)."""
  sets = [(scores >= t) if top else (scores <= t) for t in np.unique(scores)]
  return max((a for a in sets if a.sum() <= k), key=np.sum,
             default=np.zeros(scores.shape, bool))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.3, 0.5])
def test_top_fraction_two_sided_is_the_top_and_bottom_sets(seed, fraction):
  """TopFraction(f, two_sided=True) tests exactly the rule "in" for the top
  and "out" for the bottom tie-complete sets of at most floor(f m)
  scores, with both bounds, at the full significance."""
  rng = np.random.default_rng(seed)
  member = rng.random(300) < 0.5
  scores = rng.integers(0, 40, 300) + 8 * member    # ties, some signal
  auditor = CanaryScoreAuditor(scores[member], scores[~member])
  # The auditor's labels follow its own (in, out) order.
  scores = np.r_[scores[member], scores[~member]]
  member = np.r_[np.ones(member.sum(), bool), np.zeros((~member).sum(), bool)]
  k = max(1, int(math.floor(fraction * 300)))
  top = _ref_tie_complete(scores, k, top=True)
  bottom = _ref_tie_complete(scores, k, top=False)
  assert not np.any(top & bottom)
  for two_sided in (False, True):
    r, v = int(top.sum()), int(np.sum(top & member))
    if two_sided:
      r, v = r + int(bottom.sum()), v + int(np.sum(bottom & ~member))
    rule = audit.TopFraction(fraction, two_sided=two_sided)
    want = audit.one_run_epsilon_fdp(300, r, v, 0.05, 1e-5) if v else 0.0
    assert auditor.epsilon_one_run_fdp(
        0.05, 1e-5, threshold_strategy=rule) == pytest.approx(want, abs=1e-9)
    want = one_run_epsilon(300, r, v, 0.05, 1e-5) if v else 0.0
    assert auditor.epsilon_one_run(
        0.05, 1e-5, threshold_strategy=rule) == pytest.approx(want, abs=1e-9)


def test_two_sided_top_fraction_holds_for_the_gaussian_mechanism():
  """The claim is true (a μ(ε, δ)-GDP mechanism's scores, the worst case of
  the claim): the two-sided rule's f-DP bound must exceed ε in at most
  `significance` of the runs. 40 seeded runs of m = 400 at significance
  0.1 (Binomial(40, 0.1) exceeds 12 with probability < 1e-3). And the
  "out" guesses count: on the same scores the two-sided rule's mean bound
  is above the one-sided one's (measured: 0.93 against 0.59; one run of
  40 above ε = 2)."""
  eps, delta = 2.0, 1e-5
  mu = audit.gaussian_mu(eps, delta)
  one, two = [], []
  for seed in range(40):
    rng = np.random.default_rng(100 + seed)
    member = rng.random(400) < 0.5
    scores = rng.standard_normal(400) + mu * member
    auditor = CanaryScoreAuditor(scores[member], scores[~member])
    for bounds, two_sided in ((one, False), (two, True)):
      bounds.append(auditor.epsilon_one_run_fdp(
          0.1, delta, threshold_strategy=audit.TopFraction(
              0.1, two_sided=two_sided)))
  assert sum(b > eps for b in two) <= 12, two
  assert np.mean(two) > np.mean(one) > 0, (one, two)


def test_partition_is_label_independent():
  from tf_pxg.audit import thresholds  # noqa: PLC0415
  a, b = thresholds.partition(10, 0.5, np.random.default_rng(0))
  assert sorted(np.r_[a, b]) == list(range(10)) and len(a) == 5
  a, _ = thresholds.partition(3, 0.01, np.random.default_rng(0))
  assert len(a) == 1       # at least one canary on each side


def test_strategy_errors():
  auditor = CanaryScoreAuditor([1.0, 2.0], [0.0, 0.5])
  with pytest.raises(ValueError, match="threshold_strategy must be"):
    auditor.epsilon_one_run(threshold_strategy="split")
  with pytest.raises(ValueError, match="threshold_estimation_frac"):
    auditor.epsilon_one_run(threshold_strategy=audit.Split(1.5))
  with pytest.raises(ValueError, match="num_samples"):
    auditor.epsilon_one_run(threshold_strategy=audit.MultiSplit(0))
  with pytest.raises(ValueError, match="Bonferroni"):
    auditor.epsilon_one_run(one_sided=False,
                            threshold_strategy=audit.Split())
  with pytest.raises(ValueError, match="never"):
    auditor.epsilon_one_run_fdp(0.05, 0.0)
  with pytest.raises(ValueError, match="must not overlap"):
    auditor.epsilon_one_run_fdp(0.05, 1e-5, threshold_strategy=(
        audit.TopFraction(0.6, two_sided=True)))
