"""Putting the examples where an interface's rule takes them.

A per-example rule takes the examples where its `batch_axes` says (axis 0
of the data operand and the output, by default). The batch axis tracked on
the data (`tf_pxg.interface.batch_axis`) may be elsewhere — time-major data, a
transposed operand — and `normalise_batch_axis` moves it, by the rule's own
rewrite (`Rule.batch_first`: an Einsum's equation) or, for ops the rule
declares `permutable`, by transposing the data operands, the outputs and
their gradients, so that each rule sees one layout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from tf_pxg.interface.batch_axis import Layout
from tf_pxg.interface.batch_copies import is_batch_copy_op
from tf_pxg.tape.recording import Entry


def _move_to_front(t, axis: int):
  perm = [axis] + [a for a in range(t.shape.rank) if a != axis]
  return tf.transpose(t, perm)


def normalise_batch_axis(itf, layout_of: Callable[[int], Layout]):
  """`itf` (a `tf_pxg.interface.classify.Interface`) with the examples where its
  rule expects them.

  Rules take the examples where their `batch_axes` says (default axis 0 of
  the data operand and the output; a MatMul's on the rows of the matrix
  that holds them). Where the tracked batch axis differs — time-major data,
  say — the rule's `batch_first` rewrites the op (an Einsum's equation) or,
  for ops the rule declares `permutable`, the data operand, the outputs and
  their gradients are transposed to put it first. A parameter copied along the
  batch axis (no data operand) keeps its op; `copy_axis` says where the
  examples are in its output.

  Args:
    itf: the interface, its `rule` chosen (`tf_pxg.rules.base.Rule`).
    layout_of: tensor id -> layout of that data tensor.

  Raises:
    ValueError: the examples are on another axis of an op that cannot be
      permuted that way, or their position in a data operand is unknown.
  """
  entry = itf.entry
  if not itf.data_indices and is_batch_copy_op(entry.op_type):
    lay = layout_of(entry.output_ids[0])
    if lay is not None:  # A parameter copied along the batch axis.
      return dataclasses.replace(itf, copy_axis=lay[0])
  lays = [layout_of(entry.input_ids[i]) for i in itf.data_indices]
  if any(l is None for l in lays):
    raise ValueError(
        f"{entry.describe()} consumes a parameter and data that holds no "
        "rows of single examples (a value computed from the whole batch, "
        "such as a batch statistic or a dense shape), so its per-example "
        "gradient is undefined. Compute that value from each example alone.")
  outs = [layout_of(t) for t in entry.output_ids]
  minor = any(l[1] for l in lays)
  rule = itf.rule
  want_data, want_out = rule.batch_axes(itf)
  if (all(l[0] == want_data for l in lays) and
      all(l is None or want_out is None or l[0] == want_out for l in outs)):
    itf.batch_minor = itf.batch_minor or minor
    return itf
  axis = lays[0][0] if lays else None
  if len(lays) == 1:
    rewritten = rule.batch_first(itf, axis, minor)
    if rewritten is not None:
      return rewritten
  if (len({l[0] for l in lays}) != 1 or want_data != 0 or
      entry.outputs[0].shape.rank is None or itf.param.shape.rank is None or
      not rule.permutable(itf, axis)):
    raise ValueError(
        f"{entry.describe()} consumes a parameter with the examples on axis "
        f"{axis} of its data operand, which its per-example rule cannot take "
        "(it expects them on axis 0). Transpose the data so the batch is "
        "axis 0 before this op, or use tf.einsum with the batch letter "
        "first.")
  inputs = list(entry.inputs)
  for i in itf.data_indices:
    inputs[i] = _move_to_front(inputs[i], axis)
  out_axes = [axis if l is None else l[0] for l in outs]
  outputs = [_move_to_front(o, a) for o, a in zip(entry.outputs, out_axes)]
  grads = [g if g is None else _move_to_front(g, a)
           for g, a in zip(itf.output_grads, out_axes)]
  original_id = original_shape = None
  p = itf.param
  out_rank = entry.outputs[0].shape.rank
  if (rule.broadcasts_param and p.shape.rank == out_rank
      and p.shape.rank and p.shape[axis] == 1 and axis):
    original_id, original_shape = itf.param_id, p.shape
    moved_shape = [p.shape[axis]] + [n for a, n in enumerate(p.shape)
                                     if a != axis]
    inputs[itf.param_index] = tf.reshape(p, moved_shape)
  moved = Entry(entry.op_type, tuple(inputs), tuple(outputs), entry.attrs,
                entry.op, entry.scope, entry.index)
  return dataclasses.replace(
      itf, entry=moved, output_grads=grads, batch_minor=minor,
      original_param_id=original_id, original_param_shape=original_shape)
