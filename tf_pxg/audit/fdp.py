"""The Gaussian f-DP one-run bound (Mahloujifar, Melis and Chaudhuri 2024).

"Auditing f-Differential Privacy in One Run", arXiv 2410.22235 (ICML
2025). Same game as Steinke, Nasr and Jagielski's (`tf_pxg.audit.auditor`):
m canaries, each included independently with probability 1/2, one run,
then r guesses "in" of which v are right. Steinke et al. test the claim
"(ε, δ)-DP in each canary", whose worst case is ε-randomised response. This
bound tests a *trade-off curve* instead: the claim "the mechanism is
f-DP in each canary" (Dong, Roth and Su 2022) for the Gaussian curve

    f = G_μ,   G_μ(x) = Φ(Φ⁻¹(1 - x) - μ),

with μ = `gaussian_mu(ε, δ)`, the μ whose Gaussian mechanism is exactly
(ε, δ)-DP (Balle and Wang's analytic calibration, `dp_accounting`). For a
Gaussian-like mechanism (DP-SGD, whose composition tends to a Gaussian
curve) this is much closer to the truth than randomised response, so the
same scores refute much larger ε.

**The test** (`fdp_refutes`, the paper's recursion with a cap, as
jax-privacy 2.0 implements it in `auditing._epsilon_one_run_fdp`).
Suppose the claim holds and yet `P[W ≥ v] > τ` (W: right guesses, τ: the
significance). Then the event {W ≥ v} carries, per canary, at least τ v / m
of right-guess mass and τ (r - v) / m of wrong-guess mass. Walking down
i = v - 1, ..., 0, the f-DP inequality of each canary (a test that is right
with probability x must be wrong with probability at least f̄⁻¹(x), here
`Φ(Φ⁻¹(x) - μ)`) forces the wrong-guess mass up to
`max(h, Φ(Φ⁻¹(hit) - μ))`, and the exchange between the right and wrong
guesses of a set of r guesses with i right moves `i / (r - i)` of the
increase into the right-guess mass (capped at 1). If the forced total mass
exceeds r / m — more guesses than were made — the supposition is false: the
claim is rejected at level τ. (Paper: §4-5, Theorem and Algorithm
"audit_rh_with_cap".) A guess may be "in" or "out": the test uses, per
canary, that its wrong-guess mass w and right-guess mass h obey
`w ≥ Φ(Φ⁻¹(h) - μ)`, which holds for "out" guesses too (the argument is in
`tf_pxg.audit.thresholds.TopFraction`).

**The bound** `one_run_epsilon_fdp(m, r, v, τ, δ)` is the largest ε whose
claim `G_{μ(ε, δ)}` is rejected: μ(ε, δ) grows with ε, G_μ falls with μ, so
a rejected claim at ε is rejected at every smaller ε (a stronger claim),
and the bound is a root, found by bracketing and Brent's method.

**What it refutes.** `G_μ(ε,δ)`-DP implies (ε, δ)-DP but not conversely: the
bound refutes "as private as a Gaussian mechanism that is (ε, δ)-DP". A
correct run is covered by the theorem (the bound exceeds its claim with
probability at most τ) when its mechanism is `G_μ(ε_claim, δ)`-DP, which
`gdp_covers` checks for a DP-SGD or BandMF run from its `dp_accounting`
event: by Dong, Roth and Su's Corollary 2.13 a mechanism is μ-GDP iff it is
(ε, δ_μ(ε))-DP for every ε ≥ 0, so it suffices that the accountant's
privacy profile lies below the Gaussian one.

No TensorFlow is imported here.

References:
  Mahloujifar, Melis, Chaudhuri, "Auditing f-Differential Privacy in One
  Run", arXiv 2410.22235. Dong, Roth, Su, "Gaussian Differential Privacy",
  JRSS-B 2022 (arXiv 1905.02383). Balle, Wang, "Improving the Gaussian
  Mechanism for Differential Privacy", ICML 2018.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import optimize
from scipy import special

from tf_pxg.risk import gaussian_delta  # the μ-GDP profile, one place

__all__ = ["gaussian_mu", "gaussian_delta", "fdp_slack", "fdp_refutes",
           "one_run_epsilon_fdp", "gdp_covers"]


@functools.lru_cache(maxsize=4096)
def gaussian_mu(epsilon: float, delta: float) -> float:
  """μ of the Gaussian mechanism that is exactly (ε, δ)-DP (`inf` for
  ε = inf).

  Args:
    epsilon: ε ≥ 0.
    delta: δ in (0, 1).

  Returns:
    `1 / dp_accounting.get_sigma_gaussian(ε, δ)` (sensitivity 1).
  """
  import dp_accounting  # noqa: PLC0415  (imported when first needed)
  sigma = dp_accounting.get_sigma_gaussian(epsilon, delta)
  return math.inf if sigma == 0 else 1.0 / sigma


def _wrong_for_right(mu: float):
  """x ↦ Φ(Φ⁻¹(x) - μ): the least wrong-guess mass that a right-guess
  mass x forces under G_μ."""
  if math.isinf(mu):
    return lambda x: float(x == 1.0)
  # special.ndtr / ndtri are what stats.norm.cdf / ppf evaluate, without
  # their per-call overhead (this runs in an inner loop).
  return lambda x: float(special.ndtr(special.ndtri(x) - mu))


def fdp_slack(m: int, r: int, v: int, significance: float,
              mu: float) -> float:
  """The forced guess mass minus r / m (module docstring); positive means
  "μ-GDP rejected at level `significance` by v right out of r guesses"."""
  wrong_for_right = _wrong_for_right(mu)
  hit = significance * v / m
  miss = significance * (r - v) / m
  for i in range(v - 1, -1, -1):
    new_miss = max(miss, wrong_for_right(hit))
    if new_miss == miss:  # a fixed point: nothing changes any more
      break
    hit = min(hit + (i / (r - i)) * (new_miss - miss), 1.0)
    miss = new_miss
  return hit + miss - r / m


def fdp_refutes(m: int, r: int, v: int, significance: float,
                mu: float) -> bool:
  """Whether v right out of r guesses on m canaries reject "μ-GDP in each
  canary" at level `significance` (module docstring)."""
  return fdp_slack(m, r, v, significance, mu) > 0


