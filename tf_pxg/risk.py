"""A run's privacy risk as attacks read it: μ-GDP and the best attack's TPR.

ε at one δ is one point of a curve. An auditor asks what the strongest
membership-inference attack can do: given the trained model, decide whether
one example was in the training data (H1, "in") or not (H0, "out"). A test
with false positive rate α (says "in" when the example was out) has true
positive rate TPR = 1 - β, β its false negative rate. The **trade-off
function** (Dong, Roth and Su 2022, Def. 2.1)

    f(α) = inf { β_φ : α_φ <= α }      over all tests φ

is the least β at FPR α, so **1 - f(α) is the best attack's TPR at FPR α**.
A mechanism is f-DP when the curve of every pair of neighbouring datasets,
in both orders, lies above f. tf_pxg reports 1 - f(α) at α = 10⁻³ and
10⁻² (`FPRS`) and μ of μ-GDP: the curve of telling N(0, 1) from N(μ, 1),

    G_μ(α) = Φ(Φ⁻¹(1 - α) - μ),   so   TPR_μ(α) = Φ(Φ⁻¹(α) + μ)

(`gaussian_tpr`), with privacy profile δ_μ(ε) = Φ(-ε/μ + μ/2) -
e^ε Φ(-ε/μ - μ/2) (`gaussian_delta`; Dong, Roth and Su, Cor. 2.13).

**From a run's events to its curve** (`event_risk`). The events are the
ones ε is computed from (`tf_pxg.accounting`, the privacy ledger
`tf_pxg.dp.ledger`), composed as they are for ε:

1. *Exact μ.* When the event is a composition of Gaussian mechanisms only
   (`GaussianDpEvent`, also Poisson-sampled at q = 1, self-composed,
   composed, with no-ops), the run is exactly μ-GDP with

       μ = sqrt(Σ_i 1 / σ_i²)

   (sensitivity 1: one Gaussian is 1/σ-GDP, Dong, Roth and Su Thm. 2.7;
   adaptive composition of μ_i-GDP mechanisms is sqrt(Σ μ_i²)-GDP, exactly,
   Cor. 3.3), and TPR(α) = TPR_μ(α). T steps at σ give μ = sqrt(T) / σ.
   BLT's whole-run event and balls-in-bins' per-epoch Gaussians are of this
   kind.

2. *The PLD's curve.* Otherwise (Poisson subsampling, amplified BandMF,
   mixtures), the run's privacy profile δ(ε) is dp-accounting's PLD
   accountant's (`PLDAccountant(value_discretization_interval=Δ)
   .get_delta(ε)`): the hockey-stick divergence of the pessimistically
   discretised privacy loss distribution, the larger of the add and remove
   directions, an upper bound on the true δ(ε) (Doroshenko et al. 2022).
   A mechanism that is (ε, δ(ε))-DP is f_{ε,δ(ε)}-DP with

       f_{ε,δ}(α) = max(0, 1 - δ - e^ε α, e^-ε (1 - δ - α))

   (Dong, Roth and Su, Prop. 2.5; Kairouz, Oh and Viswanath 2015), so it
   is f-DP for the supremum of these over any set of ε >= 0,

       f(α) = sup_{ε >= 0} f_{ε,δ(ε)}(α),                         (*)

   and for the exact profile of a symmetric curve (*) is the curve itself
   (Dong, Roth and Su, Prop. 2.12). The supremum over fewer ε gives a
   lower f, i.e. a higher TPR: never an understatement. It is computed
   exactly for the discretised PLD: its losses lie on the grid ε_k = kΔ,
   and with P, Q the PLD's two measures and L the privacy loss,
   1 - δ(ε) = P[L <= ε] + e^ε Q[L > ε], so that

       b1(k) = 1 - δ(ε_k) - e^{ε_k} α:
         b1(k+1) - b1(k) = (e^Δ - 1) e^{ε_k} (Q[L >= ε_{k+1}] - α),
       b2(k) = e^{-ε_k} (1 - δ(ε_k) - α):
         b2(k+1) - b2(k) = (1 - e^-Δ) e^{-ε_k} (α - P[L <= ε_k]),

   each change of sign once (Q[L >= ·] falls, P[L <= ·] rises), and
   between grid points each term is monotone in ε (a constant plus a
   multiple of e^{±ε}). So each branch is unimodal in k (the smaller of
   the two directions' unimodal sequences is unimodal too), its maximum
   over ε >= 0 sits on the grid, and a bisection on the sign of
   b(k+1) - b(k) finds it (`_branch_max`; about 2 log2(ε*/Δ) calls of
   `get_delta`). Where the PLD accountant does not support an event (a DP
   hyperparameter search's `RepeatAndSelectDpEvent`), the RDP
   accountant's profile (`RdpAccountant.get_delta`, also an upper bound)
   is used instead: its branches need not be unimodal, so they are
   scanned on ε = 0, 0.01, 0.02, ... until their bounds 1 - e^ε α and
   e^-ε (1 - α) fall below the best value found (a valid f on any grid,
   and looser than the PLD's: RDP's profile is).

   Δ is refined as ε's is (`tf_pxg.accounting
   .PLD_VALUE_DISCRETIZATION_INTERVALS`, from 1e-3 down to 1e-5) until μ
   and every TPR change by less than 1 %; each refinement is an upper
   bound, and the smaller value of each is kept.

3. *μ where no exact one exists: the dominating fit at δ.* A Poisson-
   subsampled Gaussian's curve is not a Gaussian one. The μ reported is

       μ_δ = inf { μ : δ_run(ε) <= δ_μ(ε) for every ε >= 0 with
                        δ_run(ε) > δ }
           = sup_{0 <= ε <= ε_run(δ)} μ(ε),

   μ(ε) the μ with δ_μ(ε) = δ_run(ε) (δ_μ(ε) grows with μ, so there is
   one): the smallest μ such
   that the run keeps every (ε', δ')-DP guarantee of μ-GDP with δ' >= δ,
   the δ its ε is reported at (Dong, Roth and Su, Cor. 2.13, restricted
   to δ' >= δ). Conservative: δ_run is the PLD's upper bound, so μ(ε) and
   the range [0, ε_run(δ)] are both at least the true ones; μ(0) says how
   tight it is for the curve's middle. Why not "G_μ below the curve
   everywhere": a Poisson-subsampled Gaussian's curve near α -> 0 follows
   the event that the example was drawn at every step (probability q^T),
   whose μ is the unsampled sqrt(T)/σ, and the PLD moves its truncated
   tail (about 1e-15) to an infinite loss, so its δ(ε) never falls below
   that and no finite μ would dominate it; below δ the fit claims
   nothing. The supremum is taken on a 33-point grid of [0, ε_run(δ)],
   refined around its best point by Brent's method; for DP-SGD μ(ε)
   increases and the maximum is the end point, μ_δ =
   μ(ε_run(δ)), the μ of the Gaussian mechanism that is exactly
   (ε_run(δ), δ)-DP. For an exact μ (1.) μ(ε) is that μ at every ε; for
   a q = 1 Gaussian through the PLD (`closed_form=False`, Δ = 1e-4) the
   fit recovers sqrt(T)/σ to about 1e-9, 5e-8 where the PLD composes the
   T steps by FFT (Poisson sampling at q = 1; tests/test_privacy_risk.py).

The TPRs never go through the fit: they are 1 - f(α) of (*) (or TPR_μ for
an exact μ). No TensorFlow is imported here.

References:
  Dong, Roth and Su, "Gaussian Differential Privacy", JRSS-B 2022
    (arXiv:1905.02383).
  Kairouz, Oh and Viswanath, "The Composition Theorem for Differential
    Privacy", ICML 2015.
  Doroshenko, Ghazi, Kamath, Kumar and Manurangsi, "Connect the Dots:
    Tighter Discrete Approximations of Privacy Loss Distributions",
    PETS 2022.
  Gomez, Kulynych, Kaissis, Hayes, Balle and Honkela, "(ε, δ) Considered
    Harmful: Best Practices for Reporting Differential Privacy
    Guarantees", arXiv:2503.10945, 2025 (reporting μ-GDP for DP-SGD).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import dp_accounting
import numpy as np
from scipy import optimize
from scipy import special

from tf_pxg import accounting

__all__ = ["FPRS", "PrivacyRisk", "event_risk", "exact_mu",
           "gaussian_delta", "gaussian_tpr"]

#: The false positive rates the risk is reported at.
FPRS = (1e-3, 1e-2)

# Grid of ε for the supremum of μ(ε) (item 3 of the module docstring).
_FIT_GRID_POINTS = 33
# The ε step of the scan of an RDP profile (no grid of its own), and the
# largest ε a scan or bisection looks at (a branch of (*) still rising
# there is e^-ε (1 - δ - α) < 0 of an almost non-private run: f = 0).
_RDP_EPSILON_STEP = 1e-2
_SCAN_EPSILON_CAP = 100.0


# ---------------------------------------------------------------------------
# μ-GDP in closed form.
# ---------------------------------------------------------------------------


def gaussian_delta(mu: float, epsilon) -> np.ndarray:
  """The privacy profile of μ-GDP, `Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)`
  (Dong, Roth and Su, Corollary 2.13), elementwise over `epsilon`,
  computed in log space (0 for μ = 0, 1 for μ = inf)."""
  eps = np.asarray(epsilon, dtype=np.float64)
  if mu == 0:
    return np.zeros_like(eps)
  if math.isinf(mu):
    return np.ones_like(eps)
  a = special.log_ndtr(-eps / mu + mu / 2)
  b = eps + special.log_ndtr(-eps / mu - mu / 2)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(b < a, np.exp(a) * -np.expm1(b - a), 0.0)


def gaussian_tpr(mu: float, fpr: float) -> float:
  """The best attack's TPR at FPR `fpr` against μ-GDP:
  `1 - G_μ(α) = Φ(Φ⁻¹(α) + μ)`."""
  if math.isinf(mu):
    return 1.0
  return float(special.ndtr(special.ndtri(fpr) + mu))


def _scalar_gaussian_delta(mu: float, epsilon: float) -> float:
  """`gaussian_delta` for one μ > 0 and one ε (no array overhead)."""
  a = float(special.log_ndtr(-epsilon / mu + mu / 2))
  b = epsilon + float(special.log_ndtr(-epsilon / mu - mu / 2))
  return math.exp(a) * -math.expm1(b - a) if b < a else 0.0


def _mu_for_delta(epsilon: float, delta: float) -> float:
  """The μ with `gaussian_delta(μ, ε) = δ` (it grows with μ): 0 if
  δ <= 0, inf if δ >= 1."""
  if delta <= 0.0:
    return 0.0
  if delta >= 1.0:
    return math.inf
  hi = 1.0
  while _scalar_gaussian_delta(hi, epsilon) < delta:
    hi *= 2.0
    if hi > 1e6:
      return math.inf
  return float(optimize.brentq(
      lambda m: (_scalar_gaussian_delta(m, epsilon) if m > 0 else 0.0) -
      delta, 0.0, hi, xtol=1e-14, rtol=4 * np.finfo(float).eps))


def exact_mu(event: dp_accounting.DpEvent) -> Optional[float]:
  """μ of `event` when it is a composition of Gaussian mechanisms only
  (item 1 of the module docstring): sqrt(Σ count / σ²); inf if a σ is 0;
  None when the event has any other part (then it has no exact μ)."""
  total = _inverse_variance(event)
  return None if total is None else math.sqrt(total)


def _inverse_variance(event) -> Optional[float]:
  """Σ count / σ² over the event's Gaussians, or None (not all Gaussian)."""
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return 0.0
  if isinstance(event, dp_accounting.GaussianDpEvent):
    sigma = float(event.noise_multiplier)
    return math.inf if sigma == 0 else sigma**-2
  if (isinstance(event, dp_accounting.PoissonSampledDpEvent) and
      isinstance(event.event, dp_accounting.GaussianDpEvent)):
    if event.sampling_probability == 0:
      return 0.0
    if event.sampling_probability == 1:
      return _inverse_variance(event.event)
    return None
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    if event.count == 0:
      return 0.0
    inner = _inverse_variance(event.event)
    return None if inner is None else event.count * inner
  if isinstance(event, dp_accounting.ComposedDpEvent):
    parts = [_inverse_variance(e) for e in event.events]
    return None if any(p is None for p in parts) else float(sum(parts))
  return None


