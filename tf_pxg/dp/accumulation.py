"""Logical DP-SGD steps over several physical batches (gradient accumulation).

A logical step's batch (a Poisson sample, see `tf_pxg.data`) may span k
physical batches. DP-SGD's update for the step is

  `(sum over the step's examples of clip(g_b) + N(0, (sigma C)^2)) / (qN)`

so the clipped sums of the k physical batches are added up first, the noise
is drawn **once** (not k times: k draws would add k times the variance the
accountant assumes and waste k-1 draws), the result is divided by the
expected batch size `qN` (not the realised one: that would make the
update's sensitivity data-dependent), and the optimizer applies it once, so
`optimizer.iterations` counts logical steps. With `sigma = 0` the logical
step equals one step on the concatenated batch.

`LogicalStepAccumulator` holds the running sums. Its variables are
`ON_READ`/`SUM` variables: under a `tf.distribute` strategy each replica
accumulates its own share locally (no communication per physical batch);
the optimizer's all-reduce at the end of the logical step sums them.
`noisy_mean` adds the noise and normalises; under R replicas each adds std
`sigma C / sqrt(R)` (`tf_pxg.dp.noise.replica_noise_stddev`), so the
all-reduced sum carries std `sigma C` exactly once.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from tf_pxg.dp import noise as dp_noise


def _accumulator_dtype(dtype: tf.DType) -> tf.DType:
  """float32 for half-precision variables (sums of many terms), else theirs."""
  return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class LogicalStepAccumulator:
  """Running clipped-gradient sums and non-finite count of a logical step.

  Create it in the strategy scope (as the model's variables), outside any
  replica context. `variables` are the trainable variables the sums are
  for; `matches(variables)` tells whether it can be reused for a list.

  Args:
    variables: the trainable variables (any dtype; half precision is
      accumulated in float32).
  """

  def __init__(self, variables: Sequence[tf.Variable]):
    self._keys = [id(v) for v in variables]
    on_read = tf.VariableSynchronization.ON_READ
    agg = tf.VariableAggregation.SUM
    self.sums = [
        tf.Variable(tf.zeros(v.shape, _accumulator_dtype(v.dtype)),
                    trainable=False, synchronization=on_read,
                    aggregation=agg, name="dp_accumulated_sum")
        for v in variables]
    self.non_finite = tf.Variable(0, dtype=tf.int32, trainable=False,
                                  synchronization=on_read, aggregation=agg,
                                  name="dp_accumulated_non_finite")

  def matches(self, variables: Sequence[tf.Variable]) -> bool:
    return self._keys == [id(v) for v in variables]

  def reset(self) -> None:
    """Discards a partial logical step (call outside replica context)."""
    for a in self.sums:
      a.assign(tf.zeros_like(a))
    self.non_finite.assign(0)

  def step(self, sums: Sequence[tf.Tensor], non_finite: tf.Tensor,
           step_end: tf.Tensor,
           finish: Callable[[List[tf.Tensor], tf.Tensor], None]) -> None:
    """Adds one physical batch; at `step_end` finishes the logical step.

    Args:
      sums: this replica's clipped-gradient sums for this physical batch,
        one dense tensor per variable.
      non_finite: scalar int32, the number of non-finite per-example norms
        in this physical batch, already summed over replicas.
      step_end: scalar bool, equal on all replicas: whether this physical
        batch is the last of its logical step.
      finish: called (inside a `tf.cond` branch) with the logical step's
        totals `(sums, non_finite)`; it must add the noise and apply. The
        accumulators are then zeroed; otherwise the totals are stored.
    """
    totals = [tf.cast(a.read_value(), a.dtype) + tf.cast(s, a.dtype)
              for a, s in zip(self.sums, sums)]
    bad = self.non_finite.read_value() + tf.cast(non_finite, tf.int32)

    def end():
      finish(totals, bad)
      for a in self.sums:
        a.assign(tf.zeros_like(a))
      self.non_finite.assign(0)
      return tf.constant(True)

    def carry():
      for a, t in zip(self.sums, totals):
        a.assign(t)
      self.non_finite.assign(bad)
      return tf.constant(False)

    tf.cond(step_end, end, carry)


def noisy_mean(sums: Sequence[Optional[tf.Tensor]], l2_norm_clip: float,
               noise_multiplier: float, normalizer,
               generator: tf.random.Generator,
               num_replicas: int = 1) -> List[Optional[tf.Tensor]]:
  """`(sums + N(0, (sigma C)^2 / R)) / normalizer`, per replica.

  Args:
    sums: one replica's clipped-gradient sums over its share of a logical
      step (`None` entries pass through).
    l2_norm_clip: C.
    noise_multiplier: sigma; 0 draws no noise.
    normalizer: scalar, the divisor: the expected batch size qN of a Poisson
      step (or the realised global batch size for fixed batches).
    generator: the noise generator (created in the strategy scope, so every
      replica has its own stream).
    num_replicas: R; the R replicas' results are summed by the all-reduce.

  Returns:
    The replica's noisy, normalised gradients.
  """
  sums = list(sums)
  if noise_multiplier:
    stddev = dp_noise.replica_noise_stddev(noise_multiplier * l2_norm_clip,
                                           num_replicas)
    sums = dp_noise.add_gaussian_noise(sums, stddev, generator=generator)
  return [None if g is None else g / tf.cast(normalizer, g.dtype)
          for g in sums]
