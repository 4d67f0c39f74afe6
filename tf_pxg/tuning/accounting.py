"""ε of a DP search, and the per-run σ that meets a target ε.

**The search's event.** One run Q trains a candidate drawn from a fixed
prior and releases its model and score; the search repeats Q a random
number K ~ D of times and releases the best run only. Papernot and
Steinke (ICLR 2022, Theorems 2 and 6) bound its Rényi DP from Q's RDP
curve ε_Q(λ) at every order and D's parameters; dp-accounting computes it
for `RepeatAndSelectDpEvent(Q's event, mean, shape)` with its RDP
accountant (the only one that supports the event: its PLD accountant
does not). So the search's ε is

    RdpAccountant().compose(RepeatAndSelectDpEvent(E_ref, E[K], η))
                   .get_epsilon(δ)

for a per-run event E_ref whose RDP curve bounds every candidate's.

**Every candidate inside one per-run event.** Candidates differ in how
many steps they train (epochs), at what rate (batch size), and with what
σ. Q picks candidate c with a data-independent probability w_c and runs
it; its output (c, run) has, for λ > 1,

    exp((λ-1) D_λ(Q(x) || Q(x'))) = Σ_c w_c exp((λ-1) D_λ(M_c(x) || M_c(x')))
                                  <= max_c exp((λ-1) ε_c(λ)),

so ε_Q(λ) <= max_c ε_c(λ) (Rényi divergences of a mixture over a public
index average in exp((λ-1) D)). `calibrate` makes every candidate's curve
at most E_ref's at each of the accountant's orders: it gives candidate c
the smallest σ_c (RDP decreases in σ) with ε_c(λ; σ_c) <= ε_ref(λ) at all
orders of `tf_pxg.accounting.RDP_ORDERS` — exactly the orders the
accountant bounds with, so its number for E_ref bounds Q (its formulas
are increasing in each ε(λ)). With `calibrate=False` ("worst case") every
candidate keeps σ_ref and must already be dominated (else ValueError).

**Both ways.** `search_epsilon` is the ε of the search at given per-run
settings; `noise_multiplier_for_search` bisects the reference σ for a
target total ε (ε is decreasing in σ).

The RDP curve of an event is read from dp-accounting's RdpAccountant
(its `_rdp` array over the orders it was built with: the one place this
package reads a dp-accounting attribute that is not public; tested
against the Gaussian's closed form λ / (2σ²)).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import dp_accounting
from dp_accounting import dp_event as dp_event_lib
import numpy as np

from tf_pxg import _compat
from tf_pxg import accounting
from tf_pxg.tuning import distributions

__all__ = ["calibrate", "dominates", "noise_multiplier_for_search",
           "rdp_curve", "search_epsilon", "search_event"]

EventFn = Callable[[float], dp_accounting.DpEvent]

_ORDERS = tuple(accounting.RDP_ORDERS)
# σ is searched in (0, this]; a run needing more never finishes training.
_MAX_SIGMA = 1e4


def rdp_curve(event: dp_accounting.DpEvent,
              orders: Sequence[float] = _ORDERS) -> np.ndarray:
  """The RDP ε(λ) of `event` at `orders` (dp-accounting's RDP accountant;
  cached: a search checks every run against the same few events).

  Raises:
    ValueError: the RDP accountant does not support the event.
  """
  key = (repr(event), tuple(orders))  # events holding lists are unhashable
  if key not in _CURVES:
    if len(_CURVES) >= 512:
      _CURVES.clear()
    _CURVES[key] = _curve(event, orders)
  return _CURVES[key].copy()


_CURVES = {}


def _curve(event: dp_accounting.DpEvent, orders) -> np.ndarray:
  rdp = dp_accounting.rdp.RdpAccountant(list(orders))
  if not rdp.supports(event):
    raise ValueError(f"dp-accounting's RDP accountant does not support "
                     f"{event!r}; a DP search is accounted in RDP only.")
  with accounting._quiet_dp_accounting():  # pylint: disable=protected-access
    rdp.compose(event)
  return np.asarray(_compat.rdp_curve(rdp), dtype=np.float64)


def dominates(upper: dp_accounting.DpEvent,
              lower: dp_accounting.DpEvent) -> bool:
  """Whether `lower`'s RDP is at most `upper`'s at every accountant order
  (an event always dominates itself; `lower`'s curve is first made
  monotone, `_monotone`)."""
  if upper == lower or isinstance(lower, dp_accounting.NoOpDpEvent):
    return True
  return _below(rdp_curve(upper), lower)


def _monotone(curve: np.ndarray) -> np.ndarray:
  """min over orders >= λ of `curve`: still an upper bound on ε(λ) (Rényi
  divergence is non-decreasing in λ), finite where the accountant gave up
  on an order (dp-accounting returns inf where a fractional order's series
  does not converge, e.g. q = 0.5 with large σ)."""
  return np.minimum.accumulate(curve[::-1])[::-1]


def _below(curve: np.ndarray, event: dp_accounting.DpEvent) -> bool:
  return bool(np.all(_monotone(rdp_curve(event)) <= curve))


def calibrate(event_fn: EventFn, reference: dp_accounting.DpEvent,
              sigma_max: float) -> float:
  """The smallest σ (to 1e-4 relative, rounded up) with `event_fn(σ)`
  dominated by `reference`, searched in (0, sigma_max].

  Raises:
    ValueError: not dominated even at `sigma_max`.
  """
  curve = rdp_curve(reference)
  if not _below(curve, event_fn(sigma_max)):
    raise ValueError(
        f"a candidate's run releases more than the per-run event "
        f"{reference!r} even at noise multiplier {sigma_max:g}; give the "
        "search a larger reference (the candidate with most steps at the "
        "highest sampling rate).")
  lo, hi = 0.0, float(sigma_max)
  while hi - lo > 1e-4 * hi:
    mid = (lo + hi) / 2
    if _below(curve, event_fn(mid)):
      hi = mid
    else:
      lo = mid
  return hi


def search_event(per_run: dp_accounting.DpEvent,
                 num_runs: distributions.NumRuns) -> dp_accounting.DpEvent:
  """`RepeatAndSelectDpEvent(per_run, E[K], shape)` (module docstring)."""
  return dp_event_lib.RepeatAndSelectDpEvent(per_run, float(num_runs.mean),
                                             float(num_runs.shape))


def search_epsilon(per_run: dp_accounting.DpEvent,
                   num_runs: distributions.NumRuns, delta: float) -> float:
  """ε at `delta` of the search (RDP; module docstring)."""
  return accounting.event_epsilon(search_event(per_run, num_runs), delta,
                                  "rdp")


def noise_multiplier_for_search(target_epsilon: float, delta: float,
                                num_runs: distributions.NumRuns,
                                per_run_fn: EventFn,
                                tolerance: float = 1e-4) -> float:
  """The smallest reference σ whose search is (target_epsilon, δ)-DP.

  Args:
    target_epsilon: the whole search's ε.
    delta: its δ.
    num_runs: K's distribution.
    per_run_fn: σ -> the per-run event E_ref(σ) (score release included).
    tolerance: relative width of the final bracket; the upper end (ε <=
      target) is returned.

  Raises:
    ValueError: target not > 0, or not reachable with σ <= 1e4 (e.g. a
      score release that alone exceeds it).
  """
  if not (isinstance(target_epsilon, (int, float)) and
          math.isfinite(target_epsilon) and target_epsilon > 0):
    raise ValueError(f"target_epsilon must be a finite number > 0; got "
                     f"{target_epsilon!r}.")

  def eps(sigma):
    return search_epsilon(per_run_fn(sigma), num_runs, delta)

  hi = 1.0
  while eps(hi) > target_epsilon:
    hi *= 2
    if hi > _MAX_SIGMA:
      raise ValueError(
          f"a search with {num_runs!r} cannot reach ε = {target_epsilon} at "
          f"δ = {delta} with noise multipliers up to {_MAX_SIGMA:g} (is a "
          "score release alone above it?).")
  lo = hi / 2 if hi > 1.0 else 0.0
  while hi - lo > tolerance * hi:
    mid = (lo + hi) / 2
    if mid > 0 and eps(mid) <= target_epsilon:
      hi = mid
    else:
      lo = mid
  return hi
