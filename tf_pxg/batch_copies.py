"""Parameters copied along the batch axis: a copy is an interface.

`tf.broadcast_to(w, [B, T, d])`, `tf.tile(w, [B, 1, 1])` and `tf.repeat`
(an ExpandDims, a Tile and a Reshape) give every example its own copy of a
parameter: KerasHub's PositionEmbedding, ViT's class token, DeBERTa's
relative table. Such an op's output is data whose example b holds copy b
(`copy_layout`), so the op itself is the interface: example b's gradient
of the parameter is its output gradient's rows for example b, summed over
the copy's other axes (`tf_pxg.rules.copies`). Everything after it is
data, tracked like any other (`tf_pxg.batch_axis`).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_pxg.batch_axis import Layout

# Op type -> index of the input that gives the output's size per axis
# (BroadcastTo's shape, Tile's multiples).
_COPY_SIZES = {"BroadcastTo": 1, "Tile": 1}

# Ops between `tf.shape(data)[a]` and a shape vector's entry (tf.repeat casts
# and reshapes its count).
_SIZE_PASSTHROUGH = ("Cast", "Identity", "Reshape", "ExpandDims", "Squeeze")


def is_batch_copy_op(op_type: str) -> bool:
  """Whether `op_type` may copy a parameter along the batch axis."""
  return op_type in _COPY_SIZES


def _is_batch_size_of(t, layout_of) -> bool:
  """Whether scalar `t` is `tf.shape(d)[a']` of a data tensor `d` whose
  examples are alone on axis a' (so `t` is B), possibly cast or reshaped."""
  try:
    op = t.op
    while op.type in _SIZE_PASSTHROUGH:
      op = op.inputs[0].op
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape":
      return False
    begin = tf.get_static_value(op.inputs[1])
    if begin is None or not op.get_attr("shrink_axis_mask") & 1:
      return False
    d = op.inputs[0].op.inputs[0]
    return layout_of is not None and layout_of(d) == (int(np.ravel(begin)[0]),
                                                       False)
  except (AttributeError, ValueError, TypeError, IndexError):
    return False


def _is_batch_sized(sizes, a: int, layout_of) -> bool:
  """Whether entry `a` of a graph's 1-D size vector `sizes` (a shape or
  multiples input) is `tf.shape(d)[a']` of data `d` whose examples are
  alone on axis a' (a dynamic batch size)."""
  op = getattr(sizes, "op", None)
  if op is None or layout_of is None:
    return False
  if op.type == "Pack" and a < len(op.inputs):
    return _is_batch_size_of(op.inputs[a], layout_of)
  return op.type == "Shape" and layout_of(op.inputs[0]) == (a, False)


def copy_layout(entry, batch_size: Optional[int],
                layout_of: Optional[Callable] = None) -> Layout:
  """The layout of `entry`'s output if it copies its parameter input along
  the batch axis, else None.

  `entry` computes from parameters alone (its inputs carry no examples). It
  is a copy along axis a when the parameter is copied there B times:
  broadcast from size 1 (or an added axis) by `BroadcastTo`, or tiled by
  `Tile` (each example a whole copy: `[B, k]` merged when the parameter has
  k rows on that axis). B is the static batch size, matched against the
  output's static shape, or, for a dynamic size, `tf.shape(x)[0]` of data
  `x` with its examples on axis 0, read from the size vector. The first
  such axis is the batch axis (with B = 1 every size-1 axis qualifies; any
  choice is exact, as one example's gradient is the whole gradient).

  Args:
    entry: a recorded op whose inputs are parameters or constants.
    batch_size: B if static.
    layout_of: tensor -> its layout, or None where it holds no examples.

  Returns:
    `(a, False)`, or None if `entry` is not such a copy.
  """
  index = _COPY_SIZES.get(entry.op_type)
  if index is None or len(entry.inputs) <= index or not entry.outputs:
    return None
  p, out = entry.inputs[0], entry.outputs[0]
  if p.shape.rank is None or out.shape.rank is None:
    return None
  shift = out.shape.rank - p.shape.rank
  for a, n in enumerate(out.shape.as_list()):
    k = 1 if a < shift else p.shape[a - shift]
    if k is None or (entry.op_type == "BroadcastTo" and k != 1):
      continue
    if n is None:
      copied = _is_batch_sized(entry.inputs[index], a, layout_of)
    else:
      copied = isinstance(batch_size, int) and n == batch_size * k
    if copied:
      return a, False
  return None


def copy_batch_size(entry, axis: int):
  """B for a copy along `axis` (`copy_layout`): the output's size there
  over the parameter's (int if static, else a scalar int32 tensor)."""
  p, out = entry.inputs[0], entry.outputs[0]
  shift = out.shape.rank - p.shape.rank
  k = 1 if axis < shift else p.shape[axis - shift]
  n = out.shape[axis]
  if isinstance(n, int) and isinstance(k, int):
    return n // k
  n = tf.shape(out)[axis] if n is None else n
  k = tf.shape(p)[axis - shift] if k is None else k
  return n // k
