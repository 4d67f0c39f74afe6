"""Dilated convolutions' gradient functions swapped, while the reference
runs, for dilation-free forms (a dilated filter and a plain convolution):
some CPU builds have no dilated Conv*BackpropInput kernel."""

from __future__ import annotations

import contextlib
from typing import List

import tensorflow as tf

from tf_pxg import _compat


# Convolutions whose TF gradient needs a dilated Conv*BackpropInput kernel,
# which some CPU builds lack ("Current CPU implementations do not yet support
# dilation rates larger than 1"), with the attrs their raw op takes.
_DILATED_CONV_ATTRS = {
    "Conv2D": ("strides", "padding", "explicit_paddings", "data_format",
               "use_cudnn_on_gpu"),
    "Conv3D": ("strides", "padding", "data_format"),
    "DepthwiseConv2dNative": ("strides", "padding", "explicit_paddings",
                              "data_format"),
}


def _attr(op, name):
  value = op.get_attr(name)
  return value.decode() if isinstance(value, bytes) else value


def _spatial_rates(op) -> List[int]:
  dilations = list(op.get_attr("dilations"))
  if _attr(op, "data_format").startswith("NC"):
    return dilations[2:]
  return dilations[1:-1]


def _dilate_filter(w, rates):
  """Inserts `rate - 1` zeros between the taps of each spatial filter axis.

  A convolution with the result and no dilation equals the dilated one
  exactly (the inserted taps multiply by zero).
  """
  for axis, r in enumerate(rates):
    if r == 1:
      continue
    k = w.shape[axis]
    zeros = tf.zeros(w.shape[:axis + 1] + [r - 1] + w.shape[axis + 1:],
                     w.dtype)
    w = tf.concat([tf.expand_dims(w, axis + 1), zeros], axis + 1)
    w = tf.reshape(w, w.shape[:axis] + [k * r] + w.shape[axis + 2:])
    w = w[(slice(None),) * axis + (slice(0, (k - 1) * r + 1),)]
  return w


def _undilate(g, rates):
  """The gradient of `_dilate_filter`: the taps at multiples of the rate."""
  return g[tuple(slice(None, None, r) for r in rates)]


def _dilation_free_gradient(original):
  """`original` (TF's conv gradient), or for dilations > 1 an exact version
  that differentiates the same conv written with a zero-dilated filter and no
  dilation, so it needs no dilated backprop kernel."""

  def gradient(op, *grads):
    rates = _spatial_rates(op)
    if all(r == 1 for r in rates):
      return original(op, *grads)
    x, w = op.inputs[0], op.inputs[1]
    attrs = {a: _attr(op, a) for a in _DILATED_CONV_ATTRS[op.type]}
    ones = [1] * len(op.get_attr("dilations"))
    with tf.GradientTape() as tape:
      wd = _dilate_filter(w, rates)
      tape.watch([x, wd])
      y = getattr(tf.raw_ops, op.type)(input=x, filter=wd, dilations=ones,
                                       **attrs)
    gx, gwd = tape.gradient(y, [x, wd], output_gradients=grads[0])
    return [gx, _undilate(gwd, rates)]

  return gradient


@contextlib.contextmanager
def _dilation_free_conv_gradients():
  """Swaps in `_dilation_free_gradient` for the dilated convolutions (eager
  tapes look gradient functions up at each backward pass)."""
  with _compat.swapped_gradient_functions(
      {t: _dilation_free_gradient for t in _DILATED_CONV_ATTRS}):
    yield
