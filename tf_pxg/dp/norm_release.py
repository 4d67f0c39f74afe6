"""`ClippedNormMean`: the step's mean clipped gradient norm, released privately.

Choosing the clip is DP-SGD's main tuning problem, and the statistic that
informs it, the per-example gradient norms, is private. This side release
(`tf_pxg.dp.releases`) logs, once per applied logical step,

    clipped_norm_mean_t = (sum_b min(||g_b||, C_t) + N(0, (m C_t)^2)) / n

over the step's sampled examples (padding rows and non-finite examples
contribute 0), with `m = noise_multiplier` and `n` the gradient's divisor
(the expected batch size qN of a Poisson step). A value near C says most
examples are clipped; one far below it, that C could shrink.

**Privacy.** Adding or removing one example moves the sum by at most C_t
(each term is in `[0, C_t]`): a Gaussian mechanism of sensitivity C_t and
multiplier m on the step's batch, which `tf_pxg.dp.releases` composes with
the gradient (σ⁻² = σ_g⁻² + m⁻², the gradient taking the rest): the run's
ε, accounted with the plan's σ, covers the logged value. C_t is the clip
in use, itself data-independent or a function of earlier releases.

Use: `DPOptimizer(..., side_releases=[ClippedNormMean(noise_multiplier=
10 * sigma)])` (or the model's `side_releases=`); `fit` logs
`clipped_norm_mean`. This module is the whole of the release: the train
step, the plan and the optimizer's state know only the protocol.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tf_pxg.dp import releases

__all__ = ["ClippedNormMean"]


@keras.saving.register_keras_serializable(package="tf_pxg")
class ClippedNormMean(releases.SideRelease):
  """The noisy mean clipped norm (module docstring).

  Args:
    noise_multiplier: m > 0, the noise std in units of the clip; a few
      times the model's σ costs the gradient little (m = 10 σ: 0.5 % more
      gradient noise).

  Raises:
    ValueError: `noise_multiplier` not a finite number > 0.
  """

  name = "clipped_norm_mean"

  def __init__(self, noise_multiplier: float):
    if (isinstance(noise_multiplier, bool) or
        not isinstance(noise_multiplier, (int, float)) or
        not math.isfinite(noise_multiplier) or noise_multiplier <= 0):
      raise ValueError("ClippedNormMean: noise_multiplier must be a finite "
                       f"number > 0; got {noise_multiplier!r}.")
    self.noise_multiplier = float(noise_multiplier)

  def sensitivity(self, clip):
    return clip

  def statistic(self, batch: releases.ReleaseBatch) -> tf.Tensor:
    norms = tf.cast(batch.norms, tf.float32)
    clipped = tf.minimum(norms, tf.cast(batch.clip, tf.float32))
    return tf.reduce_sum(tf.where(batch.keep, clipped,
                                  tf.zeros_like(clipped)))

  @classmethod
  def from_config(cls, config: dict) -> "ClippedNormMean":
    return cls(**config)
