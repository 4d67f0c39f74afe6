"""How many runs a DP search trains: K, and where its randomness comes from.

Papernot and Steinke (ICLR 2022, arXiv:2110.03620) run the base mechanism
a *random* number of times K and release only the best run; the privacy
cost of the search depends on K's distribution, not on its value, so K
itself must stay secret (a known K = k would make the search the max of k
runs, whose cost grows like k, not like the distribution's mean's log).

Two families, with dp-accounting's parametrisation
(`dp_accounting.dp_event.RepeatAndSelectDpEvent(event, mean, shape)`):

* **Truncated negative binomial** `TruncatedNegativeBinomial(eta, gamma)`
  (the paper's Section 2, `shape = eta`): for k = 1, 2, ...

      P[K = k] = (1 - γ)^k / (γ^-η - 1) · Π_{l=0}^{k-1} (l + η) / (l + 1)

  with γ in (0, 1] and η > -1; η = 0 is the logarithmic distribution
  P[K = k] = (1 - γ)^k / (k log(1/γ)) and η = 1 the geometric
  P[K = k] = γ (1 - γ)^(k-1). Its mean is

      E[K] = η (1 - γ) / (γ (1 - γ^η))      (η != 0)
      E[K] = (1/γ - 1) / log(1/γ)           (η = 0).

  dp-accounting supports η >= 0 (its `shape`), so this module does too.
* **Poisson** `Poisson(mean)` (the paper's Section 3.3, `shape = inf`):
  P[K = k] = e^-μ μ^k / k!, k = 0, 1, ...; K = 0 releases nothing.

Sampling is by inversion of the CDF (the pmf by its ratio recursion), with
one uniform draw from the search's random source: `random.SystemRandom`
(the OS CSPRNG) by default, `random.Random(seed)` only when a seed is given
for tests, as the package's noise does (`seed` / `secure_mode`).
"""

from __future__ import annotations

import math
import random
from typing import Optional, Union

__all__ = ["NumRuns", "Poisson", "TruncatedNegativeBinomial", "random_source"]

Rng = Union[random.Random, random.SystemRandom]

# Inversion stops when the remaining mass is below this (then K is the
# last k reached; the mass left out is < 1e-15, far below any test).
_TAIL = 1e-15


def random_source(seed: Optional[int] = None) -> Rng:
  """The OS CSPRNG (`random.SystemRandom`), or `random.Random(seed)` for
  tests.

  Raises:
    TypeError: `seed` is not None or an int.
  """
  if seed is None:
    return random.SystemRandom()
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"seed must be None (OS entropy) or an int; got "
                    f"{seed!r}.")
  return random.Random(seed)


class NumRuns:
  """The distribution of the number of runs K (module docstring).

  Attributes:
    mean: E[K].
    shape: dp-accounting's `shape` (η; `math.inf` for Poisson).
  """

  mean: float
  shape: float

  def pmf(self, k: int) -> float:
    """P[K = k]."""
    raise NotImplementedError

  def _first(self) -> int:
    raise NotImplementedError

  def _ratio(self, k: int) -> float:
    """P[K = k + 1] / P[K = k]."""
    raise NotImplementedError

  def sample(self, rng: Rng) -> int:
    """One draw of K by inversion with one uniform from `rng`."""
    u = rng.random()
    k = self._first()
    p = self.pmf(k)
    cdf = p
    while cdf <= u and 1.0 - cdf > _TAIL:
      p *= self._ratio(k)
      k += 1
      cdf += p
    return k

  def tail(self, k: int) -> float:
    """P[K > k]."""
    first = self._first()
    if k < first:
      return 1.0
    p = self.pmf(first)
    total = p
    for j in range(first, k):
      p *= self._ratio(j)
      total += p
    return max(0.0, 1.0 - total)


