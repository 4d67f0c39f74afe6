"""`tf.data` pipelines of Poisson-sampled, masked, fixed-shape batches.

Each element is `(x, y, info)`: `x` and `y` are the dataset's arrays
gathered at a `PhysicalBatch`'s indices (leading dimension P), and `info` is
a dict of `[P]` float32 tensors: `dp_mask` (1 sampled, 0 padding),
`dp_step_end` (1 on the last physical batch of a logical step, else 0),
`dp_normalizer` (the expected batch size `qN` the step's sum is divided by)
and, only when the user gave sample weights, `dp_weight` (their rows). A DP model's `fit` feeds
this structure in the `sample_weight` slot; custom loops read it directly.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np
import tensorflow as tf

from tf_pxg.data import poisson


def _as_numpy_tree(data, name):
  def convert(a):
    a = np.asarray(a)
    if a.ndim == 0:
      raise ValueError(f"`{name}` holds a scalar; every array needs a "
                       "leading example axis.")
    return a
  data = tf.nest.map_structure(convert, data)
  # tf.data treats lists as tensors to stack; model inputs given as a list
  # are passed on as a tuple (Keras accepts both).
  if isinstance(data, list):
    data = tuple(data)
  return data


def num_examples(*structures) -> int:
  """The common leading size of every array in `structures`.

  Raises:
    ValueError: arrays of different lengths (named by position).
  """
  sizes = {int(np.shape(a)[0]) for s in structures if s is not None
           for a in tf.nest.flatten(s)}
  if len(sizes) != 1:
    raise ValueError(
        f"All arrays passed to Poisson sampling must have the same number of "
        f"examples (leading dimension); got sizes {sorted(sizes)}.")
  return sizes.pop()


def poisson_dataset(sampler: poisson.PoissonSampler, x, y,
                    sample_weight=None, repeat: bool = False,
                    batches: Optional[Callable[[], Iterable[
                        poisson.PhysicalBatch]]] = None
                    ) -> tf.data.Dataset:
  """`sampler`'s physical batches of `(x, y)` as a dataset.

  Args:
    sampler: a `PoissonSampler` over `num_examples(x, y)` examples.
    x: model inputs: an array or a nest (dict, tuple, list) of arrays with a
      leading example axis, held in host memory.
    y: labels, same conventions.
    sample_weight: optional `[N]` (or `[N, ...]`) per-example weights; then
      `info` has a `dp_weight` entry.
    repeat: draw logical steps forever instead of one epoch.
    batches: optional; called at each iteration, returns the
      `PhysicalBatch`es to feed instead of drawing from `sampler` (e.g. a
      recorded stream, or the rest of a logical step).

  Returns:
    A `tf.data.Dataset` of `(x, y, info)` (see the module docstring). It is
    re-iterable; each iteration draws `sampler.steps_per_epoch` fresh
    logical steps (forever with `repeat`) from the sampler's stream.

  Raises:
    ValueError: sizes disagree with each other or with the sampler.
  """
  x = _as_numpy_tree(x, "x")
  y = _as_numpy_tree(y, "y")
  n = num_examples(x, y, sample_weight)
  if n != sampler.num_examples:
    raise ValueError(f"The sampler is for {sampler.num_examples} examples; "
                     f"the data has {n}.")
  weight = (None if sample_weight is None else
            np.asarray(sample_weight, np.float32))
  normalizer = np.full(sampler.physical_batch_size, sampler.expected_batch_size,
                       np.float32)
  p = sampler.physical_batch_size

  def spec(a):
    return tf.TensorSpec((p,) + a.shape[1:], tf.as_dtype(a.dtype))

  info_spec = {poisson.MASK: tf.TensorSpec((p,), tf.float32),
               poisson.STEP_END: tf.TensorSpec((p,), tf.float32),
               poisson.NORMALIZER: tf.TensorSpec((p,), tf.float32)}
  if weight is not None:
    info_spec[poisson.WEIGHT] = spec(weight)
  signature = (tf.nest.map_structure(spec, x), tf.nest.map_structure(spec, y),
               info_spec)

  def stream():
    while True:
      yield from sampler.epoch()
      if not repeat:
        return

  def generate():
    for batch in (stream() if batches is None else batches()):
      take = lambda a, i=batch.indices: a[i]  # noqa: E731
      info = {poisson.MASK: batch.mask,
              poisson.STEP_END: np.full(p, float(batch.step_end), np.float32),
              poisson.NORMALIZER: normalizer}
      if weight is not None:
        info[poisson.WEIGHT] = weight[batch.indices]
      yield (tf.nest.map_structure(take, x), tf.nest.map_structure(take, y),
             info)

  return tf.data.Dataset.from_generator(
      generate, output_signature=signature).prefetch(2)


def shard_batch(batch, num_shards: int, index):
  """Rows `[index * P/S, (index + 1) * P/S)` of every tensor of `batch`.

  Slice `index` is replica `index`'s share of a global batch: the sampler
  dealt the real rows round-robin over the slices. (Under a strategy use
  `for_input_pipeline`.)
  """
  def cut(t):
    rows = tf.shape(t)[0] // num_shards
    return t[index * rows:(index + 1) * rows]
  return tf.nest.map_structure(cut, batch)


def for_input_pipeline(dataset: tf.data.Dataset,
                       input_context: tf.distribute.InputContext
                       ) -> tf.data.Dataset:
  """A dataset of global batches, as one input pipeline's replicas take it.

  For `strategy.distribute_datasets_from_function(fn)`: `fn(ctx)` builds the
  same global dataset on every worker (same sampler seed) and returns
  `for_input_pipeline(dataset, ctx)`. Each global batch (P rows, laid out by
  replica) becomes the consecutive slices of this pipeline's replicas
  (replica `i * R/W + j` for pipeline i of W, j < R/W), which is the order
  in which the strategy hands elements to its local replicas.

  Raises:
    ValueError: the replica count is not a multiple of the pipeline count.
  """
  r = input_context.num_replicas_in_sync
  w = input_context.num_input_pipelines
  if r % w:
    raise ValueError(f"{r} replicas cannot be split evenly over {w} input "
                     "pipelines.")
  local, first = r // w, input_context.input_pipeline_id * (r // w)

  def slices(*batch):
    return tf.data.Dataset.range(local).map(
        lambda j: shard_batch(batch, r, first + tf.cast(j, tf.int32)))

  return dataset.flat_map(slices)


def is_dp_batch_info(value) -> bool:
  """Whether `value` is the `info` dict of a Poisson physical batch."""
  return isinstance(value, dict) and poisson.MASK in value


def dp_batch_info(mask, step_end, normalizer, weight=None) -> dict:
  """Builds the `info` dict from `[P]` tensors (custom pipelines, tests).

  Args:
    mask: `[P]` 1 for real rows, 0 for padding rows.
    step_end: scalar or `[P]` bool or 0/1: whether this physical batch ends its
      logical step.
    normalizer: scalar or `[P]`: what the logical step's noisy sum is divided
      by (the expected batch size qN).
    weight: optional `[P]` per-example weights.
  """
  mask = tf.cast(mask, tf.float32)
  shape = tf.shape(mask)
  return {poisson.MASK: mask,
          poisson.STEP_END: tf.broadcast_to(tf.cast(step_end, tf.float32),
                                            shape),
          poisson.NORMALIZER: tf.broadcast_to(
              tf.cast(normalizer, tf.float32), shape),
          **({} if weight is None else
             {poisson.WEIGHT: tf.cast(weight, tf.float32)})}


__all__ = ["dp_batch_info", "for_input_pipeline", "is_dp_batch_info",
           "num_examples", "poisson_dataset", "shard_batch"]