# ---------------------------------------------------------------------------
# The curve from a privacy profile.
# ---------------------------------------------------------------------------


class _Profile:
  """A composed accountant's privacy profile δ(ε) (`get_delta`), with its
  values on the grid ε = k `step` cached (the searches of every FPR share
  them). `unimodal`: the branches of (*) are unimodal on the grid (a
  PLD's: bisection finds their maxima); else they are scanned."""

  def __init__(self, accountant, step: float, unimodal: bool):
    self.accountant, self.step, self.unimodal = accountant, step, unimodal
    self._grid: Dict[int, float] = {}

  def delta(self, epsilon: float) -> float:
    return float(self.accountant.get_delta(epsilon))

  def one_minus_delta(self, k: int) -> float:
    """1 - δ(k step)."""
    if k not in self._grid:
      self._grid[k] = 1.0 - self.delta(k * self.step)
    return self._grid[k]


def _branch_max(value: Callable[[int], float], limit: int) -> float:
  """max over 0 <= k <= `limit` of a unimodal sequence (rises, then does
  not): the first k with value(k + 1) <= value(k), by doubling then
  bisection."""
  if value(1) <= value(0):
    return value(0)
  lo, hi = 0, 1  # value rises after lo
  while value(hi + 1) > value(hi):
    if hi >= limit:  # still rising at the limit: its maximum up to it
      return value(hi)
    lo, hi = hi, min(2 * hi, limit)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if value(mid + 1) > value(mid):
      lo = mid
    else:
      hi = mid
  return value(hi)