class TruncatedNegativeBinomial(NumRuns):
  """K ~ the truncated negative binomial (η, γ) of Papernot and Steinke.

  Give `gamma` or `mean` (γ is then found by bisection, and `mean` is
  recomputed from it, so sampling and accounting use one distribution).

  Args:
    eta: η >= 0 (0: logarithmic, 1: geometric). Smaller η costs less ε
      for the same mean and has a heavier tail (more compute, rarely).
    gamma: γ in (0, 1].
    mean: E[K] >= 1 instead of `gamma`.

  Raises:
    ValueError: η < 0 or not finite; neither or both of `gamma` and
      `mean`; γ outside (0, 1]; mean < 1.
  """

  def __init__(self, eta: float, gamma: Optional[float] = None, *,
               mean: Optional[float] = None):
    if (isinstance(eta, bool) or not isinstance(eta, (int, float)) or
        not math.isfinite(eta) or eta < 0):
      raise ValueError(f"TruncatedNegativeBinomial: eta must be a finite "
                       f"number >= 0 (dp-accounting's shape); got {eta!r}.")
    if (gamma is None) == (mean is None):
      raise ValueError("TruncatedNegativeBinomial: give exactly one of "
                       f"gamma and mean; got gamma={gamma!r}, mean={mean!r}.")
    self.eta = float(eta)
    if mean is not None:
      if not isinstance(mean, (int, float)) or not mean >= 1:
        raise ValueError(f"TruncatedNegativeBinomial: mean must be >= 1; "
                         f"got {mean!r}.")
      gamma = _gamma_for_mean(self.eta, float(mean))
    if not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
      raise ValueError(f"TruncatedNegativeBinomial: gamma must be in (0, 1]; "
                       f"got {gamma!r}.")
    self.gamma = float(gamma)
    self.mean = _tnb_mean(self.eta, self.gamma)
    self.shape = self.eta

  def __repr__(self):
    return (f"TruncatedNegativeBinomial(eta={self.eta!r}, "
            f"gamma={self.gamma!r})  # mean {self.mean:.4g}")

  def pmf(self, k: int) -> float:
    if k < 1:
      return 0.0
    if self.gamma == 1.0:
      return 1.0 if k == 1 else 0.0
    eta, g = self.eta, self.gamma
    if eta == 0:
      return (1 - g)**k / (k * math.log(1 / g))
    log_p = (k * math.log1p(-g) - math.log(math.expm1(-eta * math.log(g))) +
             math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1))
    return math.exp(log_p)

  def _first(self) -> int:
    return 1

  def _ratio(self, k: int) -> float:
    return (1 - self.gamma) * (k + self.eta) / (k + 1)


class Poisson(NumRuns):
  """K ~ Poisson(μ) (K = 0 possible: the search then releases nothing).

  Raises:
    ValueError: μ < 1 (dp-accounting's bound needs mean >= 1) or not finite.
  """

  def __init__(self, mean: float):
    if (isinstance(mean, bool) or not isinstance(mean, (int, float)) or
        not math.isfinite(mean) or mean < 1):
      raise ValueError(f"Poisson: mean must be a finite number >= 1; got "
                       f"{mean!r}.")
    self.mean = float(mean)
    self.shape = math.inf

  def __repr__(self):
    return f"Poisson(mean={self.mean!r})"

  def pmf(self, k: int) -> float:
    if k < 0:
      return 0.0
    return math.exp(-self.mean + k * math.log(self.mean) - math.lgamma(k + 1))

  def _first(self) -> int:
    return 0

  def _ratio(self, k: int) -> float:
    return self.mean / (k + 1)


def _tnb_mean(eta: float, gamma: float) -> float:
  if gamma == 1.0:
    return 1.0
  if eta == 0:
    return (1 / gamma - 1) / math.log(1 / gamma)
  return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def _gamma_for_mean(eta: float, mean: float) -> float:
  """γ with E[K] = mean (the mean decreases in γ), by bisection to 1e-15
  relative."""
  if mean == 1.0:
    return 1.0
  lo, hi = 0.0, 1.0
  for _ in range(200):
    mid = (lo + hi) / 2
    if mid == lo or mid == hi:
      break
    if _tnb_mean(eta, mid) > mean:
      lo = mid
    else:
      hi = mid
  return hi
