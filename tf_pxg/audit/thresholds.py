"""How a one-run audit picks its guess rule: threshold strategies.

A one-run bound (`CanaryScoreAuditor.epsilon_one_run`, ε-DP;
`epsilon_one_run_fdp`, Gaussian f-DP) tests one guess rule, "in" for the
canaries scoring at least t. Choosing t after looking at the scores *and
the labels* (which canaries were in) and then testing it on the same
canaries would be a biased test. Each strategy below pays for the choice
differently; each docstring says why the bound stays valid, i.e. why a
mechanism that satisfies the claim yields a bound above it with
probability at most `significance`.

* `Bonferroni()` (the default): every rule of a family fixed before
  looking, each tested at `significance / K`.
* `Explicit(t)`: one threshold fixed in advance, tested at `significance`.
* `TopFraction(f, two_sided)`: "in" for the top f of the scores (and
  "out" for the bottom f), one test at `significance`.
* `Split(frac, seed)`: choose t on a random part of the canaries, test it on
  the rest at `significance`.
* `MultiSplit(num_samples, frac, seed)`: the median of many splits' bounds,
  each at `significance / 2`.

The names and the median rule follow jax-privacy 2.0 (`auditing.Split`,
`MultiSplit`); the partition differs (see `Split`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["Bonferroni", "Explicit", "MultiSplit", "Split",
           "ThresholdStrategy", "TopFraction"]


class ThresholdStrategy:
  """Base class of the strategies (module docstring)."""


@dataclasses.dataclass(frozen=True)
class Bonferroni(ThresholdStrategy):
  """Every rule of a label-independent family, each at `significance / K`.

  The family is fixed by m alone: one-sided, rule k = 1..m guesses "in"
  for the largest tie-complete set of top scores of size at most k (K = m;
  two-sided for the ε-DP bound: also "out" for the bottom k, K = ⌊m/2⌋).
  Validity: under the claim each rule's test rejects with probability at
  most `significance / K`, so by the union bound the probability that any
  rule of the family rejects, and hence that the maximum over the family
  exceeds the claim, is at most `significance`, whatever the scores.
  (jax-privacy's `Bonferroni` divides by the number of thresholds on the
  ROC frontier, a number that depends on the labels, so its K is itself
  chosen after looking.)
  """


@dataclasses.dataclass(frozen=True)
class Explicit(ThresholdStrategy):
  """One threshold t, fixed before the run (e.g. from a previous run).

  Validity: one test at `significance`. The number of guesses, #{s ≥ t},
  is random; both theorems bound the right guesses conditionally on the
  guess vector, so a data-dependent number of guesses is allowed.

  Attributes:
    threshold: guess "in" for the canaries scoring at least this.
  """
  threshold: float


@dataclasses.dataclass(frozen=True)
class TopFraction(ThresholdStrategy):
  """One rule fixed by m alone: "in" for the top `fraction` of the scores
  (and, two-sided, "out" for the bottom `fraction`).

  One-sided: the largest tie-complete set of top scores with at most
  `k = max(1, floor(fraction m))` members guesses "in", the rest abstain.
  Two-sided: also the largest tie-complete set of bottom scores with at
  most k members guesses "out" (r = both sets' sizes, v = the in-canaries
  on top plus the out-canaries at the bottom). One test at `significance`.

  Validity: both one-run theorems let the guesses be any function of the
  run's output, hence of all the scores; only a choice that looks at the
  labels needs paying for. This rule looks at the scores alone, so one test
  at `significance` is exact — provided `fraction` (and `two_sided`) is
  fixed before the labels are seen (e.g. from a simulation of the claimed
  mechanism, as in `examples/audit_digits.py`). It avoids both the
  Bonferroni factor K and a split's halving of the canaries.

  Two-sided guesses are covered by both theorems:
  * the ε-DP bound: Steinke, Nasr and Jagielski's guesses are any
    `T ∈ {-1, 0, +1}^m` (their k₊ "in" and k₋ "out" guesses);
  * the f-DP bound (`tf_pxg.audit.fdp`): its test needs, for each canary
    given the others, that the guess's wrong-mass w and right-mass h obey
    `w ≥ ψ(h)`, `ψ(x) = Φ(Φ⁻¹(x) - μ)`. Write P_in, P_out for the output's
    laws with the canary in and out, A = {guess "in"}, B = {guess "out"}:
    `h = (P_in(A) + P_out(B)) / 2`, `w = (P_out(A) + P_in(B)) / 2`.
    f-DP under add/remove adjacency holds for both orders of a neighbouring
    pair, and G_μ is symmetric, so `P_out(A) ≥ ψ(P_in(A))` and
    `P_in(B) ≥ ψ(P_out(B))`; ψ is convex, so `w ≥ ψ(h)`. (`gdp_covers`
    checks both orders: `dp_accounting`'s PLD profile is the maximum of
    its remove and add directions.)

  Attributes:
    fraction: the share of the m canaries guessed "in" (and, two-sided,
      "out"), in (0, 1] (in (0, 1/2] two-sided, so that the sets are
      disjoint).
    two_sided: also guess "out" for the bottom scores.
  """
  fraction: float = 0.05
  two_sided: bool = False


@dataclasses.dataclass(frozen=True)
class Split(ThresholdStrategy):
  """Choose t on a random part of the canaries; test it on the rest.

  A uniformly random subset of `round(frac m)` canaries (drawn from `seed`
  alone, without looking at scores or labels) is the *selection* part: the
  best rule's threshold on it (the rule maximising the bound at
  `significance`, as `Bonferroni` would search) becomes t. The bound is
  then `Explicit(t)` on the other m₂ canaries, at `significance`, with m₂
  as the number of canaries.

  Validity: the canaries' inclusions are independent fair coins, and the
  partition is independent of them, so given the selection part (its
  scores, its labels, hence t) the m₂ test canaries' inclusions are still
  independent fair coins, and the selection canaries are fixed data like
  any other training example. The mechanism is still DP in each test
  canary, so the one-run theorem applies to the m₂ test canaries with the
  single rule "in if s ≥ t" at `significance`. (jax-privacy partitions the
  in and out canaries separately, which fixes how many test canaries are
  in: their labels are then no longer independent coins. Drawing the
  subset from all m canaries keeps them so.)

  Attributes:
    threshold_estimation_frac: the selection part's share of the canaries.
    seed: seeds the partition (default: OS entropy).
  """
  threshold_estimation_frac: float = 0.5
  seed: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class MultiSplit(ThresholdStrategy):
  """The median of `num_samples` `Split` bounds, each at `significance / 2`.

  Validity (Meinshausen, Meier and Bühlmann 2009, Theorem 3.1 with γ = 1/2:
  twice the median of valid p-values is a valid p-value). Let p_j(ε) be
  split j's p-value for the claim ε. Under the claim, each
  `P[p_j ≤ significance / 2] ≤ significance / 2`, so the expected number of
  splits with `p_j ≤ significance / 2` is at most `n significance / 2`
  and, by Markov's inequality, at least half of them do so with probability
  at most `significance`. A median bound above the claim needs at least
  half of the splits' bounds at `significance / 2` above it, i.e. half of
  the p_j at most `significance / 2`. (`np.median` of an even number
  averages the middle two, which is at most the upper one: conservative.)
  Many splits remove most of the luck of one partition.

  Attributes:
    num_samples: the number of random partitions.
    threshold_estimation_frac: the selection part's share, as `Split`.
    seed: seeds the partitions (default: OS entropy).
  """
  num_samples: int = 100
  threshold_estimation_frac: float = 0.5
  seed: Optional[int] = None


def check(strategy) -> ThresholdStrategy:
  """`strategy`, or `Bonferroni()` for None; raises on anything else."""
  if strategy is None:
    return Bonferroni()
  if not isinstance(strategy, ThresholdStrategy):
    raise ValueError(f"threshold_strategy must be one of Bonferroni(), "
                     f"Explicit(t), TopFraction(f), Split(...), "
                     f"MultiSplit(...) (from "
                     f"tf_pxg.audit); got {strategy!r}.")
  frac = getattr(strategy, "threshold_estimation_frac", 0.5)
  if not 0 < frac < 1:
    raise ValueError(f"threshold_estimation_frac must be in (0, 1); got "
                     f"{frac!r}.")
  if isinstance(strategy, TopFraction):
    top = 0.5 if strategy.two_sided else 1.0
    if not 0 < strategy.fraction <= top:
      raise ValueError(f"TopFraction(two_sided={strategy.two_sided}) needs a "
                       f"fraction in (0, {top:g}] (two-sided: the top and "
                       f"bottom sets must not overlap); got "
                       f"{strategy.fraction!r}.")
  if isinstance(strategy, MultiSplit) and strategy.num_samples < 1:
    raise ValueError(f"MultiSplit needs num_samples >= 1; got "
                     f"{strategy.num_samples!r}.")
  return strategy


def partition(m: int, frac: float, rng: np.random.Generator):
  """A uniformly random (selection, test) split of range(m), drawn from
  `rng` only; the selection part has `round(frac m)` members (at least one
  canary on each side)."""
  order = rng.permutation(m)
  k = min(max(int(round(frac * m)), 1), m - 1)
  return order[:k], order[k:]