def _scan_max(value: Callable[[int], float], step: float,
              bound: Callable[[int], float]) -> float:
  """max of `value` over k = 0, 1, ... while `bound(k)`, an upper bound
  on every later value, exceeds the best found (and k step <= the cap)."""
  best, k = 0.0, 0
  while bound(k) > best and k * step <= _SCAN_EPSILON_CAP:
    best = max(best, value(k))
    k += 1
  return best


def _tradeoff(profile: _Profile, fpr: float) -> float:
  """f(α) of (*) over ε = k `profile.step`, k >= 0 (module docstring,
  item 2): the larger of the two branches' maxima, in [0, 1 - α]. Any
  set of ε gives a valid f: the scan of a profile whose branches need not
  be unimodal stops where the branch's bound (1 - e^ε α, e^-ε (1 - α))
  falls below the best value found."""
  step, one_minus_delta = profile.step, profile.one_minus_delta

  def first(k):
    return one_minus_delta(k) - math.exp(k * step) * fpr

  def second(k):
    return math.exp(-k * step) * (one_minus_delta(k) - fpr)

  if profile.unimodal:
    limit = int(_SCAN_EPSILON_CAP / step)
    found = (_branch_max(first, limit), _branch_max(second, limit))
  else:
    found = (_scan_max(first, step, lambda k: 1 - math.exp(k * step) * fpr),
             _scan_max(second, step,
                       lambda k: math.exp(-k * step) * (1 - fpr)))
  return min(1.0 - fpr, max(0.0, *found))


