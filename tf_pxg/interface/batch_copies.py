"""Parameters copied along the batch axis: a copy is an interface.

`tf.broadcast_to(w, [B, T, d])`, `tf.tile(w, [B, 1, 1])` and `tf.repeat`
(an ExpandDims, a Tile and a Reshape) give every example its own copy of a
parameter: KerasHub's PositionEmbedding, ViT's class token, DeBERTa's
relative table; a gather by constant ids whose rows are equal (BERT's
segment ids made as `zeros_like` of the token ids). Such an op's output is data whose example b holds copy b
(`copy_layout`), so the op itself is the interface: example b's gradient
of the parameter is its output gradient's rows for example b, summed over
the copy's other axes (`tf_pxg.rules.copies`). Everything after it is
data, tracked like any other (`tf_pxg.interface.batch_axis`).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tf_pxg.interface.batch_axis import Layout
from tf_pxg.tape import recording

# Op type -> index of the input that gives the output's size per axis
# (BroadcastTo's shape, Tile's multiples).
_COPY_SIZES = {"BroadcastTo": 1, "Tile": 1}

# Ops between `tf.shape(data)[a]` and a shape vector's entry (tf.repeat casts
# and reshapes its count).
_SIZE_PASSTHROUGH = ("Cast", "Identity", "Reshape", "ExpandDims", "Squeeze")


# Gathers of a table by constant ids whose B rows are equal: KerasHub's
# `BertBackbone` given `ops.zeros_like(token_ids)` as segment ids, which TF
# folds into a constant `[B, T]` when B is static.
_GATHERS = ("GatherV2", "ResourceGather")


def is_batch_copy_op(op_type: str) -> bool:
  """Whether `op_type` may copy a parameter along the batch axis."""
  return op_type in _COPY_SIZES or op_type in _GATHERS


def _gather_copy_layout(entry, batch_size) -> Layout:
  """`(0, False)` if `entry` gathers rows of its table (input 0, on axis
  0) by constant ids (input 1) of a static `[B, ...]` shape whose B
  entries along axis 0 are equal, so every example gathers the same rows:
  a copy of those rows along the batch axis; else None."""
  ids = entry.inputs[1] if len(entry.inputs) > 1 else None
  if (ids is None or not isinstance(batch_size, int) or
      ids.shape.rank is None or ids.shape.rank < 1 or
      ids.shape[0] != batch_size or
      (recording.get_attr(entry, "batch_dims") or 0) != 0):
    return None
  if entry.op_type == "GatherV2":
    axis = tf.get_static_value(entry.inputs[2])
    if axis is None or int(axis) != 0:
      return None
  return (0, False) if _equal_rows(ids) else None


# Elementwise ops through which equal rows stay equal (Keras' `ops.take`
# wraps negative ids: `where(ids < 0, ids + V, ids)`).
_ELEMENTWISE = ("Identity", "Cast", "SelectV2", "Select", "Less",
                "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual",
                "AddV2", "Add", "Sub", "Mul", "Maximum", "Minimum",
                "FloorMod", "Neg")


def _equal_rows(t, rank=None, depth: int = 8) -> bool:
  """Whether the (constant) `t`, broadcast to rank `rank`, has equal rows
  along axis 0: its static value does, or it is an elementwise op of
  tensors that do (a scalar or an operand without that axis does)."""
  rank = t.shape.rank if rank is None else rank
  if t.shape.rank is None:
    return False
  if t.shape.rank < rank or (t.shape.rank == rank and t.shape[0] == 1):
    return True  # Broadcast along axis 0.
  value = tf.get_static_value(t)
  if value is not None:
    return bool(np.all(value == value[:1]))
  op = getattr(t, "op", None)
  if depth == 0 or op is None or op.type not in _ELEMENTWISE:
    return False
  return all(_equal_rows(x, rank, depth - 1) for x in op.inputs)


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
  if entry.op_type in _GATHERS:
    return _gather_copy_layout(entry, batch_size)
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
  over the parameter's (int if static, else a scalar int32 tensor); for
  a gather, the ids' static axis 0."""
  if entry.op_type in _GATHERS:
    return entry.inputs[1].shape[0]
  p, out = entry.inputs[0], entry.outputs[0]
  shift = out.shape.rank - p.shape.rank
  k = 1 if axis < shift else p.shape[axis - shift]
  n = out.shape[axis]
  if isinstance(n, int) and isinstance(k, int):
    return n // k
  n = tf.shape(out)[axis] if n is None else n
  k = tf.shape(p)[axis - shift] if k is None else k
  return n // k
