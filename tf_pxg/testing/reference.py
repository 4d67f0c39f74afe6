"""The reference: a plain `tf.GradientTape` loop over single examples
(`reference_per_example_gradients`), and the batch helpers it shares with
the checks."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from tf_pxg.testing.dilated_conv import _dilation_free_conv_gradients
from tf_pxg.testing.tolerances import _variable_dtype


def _batch_size(inputs) -> int:
  flat = tf.nest.flatten(inputs)
  if not flat:
    raise ValueError("`inputs` is empty; it must hold at least one tensor "
                     "with the batch on axis 0.")
  b = tf.convert_to_tensor(flat[0]).shape[0]
  if b is None:
    raise ValueError("The batch size (axis 0 of the inputs) must be static.")
  return int(b)


def _slice(nest, b: int):
  """Example b of every tensor of `nest` as a batch of one (axis 0)."""
  if nest is None:
    return None
  return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[b:b + 1],
                               nest)


def _per_example_loss(loss_fn: Optional[Callable], model_or_fn: Callable,
                      inputs, labels, training: Optional[bool]):
  """Calls the model and the loss; checks the `[B]` contract."""
  kwargs = {} if training is None else {"training": training}
  outputs = model_or_fn(inputs, **kwargs)
  if loss_fn is None:
    losses = outputs
  elif labels is None:
    losses = loss_fn(outputs)
  else:
    losses = loss_fn(labels, outputs)
  losses = tf.convert_to_tensor(losses)
  b = _batch_size(inputs)
  if losses.shape.rank != 1 or (losses.shape[0] is not None and
                                losses.shape[0] != b):
    raise ValueError(
        f"The per-example loss must have shape [B] = [{b}] (one value per "
        f"example, batch on axis 0); got shape {losses.shape}. Use a Keras "
        "loss with reduction='none', or reduce the non-batch axes yourself.")
  return losses


def _dense(g, like):
  if g is None:
    return tf.zeros(like.shape, _variable_dtype(like))
  if isinstance(g, tf.IndexedSlices):
    return tf.convert_to_tensor(g)
  return g


def reference_per_example_gradients(
    loss_fn: Optional[Callable],
    model_or_fn: Callable,
    variables: Sequence[Any],
    inputs: Any,
    labels: Any = None,
    training: Optional[bool] = None,
) -> List[tf.Tensor]:
  """Per-example gradients by a `tf.GradientTape` loop over single examples.

  For each b, example b is sliced out of axis 0 of every tensor in `inputs`
  (and `labels`) as a batch of one, the loss is computed and differentiated
  with a plain `tf.GradientTape`, eagerly. Unconnected variables get zeros and
  `tf.IndexedSlices` (gathers) are densified. Dilated convolutions
  (`Conv2D`, `Conv3D`, `DepthwiseConv2dNative` with dilations > 1) are
  differentiated as the same convolution with a zero-dilated filter, which is
  exact and needs no dilated `Conv*BackpropInput` kernel (some CPU builds have
  none).

  Args:
    loss_fn: `loss_fn(labels, outputs)` (or `loss_fn(outputs)` when `labels`
      is None) returning per-example losses of shape `[B]`, e.g. a Keras loss
      with `reduction="none"`; None if `model_or_fn` returns them itself.
    model_or_fn: a Keras model/layer or function called as
      `model_or_fn(inputs)` (plus `training=` if given).
    variables: the tf/Keras variables to differentiate.
    inputs: a tensor or nest of tensors, the batch on axis 0 of each.
    labels: None, or a tensor/nest with the batch on axis 0.
    training: if not None, passed as `training=` to `model_or_fn`.

  Returns:
    One tensor per variable, of shape `[B, *variable.shape]` and the
    variable's dtype.
  """
  variables = list(variables)
  b_total = _batch_size(inputs)
  per_var: List[List[tf.Tensor]] = [[] for _ in variables]
  for b in range(b_total):
    with tf.GradientTape() as tape:
      loss = _per_example_loss(loss_fn, model_or_fn, _slice(inputs, b),
                               _slice(labels, b), training)
      loss = tf.reduce_sum(loss)
    with _dilation_free_conv_gradients():
      grads = tape.gradient(loss, variables)
    for i, (g, v) in enumerate(zip(grads, variables)):
      per_var[i].append(tf.cast(_dense(g, v), _variable_dtype(v)))
  return [tf.stack(gs) if gs else tf.zeros([0] + list(v.shape),
                                           _variable_dtype(v))
          for gs, v in zip(per_var, variables)]
