"""`tf.data` pipelines of Poisson-sampled, masked, fixed-shape batches.

Each element is `(x, y, info)`: `x` and `y` are the dataset's arrays
gathered at a `PhysicalBatch`'s indices (leading dimension P), and `info` is
a dict of `[P]` float32 tensors: `dp_mask` (1 sampled, 0 padding),
`dp_step_end` (1 on the last physical batch of a logical step, else 0),
`dp_normalizer` (the expected batch size B = `qN` the step's sum is divided
by; with cyclic sampling, `min_separation=b`, it stays the constant
B = `qN / b`, the expected batch averaged over the groups, see `tf_pxg.data.poisson`)
and, only when the user gave sample weights, `dp_weight` (their rows): the
wire form of a `tf_pxg.data.BatchInfo` (`BatchInfo.to_element`). A DP
model's `fit` feeds this structure in the `sample_weight` slot; the train
step and custom loops read it as `BatchInfo.from_element(info)`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np
import tensorflow as tf

from tf_pxg.data import batch_info
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
                    num_parallel_calls=tf.data.AUTOTUNE,
                    augmult: int = 1, user_ids=None,
                    examples_per_user: Optional[int] = None
                    ) -> tf.data.Dataset:
  """`sampler`'s physical batches of `(x, y)` as a dataset, all TF ops.

  Sampling (`tf_pxg.data.sampling_ops`: geometric skips, stateless RNG
  keyed per step, O(B) per step) and gathering (`tf.gather` on tensors
  held once in the dataset, as Keras' own array adapter does) run inside
  `tf.data`: no Python generator, no GIL in the hot path, and the same
  stream from a `tf.data` service or under `tf.distribute`.

  Args:
    sampler: a `PoissonSampler` over `num_examples(x, y)` examples; its
      seed (or `secure_mode`) keys the stream, its `min_separation` and
      `group_seed` make it cyclic (step s draws only the rows of group
      s mod b, the sampler's `group_members(s % b)`; its member lists are
      held in the dataset as constant tensors).
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
      (`fit` starts at `optimizer.iterations`; with `min_separation` b the
      step s samples group s mod b, so the cycle continues). None
      (default): each iteration draws fresh steps (a per-iteration nonce
      from the seeded stream), reproducibly given the seed, counted from 0
      (group 0 first; with b > 1 and `repeat=False`,
      `sampler.steps_per_epoch` must then be a multiple of b).
    num_parallel_calls: for the gather map.
    augmult: K >= 1, augmentation multiplicity: every sampled example's
      row appears K times, contiguously (P·K rows per physical batch, unit
      `p` in rows `[p K, (p + 1) K)`); `info` then also has `dp_row_mask`
      `[P K]`, and the DP train step averages the K copies' losses into
      the example's loss before clipping (see docs/privacy_units.md).
    user_ids: optional `[N]` int or string user of each example, for
      user-level DP: `sampler` is then over the U users
      (`PoissonSampler(U, B)`, U = number of distinct ids, see
      `user_index`; with `min_separation`, the groups are of users, by their
      index among the sorted distinct ids), and each sampled user
      contributes up to `examples_per_user` = k of their examples chosen
      uniformly at random without replacement (fresh per physical
      batch), padded to k with masked rows (`dp_row_mask` 0): P·k rows.
      The train step takes the masked mean of the user's rows' losses as
      the user's loss.
    examples_per_user: k, required with `user_ids`. With `augmult` K as
      well, each chosen example appears K times: P·k·K rows.

  Returns:
    A `tf.data.Dataset` of `(x, y, info)` (see the module docstring), `x`
    and `y` with leading dimension P and their own dtypes.

  Raises:
    ValueError: sizes disagree with each other or with the sampler.
  """
  x = _as_tensor_tree(x, "x")
  y = _as_tensor_tree(y, "y")
  n = num_examples(x, y, sample_weight)
  if isinstance(augmult, bool) or int(augmult) != augmult or augmult < 1:
    raise ValueError(f"augmult must be a positive integer; got {augmult!r}.")
  augmult = int(augmult)
  users = None
  if user_ids is not None:
    users = user_index(user_ids, n, examples_per_user)
    if users.num_users != sampler.num_examples:
      raise ValueError(
          f"With user_ids the sampler is over users: it is for "
          f"{sampler.num_examples} units, the data has {users.num_users} "
          f"distinct users. Use PoissonSampler(num_users, B).")
  elif examples_per_user is not None:
    raise ValueError("examples_per_user needs user_ids.")
  elif n != sampler.num_examples:
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
  if users is not None:
    index = tf.data.Dataset.zip((index, _selection_keys(sampler)))
  else:
    index = index.map(sampling_ops.as_written(
        lambda i, m, e: ((i, m, e), tf.zeros([2], tf.int64))))

  def rows_of(idx, mask, key):
    """The rows of the P units and their `[P G]` mask (None: G = 1)."""
    if users is not None:
      # With augmult too: each chosen example's row K times (the user's
      # unit is k K rows; every real example has K real copies, so the
      # masked mean over rows is the mean over examples of their copies'
      # means).
      idx, mask = users.rows(idx, mask, key)
    elif augmult == 1:
      return idx, None
    if augmult == 1:
      return idx, mask
    return tf.repeat(idx, augmult), tf.repeat(mask, augmult)

  def gather(batch, data):
    (idx, mask, step_end), key = batch
    xs, ys, w = data
    idx = tf.ensure_shape(idx, [p])
    mask = tf.ensure_shape(mask, [p])
    rows, row_mask = rows_of(idx, mask, key)
    take = lambda a: tf.gather(a, rows)  # noqa: E731
    info = batch_info.BatchInfo(
        mask, step_end, normalizer, None if w is None else take(w), row_mask)
    return (tf.nest.map_structure(take, xs), tf.nest.map_structure(take, ys),
            info.to_element())

  data = tf.data.Dataset.from_tensors(held).repeat()
  return tf.data.Dataset.zip((index, data)).map(
      sampling_ops.as_written(gather), num_parallel_calls=num_parallel_calls,
      deterministic=True).prefetch(tf.data.AUTOTUNE)


def _selection_keys(sampler) -> tf.data.Dataset:
  """Endless `[2]` int64 keys, one per physical batch, for user selection.

  Seeded: a pure function of `(seed, batch count)` of this iteration (a
  stream salted apart from the sampling keys). Secure mode: 128 fresh bits
  from the OS CSPRNG per batch.
  """
  if sampler.secure_mode:
    return sampling_ops.urandom_keys()
  base = sampling_ops.step_key(sampler.seed, -1)
  return tf.data.Dataset.counter().map(sampling_ops.as_written(
      lambda i: tf.cast(tf.random.experimental.stateless_fold_in(
          base, tf.cast(i, tf.int64)), tf.int64)))


class UserIndex:
  """Examples grouped by user: `order` (example ids sorted by user),
  `offsets` and `counts` per user (int64 tensors), `num_users` U, the
  largest user `max_count`, and `k` examples per user per step."""

  def __init__(self, inverse: np.ndarray, k: int):
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse)
    self.num_users = int(counts.size)
    self.max_count = int(counts.max())
    self.k = int(k)
    self.counts_np = counts
    self.inverse = inverse
    self.order = tf.constant(order, tf.int64)
    self.counts = tf.constant(counts, tf.int64)
    self.offsets = tf.constant(
        np.concatenate([[0], np.cumsum(counts)[:-1]]), tf.int64)

  def rows(self, units, unit_mask, key):
    """`[P k]` example rows of users `units` and their row mask.

    Each user's k slots take min(k, count) of their examples uniformly at
    random without replacement (the k smallest of i.i.d. uniform keys over
    the user's positions); the rest are masked copies of one example.
    """
    k, m = self.k, max(self.max_count, self.k)
    p = tf.shape(units)[0]
    counts = tf.gather(self.counts, units)
    u = tf.random.stateless_uniform([p, m], tf.cast(key, tf.int64),
                                    dtype=tf.float32)
    pos = tf.range(m, dtype=tf.int64)[None, :]
    u = tf.where(pos < counts[:, None], u, 2.0 + tf.cast(pos, tf.float32))
    _, chosen = tf.math.top_k(-u, k=k)
    chosen = tf.cast(chosen, tf.int64)
    valid = chosen < counts[:, None]
    chosen = tf.minimum(chosen, counts[:, None] - 1)
    rows = tf.gather(self.order,
                     tf.gather(self.offsets, units)[:, None] + chosen)
    row_mask = tf.cast(valid, tf.float32) * unit_mask[:, None]
    return tf.reshape(rows, [-1]), tf.reshape(row_mask, [-1])


def user_index(user_ids, num_rows: Optional[int] = None,
               examples_per_user: Optional[int] = None) -> UserIndex:
  """Groups examples by `user_ids` (`[N]` ints or strings) for user-level DP.

  The number of users U is the number of distinct ids (`.num_users`):
  sample users with `PoissonSampler(U, B)`.

  Raises:
    ValueError: `user_ids` not a 1-D array of ints or strings, of a length
      other than `num_rows`; `examples_per_user` not a positive int.
  """
  if (examples_per_user is None or isinstance(examples_per_user, bool) or
      int(examples_per_user) != examples_per_user or examples_per_user < 1):
    raise ValueError("user-level sampling needs examples_per_user, a "
                     f"positive integer; got {examples_per_user!r}.")
  if isinstance(user_ids, tf.Tensor):
    user_ids = user_ids.numpy()
  ids = np.asarray(user_ids)
  if ids.dtype == object:
    try:
      ids = ids.astype(bytes)
    except (TypeError, ValueError, UnicodeEncodeError) as e:
      raise ValueError("user_ids must hold ints or strings; got objects "
                       f"that are neither ({e}).") from None
  if ids.ndim != 1:
    raise ValueError(f"user_ids must be a 1-D array (one id per example); "
                     f"got shape {ids.shape}.")
  if ids.dtype.kind not in "iuSU":
    raise ValueError(f"user_ids must be integers or strings (one user id "
                     f"per example); got dtype {ids.dtype}.")
  if num_rows is not None and ids.shape[0] != num_rows:
    raise ValueError(f"user_ids has {ids.shape[0]} entries but the data has "
                     f"{num_rows} examples: one user id per example.")
  if ids.shape[0] == 0:
    raise ValueError("user_ids is empty.")
  _, inverse = np.unique(ids, return_inverse=True)
  return UserIndex(inverse.reshape(-1), int(examples_per_user))


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
    return tf.data.Dataset.range(local).map(sampling_ops.as_written(
        lambda j: shard_batch(batch, r, first + tf.cast(j, tf.int32))))

  return dataset.flat_map(sampling_ops.as_written(slices))


def is_dp_batch_info(value) -> bool:
  """Whether `value` is the `info` dict of a Poisson physical batch (the
  wire form of a `tf_pxg.data.BatchInfo`)."""
  return batch_info.is_element(value)


def dp_batch_info(mask, step_end, normalizer, weight=None,
                  row_mask=None) -> dict:
  """Builds the `info` dict from `[P]` tensors (custom pipelines, tests):
  `BatchInfo(...).to_element()`.

  Args:
    mask: `[P]` 1 for real rows, 0 for padding rows.
    step_end: scalar or `[P]` bool or 0/1: whether this physical batch ends its
      logical step.
    normalizer: scalar or `[P]`: what the logical step's noisy sum is divided
      by (the expected batch size qN).
    weight: optional per-row weights (`[P]`, or `[P G]` with `row_mask`).
    row_mask: optional `[P G]` per-row mask of units of G contiguous rows
      (augmult, user-level): the train step averages each unit's real
      rows' losses into the unit's loss, clipped as one.
  """
  return batch_info.BatchInfo(mask, step_end, normalizer, weight,
                              row_mask).to_element()


__all__ = ["UserIndex", "dp_batch_info", "for_input_pipeline",
           "is_dp_batch_info", "num_examples", "poisson_dataset",
           "shard_batch", "user_index"]
