"""Private side releases: statistics of the batch released with the gradient.

A DP step releases the noisy clipped-gradient sum. On the same sampled
batch it may release more: adaptive clipping's unclipped count
(`tf_pxg.clipping.QuantileAdaptive`'s `QuantileCount`), the noisy training loss
(`tf_pxg.keras.NoisyLoss`), DP-AdaFEST's row selection
(`tf_pxg.dp.sparse_selection`), or a user's own (e.g.
`tf_pxg.dp.norm_release.ClippedNormMean`). Each is a Gaussian mechanism:
a sum over the batch's examples of contributions bounded by its
sensitivity `Δ_i`, plus Gaussian noise of std `m_i Δ_i` (its noise
multiplier `m_i`).

**Privacy.** Scaled by `1/C` and `1/Δ_i`, the gradient sum and the side
releases are Gaussian mechanisms of sensitivity 1 with multipliers `σ_g`
and `m_i` on disjoint coordinates of one output. The Rényi divergence of
a Gaussian mechanism of sensitivity 1 and multiplier `s` is `α / (2 s²)`,
and those of independent mechanisms on one input add, so the tuple is
exactly ONE Gaussian mechanism of sensitivity 1 and multiplier σ with

    σ⁻² = σ_g⁻² + Σ_i m_i⁻²        (Andrew et al. 2021, Theorem 1)

(its worst-case neighbouring pair moves every coordinate by its full
sensitivity, which the joint mechanism covers). All parts see the same
sampled batch, so Poisson subsampling, cyclic participation and BandMF's
rounds act on the tuple as on one Gaussian: the run is accounted with the
plan's σ, unchanged, and the gradient gets

    σ_g = (σ⁻² − Σ_i m_i⁻²)^(-1/2)  >  σ        (`gradient_noise_multiplier`)

— the one place the σ of a step is split (`tf_pxg.dp.plan.DPPlan.step_noise`
calls it). A release with `m_i = 0` would use the whole budget and is
refused, as is any set whose shares reach `σ⁻²`. Anything computed from a
release afterwards (a logged value, the adaptive clip's next value) is
post-processing.

The protocol (`SideRelease`): `name` (the log key and the accumulator
slot), `noise_multiplier`, `sensitivity(clip)`, `statistic(batch)` (the
sum over the batch's examples, each term of absolute value at most Δ,
padding rows and non-finite examples contributing a term within that
bound too: adding or removing one example moves the sum by its own term,
at most Δ), and, for a release
that keeps state in the `DPOptimizer` (`stateful`), `initial_state` and
`next_state(state, estimate)` with `estimate = noisy_sum / n` (`n` the
step's divisor). A release whose noise is drawn by the part that owns it
(`drawn_by_mechanism`: DP-AdaFEST's selection, inside the noise
mechanism's pass) declares only its multiplier.

Adding one: a `SideRelease` subclass in one file, given to a DP model or
`DPOptimizer` as `side_releases=[...]` (docs/extending.md, "A private side
release").
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import tensorflow as tf

__all__ = ["MechanismRelease", "ReleaseBatch", "SideRelease",
           "gradient_noise_multiplier"]


class ReleaseBatch(NamedTuple):
  """What a side release's `statistic` reads of one physical batch.

  Attributes:
    losses: `[B]` float per-example (per-unit) losses.
    norms: `[B]` float32 per-example gradient norms (unclipped).
    clip: scalar, the clip in use this step.
    mask: `[B]` float32, 1 for a sampled example, 0 for a padding row
      (all ones for a plain batch).
    finite: `[B]` bool, the example's loss and norm are finite (its clip
      factor is not zeroed).
    group_norms: `[G, B]` float32 per-group norms of a grouped clipping
      policy (`tf_pxg.clipping.PerLayer`), else None.
    group_scales: `[G]` its adaptive bounds' quantile estimates in use
      this step, else None.
  """
  losses: Any
  norms: Any
  clip: Any
  mask: Any
  finite: Any
  group_norms: Any = None
  group_scales: Any = None

  @property
  def keep(self):
    """`[B]` bool: a real, finite example."""
    return tf.logical_and(self.finite, self.mask > 0)


class SideRelease:
  """A private statistic released with the gradient (module docstring).

  Subclasses set `name` and `noise_multiplier` and implement `sensitivity`
  and `statistic`; a stateful one (`stateful = True`) also `initial_state`
  and `next_state`. They are immutable settings (`get_config`, equality by
  config) saved with the plan.
  """

  #: The log key (and the name of its state variable, if any).
  name = "side_release"
  #: m: the noise std in units of the sensitivity.
  noise_multiplier: float = 1.0
  #: Whether it keeps a float32 scalar state in the `DPOptimizer`
  #: (`initial_state`, `next_state`), logged under `name`. The one
  #: stateless release is the plan's `noisy_loss` (Keras' loss tracker
  #: averages it); a release in `side_releases` must be stateful, so that
  #: only its gated state, never a physical batch's un-noised partial sum,
  #: reaches the logs.
  stateful = True
  #: Whether the part that owns it draws its noise (only its multiplier
  #: enters the split).
  drawn_by_mechanism = False
  #: Whether its state is the clip (an adaptive clipping policy's release:
  #: the `DPOptimizer`'s clip variable, which the next step clips at).
  drives_clip = False

  def sensitivity(self, clip):
    """Δ: the most one example's term can move the statistic."""
    raise NotImplementedError

  def statistic(self, batch: ReleaseBatch) -> tf.Tensor:
    """The float32 scalar sum over `batch`'s examples (module docstring)."""
    raise NotImplementedError

  def stddev(self, clip):
    """The noise std: `noise_multiplier * sensitivity(clip)`."""
    return self.noise_multiplier * self.sensitivity(clip)

  def initial_state(self, l2_norm_clip: float) -> float:
    """The state before the first release (stateful releases)."""
    del l2_norm_clip
    return 0.0

  def next_state(self, state, estimate):
    """The state after a release of `estimate = noisy_sum / n`
    (post-processing: a function of the release and the old state)."""
    del state
    return estimate

  def overuse_hint(self, noise_multiplier: float) -> str:
    """What to change when this release's share uses the budget."""
    return (f"Give {self!r} a noise_multiplier larger than "
            f"{noise_multiplier!r} (a few times it leaves most of the "
            "budget to the gradient).")

  def get_config(self) -> dict:
    return {"noise_multiplier": self.noise_multiplier}

  def __eq__(self, other):
    return type(self) is type(other) and self.get_config() == \
        other.get_config()

  def __hash__(self):
    return hash((type(self).__name__,
                 tuple(sorted(self.get_config().items()))))

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
    return f"{type(self).__name__}({args})"


