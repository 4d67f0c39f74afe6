"""Balls-in-bins sampling: every example in exactly one batch per epoch.

Each epoch e (k logical steps), every example is thrown independently and
uniformly into one of the epoch's k bins; step `t = e k + j` trains on bin
j (Chua, Ghazi, Harrison, Kamath, Kumar, Leeman, Manurangsi, Sinha, Zhang,
"Balls-and-Bins Sampling for DP-SGD", AISTATS 2025, arXiv:2412.16802).
Like shuffling, every example is seen once per epoch; unlike shuffling, the
bins' sizes are random (`Binomial(N, 1/k)`), so the batches are laid out
exactly as Poisson batches are (`PoissonSampler`'s fixed-shape masked
physical batches, overflow included) and the clipped sum is divided by the
expected batch size N / k, never by the realised size (which depends on
the data only through the public N, but dividing by it would make the
sensitivity data-dependent).

The bins of epoch e are a pure function of `(seed, e)`: the assignment is
drawn by TF's stateless RNG (philox) under a key folded from the seed and
the epoch (`epoch_key`), so every step of the epoch, a resumed `fit`, and
the NumPy path (`indices_for_step`, which runs the same TF ops eagerly)
see the same bins. Secure mode is refused: its per-step OS keys cannot key
a whole epoch (use Poisson sampling there).

**Accounting (an upper bound, stated).** dp-accounting has no
balls-in-bins event. Chua et al. compute ε by Monte-Carlo estimation of
the privacy loss (close to Poisson's at the same rate, see their Table 1);
that estimate is not a certified bound and is not implemented here.
`dp_event` instead returns a valid upper bound: fix any assignment of the
bins; then a unit's data enters exactly one step per epoch, so the release
is the adaptive composition of one Gaussian mechanism (sensitivity C,
noise multiplier sigma; the mechanism's per-participation event) per
epoch, and the other steps do not depend on it. The actual release is a
mixture over assignments drawn independently of the data, and the
hockey-stick divergence is jointly convex, so the bound for every fixed
assignment holds for the mixture:

    SelfComposedDpEvent(mechanism.dp_event(sigma), ceil(T / k)).

This is the deterministic-participation (no amplification) bound, also
valid for shuffling; it is loose (it ignores that the adversary does not
know the step), often far above Poisson's ε at rate 1/k (the test and
docs/sampling.md give numbers). It needs a per-step mechanism with no
cyclic schema (`participation_groups == 1`); others are refused.

Added in this one file plus a generic hook: `PoissonSampler`'s subclass
overrides `step_indices` (the sampler protocol's selection, which
`tf_pxg.data.sampling_ops.index_stream` calls) and `dp_event`; `fit`
takes it as `sampling=BallsInBinsSampler`.
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_pxg.data import poisson

__all__ = ["BallsInBinsSampler"]

_EPOCH_SALT = 0x62616C6C  # "ball": keeps epoch keys apart from step keys


class BallsInBinsSampler(poisson.PoissonSampler):
  """Balls-in-bins logical batches, laid out as `PoissonSampler`'s.

  Args:
    num_examples: N.
    expected_batch_size: B; the epoch has `k = steps_per_epoch` bins
      (default `round(N / B)`, at least 1) and the expected batch size is
      N / k (B exactly when k divides N).
    seed: the assignment's seed (None: OS entropy, drawn once).
    secure_mode: must be False (module docstring).
    num_groups: must be 1 (no cyclic schema).
    others: as `PoissonSampler`.

  Raises:
    ValueError: secure mode, `num_groups > 1`, bad sizes.
  """

  def __init__(self, num_examples: int, expected_batch_size: float,
               physical_batch_size: Optional[int] = None,
               accumulation_steps: int = 1, num_replicas: int = 1,
               steps_per_epoch: Optional[int] = None,
               seed: Optional[int] = None, secure_mode: bool = False,
               start_step: int = 0, num_groups: int = 1,
               group_seed: Optional[int] = None):
    del group_seed
    if secure_mode:
      raise ValueError(
          "BallsInBinsSampler: secure mode draws every step's key from the "
          "OS, but balls-in-bins needs one assignment per epoch shared by "
          "its k steps. Use Poisson sampling (the default) in secure mode.")
    if num_groups != 1:
      raise ValueError(
          f"BallsInBinsSampler has no cyclic groups; the model's noise "
          f"mechanism needs {num_groups} (BandMF/BLT participation). Use "
          "Poisson sampling (the default) for it.")
    bins = steps_per_epoch or max(1, round(num_examples /
                                           expected_batch_size))
    super().__init__(num_examples, num_examples / bins,
                     physical_batch_size=physical_batch_size,
                     accumulation_steps=accumulation_steps,
                     num_replicas=num_replicas, steps_per_epoch=bins,
                     seed=seed, start_step=start_step)

  @property
  def num_bins(self) -> int:
    """k, the batches (steps) of an epoch."""
    return self.steps_per_epoch

  def epoch_key(self, epoch) -> tf.Tensor:
    """The `[2]` int64 stateless key of epoch `epoch`'s assignment."""
    base = tf.constant([self.seed >> 32, self.seed & 0xFFFFFFFF], tf.int64)
    return tf.cast(tf.random.experimental.stateless_fold_in(
        tf.random.experimental.stateless_fold_in(base, _EPOCH_SALT),
        tf.cast(epoch, tf.int64)), tf.int64)

  def step_indices(self, step, key=None) -> tf.Tensor:
    """TF ops: the sorted indices of logical step `step` (bin
    `step mod k` of epoch `step div k`). `key` (the stream's per-step
    key) is not used: the epoch's key is."""
    del key
    step = tf.cast(step, tf.int64)
    k = tf.constant(self.num_bins, tf.int64)
    bins = tf.random.stateless_uniform(
        [self.num_examples], seed=self.epoch_key(step // k), minval=0,
        maxval=self.num_bins, dtype=tf.int64, alg="philox")
    return tf.where(tf.equal(bins, tf.math.floormod(step, k)))[:, 0]

  def indices_for_step(self, step: int) -> np.ndarray:
    return self.step_indices(int(step)).numpy().astype(np.int64)

  def dp_event(self, mechanism, noise_multiplier: float,
               steps: int) -> dp_accounting.DpEvent:
    """The upper bound of the module docstring: the mechanism's event
    composed once per epoch begun, `ceil(steps / k)` times.

    Raises:
      ValueError: a mechanism with a cyclic schema or a whole-run event.
    """
    if (int(mechanism.participation_groups) != 1 or
        getattr(mechanism, "whole_run_event", False)):
      raise ValueError(
          f"BallsInBinsSampler's ε is stated for a per-step mechanism "
          f"without cyclic participation; got {mechanism!r}. Use Poisson "
          "sampling (the default) for it.")
    return dp_accounting.SelfComposedDpEvent(
        mechanism.dp_event(noise_multiplier),
        math.ceil(int(steps) / self.num_bins))
