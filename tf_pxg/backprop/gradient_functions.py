"""Calling TensorFlow's registered gradient function for one recorded entry.

Each entry is presented to the gradient function as the op-like object
`tf_pxg.tape.recording.op_view` makes: TF's own light mock op for eager
entries, the real `tf.Operation` seen through a thin view for graph ones,
with `skip_input_indices` (the hint TF's gradient functions read to skip
inputs nobody needs).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.tape.recording import Entry, op_view

# Some gradient functions accept `None` for output gradients they ignore, so no
# zeros need be built for them (the seed's `_grad_fn_accepts_none_for_indices`).
GRAD_FN_ACCEPTS_NONE_FOR_INDICES = {
    "SoftmaxCrossEntropyWithLogits": (1,),
    "SparseSoftmaxCrossEntropyWithLogits": (1,),
    "FusedBatchNorm": (1, 2, 3, 4),
    "FusedBatchNormV2": (1, 2, 3, 4),
    "FusedBatchNormV3": (1, 2, 3, 4, 5),
}


_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def _call_op_gradient(op, *out_grads):
  """A function call in a graph (a ConcreteFunction called while tracing):
  its symbolic gradient, as `tf.gradients` takes it."""
  grads = [tf.zeros_like(o) if g is None else g
           for o, g in zip(op.outputs, out_grads)]
  return _compat.call_op_gradient(op._op, grads)  # pylint: disable=protected-access


def lookup(entry: Entry):
  """TF's registered gradient function for `entry`, or None if not differentiable.

  Raises:
    LookupError: if TF has no gradient registered for the op type.
  """
  op_type = entry.op_type
  if entry.op is not None:
    try:  # tf.custom_gradient in graphs: IdentityN with a private gradient.
      op_type = entry.op.get_attr("_gradient_op_type").decode()
    except (ValueError, AttributeError):
      pass
  try:
    return _compat.gradient_function(op_type)
  except LookupError as e:
    if entry.op is not None and op_type in _CALL_OPS:
      return _call_op_gradient
    raise LookupError(
        f"No gradient defined for {entry.describe()} (op type '{op_type}'). "
        "TensorFlow has no registered gradient for it; register one with "
        "tf.RegisterGradient or keep the op out of the differentiated path."
    ) from e


def call_gradient_function(entry: Entry,
                           out_grads: Sequence[Any],
                           skip_input_indices: Optional[Sequence[int]] = None,
                           inputs: Optional[Sequence[Any]] = None,
                           outputs: Optional[Sequence[Any]] = None) -> list:
  """Runs TF's gradient function; returns one gradient (or None) per input."""
  n = len(entry.inputs)
  if entry.backward is not None:  # An eager tf.custom_gradient call.
    with tf.name_scope("gradient_tape"):
      in_grads = entry.backward(*out_grads)
  else:
    grad_fn = lookup(entry)
    if grad_fn is None:
      return [None] * n
    view = op_view(entry, skip_input_indices, inputs, outputs)
    with tf.name_scope("gradient_tape"):
      in_grads = grad_fn(view, *out_grads)
  if not isinstance(in_grads, (list, tuple)):
    in_grads = [in_grads]
  in_grads = list(in_grads)
  if len(in_grads) < n:  # Some functions omit trailing non-differentiable inputs.
    in_grads += [None] * (n - len(in_grads))
  if skip_input_indices:
    for i in skip_input_indices:
      in_grads[i] = None
  return in_grads[:n]


def aggregate(grads: Sequence[Any]):
  """Sums a list of gradients (Tensors and/or IndexedSlices)."""
  return _compat.aggregate_grads(list(grads))


def num_elements(grad) -> int:
  if isinstance(grad, tf.IndexedSlices):
    shape = grad.values.shape
  else:
    shape = grad.shape
  return shape.num_elements() or 0