def one_run_epsilon_fdp(m: int, r: int, v: int, significance: float,
                        delta: float, floor: float = 0.0) -> float:
  """`sup{ε ≥ floor : G_μ(ε, δ) rejected}`, or `floor` if nothing above it
  is (module docstring).

  Args:
    m: canaries; r: guesses; v: right guesses (0 ≤ v ≤ r ≤ m).
    significance: the level of each test.
    delta: δ in (0, 1) of the claims.
    floor: skip ε below this (a search over rules passes its best so far).

  Returns:
    The bound, to about 1e-6.
  """
  if not (0 <= v <= r <= m):
    raise ValueError(f"need 0 <= v <= r <= m (correct <= guesses <= "
                     f"canaries); got m={m}, r={r}, v={v}.")

  def gap(eps):
    return fdp_slack(m, r, v, significance, gaussian_mu(eps, delta))

  if v == 0 or gap(floor) <= 0:
    return floor
  lo, hi = floor, max(1.0, 2.0 * floor)
  while gap(hi) > 0:
    lo, hi = hi, 2.0 * hi
    if hi > 1e3:  # rejected at every finite ε: cannot happen for v < m
      return lo
  return float(optimize.brentq(gap, lo, hi, xtol=1e-6))


def gdp_covers(event, epsilon: float, delta: float,
               max_epsilon: float = 100.0, num: int = 2000) -> bool:
  """Whether a mechanism is `G_μ(ε, δ)`-DP, from its `dp_accounting` event.

  By Dong, Roth and Su's Corollary 2.13 a mechanism is μ-GDP iff it is
  (ε', δ_μ(ε'))-DP for every ε' ≥ 0. The mechanism's profile is the PLD
  accountant's `get_delta` (pessimistic: an upper bound on its δ), compared
  with `gaussian_delta` on `num` points of [0, max_epsilon]; beyond, both are
  below 1e-300 for the runs audited here. A grid is a check, not a proof
  between its points; both profiles are smooth and decreasing.

  Args:
    event: e.g. `tf_pxg.accounting.dp_event(N, B, σ, epochs=E)`.
    epsilon, delta: the claim; μ = `gaussian_mu(epsilon, delta)`.

  Returns:
    True when the accountant's profile is at most the Gaussian one
    everywhere on the grid: then the f-DP bound of a correct run exceeds
    `epsilon` with probability at most the significance.
  """
  import dp_accounting  # noqa: PLC0415
  mu = gaussian_mu(epsilon, delta)
  accountant = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-3)
  accountant.compose(event)
  grid = np.linspace(0.0, max_epsilon, num)
  mech = np.array([accountant.get_delta(e) for e in grid])
  return bool(np.all(mech <= gaussian_delta(mu, grid) + 1e-12))
