"""ε lower bounds from canary scores: `CanaryScoreAuditor`.

An audit inserts m *canaries* into the training set, each independently
with probability 1/2 (the "in" canaries; the others are "out"), trains
once, and scores every canary (higher = "looks included", e.g. minus its
loss). If the scores separate in from out better than (ε, δ)-DP allows,
the mechanism is not (ε, δ)-DP — with a stated probability of being wrong,
the significance α. The numbers this class returns are **lower bounds**: a
bound above the claimed ε refutes the claim (a bug), a bound below it
proves nothing (see `docs/auditing.md`).

No TensorFlow is imported here; SciPy computes the binomial and beta tails
(`scipy.stats`) and the root (`scipy.optimize.brentq`).

## The one-run bound (Steinke, Nasr and Jagielski, NeurIPS 2023)

"Privacy auditing with one (1) training run", arXiv 2305.08846. Let
`S ∈ {-1, +1}^m` be the inclusion signs (uniform, independent), and let an
auditor, seeing only the trained model, output guesses `T ∈ {-1, 0, +1}^m`
(+1 "in", -1 "out", 0 abstain) with at most r non-zero entries. Let
`W = #{i : T_i = S_i ≠ 0}` be the number of correct guesses. Their
Theorem 5.2 (with its δ term, as computed in their Algorithm of
Appendix D): if the mechanism is (ε, δ)-DP in each canary, then for every v

    P[W ≥ v] ≤ β + 2 m δ α,      q = e^ε / (1 + e^ε)
    β = P[Binomial(r, q) ≥ v]
    α = max_{i = 1..v} (1/i) · P[v - i ≤ Binomial(r, q) ≤ v - 1].

(For δ = 0 this is the tail of ε-randomised response: each guess is right
with probability at most q, however the guesses depend on each other.) So
`p(ε) = min(1, β + 2mδα)` is a p-value for the hypothesis "(ε, δ)-DP" given
v correct out of r guesses, and the claim is rejected at level `a` when
`p(ε) ≤ a`. `p` grows with ε (q does), and (ε, δ)-DP implies (ε', δ)-DP
for every ε' > ε, so the bound is

    ε_lb(m, r, v, a, δ) = sup{ε ≥ 0 : p(ε) ≤ a}    (0 if p(0) > a),

found by bracketing (doubling the upper end) and Brent's method, to 1e-9.
It is finite: as ε → ∞, q → 1 and β → 1 > a. With δ = 0 and v = r it is
`logit(a^(1/r))`: perfectly separated scores give at most about
`ln(r / ln(1/a))`, which grows with the number of guesses (so with m).

**Which guesses.** `epsilon_one_run` does not fix r in advance; it tries a
family of guess rules and keeps the best, paying for the choice with a
Bonferroni correction (each rule is tested at `a = significance / K` for a
family of K rules, so the probability that *any* rule falsely rejects is at
most `significance`):

* one-sided (k₋ = 0 in the paper): rule k = 1..m guesses "in" for the
  canaries scoring at least t_k, where t_k is the lowest score whose
  set `{s ≥ t_k}` has at most k members (ties are never split: a split
  would have to look at which canaries are in), and abstains on the rest;
  its bound uses r = k. K = m. Only rules at a tie boundary (r = the set's
  size) can be best, since a smaller r with the same v gives a smaller p;
  those are the ones evaluated.
* two-sided: rule k = 1..⌊m/2⌋ guesses "in" for the top tie-complete set of
  at most k canaries and "out" for the bottom one of at most k, r = 2k,
  K = ⌊m/2⌋.

The family depends only on m, never on the scores, so the correction is
valid whatever the data. (jax-privacy's `CanaryScoreAuditor` divides by the
number of thresholds on the ROC frontier instead, which depends on the
labels; K = m is larger, so our bound is at most that much smaller:
additively about `ln(m / frontier) / r` in q's log-odds.)

**Other threshold strategies** (`tf_pxg.audit.thresholds`: `Explicit`,
`TopFraction`, `Split`, `MultiSplit`, each with its validity argument)
choose one rule instead of paying for a family (one-sided, or for
`TopFraction(f, two_sided=True)` the top and bottom sets).

**The Gaussian f-DP bound** (`epsilon_one_run_fdp`, Mahloujifar, Melis and
Chaudhuri 2024) tests the trade-off curve of a Gaussian mechanism that is
(ε, δ)-DP instead of ε-randomised response: much tighter for DP-SGD. Its
test and validity argument are in `tf_pxg.audit.fdp`.

## Clopper–Pearson (the classical audit)

Jagielski, Ullman and Oprea (NeurIPS 2020), Nasr et al. (S&P 2021): a
threshold rule "in if s ≥ t" has true- and false-positive rates that
(ε, δ)-DP bounds by `TPR ≤ e^ε FPR + δ` (and, for the complementary rule,
`TNR ≤ e^ε FNR + δ`). With one-sided Clopper–Pearson bounds at level a/2
each, `TPR ≥ TPR_lb` and `FPR ≤ FPR_ub`, so
`ε ≥ ln((TPR_lb - δ) / FPR_ub)` with probability ≥ 1 - a. Thresholds are
the distinct scores, with the same Bonferroni family (K = m, 2m two-sided).
**Caveat:** the binomial model needs independent trials, i.e. one canary
per training run. Applied to many canaries of one run it is a heuristic,
not a proven bound; `epsilon_one_run` is the one that holds for one run.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import optimize
from scipy import special
from scipy import stats

from tf_pxg.audit import fdp
from tf_pxg.audit import thresholds
from tf_pxg.audit.thresholds import ThresholdStrategy

__all__ = ["CanaryScoreAuditor", "one_run_p_value", "one_run_epsilon"]


def one_run_p_value(m: int, r: int, v: int, epsilon: float,
                    delta: float = 0.0) -> float:
  """`min(1, β + 2mδα)` of Steinke et al. (module docstring): the p-value of
  "(ε, δ)-DP" after `v` correct out of `r` guesses on `m` canaries."""
  _check_counts(m, r, v)
  if v == 0:
    return 1.0
  q = float(special.expit(epsilon))
  beta = float(stats.binom.sf(v - 1, r, q))  # P[Bin >= v]
  if delta == 0:
    return min(1.0, beta)
  # P[v - i <= Bin <= v - 1] for i = 1..v, as a cumulative sum of the pmf.
  band = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
  alpha = float(np.max(band / np.arange(1, v + 1)))
  return min(1.0, beta + 2.0 * m * delta * alpha)


def one_run_epsilon(m: int, r: int, v: int, significance: float,
                    delta: float = 0.0, floor: float = 0.0) -> float:
  """`sup{ε ≥ floor : one_run_p_value(m, r, v, ε, δ) ≤ significance}`, or
  `floor` if the p-value at `floor` already exceeds `significance`.

  `floor` lets a search over guess rules skip rules that cannot beat the
  best bound so far (the p-value grows with ε).
  """
  _check_counts(m, r, v)
  if v == 0 or one_run_p_value(m, r, v, floor, delta) > significance:
    return floor

  def gap(eps):
    return one_run_p_value(m, r, v, eps, delta) - significance

  lo, hi = floor, max(1.0, 2.0 * floor)
  while gap(hi) <= 0:
    lo, hi = hi, 2.0 * hi
    if hi > 1e4:  # unreachable for r >= 1 and significance < 1
      return lo
  return float(optimize.brentq(gap, lo, hi, xtol=1e-9, rtol=1e-12))


def _check_counts(m, r, v):
  if not (0 <= v <= r <= m):
    raise ValueError(f"need 0 <= v <= r <= m (correct <= guesses <= "
                     f"canaries); got m={m}, r={r}, v={v}.")


def _check_significance(significance):
  if not 0 < significance < 1:
    raise ValueError(f"significance must be in (0, 1) (the allowed "
                     f"probability that the bound is wrong, e.g. 0.05); got "
                     f"{significance!r}.")


def _check_delta(delta):
  if not 0 <= delta < 1:
    raise ValueError(f"delta must be in [0, 1); got {delta!r}.")


def _cp_upper(k, n, a):
  """One-sided Clopper-Pearson upper bound on p from k of n, level a."""
  k = np.asarray(k, dtype=float)
  with np.errstate(invalid="ignore"):
    ub = stats.beta.ppf(1.0 - a, k + 1, n - k)
  return np.where(k >= n, 1.0, ub)


def _cp_lower(k, n, a):
  """One-sided Clopper-Pearson lower bound on p from k of n, level a."""
  k = np.asarray(k, dtype=float)
  with np.errstate(invalid="ignore"):
    lb = stats.beta.ppf(a, k, n - k + 1)
  return np.where(k <= 0, 0.0, lb)


class CanaryScoreAuditor:
  """ε lower bounds and attack metrics from in/out canary scores.

  Args:
    in_canary_scores: scores of the canaries that were in the training set.
    out_canary_scores: scores of those that were not. A higher score must
      mean "looks included" (negate losses). Both non-empty, finite.

  The derivations are in the module docstring (`tf_pxg.audit.auditor`).

  Raises:
    ValueError: an empty or non-finite score array.
  """

  def __init__(self, in_canary_scores: Sequence[float],
               out_canary_scores: Sequence[float]):
    s_in = np.asarray(in_canary_scores, dtype=np.float64).reshape(-1)
    s_out = np.asarray(out_canary_scores, dtype=np.float64).reshape(-1)
    for name, s in (("in_canary_scores", s_in),
                    ("out_canary_scores", s_out)):
      if s.size == 0:
        raise ValueError(f"{name} is empty: an audit needs canaries on both "
                         "sides (each canary is included with probability "
                         "1/2; use more canaries).")
      if not np.all(np.isfinite(s)):
        raise ValueError(f"{name} has non-finite values; score by a finite "
                         "quantity (e.g. clip the loss).")
    self.in_scores = s_in
    self.out_scores = s_out
    self._index(np.concatenate([s_in, s_out]),
                np.concatenate([np.ones(s_in.size, bool),
                                np.zeros(s_out.size, bool)]))

  def _index(self, scores, member):
    """Sorts the scores and finds the top sets (no checks: a split's part
    may have no canary on one side)."""
    self.m = scores.size
    self._scores, self._labels = scores, member   # unsorted, for splits
    order = np.argsort(-scores, kind="stable")
    self._sorted = scores[order]          # descending
    self._member = member[order]
    # Tie boundaries: position j (1..m) ends a group of equal scores.
    ends = np.flatnonzero(np.r_[self._sorted[1:] != self._sorted[:-1], True])
    self._cuts = ends + 1                 # sizes of the top sets {s >= t}
    cum_in = np.r_[0, np.cumsum(self._member)]
    self._top_in = cum_in[self._cuts]     # in-canaries in each top set
    self._n_in = int(member.sum())
    self._n_out = self.m - self._n_in

  @classmethod
  def _part(cls, scores, member) -> "CanaryScoreAuditor":
    """The auditor of a subset of the canaries (a split's part)."""
    part = cls.__new__(cls)
    part.in_scores, part.out_scores = scores[member], scores[~member]
    part._index(scores, member)
    return part

  def __repr__(self):
    return (f"CanaryScoreAuditor(in={self._n_in}, out={self._n_out}, "
            f"auroc={self.auroc():.3f})")

  # One run -------------------------------------------------------------------

  def _one_sided_rules(self) -> Tuple[np.ndarray, np.ndarray]:
    """(r, v) of the tie-complete top sets."""
    return self._cuts, self._top_in

  def _two_sided_rules(self):
    """(k, r, v) of the balanced two-sided rules at tie boundaries."""
    m = self.m
    cuts = np.r_[0, self._cuts]            # top-set sizes, increasing
    top_in = np.r_[0, self._top_in]
    # Bottom sets {s < t} are complements of top sets: size m - c.
    out_total = self._n_out
    out_top = cuts - top_in                # out-canaries in each top set
    rules = []
    for k in range(1, m // 2 + 1):
      i = np.searchsorted(cuts, k, side="right") - 1     # top size <= k
      j = np.searchsorted(cuts, m - k, side="left")      # bottom size <= k
      top, bottom = cuts[i], m - cuts[j]
      if top + bottom == 0:
        continue
      v = top_in[i] + (out_total - out_top[j])
      rules.append((k, 2 * k, int(v), top + bottom))
    return rules

  def epsilon_one_run(self, significance: float = 0.05, delta: float = 0.0,
                      one_sided: bool = True, *,
                      threshold_strategy: Optional[ThresholdStrategy] = None
                      ) -> float:
    """The one-run ε-DP lower bound (Steinke, Nasr and Jagielski 2023).

    With the default `Bonferroni()` strategy, maximises
    `one_run_epsilon(m, r, v, significance / K, delta)` over the guess rules
    of the module docstring (one-sided: "in" for the top scores, K = m;
    two-sided: "in" for the top and "out" for the bottom k, K = ⌊m/2⌋).
    `Explicit`, `TopFraction`, `Split` and `MultiSplit`
    (`tf_pxg.audit.thresholds`, each with its validity argument) test
    one-sided rules (`TopFraction(f, two_sided=True)`: the top and bottom
    sets). With probability at
    least `1 - significance` over the canaries' inclusion (and the training
    randomness), a mechanism that is (ε, δ)-DP in each canary gives a bound
    ≤ ε.

    Args:
      significance: the allowed probability that the bound is wrong.
      delta: the δ of the claim being tested (the run's δ).
      one_sided: only "in" guesses (k₋ = 0), or balanced in/out guesses
        (Bonferroni only).
      threshold_strategy: how the rule is chosen (default `Bonferroni()`).

    Returns:
      The lower bound (≥ 0; 0 means nothing was refuted).

    References:
      Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training
      Run", NeurIPS 2023 (arXiv 2305.08846).
    """
    _check_significance(significance)
    _check_delta(delta)
    strategy = thresholds.check(threshold_strategy)
    if not one_sided:
      if not isinstance(strategy, thresholds.Bonferroni):
        raise ValueError("one_sided=False is only defined for the "
                         "Bonferroni() threshold strategy.")
      return self._two_sided_one_run(significance, delta)
    return self._with_strategy(strategy, one_run_epsilon, significance,
                               delta, precision_prune=True)

  def epsilon_one_run_fdp(
      self, significance: float = 0.05, delta: float = 1e-5, *,
      threshold_strategy: Optional[ThresholdStrategy] = None) -> float:
    """The one-run Gaussian f-DP lower bound (Mahloujifar et al. 2024).

    The largest ε whose claim "`G_μ(ε, δ)`-DP in each canary" (as private
    as a Gaussian mechanism that is (ε, δ)-DP) the canaries reject
    (`tf_pxg.audit.fdp`, with the test's validity argument), over the same
    label-independent one-sided family as `epsilon_one_run` (K = m rules at
    `significance / m`) or another `threshold_strategy`. With probability
    at least `1 - significance`, a mechanism that is `G_μ(ε, δ)`-DP in each
    canary gives a bound ≤ ε; `tf_pxg.audit.fdp.gdp_covers` checks that a
    DP-SGD run's accounting implies it.

    Args:
      significance: the allowed probability that the bound is wrong.
      delta: δ in (0, 1) of the claim (μ-GDP is never (ε, 0)-DP).
      threshold_strategy: how the rule is chosen (default `Bonferroni()`).

    Returns:
      The lower bound (≥ 0; 0 means nothing was refuted).

    References:
      Mahloujifar, Melis, Chaudhuri, "Auditing f-Differential Privacy in
      One Run", ICML 2025 (arXiv 2410.22235); jax-privacy 2.0's
      `CanaryScoreAuditor.epsilon_one_run_fdp` (the same test).
    """
    _check_significance(significance)
    if not 0 < delta < 1:
      raise ValueError(f"delta must be in (0, 1) for the f-DP bound (a "
                       f"Gaussian mechanism is never (ε, 0)-DP); got "
                       f"{delta!r}.")
    return self._with_strategy(thresholds.check(threshold_strategy),
                               fdp.one_run_epsilon_fdp, significance, delta,
                               precision_prune=False)

  def _with_strategy(self, strategy, bound, significance, delta,
                     precision_prune):
    """`bound(m, r, v, level, delta, floor)` under a threshold strategy."""
    if isinstance(strategy, thresholds.Bonferroni):
      return self._best_rule(bound, significance / self.m, delta,
                             precision_prune)[0]
    if isinstance(strategy, thresholds.Explicit):
      return self._at_threshold(bound, significance, delta,
                                strategy.threshold)
    if isinstance(strategy, thresholds.TopFraction):
      return self._top_fraction(bound, significance, delta,
                                strategy.fraction, strategy.two_sided)
    frac = strategy.threshold_estimation_frac
    rng = np.random.default_rng(strategy.seed)
    if isinstance(strategy, thresholds.Split):
      return self._split_once(bound, significance, delta, frac, rng,
                              precision_prune)
    return float(np.median([
        self._split_once(bound, significance / 2, delta, frac, rng,
                         precision_prune)
        for _ in range(strategy.num_samples)]))

  def _split_once(self, bound, level, delta, frac, rng, precision_prune):
    """`Split`: the best rule's threshold on a random part, tested at
    `level` on the rest (`tf_pxg.audit.thresholds.Split`)."""
    select, test = thresholds.partition(self.m, frac, rng)
    chooser = self._part(self._scores[select], self._labels[select])
    eps, threshold = chooser._best_rule(bound, level, delta, precision_prune)
    if eps <= 0:  # no rule separates the selection part: nothing to test
      return 0.0
    tester = self._part(self._scores[test], self._labels[test])
    return tester._at_threshold(bound, level, delta, threshold)

  def _best_rule(self, bound, level, delta, precision_prune):
    """(bound, threshold) of the best one-sided rule, each at `level`."""
    m = self.m
    rules = [(int(r), int(v), float(self._sorted[r - 1]))
             for r, v in zip(*self._one_sided_rules()) if v > 0]
    # Most precise rules first, then the most guesses, so that a good bound
    # is found early; a rule whose bound cannot beat the best so far is
    # skipped after one test at the best ε (`floor`). For the ε-DP bound a
    # rule whose raw precision v/r is at most the best q cannot win (its
    # root lies below logit(v/r)) and is not even tested.
    rules.sort(key=lambda t: (-(t[1] / t[0]), -t[0]))
    best, best_threshold = 0.0, math.inf
    for r, v, threshold in rules:
      if precision_prune and v / r <= special.expit(best):
        continue
      eps = bound(m, r, v, level, delta, floor=best)
      if eps > best:
        best, best_threshold = eps, threshold
    return best, best_threshold

  def _top_fraction(self, bound, level, delta, fraction, two_sided):
    """The bound of the rule "in for the largest tie-complete top set of
    at most k = max(1, floor(fraction m)) canaries" (two-sided: and "out"
    for the largest tie-complete bottom set of at most k) at `level`."""
    k = max(1, int(math.floor(fraction * self.m)))
    cuts, top_in = np.r_[0, self._cuts], np.r_[0, self._top_in]
    j = np.searchsorted(cuts, k, side="right") - 1     # top size <= k
    r, v = int(cuts[j]), int(top_in[j])
    if two_sided:
      # A bottom set {s < t} is the complement of a top set of size c:
      # the smallest c >= m - k (c >= k >= r as fraction <= 1/2: disjoint).
      i = np.searchsorted(cuts, self.m - k, side="left")
      r += self.m - int(cuts[i])
      v += self._n_out - (int(cuts[i]) - int(top_in[i]))
    return bound(self.m, r, v, level, delta) if v else 0.0

  def _at_threshold(self, bound, level, delta, threshold):
    """The bound of the single rule "in if s ≥ threshold" at `level`."""
    guess = self._scores >= threshold
    r, v = int(guess.sum()), int((guess & self._labels).sum())
    return bound(self.m, r, v, level, delta) if v else 0.0

  def _two_sided_one_run(self, significance, delta):
    """The two-sided Bonferroni family, K = ⌊m/2⌋."""
    m = self.m
    if m < 2:
      return 0.0
    a = significance / (m // 2)
    rules = [(k, r, v) for k, r, v, _ in self._two_sided_rules()]
    rules.sort(key=lambda t: (-(t[2] / t[1]), -t[1]))
    best = 0.0
    for _, r, v in rules:
      if v / r <= special.expit(best):
        continue
      best = max(best, one_run_epsilon(m, r, v, a, delta, floor=best))
    return best

  # Clopper-Pearson -----------------------------------------------------------

  def epsilon_clopper_pearson(self, significance: float = 0.05,
                              delta: float = 0.0,
                              one_sided: bool = True) -> float:
    """`max_t ln((TPR_lb(t) - δ) / FPR_ub(t))` (module docstring).

    Bounds at level `significance / (2K)` each, K = m thresholds (2m with
    `one_sided=False`, which adds the complementary rules' TNR/FNR).
    Valid for independent runs (one canary each); a heuristic for many
    canaries of one run.
    """
    _check_significance(significance)
    _check_delta(delta)
    k = self.m if one_sided else 2 * self.m
    a = significance / (2 * k)
    tp = self._top_in
    fp = self._cuts - self._top_in
    best = 0.0
    pairs = [(_cp_lower(tp, self._n_in, a), _cp_upper(fp, self._n_out, a))]
    if not one_sided:
      tn = self._n_out - fp     # out-canaries below t ("out" guesses right)
      fn = self._n_in - tp
      # The complementary rule guesses "out" below t; sets {s < t} include
      # the empty set (t = the lowest score) via the top set of all m.
      pairs.append((_cp_lower(tn, self._n_out, a),
                    _cp_upper(fn, self._n_in, a)))
    for rate_lb, rate_ub in pairs:
      ok = (rate_lb > delta) & (rate_ub > 0)
      if np.any(ok):
        best = max(best, float(np.max(np.log(rate_lb[ok] - delta) -
                                      np.log(rate_ub[ok]))))
    return best

  # Attack metrics -------------------------------------------------------------

  def roc(self) -> Tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) of the rules "in if s ≥ t" over the distinct scores t,
    from (0, 0) to (1, 1)."""
    tpr = np.r_[0, self._top_in] / self._n_in
    fpr = np.r_[0, self._cuts - self._top_in] / self._n_out
    return fpr, tpr

  def tpr_at_fpr(self, fpr: float) -> float:
    """The highest TPR of any rule with false-positive rate `fpr`.

    Rules are the thresholds "in if s ≥ t" and their randomisations (use
    threshold t₁ with probability w, t₂ otherwise), whose (FPR, TPR) are
    the convex combinations of the ROC points: the answer is the upper
    concave hull of the ROC at `fpr`. `tpr_at_fpr(0)` is the TPR of the
    best rule with no false positive.
    """
    if not 0 <= fpr <= 1:
      raise ValueError(f"fpr must be in [0, 1]; got {fpr!r}.")
    f, t = self.roc()
    # The highest TPR at each FPR (the ROC has vertical steps), then the
    # upper hull by a monotone chain.
    last = np.r_[f[1:] != f[:-1], True]
    hull = []
    for x, y in zip(f[last], t[last]):
      while len(hull) >= 2:
        (x1, y1), (x2, y2) = hull[-2], hull[-1]
        if (y2 - y1) * (x - x1) <= (y - y1) * (x2 - x1):
          hull.pop()            # (x2, y2) lies on or below the chord
        else:
          break
      hull.append((x, y))
    hx, hy = zip(*hull)
    return float(np.interp(fpr, hx, hy))

  def auroc(self) -> float:
    """Area under the ROC curve: `P[s_in > s_out] + P[s_in = s_out] / 2`
    over independent in/out pairs (the Mann-Whitney U over n_in n_out)."""
    f, t = self.roc()
    return float(np.sum((f[1:] - f[:-1]) * (t[1:] + t[:-1]) / 2))

  def summary(self, significance: float = 0.05, delta: float = 0.0) -> dict:
    """All numbers at once (for logs)."""
    fdp_bound = ({"epsilon_one_run_fdp": self.epsilon_one_run_fdp(
        significance, delta)} if delta > 0 else {})
    return {
        "m": self.m, "in": self._n_in, "out": self._n_out,
        "epsilon_one_run": self.epsilon_one_run(significance, delta),
        **fdp_bound,
        "epsilon_one_run_two_sided": self.epsilon_one_run(
            significance, delta, one_sided=False),
        "epsilon_clopper_pearson": self.epsilon_clopper_pearson(
            significance, delta),
        "auroc": self.auroc(),
        "tpr_at_fpr_0.01": self.tpr_at_fpr(0.01),
    }

