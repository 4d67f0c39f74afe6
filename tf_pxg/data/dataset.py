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
from tf_pxg.data import sampling_ops


def _as_tensor_tree(data, name):
  """`data`'s arrays as tensors (held once; strings become tf.string)."""
  def convert(a):
    t = a if isinstance(a, tf.Tensor) else tf.convert_to_tensor(
        a if np.asarray(a).dtype != object else np.asarray(a).astype(bytes))
    if t.shape.rank == 0:
      raise ValueError(f"`{name}` holds a scalar; every array needs a "
                       "leading example axis.")
    return t
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
                        poisson.PhysicalBatch]]] = None,
                    start_step: Optional[int] = None,
                    num_parallel_calls=tf.data.AUTOTUNE
                    ) -> tf.data.Dataset:
  """`sampler`'s physical batches of `(x, y)` as a dataset, all TF ops.

  Sampling (`tf_pxg.data.sampling_ops`: geometric skips, stateless RNG
  keyed per step, O(B) per step) and gathering (`tf.gather` on tensors
  held once in the dataset, as Keras' own array adapter does) run inside
  `tf.data`: no Python generator, no GIL in the hot path, and the same
  stream from a `tf.data` service or under `tf.distribute`.

  Args:
    sampler: a `PoissonSampler` over `num_examples(x, y)` examples; its
      seed (or `secure_mode`) keys the stream.
    x: model inputs: an array or tensor, or a nest (dict, tuple, list) of
      them, with a leading example axis; any dtype, strings included.
    y: labels, same conventions.
    sample_weight: optional `[N]` (or `[N, ...]`) per-example weights; then
      `info` has a `dp_weight` entry.
    repeat: draw logical steps forever instead of `sampler.steps_per_epoch`.
    batches: optional; called once, here, and returns the `PhysicalBatch`es
      to feed instead of sampling (e.g. a recorded stream).
    start_step: key the stream's steps `start_step, start_step + 1, ...`
      (each a pure function of `(seed, step)`): every iteration yields those
      same steps, and a stream is resumed by starting where it stopped
      (`fit` starts at `optimizer.iterations`). None (default): each
      iteration draws fresh steps (a per-iteration nonce from the seeded
      stream), reproducibly given the seed.
    num_parallel_calls: for the gather map.

  Returns:
    A `tf.data.Dataset` of `(x, y, info)` (see the module docstring), `x`
    and `y` with leading dimension P and their own dtypes.

  Raises:
    ValueError: sizes disagree with each other or with the sampler.
  """
  x = _as_tensor_tree(x, "x")
  y = _as_tensor_tree(y, "y")
  n = num_examples(x, y, sample_weight)
  if n != sampler.num_examples:
    raise ValueError(f"The sampler is for {sampler.num_examples} examples; "
                     f"the data has {n}.")
  weight = (None if sample_weight is None else
            tf.cast(tf.convert_to_tensor(sample_weight), tf.float32))
  p = sampler.physical_batch_size
  if batches is not None:
    recorded = list(batches())
    index = tf.data.Dataset.from_tensor_slices((
        np.stack([b.indices for b in recorded]).astype(np.int64)
        if recorded else np.zeros((0, p), np.int64),
        np.stack([b.mask for b in recorded]).astype(np.float32)
        if recorded else np.zeros((0, p), np.float32),
        np.array([b.step_end for b in recorded], bool)))
  else:
    index = sampling_ops.index_stream(
        sampler, start_step=start_step,
        num_steps=None if repeat else sampler.steps_per_epoch)
  normalizer = tf.constant(sampler.expected_batch_size, tf.float32)
  held = (x, y, weight)

  def gather(batch, data):
    idx, mask, step_end = batch
    xs, ys, w = data
    idx = tf.ensure_shape(idx, [p])
    take = lambda a: tf.gather(a, idx)  # noqa: E731
    info = {poisson.MASK: mask,
            poisson.STEP_END: tf.fill([p], tf.cast(step_end, tf.float32)),
            poisson.NORMALIZER: tf.fill([p], normalizer)}
    if w is not None:
      info[poisson.WEIGHT] = take(w)
    info[poisson.MASK] = tf.ensure_shape(mask, [p])
    return (tf.nest.map_structure(take, xs), tf.nest.map_structure(take, ys),
            info)

  data = tf.data.Dataset.from_tensors(held).repeat()
  return tf.data.Dataset.zip((index, data)).map(
      gather, num_parallel_calls=num_parallel_calls,
      deterministic=True).prefetch(tf.data.AUTOTUNE)


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
