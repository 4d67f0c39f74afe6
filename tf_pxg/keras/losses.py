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
from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses import loss as keras_loss_module


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
    in_mask = get_keras_mask(y_pred)
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
    out_mask = get_keras_mask(values)
    mask = in_mask if out_mask is None else (
        out_mask if in_mask is None else tf.logical_and(in_mask, out_mask))
    count = None
    if mask is not None:
      m = tf.cast(mask, values.dtype)
      values, m = keras_loss_module.squeeze_or_expand_to_same_rank(values, m)
      m = tf.broadcast_to(m, tf.shape(values))
      values = values * m
      count = tf.reduce_sum(m, list(range(1, values.shape.rank)))
    if sample_weight is not None:
      w = tf.cast(sample_weight, values.dtype)
      values, w = keras_loss_module.squeeze_or_expand_to_same_rank(values, w)
      values = values * w
    axes = list(range(1, values.shape.rank))
    if axes:
      values = (tf.reduce_mean(values, axes) if count is None else
                tf.reduce_sum(values, axes) / tf.maximum(count, 1.0))
    # CompileLoss "unscales" what it logs per output by the replica count, as
    # Keras' reduced losses are pre-scaled; do the same, undone by the caller.
    return keras_loss_module.scale_loss_for_distribution(values)


@contextlib.contextmanager
def _per_example_mode(compile_loss):
  """Temporarily swaps `compile_loss`'s resolved losses for adapters."""
  saved = {}

  def swap():
    saved["flat"] = list(compile_loss._flat_losses)
    compile_loss._flat_losses = [
        entry._replace(loss=_PerExampleLoss(entry.loss))
        for entry in compile_loss._flat_losses]

  patched_build = False
  if compile_loss.built:
    swap()
  else:
    original_build = compile_loss.build

    def build(y_true, y_pred):
      original_build(y_true, y_pred)
      swap()

    compile_loss.build = build
    patched_build = True
  try:
    yield
  finally:
    if patched_build:
      del compile_loss.build
    if "flat" in saved:
      compile_loss._flat_losses = saved["flat"]


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
  compile_loss = getattr(model, "_compile_loss", None)
  if compile_loss is None:
    raise ValueError(
        f"Model {model.name!r} has no compiled loss; DP training needs "
        "per-example losses. Pass `loss=` to `model.compile()`.")
  with _per_example_mode(compile_loss):
    values = compile_loss(y, y_pred, sample_weight)
  values = keras_loss_module.unscale_loss_for_distribution(
      tf.convert_to_tensor(values))
  if values.shape.rank != 1:
    raise ValueError(
        f"The compiled loss of model {model.name!r} gave per-example values "
        f"of shape {values.shape}; expected [batch]. Check that every "
        "output's loss returns unreduced values.")
  return values
