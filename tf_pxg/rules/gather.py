"""Gathers (embedding lookups): GatherV2 and ResourceGather on axis 0.

Example b's gradient is a scatter of its rows of dz into a `[V, ...]` table.
`per_example` must return that dense `[B, V, ...]` tensor (it is what was
asked for), but norms and weighted sums never build it:

* squared norm: `sum_{t,s} [id_t == id_s] <dz_t, dz_s>` over the example's
  tokens (repeated tokens add up before squaring), O(B L^2 D), compiled
  with XLA as one function (the comparison, the select and the sum fuse
  into one loop over the Gram; TF's kernels make three passes, and its
  broadcasting `Equal` alone cost about as much as the Gram's matmul;
  docs/benchmarks.md);
* weighted sum: TF's IndexedSlices gradient of the rows scaled by c_b;
* outer factors (`tf_pxg.rules.factors`): one-hot rows of the ids and dz's
  rows, for the inner product with another use of the table (a tied LM
  head) without the `[B, V, D]` gradient.
"""

from __future__ import annotations

import tensorflow as tf

from tf_pxg.rules import base
from tf_pxg.rules import factors
from tf_pxg.rules.base import register


class _GatherRule(base.Rule):
  """Gather with the parameter as the table (input 0) and batched indices."""

  # The table's gradient is dz's rows at the indices: scaling dz (a select
  # for a zero factor) is all a non-finite example needs.
  drop_inputs = False
  drop_outputs = False
  mergeable = True

  def permutable(self, itf, axis):
    """The table is gathered on its axis 0 whatever axis holds the
    examples of the indices."""
    del axis
    return itf.param_index == 0

  def check(self, ctx):
    if ctx.param_index != 0:
      raise NotImplementedError(
          f"{ctx.describe()}: the parameter is the indices, not the table")
    if ctx.attr("batch_dims") != 0:
      raise NotImplementedError(f"{ctx.describe()}: batch_dims != 0")
    if ctx.op_type == "GatherV2":
      axis = tf.get_static_value(ctx.inputs[2])
      if axis is None or int(axis) != 0:
        raise NotImplementedError(
            f"{ctx.describe()}: only gathers along axis 0 have a rule")

  def _rows(self, ctx):
    """ids `[B, L]` and dz `[B, L, D]` (D = row size of the table)."""
    ids = ctx.split_batch(ctx.inputs[1])
    b = tf.shape(ids)[0]
    ids = tf.reshape(ids, [b, -1])
    dz = ctx.split_batch(ctx.dz)
    dz = tf.reshape(dz, tf.stack([b, tf.shape(ids)[1], -1]))
    return ids, dz

  def per_example(self, ctx):
    ids, dz = self._rows(ctx)
    shape = ctx.param_shape
    vocab = shape[0]
    b = tf.shape(ids)[0]
    flat = tf.reshape(
        ids + tf.cast(vocab, ids.dtype) * tf.range(b, dtype=ids.dtype)[:, None],
        [-1])
    rows = tf.reshape(dz, tf.stack([-1, tf.shape(dz)[2]]))
    table = tf.math.unsorted_segment_sum(rows, flat, b * tf.cast(vocab, b.dtype))
    return tf.reshape(table, tf.concat([[b], tf.cast(shape, tf.int32)], 0))

  def sq_norm(self, ctx):
    ids, dz = self._rows(ctx)
    return _masked_gram_sum(ids, tf.cast(dz, tf.float32))

  def outer_factors(self, ctx):
    """`factors.OuterFactors` of a 2-D table's per-example gradient:
    `sum_t e_{id_t} (x) dz_t` (one-hot rows `[B, L]`, dz `[B, L, D]`);
    None for a table of another rank."""
    shape = ctx.param_shape
    if tf.is_tensor(shape):  # A resource handle's shape: static if known.
      shape = tf.get_static_value(shape)
    elif shape.rank is None:
      return None
    if shape is None or len(shape) != 2:
      return None
    shape = [None if d is None else int(d) for d in shape]
    ids, dz = self._rows(ctx)
    ids.set_shape([None, _rows_per_example(ctx)])
    dtype = tf.float64 if dz.dtype == tf.float64 else tf.float32
    return factors.OuterFactors(factors.OneHot(ids, shape[0]),
                                factors.Dense(tf.cast(dz, dtype)))


def _rows_per_example(ctx):
  """The static number of ids per example, or None."""
  ids = ctx.inputs[1]
  tail = ids.shape[1:].num_elements()
  n, b = ids.shape[0], ctx.batch_size
  if tail is None or n is None or not isinstance(b, int) or b == 0:
    return None
  return tail * (n // b)


@tf.function(jit_compile=True, autograph=False)
def _masked_gram_sum(ids, dz):
  """`[B]`: `sum_{t,s} [ids[b,t] == ids[b,s]] <dz[b,t], dz[b,s]>`.

  Args:
    ids: `[B, L]` integer token ids.
    dz: `[B, L, D]` float32 gradients at the gathered rows.
  """
  gram = tf.einsum("bld,bmd->blm", dz, dz)
  same = tf.equal(ids[:, :, None], ids[:, None, :])
  return tf.reduce_sum(tf.where(same, gram, tf.zeros_like(gram)), axis=[1, 2])


register("GatherV2")(_GatherRule)
register("ResourceGather")(_GatherRule)
