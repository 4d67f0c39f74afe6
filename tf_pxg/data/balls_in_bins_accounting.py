"""Monte-Carlo ε of balls-in-bins sampling, with a stated confidence.

**The pair.** Balls-in-bins DP-SGD with k steps per epoch, noise
multiplier σ and E epochs (`tf_pxg.data.balls_in_bins`) is, for one unit,
dominated by the E-fold product of the pair (Chua, Ghazi, Harrison, Kamath,
Kumar, Leeman, Manurangsi, Sinha, Zhang, "Balls-and-Bins Sampling for
DP-SGD", AISTATS 2025, arXiv:2412.16802, Section 3: a tight dominating pair
of the adaptive mechanism ABLQ_B, in units of the clip norm)

    P = (1/k) sum_t N(e_t, σ² I_k),      Q = N(0, σ² I_k),

one factor per epoch (the epochs' assignments are independent, so the
epochs compose adaptively and their pairs multiply). A run of T steps is
counted as `E = ceil(T / k)` whole epochs: the steps of a begun epoch are a
prefix of that epoch's release (post-processing). The privacy loss of one
epoch at x is

    L(x) = log sum_t exp(x_t / σ²) - log k - 1 / (2 σ²)

(remove: x ~ P, loss L; add: x ~ Q, loss -L), E epochs add their losses,
and for each direction `δ(ε) = E[max(0, 1 - exp(ε - L))]`; the run is
(ε, δ)-DP for add/remove adjacency when both directions' δ(ε) are <= δ.

**The estimate and its confidence.** `num_samples` n draws of the loss per
direction (NumPy, vectorised in chunks, deterministic under `seed`) give
the empirical mean m̂(ε) of `f_ε = max(0, 1 - exp(ε - L)) ∈ [0, 1]`. Its
upper confidence bound at level 1 - β' is the Chernoff-Hoeffding bound for
[0, 1]-valued variables (Hoeffding 1963, Theorem 1; Chua et al.'s Fact 4.2):
the smallest p >= m̂ with `n KL(m̂ || p) >= log(1 / β')`; then
`P[UCB(ε) <= δ(ε)] <= β'` at every fixed ε. The reported `epsilon` is the
smallest ε (bisection, rounded up) with `UCB(ε) <= delta` in both
directions, each at β' = β / 2 (union bound, β = 1 - confidence). It is
data-dependent, yet the statement holds: the same draws serve every ε and
`f_ε` falls with ε, so m̂ and the UCB fall with ε; if the reported ε were
below the true ε* (the smallest with `δ(ε*) <= delta`), then
`UCB(ε*) <= UCB(ε) <= delta = δ(ε*)`, the failure at the fixed ε*, of
probability <= β'.

So the guarantee is: **with probability at least `confidence` over the
accountant's own draw (independent of the data), the run is
(`epsilon`, `delta`)-DP.** It is not a certified bound (a bad draw, of
probability <= 1 - confidence, can state too small an ε); `estimate` is the
point estimate (m̂ = delta, no confidence) for comparison. With too few
samples for `delta` (roughly n·delta below log(2/β)) the bound is inf;
`tf_pxg.data.balls_in_bins.BallsInBinsSampler.epsilon` then falls back to
the certified (deterministic-participation) bound, which always holds.

No importance sampling: every draw is a plain draw of the pair, so the cost
is `2 n E k` Gaussians (measured: 4 x 10^8 in 24-31 s on this shared
VM, i.e. about 7 s per 10^8).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy import optimize
from scipy import special

__all__ = ["MonteCarloEpsilon", "privacy_loss_samples", "delta_upper_bound",
           "monte_carlo_epsilon"]

# Gaussians drawn per chunk (memory ~ 8 bytes each, twice).
_CHUNK = 1 << 22


class MonteCarloEpsilon(NamedTuple):
  """The Monte-Carlo ε of balls-in-bins (module docstring).

  Attributes:
    epsilon: with probability >= `confidence` over the accountant's draw,
      the run is (epsilon, delta)-DP (inf: too few samples for `delta`).
    estimate: the point estimate, both directions' empirical δ(ε) <= delta.
    delta, confidence, num_samples, seed: as given.
    noise_multiplier, num_bins, num_epochs: the pair's σ, k and E.
  """
  epsilon: float
  estimate: float
  delta: float
  confidence: float
  num_samples: int
  seed: int
  noise_multiplier: float
  num_bins: int
  num_epochs: int


def _check(noise_multiplier, num_bins, num_epochs, num_samples):
  if not (isinstance(noise_multiplier, (int, float, np.floating)) and
          noise_multiplier > 0 and math.isfinite(noise_multiplier)):
    raise ValueError("balls-in-bins Monte-Carlo accounting needs a finite "
                     f"noise_multiplier > 0; got {noise_multiplier!r}.")
  for name, value in (("num_bins", num_bins), ("num_epochs", num_epochs),
                      ("num_samples", num_samples)):
    if isinstance(value, bool) or int(value) != value or value < 1:
      raise ValueError(f"balls-in-bins Monte-Carlo accounting: {name} must "
                       f"be a positive integer; got {value!r}.")


def privacy_loss_samples(noise_multiplier: float, num_bins: int,
                         num_epochs: int, num_samples: int, *, seed: int,
                         remove: bool = True) -> np.ndarray:
  """`[num_samples]` float64 draws of the E-epoch privacy loss.

  remove=True: x ~ P per epoch, loss `sum_e L(x_e)`; False: x ~ Q, loss
  `-sum_e L(x_e)` (module docstring). Deterministic in `seed`
  (`numpy.random.Generator(PCG64(seed))`, fixed chunks).
  """
  _check(noise_multiplier, num_bins, num_epochs, num_samples)
  rng = np.random.Generator(np.random.PCG64(seed))
  inv_sigma = 1.0 / float(noise_multiplier)
  shift = math.log(num_bins) + 0.5 * inv_sigma ** 2
  per_chunk = max(1, _CHUNK // (num_bins * num_epochs))
  out = np.empty(int(num_samples))
  for start in range(0, int(num_samples), per_chunk):
    rows = min(per_chunk, int(num_samples) - start)
    # x / σ² = g / σ (+ e_1 / σ² under P), g standard normal.
    z = rng.standard_normal((rows, int(num_epochs), int(num_bins)))
    z *= inv_sigma
    if remove:
      z[..., 0] += inv_sigma ** 2
    top = z.max(axis=-1, keepdims=True)  # logsumexp, 6x scipy's speed
    z -= top
    np.exp(z, out=z)
    loss = (np.log(z.sum(axis=-1)) + top[..., 0] - shift).sum(axis=-1)
    out[start:start + rows] = loss if remove else -loss
  return out


def _kl_bernoulli(q: float, p: float) -> float:
  return float(special.rel_entr(q, p) + special.rel_entr(1 - q, 1 - p))


def delta_upper_bound(mean: float, num_samples: int, beta: float) -> float:
  """The smallest p >= mean with `n KL(mean || p) >= log(1 / beta)`: the
  1 - beta upper confidence bound on E[f] of n draws of f ∈ [0, 1]
  (Chernoff-Hoeffding)."""
  target = math.log(1.0 / beta) / num_samples
  if _kl_bernoulli(mean, 1.0) <= target:  # also mean == 1
    return 1.0
  return float(optimize.brentq(lambda p: _kl_bernoulli(mean, p) - target,
                               mean, 1.0, xtol=1e-15, rtol=1e-12))


def _hockey_stick(losses_sorted: np.ndarray, epsilon: float) -> float:
  """mean of max(0, 1 - exp(ε - L)) (only L > ε contribute)."""
  tail = losses_sorted[np.searchsorted(losses_sorted, epsilon, "right"):]
  return float(-np.expm1(epsilon - tail).sum() / losses_sorted.size)


def _smallest_epsilon(holds, hi_start: float) -> float:
  """Smallest ε >= 0 (rounded up, rel. 1e-6) with holds(ε); holds is
  monotone (False, then True). inf if none below 1e4."""
  if holds(0.0):
    return 0.0
  lo, hi = 0.0, max(hi_start, 1e-3)
  while not holds(hi):
    lo, hi = hi, 2 * hi
    if hi > 1e4:
      return math.inf
  while hi - lo > 1e-6 * hi:
    mid = 0.5 * (lo + hi)
    lo, hi = (lo, mid) if holds(mid) else (mid, hi)
  return hi


def monte_carlo_epsilon(noise_multiplier: float, num_bins: int,
                        num_epochs: int, delta: float, *,
                        confidence: float = 0.99,
                        num_samples: int = 1_000_000,
                        seed: int = 0) -> MonteCarloEpsilon:
  """ε of E epochs of balls-in-bins with k bins at noise multiplier σ.

  Args:
    noise_multiplier: σ (noise std / clip norm), > 0.
    num_bins: k, the steps of an epoch.
    num_epochs: E, the epochs begun.
    delta: the target δ in (0, 1).
    confidence: 1 - β in (0, 1): the probability, over this function's
      draw, that `epsilon` holds (module docstring).
    num_samples: n draws per direction (2 n E k Gaussians in all).
    seed: the draw's seed (same arguments, same result).

  Returns:
    `MonteCarloEpsilon`.

  Raises:
    ValueError: out-of-range arguments.
  """
  _check(noise_multiplier, num_bins, num_epochs, num_samples)
  if not 0.0 < delta < 1.0:
    raise ValueError(f"delta must be in (0, 1); got {delta!r}.")
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1); got {confidence!r}.")
  beta_each = (1.0 - confidence) / 2  # two directions, union bound
  seeds = np.random.SeedSequence(int(seed)).generate_state(2, np.uint64)
  losses = [np.sort(privacy_loss_samples(
      noise_multiplier, num_bins, num_epochs, num_samples,
      seed=int(s), remove=r)) for s, r in zip(seeds, (True, False))]
  n = int(num_samples)

  def bound_holds(eps):
    return all(delta_upper_bound(_hockey_stick(l, eps), n, beta_each) <=
               delta for l in losses)

  def estimate_holds(eps):
    return all(_hockey_stick(l, eps) <= delta for l in losses)

  start = float(max(l[-1] for l in losses))
  return MonteCarloEpsilon(
      epsilon=_smallest_epsilon(bound_holds, start),
      estimate=_smallest_epsilon(estimate_holds, start),
      delta=float(delta), confidence=float(confidence), num_samples=n,
      seed=int(seed), noise_multiplier=float(noise_multiplier),
      num_bins=int(num_bins), num_epochs=int(num_epochs))
