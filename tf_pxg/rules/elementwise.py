"""Elementwise ops with broadcasting: AddV2, Add, Sub, Mul, BiasAdd.

For `out = f(data, p)` with `p` broadcast against the data, example b's
gradient is `dz_b * df/dp` summed over the axes along which `p` was
broadcast (and over the example's merged rows). Norms and weighted sums use
the defaults: the per-example tensor is only `B * |p|` (biases, scales).
"""

from __future__ import annotations

import tensorflow as tf

from tf_pxg.rules import base
from tf_pxg.rules.base import register
from tf_pxg.tape import recording


def reduce_to_param(ctx, e):
  """Sums `e` (shape of the output, batch on axis 0) to `[B, *param.shape]`."""
  p = ctx.param
  out_rank, p_rank = e.shape.rank, p.shape.rank
  if out_rank is None or p_rank is None:
    raise NotImplementedError(f"{ctx.describe()}: unknown rank")
  padded = [1] * (out_rank - p_rank) + list(p.shape)
  base.check_param_shared(ctx, broadcasting=True)
  e = tf.reduce_sum(ctx.split_batch(e), axis=1)  # [B, rest of output]
  axes = [a for a in range(1, out_rank)
          if padded[a] == 1 and e.shape[a] != 1]
  if axes:
    e = tf.reduce_sum(e, axis=axes, keepdims=True)
  return tf.reshape(e, tf.concat([tf.shape(e)[:1], tf.shape(p)], 0))


class _Broadcasting(base.Rule):
  """`per_example = reduce_to_param(dz * partial)`."""

  # The parameter gradient reads dz (and, for Mul, the other operand).
  drop_inputs = False
  drop_outputs = False
  broadcasts_param = True
  mergeable = True
  chunked = True  # Per-example gradients are parameter-sized: they add up.

  def permutable(self, itf, axis):
    """The parameter is broadcast (size 1 or absent) on the batch axis and
    the data operands have the output's rank; size-1 parameter axes move
    with the batch axis (`broadcasts_param`)."""
    out_rank = itf.entry.outputs[0].shape.rank
    p_rank = itf.param.shape.rank
    padded = [1] * (out_rank - p_rank) + itf.param.shape.as_list()
    return p_rank <= out_rank and padded[axis] == 1 and all(
        itf.entry.inputs[i].shape.rank == out_rank for i in itf.data_indices)

  def partial(self, ctx):
    """df/dp times dz, shaped like the output."""
    raise NotImplementedError

  def per_example(self, ctx):
    return reduce_to_param(ctx, self.partial(ctx))


@register("AddV2")
@register("Add")
class AddRule(_Broadcasting):

  def partial(self, ctx):
    return _as_output(ctx, ctx.dz)


@register("Sub")
class SubRule(_Broadcasting):

  def partial(self, ctx):
    sign = 1.0 if ctx.param_index == 0 else -1.0
    return _as_output(ctx, tf.cast(sign, ctx.dz.dtype) * ctx.dz)


def _as_output(ctx, t):
  """`t` (dz's shape) broadcast to the output's shape: `t` itself when the
  shapes are static and equal (no pass), else `t * ones`."""
  out = ctx.outputs[0]
  if (t.shape.is_fully_defined() and out.shape.is_fully_defined() and
      t.shape == out.shape):
    return t
  return t * tf.ones_like(out)


@register("Mul")
class MulRule(_Broadcasting):

  drop_inputs = True  # dp = dz * other: a non-finite example's `other` rows

  def partial(self, ctx):
    other = ctx.inputs[1 - ctx.param_index]
    return ctx.dz * other


@register("BiasAdd")
class BiasAddRule(base.Rule):
  """`BiasAdd(value, bias)`: sum dz over all but the batch and channel axes."""

  drop_inputs = False  # the bias gradient reads dz only
  drop_outputs = False
  mergeable = True
  chunked = True

  def permutable(self, itf, axis):
    """NHWC: the bias is on the last axis, which the batch axis must not be."""
    fmt = recording.get_attr(itf.entry, "data_format") or b"NHWC"
    return (fmt in (b"NHWC", "NHWC") and
            axis < itf.entry.outputs[0].shape.rank - 1)

  def check(self, ctx):
    if ctx.param_index != 1:
      raise NotImplementedError(
          f"{ctx.describe()}: the parameter is the value, not the bias")

  def per_example(self, ctx):
    fmt = ctx.attr("data_format", "NHWC")
    dz = ctx.split_batch(ctx.dz)  # [B, k, ...]
    rank = dz.shape.rank
    channel = 2 if fmt.startswith("NC") and rank > 3 else rank - 1
    axes = [a for a in range(1, rank) if a != channel]
    return tf.reduce_sum(dz, axis=axes)
