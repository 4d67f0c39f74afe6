"""Per-example losses from a model's compiled Keras loss.

DP-SGD clips each example's gradient, so it needs one loss value per example
(a `[B]` vector), not the batch mean Keras' compiled loss returns. This module
runs the model's own `CompileLoss` (so its output/label structure matching,
`loss_weights` and per-output loss trackers behave as in Keras) with every
resolved loss swapped, for the duration of the call, for an adapter that
returns per-example values:

  `l_b = mean over non-batch axes of (w_b * loss_values_b)`

where `loss_values` is the loss's unreduced `call(y_true, y_pred)` and `w` the
sample weight (broadcast as Keras does), with Keras masks honoured (masked
entries are excluded from the mean). Several outputs give
`sum_o loss_weight_o * l_b^(o)`.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tf_pxg import _compat


def _squeeze_or_expand_to_same_rank(x1, x2):
  """Keras' `squeeze_or_expand_to_same_rank` (keras.src.losses.loss):
  if the ranks differ by one and the longer ends in 1, squeeze it, or
  expand a rank-1 shorter one."""
  r1, r2 = len(x1.shape), len(x2.shape)
  if r1 == r2 + 1 and x1.shape[-1] == 1:
    if r2 == 1:
      x2 = tf.expand_dims(x2, -1)
    else:
      x1 = tf.squeeze(x1, -1)
  if r2 == r1 + 1 and x2.shape[-1] == 1:
    if r1 == 1:
      x1 = tf.expand_dims(x1, -1)
    else:
      x2 = tf.squeeze(x2, -1)
  return x1, x2


def _scale_loss_for_distribution(value, unscale: bool = False):
  """Keras' `scale_loss_for_distribution` (times 1/replicas under a
  `tf.distribute` strategy with more than one replica) or, with `unscale`,
  its inverse `unscale_loss_for_distribution`."""
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  if replicas > 1:
    value = value * tf.cast(replicas if unscale else 1.0 / replicas,
                            value.dtype)
  return value


def _loss_name(loss) -> str:
  fn = getattr(loss, "fn", None)
  if fn is not None:
    return getattr(fn, "__name__", repr(fn))
  return getattr(loss, "name", type(loss).__name__)


class _PerExampleLoss:
  """Calls a Keras `Loss` and reduces to one value per example."""

  def __init__(self, loss: keras.losses.Loss):
    self.loss = loss
    self.name = loss.name

  def __call__(self, y_true, y_pred, sample_weight=None):
    loss = self.loss
    in_mask = _compat.get_keras_mask(y_pred)
    y_true = tf.nest.map_structure(
        lambda t: keras.ops.convert_to_tensor(t, dtype=loss.dtype), y_true)
    y_pred = tf.nest.map_structure(
        lambda t: keras.ops.convert_to_tensor(t, dtype=loss.dtype), y_pred)
    values = tf.convert_to_tensor(loss.call(y_true, y_pred))
    batch = tf.nest.flatten(y_pred)[0].shape[0]
    if values.shape.rank == 0 or (
        batch is not None and values.shape[0] is not None
        and values.shape[0] != batch):
      raise ValueError(
          f"The loss {_loss_name(loss)!r} returned a value of shape "
          f"{values.shape} for a batch of {batch} examples; DP training needs "
          "one loss value per example (leading dimension = batch size). Use a "
          "built-in Keras loss, a `keras.losses.Loss` subclass whose `call` "
          "returns unreduced values (as with reduction=None), or a function "
          "`fn(y_true, y_pred)` that returns a `[batch, ...]` tensor and does "
          "not average over the batch.")
    out_mask = _compat.get_keras_mask(values)
    mask = in_mask if out_mask is None else (
        out_mask if in_mask is None else tf.logical_and(in_mask, out_mask))
    count = None
    if mask is not None:
      m = tf.cast(mask, values.dtype)
      values, m = _squeeze_or_expand_to_same_rank(values, m)
      m = tf.broadcast_to(m, tf.shape(values))
      values = values * m
      count = tf.reduce_sum(m, list(range(1, values.shape.rank)))
    if sample_weight is not None:
      w = tf.cast(sample_weight, values.dtype)
      values, w = _squeeze_or_expand_to_same_rank(values, w)
      values = values * w
    axes = list(range(1, values.shape.rank))
    if axes:
      values = (tf.reduce_mean(values, axes) if count is None else
                tf.reduce_sum(values, axes) / tf.maximum(count, 1.0))
    # CompileLoss "unscales" what it logs per output by the replica count, as
    # Keras' reduced losses are pre-scaled; do the same, undone by the caller.
    return _scale_loss_for_distribution(values)


@contextlib.contextmanager
def _per_example_mode(compile_loss):
  """Temporarily swaps `compile_loss`'s resolved losses for adapters."""
  saved = {}
  # Its per-output loss trackers (made by build) write nothing here.
  stack = contextlib.ExitStack()

  def swap():
    stack.enter_context(_compat.loss_trackers_suspended(compile_loss))
    saved["flat"] = _compat.flat_losses(compile_loss)
    _compat.set_flat_losses(compile_loss, [
        entry._replace(loss=_PerExampleLoss(entry.loss))
        for entry in saved["flat"]])

  try:
    with _compat.when_built(compile_loss, swap):
      yield
  finally:
    stack.close()
    if "flat" in saved:
      _compat.set_flat_losses(compile_loss, saved["flat"])


def per_example_losses(model: keras.Model, y, y_pred,
                       sample_weight=None) -> tf.Tensor:
  """`[B]` per-example losses of `model`'s compiled loss.

  Args:
    model: a compiled Keras model.
    y: labels, in any structure Keras' compiled loss accepts.
    y_pred: the model's outputs for the batch.
    sample_weight: optional per-example (or per-element) weights.

  Returns:
    A `[B]` float tensor: example b's (loss-weighted, sample-weighted) loss.
    Its mean equals Keras' compiled loss when every example has the same
    number of non-batch loss elements.

  Raises:
    ValueError: the model has no compiled loss, or a loss does not return one
      value per example (the message names the loss).
  """
  compile_loss = _compat.compile_loss(model)
  if compile_loss is None:
    raise ValueError(
        f"Model {model.name!r} has no compiled loss; DP training needs "
        "per-example losses. Pass `loss=` to `model.compile()`.")
  with _per_example_mode(compile_loss):
    values = compile_loss(y, y_pred, sample_weight)
  values = _scale_loss_for_distribution(tf.convert_to_tensor(values),
                                        unscale=True)
  if values.shape.rank != 1:
    raise ValueError(
        f"The compiled loss of model {model.name!r} gave per-example values "
        f"of shape {values.shape}; expected [batch]. Check that every "
        "output's loss returns unreduced values.")
  return values
