"""Calling TensorFlow's registered gradient function for one recorded entry.

Eager entries are presented to the gradient function as TF's own light mock op
(TF's `_MockOp`, the object `tf.GradientTape` uses; `tf_pxg._compat.mock_op`); graph entries as the
real `tf.Operation`, seen through a thin view that adds `skip_input_indices`
(the hint TF's gradient functions read to skip inputs nobody needs).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.tape.recording import Entry

# Some gradient functions accept `None` for output gradients they ignore, so no
# zeros need be built for them (the seed's `_grad_fn_accepts_none_for_indices`).
GRAD_FN_ACCEPTS_NONE_FOR_INDICES = {
    "SoftmaxCrossEntropyWithLogits": (1,),
    "SparseSoftmaxCrossEntropyWithLogits": (1,),
    "FusedBatchNorm": (1, 2, 3, 4),
    "FusedBatchNormV2": (1, 2, 3, 4),
    "FusedBatchNormV3": (1, 2, 3, 4, 5),
}


class _GraphOpView:
  """A `tf.Operation` with replaceable inputs/outputs and `skip_input_indices`."""

  def __init__(self, op, skip_input_indices, inputs=None, outputs=None,
               attr_overrides=None):
    self._op = op
    self.skip_input_indices = skip_input_indices
    self.inputs = list(op.inputs) if inputs is None else list(inputs)
    self.outputs = list(op.outputs) if outputs is None else list(outputs)
    self._attr_overrides = attr_overrides or {}

  def get_attr(self, name):
    if name in self._attr_overrides:
      return self._attr_overrides[name]
    return self._op.get_attr(name)

  def __getattr__(self, name):
    return getattr(self._op, name)


def op_view(entry: Entry,
            skip_input_indices: Optional[Sequence[int]] = None,
            inputs: Optional[Sequence[Any]] = None,
            outputs: Optional[Sequence[Any]] = None):
  """An op-like object for `entry` as TF's gradient functions expect it."""
  skip = tuple(skip_input_indices) if skip_input_indices else None
  if entry.op is None:
    attrs = entry.attrs
    if entry.attr_overrides:
      attrs = list(attrs)
      for i in range(0, len(attrs), 2):
        if attrs[i] in entry.attr_overrides:
          attrs[i + 1] = entry.attr_overrides[attrs[i]]
      attrs = tuple(attrs)
    return _compat.mock_op(
        attrs,
        list(entry.inputs if inputs is None else inputs),
        list(entry.outputs if outputs is None else outputs),
        entry.op_type, skip)
  # A recorded graph entry's inputs/outputs are its op's; a merged entry
  # (`tf_pxg.merge_uses`) carries other tensors for the same op.
  return _GraphOpView(entry.op, skip,
                      entry.inputs if inputs is None else inputs,
                      entry.outputs if outputs is None else outputs,
                      entry.attr_overrides)


def get_attr(entry: Entry, name: str):
  """Reads attr `name` of a recorded op (eager or graph)."""
  return op_view(entry).get_attr(name)


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