def _fitted_mu(profile: _Profile, delta: float) -> float:
  """μ_δ of the module docstring (item 3): sup of μ(ε) over
  [0, ε_run(δ)] on a grid, refined by Brent's method around its best point
  unless that is the end point reached rising (μ(ε) increasing: DP-SGD)."""
  epsilon_max = float(profile.accountant.get_epsilon(delta))
  if math.isinf(epsilon_max):
    return math.inf

  def mu_at(epsilon: float) -> float:
    return _mu_for_delta(epsilon, profile.delta(epsilon))

  grid = np.linspace(0.0, epsilon_max, _FIT_GRID_POINTS)
  values = [mu_at(float(e)) for e in grid]
  best = int(np.argmax(values))
  last = len(values) - 1
  if math.isinf(values[best]) or epsilon_max == 0.0 or (
      best == last and values[last - 1] < values[last]):
    return values[best]
  refined = optimize.minimize_scalar(
      lambda e: -mu_at(e), method="bounded",
      bounds=(float(grid[max(best - 1, 0)]), float(grid[min(best + 1,
                                                             last)])),
      options={"xatol": 1e-9})
  return max(values[best], -float(refined.fun))


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrivacyRisk:
  """A run's risk in attack terms (`event_risk`; module docstring).

  Attributes:
    mu: μ of μ-GDP: exact (`exact`) or the dominating fit μ_δ; inf when no
      finite μ is known (no ε claimed, no noise, or no profile below 1).
    exact: whether the run is exactly `mu`-GDP (a composition of Gaussian
      mechanisms); else `mu` is the fit at `delta`.
    tpr: ((fpr, the best attack's TPR at that FPR), ...): upper bounds.
    method: "closed form", "pld", "rdp", or why nothing is known
      ("no ε claimed", "no noise", "nothing released", "unsupported").
    delta: the δ of the fit (None for an exact μ or nothing to fit).
  """
  mu: float
  exact: bool
  tpr: Tuple[Tuple[float, float], ...]
  method: str
  delta: Optional[float] = None

  def tpr_at(self, fpr: float) -> float:
    """The TPR at `fpr` (one of the FPRs it was computed at).

    Raises:
      KeyError: `fpr` is not one of them (they are listed).
    """
    for rate, value in self.tpr:
      if rate == fpr:
        return value
    raise KeyError(f"PrivacyRisk: no TPR at FPR {fpr!r}; computed at "
                   f"{[rate for rate, _ in self.tpr]}. Pass fprs= to "
                   "event_risk.")

  def logs(self, suffix: str = "") -> Dict[str, float]:
    """The values as training-log entries: `mu_gdp{suffix}` and
    `tpr_at_fpr_{fpr:g}{suffix}`."""
    out = {f"mu_gdp{suffix}": float(self.mu)}
    for rate, value in self.tpr:
      out[f"tpr_at_fpr_{rate:g}{suffix}"] = float(value)
    return out

  def describe(self) -> str:
    """One line for a summary: μ, how it was obtained, and the TPRs."""
    tprs = ", ".join(f"{value:.4g} at FPR {rate:g}"
                     for rate, value in self.tpr)
    if self.method == "closed form":
      how = "exact: a composition of Gaussian mechanisms"
    elif self.method in ("pld", "rdp"):
      how = (f"best dominating Gaussian fit: every (ε, δ') of μ-GDP with "
             f"δ' >= {self.delta:g} holds; dp-accounting "
             f"{self.method.upper()}")
    else:
      how = self.method
    return (f"risk: μ-GDP μ = {self.mu:.4g} ({how}); best attack's TPR "
            f"{tprs}")


