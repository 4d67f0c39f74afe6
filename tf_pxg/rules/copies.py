"""Parameters copied along the batch axis: BroadcastTo, Tile.

`tf.broadcast_to(w, [B, T, d])` and `tf.tile(w, [B, 1, 1])` (and
`tf.repeat(w, B, axis=0)`, which TF writes as ExpandDims, Tile, Reshape)
give every example its own copy of a parameter: KerasHub's
`PositionEmbedding`, ViT's class token, DeBERTa's relative table.
`tf_pxg.interface.batch_copies.copy_layout` recognises them; the copy op is then the
interface, with no data operand, and its output is data whose example b
holds copy b (`Context.copy_axis` says on which axis, `[B, k]` merged when
each copy has k rows there).

The parameter is shared, and example b's gradient of it is the op's own
gradient at example b's rows of the output gradient: `dz_b` summed over the
axes along which the op copies the parameter within one example (broadcast
axes; the repeats of a tile). That is one `[B, *param.shape]` tensor, so the
norms and weighted sums take the defaults: the default weighted sum is TF's
gradient of the op at `dz` with example b's rows scaled by `c_b` (exact
zeros for `c_b = 0`), or the kept per-example gradient summed with the
factors.
"""

from __future__ import annotations

import tensorflow as tf

from tf_pxg.rules import base
from tf_pxg.rules.base import register


def _dims(t):
  """`t`'s shape as a list of ints where static, scalar tensors elsewhere."""
  return [base._dim(t, i) for i in range(t.shape.rank)]  # pylint: disable=protected-access


def _as_shape(dims):
  if all(isinstance(d, int) for d in dims):
    return dims
  return tf.stack([tf.cast(d, tf.int32) for d in dims])


def examples_first(ctx: base.Context):
  """The output gradient with the examples first: `[B, *out_b]`, where
  `out_b` is the output's shape with the copy axis holding one example's
  rows (k of them, k = 1 for a broadcast)."""
  a = ctx.copy_axis
  e = ctx.split_batch(ctx.dz, axis=a)  # [..., B, k, ...] at axis a.
  perm = [a] + [i for i in range(e.shape.rank) if i != a]
  return tf.transpose(e, perm)


class _Copy(base.Rule):
  """A copy op: the parameter gradient reads the output gradient only."""

  drop_inputs = False
  drop_outputs = False

  def check(self, ctx):
    if ctx.copy_axis is None or ctx.param_index != 0:
      raise NotImplementedError(
          f"{ctx.describe()}: not a parameter copied along the batch axis")


@register("BroadcastTo")
class BroadcastToRule(_Copy):
  """`tf.broadcast_to(p, shape)`: example b's gradient sums its rows of dz
  over the axes where `p` is broadcast (added, or of size 1)."""

  def per_example(self, ctx):
    e = examples_first(ctx)  # [B, *out_b]
    p = ctx.param
    shift = e.shape.rank - 1 - p.shape.rank
    padded = [1] * shift + p.shape.as_list()
    axes = [i + 1 for i, n in enumerate(padded) if n == 1]
    if axes:
      e = tf.reduce_sum(e, axis=axes, keepdims=True)
    return tf.reshape(e, _as_shape([_dims(e)[0]] + _dims(p)))


@register("Tile")
class TileRule(_Copy):
  """`tf.tile(p, multiples)`: one example's rows of dz are `p` tiled
  `multiples` times (1 on the copy axis); its gradient sums the tiles."""

  def per_example(self, ctx):
    e = examples_first(ctx)  # [B, *out_b], out_b[i] = m[i] * p.shape[i].
    b = _dims(e)[0]
    sizes = _dims(ctx.param)
    pairs = []
    for n, s in zip(_dims(e)[1:], sizes):
      pairs += [n // s, s]  # Tile's layout: the repeat index is major.
    e = tf.reshape(e, _as_shape([b] + pairs))
    e = tf.reduce_sum(e, axis=list(range(1, 2 * len(sizes), 2)))
    return tf.reshape(e, _as_shape([b] + sizes))
