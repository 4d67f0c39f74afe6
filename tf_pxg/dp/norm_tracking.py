"""`NormTracking`: a clip that follows a private mean of the clipped norms.

A stateful clipping policy: the clip C_t is a variable (held by the
`DPOptimizer`, saved with it), and after each applied logical step

    C_{t+1} = max((1 - rate) C_t + rate * target_ratio * m_t, min_clip)

where `m_t` is the step's noisy mean clipped norm,
`(sum_b min(||g_b||, C_t) + N(0, (z C_t)^2)) / n` over the step's sampled
examples (`tf_pxg.dp.norm_release.ClippedNormMean`, with `z =
noise_multiplier`). With every norm equal to r and `target_ratio` k > 1,
the fixed point is C = k r: the clip settles at k times the typical norm,
so most examples are unclipped and the noise (σ C) stays proportional to
the gradients' size. (Quantile tracking, `QuantileAdaptive`, is the other
classic; this one needs no count and moves the clip by the norms' scale.)

**Privacy.** The policy's only data-dependent input is `m_t`, a side
release of sensitivity C_t and multiplier z on the step's batch, composed
with the gradient by `tf_pxg.dp.releases` (σ⁻² = σ_g⁻² + z⁻²): the run is
accounted with the plan's σ and its ε covers the clip's path. The update
is post-processing of that release and of C_t, applied only at steps that
are applied (data-independent gate), so C_{t+1} depends on the data only
through the releases. `z` must exceed σ.

This module is the whole policy: it registers "norm_tracking" with
`tf_pxg.clipping.register` (so `clipping="norm_tracking"` and saving
work), its state is the clip variable every adaptive policy gets, and its
release is the protocol's.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_pxg.dp import clipping
from tf_pxg.dp import norm_release

__all__ = ["NormTracking"]


class _TrackedNorm(norm_release.ClippedNormMean):
  """The policy's release: the noisy mean clipped norm, whose state is the
  clip (`drives_clip`), logged as `l2_norm_clip`."""

  name = "l2_norm_clip"
  drives_clip = True

  def __init__(self, policy: "NormTracking"):
    super().__init__(policy.noise_multiplier)
    self.policy = policy

  def initial_state(self, l2_norm_clip: float) -> float:
    return float(l2_norm_clip)

  def next_state(self, state, estimate):
    p = self.policy
    state = tf.cast(state, tf.float32)
    new = (1.0 - p.rate) * state + p.rate * p.target_ratio * estimate
    return tf.maximum(new, p.min_clip)

  def get_config(self) -> dict:
    return {"policy": self.policy}


@clipping.register("norm_tracking")
class NormTracking(clipping.ClippingPolicy):
  """Flat clipping at a clip that tracks the private mean clipped norm
  (module docstring). The initial clip is the plan's `l2_norm_clip`.

  Args:
    target_ratio: k > 0, the clip's target in units of the mean clipped
      norm (default 1.5; k > 1 for a fixed point above the norms).
    rate: in (0, 1], how far each step moves towards the target.
    noise_multiplier: z > 0 of the mean-norm release (default 10, which
      costs a gradient at σ = 1 half a percent more noise).
    min_clip: the clip's floor (> 0).

  Raises:
    ValueError: an argument out of range.
  """

  adaptive = True

  def __init__(self, target_ratio: float = 1.5, rate: float = 0.2,
               noise_multiplier: float = 10.0, min_clip: float = 1e-6):
    for arg, value in (("target_ratio", target_ratio), ("rate", rate),
                       ("noise_multiplier", noise_multiplier),
                       ("min_clip", min_clip)):
      if (isinstance(value, bool) or not isinstance(value, (int, float)) or
          not math.isfinite(value) or value <= 0 or
          (arg == "rate" and value > 1)):
        raise ValueError(f"NormTracking: {arg} must be a finite number > 0"
                         f"{' and <= 1' if arg == 'rate' else ''}; got "
                         f"{value!r}.")
    self.target_ratio = float(target_ratio)
    self.rate = float(rate)
    self.noise_multiplier = float(noise_multiplier)
    self.min_clip = float(min_clip)

  def factors(self, norms, clip):
    return clipping.clip_factors(norms, clip)

  def side_releases(self, expected_batch_size):
    del expected_batch_size  # its noise is in units of the clip
    return (_TrackedNorm(self),)

  def get_config(self) -> dict:
    return {"target_ratio": self.target_ratio, "rate": self.rate,
            "noise_multiplier": self.noise_multiplier,
            "min_clip": self.min_clip}