def event_risk(event: Optional[dp_accounting.DpEvent],
               delta: float = 1e-5,
               fprs: Sequence[float] = FPRS, *,
               value_discretization_interval: Optional[float] = None,
               closed_form: bool = True) -> PrivacyRisk:
  """μ-GDP and the best attack's TPR at each FPR of `event` (module
  docstring: exact μ for Gaussian compositions, else the PLD's curve).

  Args:
    event: the run's composed `dp_accounting.DpEvent` (the one its ε is
      computed from, e.g. `tf_pxg.accounting.dp_event(...)` or
      `PrivacyLedger.event()`); None: no ε is claimed (μ = inf, TPR = 1).
    delta: δ of the fit μ_δ where no exact μ exists (the δ the run's ε is
      reported at), 0 < δ < 1.
    fprs: false positive rates, each in (0, 1).
    value_discretization_interval: Δ of the PLD (one value, no
      refinement); default: refined from 1e-3 to 1e-5 (module docstring).
    closed_form: False computes even a Gaussian composition through the
      PLD (to check one against the other).

  Returns:
    A `PrivacyRisk`.

  Raises:
    ValueError: `delta`, an FPR or the interval out of range (named).
  """
  delta = accounting._check_delta(delta)  # pylint: disable=protected-access
  fprs = tuple(_check_fpr(a) for a in fprs)
  if value_discretization_interval is not None and not (
      isinstance(value_discretization_interval, (int, float)) and
      0 < value_discretization_interval < 1):
    raise ValueError(
        "value_discretization_interval must be a number in (0, 1), e.g. "
        f"1e-4; got {value_discretization_interval!r}.")
  if event is None:
    return _trivial("no ε claimed", fprs)
  mu = exact_mu(event)
  if mu is not None and (closed_form or mu == 0 or math.isinf(mu)):
    if math.isinf(mu):
      return _trivial("no noise", fprs)
    return PrivacyRisk(mu, True, tuple((a, gaussian_tpr(mu, a))
                                       for a in fprs),
                       "closed form" if mu > 0 else "nothing released")
  with accounting._quiet_dp_accounting():  # pylint: disable=protected-access
    if dp_accounting.pld.PLDAccountant().supports(event):
      intervals = ((value_discretization_interval,)
                   if value_discretization_interval is not None else
                   accounting.PLD_VALUE_DISCRETIZATION_INTERVALS)
      return _refined_pld_risk(event, delta, fprs, intervals)
    rdp = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS))
    if rdp.supports(event):
      rdp.compose(event)
      return _profile_risk(rdp, _RDP_EPSILON_STEP, delta, fprs, "rdp")
  return _trivial("unsupported: dp-accounting's PLD and RDP accountants "
                  f"support no {type(event).__name__} here", fprs)


