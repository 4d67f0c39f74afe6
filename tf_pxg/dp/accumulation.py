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
`step_noise` adds the noise (`noisy_mean` also normalises); under R
replicas each adds std `sigma C / sqrt(R)`
(`tf_pxg.dp.noise.replica_noise_stddev`), so the all-reduced sum carries
std `sigma C` exactly once.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from tf_pxg.dp import noise as dp_noise


def _accumulator_dtype(dtype: tf.DType) -> tf.DType:
  """float32 for half-precision variables (sums of many terms), else theirs."""
  return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class LogicalStepAccumulator:
  """Running clipped-gradient sums of a logical step.

  Create it in the strategy scope (as the model's variables), outside any
  replica context. `variables` are the trainable variables the sums are
  for; `matches(variables)` tells whether it can be reused for a list.

  Args:
    variables: the trainable variables (any dtype; half precision is
      accumulated in float32).
    num_scalars: extra float32 scalar sums accumulated after the
      variables' (adaptive clipping's unclipped count); `step` then takes
      `len(variables) + num_scalars` tensors.
  """

  def __init__(self, variables: Sequence[tf.Variable], num_scalars: int = 0):
    self._keys = [id(v) for v in variables]
    self.num_scalars = num_scalars
    on_read = tf.VariableSynchronization.ON_READ
    agg = tf.VariableAggregation.SUM
    self.sums = [
        tf.Variable(tf.zeros(shape, dtype), trainable=False,
                    synchronization=on_read, aggregation=agg,
                    name="dp_accumulated_sum")
        for shape, dtype in
        [(v.shape, _accumulator_dtype(v.dtype)) for v in variables] +
        [((), tf.float32)] * num_scalars]
    first = tf.VariableAggregation.ONLY_FIRST_REPLICA
    # Physical batches consumed since the last `reset`, and those of the
    # current logical step so far (equal on every replica). The sums hold
    # the step's running totals only while `in_step > 0`.
    self.position = tf.Variable(
        0, dtype=tf.int64, trainable=False, synchronization=on_read,
        aggregation=first, name="dp_physical_position")
    self.in_step = tf.Variable(
        0, dtype=tf.int64, trainable=False, synchronization=on_read,
        aggregation=first, name="dp_physical_in_step")

  def matches(self, variables: Sequence[tf.Variable],
              num_scalars: int = 0) -> bool:
    return (self._keys == [id(v) for v in variables] and
            self.num_scalars == num_scalars)

  def reset(self) -> None:
    """Discards a partial logical step (call outside replica context)."""
    for a in self.sums:
      a.assign(tf.zeros_like(a))
    self.position.assign(0)
    self.in_step.assign(0)

  def step(self, sums: Sequence[tf.Tensor], step_end: tf.Tensor,
           branchless: bool = False) -> List[tf.Tensor]:
    """Adds one physical batch; returns the logical step's running totals.

    The first physical batch of a step passes its sums through; later ones
    add the stored totals; all but the last store the new totals. So a
    logical step of one physical batch touches no accumulator, and one of k
    costs about one pass over the parameters per physical batch. The
    conditionals hold no synchronisation point, so they are allowed in
    replica context under MirroredStrategy. With `branchless` (for XLA on
    CPU, where a conditional copies the tensors it passes) the totals are
    always `stored + sums` and the store is a select; the stored sums are
    then zero between steps.

    Args:
      sums: this replica's clipped-gradient sums for this physical batch,
        one dense tensor per variable.
      step_end: scalar bool, equal on all replicas: whether this physical
        batch is the last of its logical step.

    Returns:
      The logical step's totals so far, one per variable.
    """
    sums = [tf.cast(x, a.dtype) for a, x in zip(self.sums, sums)]
    self.position.assign_add(1)
    if branchless:
      totals = [a.read_value() + x for a, x in zip(self.sums, sums)]
      for a, t in zip(self.sums, totals):
        a.assign(tf.where(step_end, tf.zeros_like(t), t))
      self.in_step.assign(tf.where(step_end, tf.constant(0, tf.int64),
                                   self.in_step + 1))
      return totals
    first = tf.equal(self.in_step, 0)
    totals = tf.cond(
        first, lambda: list(sums),
        lambda: [a.read_value() + x for a, x in zip(self.sums, sums)])

    def end():
      self.in_step.assign(0)
      return tf.constant(True)

    def carry():
      for a, t in zip(self.sums, totals):
        a.assign(t)
      self.in_step.assign_add(1)
      return tf.constant(False)

    tf.cond(step_end, end, carry)
    return totals


def step_noise(sums: Sequence[Optional[tf.Tensor]], l2_norm_clip: float,
               noise_multiplier: float, generator: tf.random.Generator,
               num_replicas: int = 1,
               draw: Optional[tf.Tensor] = None,
               scale=None) -> List[Optional[tf.Tensor]]:
  """`sums + N(0, (sigma C)^2 / R)`: one replica's share of a step's noise.

  Args:
    sums: one replica's clipped-gradient sums over its share of a logical
      step (`None` entries pass through).
    l2_norm_clip: C.
    noise_multiplier: sigma; 0 draws no noise.
    generator: the noise generator (created in the strategy scope, so every
      replica has its own stream).
    num_replicas: R; the R replicas' results are summed by the all-reduce,
      so each adds std `sigma C / sqrt(R)`.
    draw: optional scalar bool; when false no noise is drawn (a physical
      batch that does not end its logical step; its result is discarded
      and is not scaled).
    scale: optional factor for the noisy sums, applied in the noise's pass
      (`noisy_mean`'s division); only when noise is drawn.

  Returns:
    The replica's noisy sums (times `scale` where noise was drawn).
  """
  sums = list(sums)
  if not noise_multiplier:
    return sums
  stddev = dp_noise.replica_noise_stddev(noise_multiplier * l2_norm_clip,
                                         num_replicas)
  if draw is None:
    return dp_noise.add_gaussian_noise(sums, stddev, generator=generator,
                                       scale=scale)
  present = [i for i, g in enumerate(sums) if g is not None]
  noisy = tf.cond(
      draw,
      lambda: dp_noise.add_gaussian_noise(
          [sums[i] for i in present], stddev, generator=generator,
          scale=scale),
      lambda: [tf.identity(sums[i]) for i in present])
  for i, g in zip(present, noisy):
    sums[i] = g
  return sums


def noisy_mean(sums: Sequence[Optional[tf.Tensor]], l2_norm_clip: float,
               noise_multiplier: float, normalizer,
               generator: tf.random.Generator,
               num_replicas: int = 1,
               draw: Optional[tf.Tensor] = None) -> List[Optional[tf.Tensor]]:
  """`step_noise(...) / normalizer` (see `step_noise` for the arguments).

  `normalizer` is the divisor: the expected batch size qN of a Poisson
  step (or the realised global batch size for fixed batches). With noise,
  the division happens in the noise kernel's pass (`scale = 1 /
  normalizer`); without, as a division. With `draw` false the result is
  discarded (not divided).
  """
  if noise_multiplier:
    # float64, so float64 gradients get a float64 reciprocal.
    scale = 1.0 / tf.cast(normalizer, tf.float64)
    return step_noise(sums, l2_norm_clip, noise_multiplier, generator,
                      num_replicas, draw, scale=scale)
  return [None if g is None else g / tf.cast(normalizer, g.dtype)
          for g in sums]
