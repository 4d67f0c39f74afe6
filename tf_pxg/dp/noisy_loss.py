"""A training loss that may be logged: clipped per example, summed, noised.

The DP train step logs nothing computed from the private batch by default
(docs/threat_model.md, "Training logs"). `NoisyLoss(bound, noise_multiplier)`
releases, once per logical step, a private estimate of the mean training
loss, logged by `fit` as `loss`:

    loss_t = (sum_b min(max(l_b, 0), bound) + N(0, (z * bound)^2)) / n

over the step's sampled units `b` (padding rows and non-finite examples
contribute 0), with `z = noise_multiplier` and `n` the gradient's divisor
(the expected batch size qN of a Poisson step). Keras' loss tracker
averages the steps of an epoch, so the epoch's logged loss has noise std
about `z * bound / (n * sqrt(steps))`.

**Privacy.** Adding or removing one example changes the clamped sum by at
most `bound` (each term is in `[0, bound]`, a non-finite one is 0): a
Gaussian mechanism of sensitivity `bound` and noise multiplier `z`, on the
same sampled batch as the gradient sum (sensitivity C, multiplier σ_g). As
for adaptive clipping's count (`tf_pxg.accounting.split_noise_multipliers`,
Andrew et al. 2021, Theorem 1), the Rényi divergences of Gaussians add in
1/σ², so the pair (and the count, if any) is one subsampled Gaussian
mechanism with

    σ⁻² = σ_g⁻² + z⁻²  [+ (2 σ_b)⁻²].

The DP step therefore gives the gradient `σ_g = (σ⁻² − z⁻² [− (2σ_b)⁻²])^-1/2`
(slightly more noise than σ) and the run is accounted with the model's σ,
unchanged: `PrivacyCallback`'s ε covers the logged loss. `NoisyLoss` is a
`tf_pxg.dp.releases.SideRelease`: the split is
`tf_pxg.dp.releases.gradient_noise_multiplier`'s, with the other releases. Callbacks that read
`loss` (`TerminateOnNaN`, `EarlyStopping`, `ReduceLROnPlateau`) then decide
on a DP release: post-processing. `z` must exceed σ (else the loss alone
would use the whole budget); `z = 10 σ` costs the gradient 0.5 % more noise.

The clamp at 0 assumes losses that are >= 0 (cross-entropy, squared error);
a negative loss is logged as 0.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_pxg.dp import releases


class NoisyLoss(releases.SideRelease):
  """The noisy, accounted training loss (module doc).

  Args:
    bound: each example's loss is clamped to `[0, bound]` (the release's
      sensitivity), e.g. a few times the initial loss (log(K) for K-class
      cross-entropy).
    noise_multiplier: z, the noise std in units of `bound`; must exceed the
      model's noise multiplier σ (checked by `gradient_noise_multiplier`).

  Raises:
    ValueError: `bound` not finite and > 0, or `noise_multiplier` not
      finite and > 0.
  """

  #: Logged as Keras' `loss` (its loss tracker averages an epoch's steps).
  name = "loss"
  stateful = False

  def __init__(self, bound: float, noise_multiplier: float):
    for name, value in (("bound", bound),
                        ("noise_multiplier", noise_multiplier)):
      if (isinstance(value, bool) or not isinstance(value, (int, float)) or
          not math.isfinite(value) or value <= 0):
        raise ValueError(f"NoisyLoss: {name} must be a finite number > 0; "
                         f"got {value!r}.")
    self.bound = float(bound)
    self.noise_multiplier = float(noise_multiplier)

  def sensitivity(self, clip) -> float:
    """`bound`: each term is in `[0, bound]` (a non-finite one is 0)."""
    del clip
    return self.bound

  def statistic(self, batch: releases.ReleaseBatch) -> tf.Tensor:
    """The clamped loss sum of the real, finite examples."""
    return self.clamped_sum(batch.losses, batch.keep)

  def clamped_sum(self, losses: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    """`sum_b keep_b * min(max(l_b, 0), bound)` as float32.

    Args:
      losses: `[B]` per-example (or per-unit) losses.
      keep: `[B]` bool: real (not padding) and finite examples.
    """
    losses = tf.cast(losses, tf.float32)
    clamped = tf.clip_by_value(losses, 0.0, self.bound)
    return tf.reduce_sum(tf.where(keep, clamped, tf.zeros_like(clamped)))

  def gradient_noise_multiplier(self, noise_multiplier: float,
                                *other_multipliers: float) -> float:
    """σ_g for an accounted σ, given the other releases' multipliers
    (`tf_pxg.dp.releases.gradient_noise_multiplier`).

    Raises:
      ValueError: if σ⁻² is not larger than the releases' shares (z <= σ).
    """
    others = [releases.MechanismRelease("a side release", m)
              for m in other_multipliers]
    return releases.gradient_noise_multiplier(noise_multiplier,
                                              [self] + others)

  def overuse_hint(self, noise_multiplier: float) -> str:
    return (f"{self!r} is too noisy a release for noise_multiplier="
            f"{noise_multiplier!r}: its noise multiplier must exceed the "
            "model's (with any adaptive clipping count's share), else the "
            "logged loss alone would use the whole privacy budget. Use "
            f"noise_multiplier > {noise_multiplier!r}; 10x costs the "
            "gradient 0.5% more noise.")

  def get_config(self) -> dict:
    return {"bound": self.bound, "noise_multiplier": self.noise_multiplier}

  @classmethod
  def from_config(cls, config: dict) -> "NoisyLoss":
    return cls(**config)