def _check_fpr(fpr) -> float:
  if (isinstance(fpr, bool) or not isinstance(fpr, (int, float)) or
      not 0 < fpr < 1):
    raise ValueError(f"each FPR must be a number in (0, 1), e.g. 1e-3; "
                     f"got {fpr!r}.")
  return float(fpr)


def _trivial(method: str, fprs) -> PrivacyRisk:
  """No bound: μ = inf and TPR = 1 at every FPR."""
  return PrivacyRisk(math.inf, False, tuple((a, 1.0) for a in fprs), method)


def _profile_risk(accountant, step: float, delta: float, fprs,
                  method: str) -> PrivacyRisk:
  """The risk from a composed accountant's profile (items 2 and 3)."""
  profile = _Profile(accountant, step, unimodal=method == "pld")
  if profile.one_minus_delta(0) <= 0.0:  # a non-private part: δ(0) = 1
    return _trivial("no noise", fprs)
  tprs = tuple((a, 1.0 - _tradeoff(profile, a)) for a in fprs)
  return PrivacyRisk(_fitted_mu(profile, delta), False, tprs, method,
                     delta)


def _refined_pld_risk(event, delta: float, fprs,
                      intervals: Sequence[float]) -> PrivacyRisk:
  """`_profile_risk` of the PLD at each interval until μ and the TPRs
  change by less than `accounting`'s relative tolerance; the smaller of
  each (all are upper bounds)."""
  tolerance = accounting._PLD_RELATIVE_TOLERANCE  # pylint: disable=protected-access
  best = None
  for interval in intervals:
    pld = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=interval)
    pld.compose(event)
    finer = _profile_risk(pld, interval, delta, fprs, "pld")
    if best is None:
      best = finer
      continue
    old = [best.mu] + [v for _, v in best.tpr]
    new = [finer.mu] + [v for _, v in finer.tpr]
    converged = all(
        math.isinf(n) or abs(o - n) <= tolerance * n
        for o, n in zip(old, new))
    best = dataclasses.replace(
        best, mu=min(best.mu, finer.mu),
        tpr=tuple((a, min(v, w)) for (a, v), (_, w) in zip(best.tpr,
                                                           finer.tpr)))
    if converged:
      break
  return best