class MechanismRelease(SideRelease):
  """A side release drawn by its noise mechanism (DP-AdaFEST's selection):
  it only takes its share of σ.

  Args:
    name: what it is (for messages).
    noise_multiplier: its sensitivity-1 multiplier.
    hint: what to change when it uses the budget.
  """

  drawn_by_mechanism = True
  stateful = False

  def __init__(self, name: str, noise_multiplier: float, hint: str = ""):
    self.name = name
    self.noise_multiplier = float(noise_multiplier)
    self._hint = hint

  def overuse_hint(self, noise_multiplier: float) -> str:
    return self._hint or super().overuse_hint(noise_multiplier)

  def get_config(self) -> dict:
    return {"name": self.name, "noise_multiplier": self.noise_multiplier}


def gradient_noise_multiplier(noise_multiplier: float,
                              releases: Sequence[SideRelease],
                              where: Optional[str] = None) -> float:
  """σ_g = (σ⁻² − Σ m_i⁻²)^(-1/2): the gradient's share of the accounted σ
  after the side releases' (module docstring). σ = 0 (no noise) is
  returned as it is.

  Raises:
    ValueError: the releases' shares reach σ⁻² (naming them, with the
      costliest one's hint), or a multiplier is not a number >= 0.
  """
  sigma = float(noise_multiplier)
  if not releases or sigma == 0:
    return sigma
  shares = []
  for release in releases:
    m = release.noise_multiplier
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not m >= 0:
      raise ValueError(f"{release!r}: noise_multiplier must be a number "
                       f">= 0; got {m!r}.")
    shares.append(math.inf if m == 0 else m**-2)
  remainder = sigma**-2 - sum(shares)
  if remainder <= 0:
    costliest = releases[max(range(len(shares)), key=shares.__getitem__)]
    raise ValueError(
        f"{where + ': ' if where else ''}the side releases "
        f"{', '.join(repr(r) for r in releases)} with noise_multiplier="
        f"{sigma!r} would use the whole privacy budget (their shares "
        f"sum m^-2 = {sum(shares):.4g} reach sigma^-2 = {sigma**-2:.4g}), "
        f"leaving no noise for the gradient. "
        f"{costliest.overuse_hint(sigma)}")
  return float(remainder**-0.5)
