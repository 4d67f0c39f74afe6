"""Finding the interface: where parameters meet the data.

Every tensor the tape saw is classified as

* PARAM: derived from the sources alone (a variable read, its cast to
  float16, `W + A @ B`, a reshaped kernel);
* DATA: carries examples (the inputs, and anything computed from them),
  on the batch axis tracked by `tf_pxg.batch_axis` (axis 0 for inputs);
* CONST: neither (scalars, graph constants, reads of non-source variables,
  shape arithmetic).

An *interface* entry consumes a PARAM tensor and produces DATA. Backprop
(phase 1) runs from the target down to the interfaces, and the per-example
rule of each interface op turns its output gradients into per-example
quantities for its PARAM input. The PARAM-only region between the interface
and the sources is then differentiated with ordinary (or batched) gradient
functions (phase 2).

"Carries examples" is a property of the data, not of its dtype or
differentiability: it flows through casts to integer, gathers, one-hot and
table lookups. Shape ops (`Shape`, `Size`...) give constants, so shape
arithmetic never does; a non-floating input made outside the tape (a
placeholder of token ids, say) counts as data only at the positions listed in
`INTEGER_DATA_INPUTS` (gather and one-hot indices, casts, lookup keys), so a
constant shape vector never passes for a batch of examples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg import batch_axis
from tf_pxg.backprop import gradient_functions
from tf_pxg.tape.recording import Entry, Recorder

PARAM, CONST, DATA = "param", "const", "data"

# Where a non-floating input made outside the tape carries examples (token
# ids, string keys): indices of gathers and one-hot, casts (Keras casts
# token ids to the input layer's dtype and back), table lookups.
# Non-floating tensors made on the tape carry examples iff their inputs do.
INTEGER_DATA_INPUTS = {
    "Cast": (0,),
    "GatherV2": (1,),
    "Gather": (1,),
    "ResourceGather": (1,),
    "GatherNd": (1,),
    "ResourceGatherNd": (1,),
    "OneHot": (0,),
    "LookupTableFindV2": (1,),
    "LookupTableFind": (1,),
    "StringToHashBucketFast": (0,),
    "StringToHashBucketStrong": (0,),
    "StringToHashBucket": (0,),
    "Bucketize": (0,),
}

_NON_DATA_DTYPES = (tf.resource, tf.variant)

# Ops whose outputs never depend on parameter values (only on shapes).
_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank", "VariableShape")

# Ops creating a tensor from a shape; one of batch shape is data (it stands
# for the examples' initial RNN state, say), judged like an external tensor.
# Ops without inputs (graph constants, placeholders) are judged the same way.
_FILLS = ("Fill", "BroadcastTo")


def _is_float(dtype) -> bool:
  return dtype.is_floating or dtype.is_complex


@dataclasses.dataclass
class Interface:
  """One use of a PARAM tensor by an interface entry."""
  entry: Entry
  param_index: int
  output_grads: list
  data_indices: tuple
  batch_minor: bool = False
  rule: Any = None  # Set once the interface is found (registry or fallback).

  # Set when the engine reshaped the parameter operand (a size-1 axis moved
  # with the batch axis): the original tensor's id and shape, to which the
  # rule's results are reshaped back.
  original_param_id: Optional[int] = None
  original_param_shape: Any = None

  # Set on the chunks of one parameter's merged uses (`tf_pxg.merge_uses`):
  # a key shared by the chunks, whose per-example gradients add up.
  chunk_set: Any = None

  @property
  def param_id(self) -> int:
    if self.original_param_id is not None:
      return self.original_param_id
    return self.entry.input_ids[self.param_index]

  @property
  def param(self):
    return self.entry.inputs[self.param_index]


class Classifier:
  """Classifies the recorded tensors as PARAM, CONST or DATA (see module doc).

  Args:
    recorder: the tape's recorder (entries in topological order).
    source_ids: tensor ids of the sources (variable handles, watched tensors).
    batch_size: B if statically known, used to tell constants (leading dim
      != B) from data among tensors the tape did not see being made.
  """

  def __init__(self, recorder: Recorder, source_ids: Sequence[int],
               batch_size: Optional[int]):
    self._sources = set(source_ids)
    self._batch_size = batch_size
    self.status: Dict[int, str] = {}
    self.layouts: Dict[int, batch_axis.Layout] = {}
    self.mixing: Dict[int, str] = {}  # id(entry) -> why it mixes examples.
    # Non-floating tensors holding values of examples (not shapes).
    self._values: set = set()
    for entry in recorder.entries:
      st = CONST
      layouts = {}
      values = False
      for i, (tid, t) in enumerate(zip(entry.input_ids, entry.inputs)):
        s = self.input_status(entry, i, tid, t)
        if s == DATA:
          st = DATA
          layouts[i] = self.layout(tid)
          values = values or (
              _is_float(t.dtype) or tid in self._values or
              i in INTEGER_DATA_INPUTS.get(entry.op_type, ()))
        elif s == PARAM and st != DATA:
          st = PARAM
      if entry.op_type in _SHAPE_OPS:
        st = CONST
      elif (entry.op_type in _FILLS or not entry.inputs) and st == CONST:
        st = self._external(entry.outputs[0])  # A zero state [B, units]?
      out_layouts = [batch_axis.AXIS0] * len(entry.outputs)
      if st == DATA and layouts:
        out_layouts, why = batch_axis.propagate(entry, layouts,
                                                 batch_size)
        if why:
          self.mixing[id(entry)] = why
      for tid, lay in zip(entry.output_ids, out_layouts):
        self.status[tid] = PARAM if tid in self._sources else st
        if st == DATA:
          self.layouts[tid] = lay
          if values:
            self._values.add(tid)

  def input_status(self, entry: Entry, i: int, tid: int, t) -> str:
    """Status of input `i` of `entry` as it affects the entry's outputs.

    A non-floating input of an op with floating outputs is shape arithmetic
    (CONST) unless it carries the values of examples: it was computed from
    floating data (a cast of float token ids to int) or from a position
    listed in `INTEGER_DATA_INPUTS`, or it sits at such a position.
    """
    if tid in self._sources:
      return PARAM
    if (not _is_float(t.dtype) and entry.outputs and
        _is_float(entry.outputs[0].dtype) and tid not in self._values and
        i not in INTEGER_DATA_INPUTS.get(entry.op_type, ())):
      return CONST  # Shape arithmetic (or a mask) feeding a float op.
    if tid in self.status:
      return self.status[tid]
    return self._external(t)

  def _external(self, t) -> str:
    """Status of a tensor made before/outside the tape.

    Scalars and handles are constants. With B known, a tensor whose leading
    dimension is not a multiple of B is a constant; anything else is data
    (this includes graph constants, as tf.function captures small eager
    inputs by value). With B unknown (scalar target), graph constants are
    constants.
    """
    if t.dtype in _NON_DATA_DTYPES:
      return CONST
    rank = t.shape.rank
    if rank == 0:
      return CONST
    if rank is None:
      return DATA
    lead = t.shape[0]
    if self._batch_size is not None:
      if lead is not None and (self._batch_size == 0 or
                               lead % self._batch_size):
        return CONST
      return DATA
    if getattr(getattr(t, "op", None), "type", None) == "Const" and not (
        hasattr(t, "numpy") and tf.executing_eagerly()):
      return CONST
    return DATA

  def param_inputs(self, entry: Entry) -> List[int]:
    """Differentiable inputs of `entry` that are PARAM."""
    return [i for i, (tid, t) in enumerate(zip(entry.input_ids, entry.inputs))
            if self.input_status(entry, i, tid, t) == PARAM and
            (_is_float(t.dtype) or tid in self._sources)]

  def data_inputs(self, entry: Entry) -> tuple:
    return tuple(
        i for i, (tid, t) in enumerate(zip(entry.input_ids, entry.inputs))
        if self.input_status(entry, i, tid, t) == DATA and t.shape.rank != 0)

  def is_interface(self, entry: Entry) -> bool:
    return (any(self.status.get(t) == DATA for t in entry.output_ids) and
            bool(self.param_inputs(entry)))

  def layout(self, tid: int) -> batch_axis.Layout:
    """`(batch axis, minor)` of a DATA tensor; None if unknown."""
    return self.layouts.get(tid, batch_axis.AXIS0)

  @property
  def batch_minor(self) -> set:
    """DATA tensors whose batch axis holds examples minor (`[k, B]`)."""
    return {t for t, lay in self.layouts.items() if lay and lay[1]}

  def is_batch_minor(self, entry: Entry) -> bool:
    """Whether the entry's data inputs hold examples minor on their axis."""
    return any((self.layout(t) or batch_axis.AXIS0)[1]
               for t in entry.input_ids if self.status.get(t) == DATA)

  def param_ids(self) -> set:
    return {t for t, s in self.status.items() if s == PARAM} | self._sources


# Ops that, along axis 0 of a per-example tensor (their input 1), mix examples.
_REDUCTIONS = ("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "Cumsum",
               "Cumprod")
_BATCH_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


def check_examples_independent(entry: Entry, classifier: Classifier,
                               vector_target: bool) -> None:
  """Raises if `entry` mixes the examples of a per-example computation.

  Raises:
    ValueError: for batch-normalisation in training mode, or (when the target
      has one entry per example) a reduction over the batch axis of data.
  """
  why = None
  if entry.op_type in _BATCH_NORMS:
    try:
      training = gradient_functions.get_attr(entry, "is_training")
    except (ValueError, KeyError):
      training = True
    if training:
      why = "normalises with statistics of the whole batch"
  elif vector_target:
    why = _mixes_along_batch(entry, classifier)
  if why:
    hint = (" BatchNormalization in training does this; use "
            "keras.layers.GroupNormalization or "
            "keras.layers.LayerNormalization instead (or freeze the layer "
            "and call it with training=False)." if "statistics" in why else
            " Check which axis holds the examples: tf_pxg follows the batch "
            "axis through transposes, reshapes and contractions, and an op "
            "may reduce or contract any other axis.")
    raise ValueError(
        f"{entry.describe()} mixes examples: it {why}, so "
        "an example's gradient depends on the other examples and has no "
        f"per-example value.{hint}")


def _mixes_along_batch(entry: Entry, classifier: Classifier):
  """Why `entry` mixes examples along the tracked batch axis, or None.

  Reductions of `[B]` vectors are left alone (a loss may be averaged); where
  the batch axis of a reduction's input is unknown it is taken to be 0.
  """
  data = entry.inputs[0] if entry.inputs else None
  rank = data.shape.rank if data is not None else None
  if entry.op_type in _REDUCTIONS and not (rank and rank >= 2):
    return None
  why = classifier.mixing.get(id(entry))
  if why or entry.op_type not in _REDUCTIONS:
    return why
  if (classifier.status.get(entry.input_ids[0]) != DATA or
      classifier.layout(entry.input_ids[0]) is not None):
    return None
  axis = tf.get_static_value(entry.inputs[1])
  if axis is not None and 0 in {int(a) % rank for a in np.reshape(axis, [-1])}:
    return "reduces over the batch axis 0 (batch statistics)"
  return None


# Batch axis at the interface -------------------------------------------------

# Ops for which moving the batch axis of the data operand and of the output
# to 0 gives the same op on permuted tensors (the parameter is broadcast
# along every axis that moves), and the checks that make it so.
_ELEMENTWISE = ("AddV2", "Add", "Sub", "Mul")
_PERMUTABLE = _ELEMENTWISE + ("BiasAdd", "BatchMatMulV2", "BatchMatMulV3",
                              "GatherV2", "ResourceGather")


def expected_axes(itf: Interface):
  """(data axis, output axis) where the rule expects the examples."""
  entry = itf.entry
  if entry.op_type == "MatMul":
    ta = gradient_functions.get_attr(entry, "transpose_a") or False
    tb = gradient_functions.get_attr(entry, "transpose_b") or False
    if itf.param_index == 1:
      return (1 if ta else 0), 0
    return (0 if tb else 1), 1
  if entry.op_type == "Einsum":
    return 0, None  # The rule finds the output's batch letter itself.
  return 0, 0


def _move_to_front(t, axis: int):
  perm = [axis] + [a for a in range(t.shape.rank) if a != axis]
  return tf.transpose(t, perm)


def _permutable(itf: Interface, axis: int) -> bool:
  entry = itf.entry
  out_rank = entry.outputs[0].shape.rank
  p_rank = itf.param.shape.rank
  if out_rank is None or p_rank is None or entry.op_type not in _PERMUTABLE:
    return False
  if entry.op_type in ("GatherV2", "ResourceGather"):
    return itf.param_index == 0
  if entry.op_type == "BiasAdd":
    fmt = gradient_functions.get_attr(entry, "data_format") or b"NHWC"
    return fmt in (b"NHWC", "NHWC") and axis < out_rank - 1
  if entry.op_type.startswith("BatchMatMul"):
    return p_rank == 2 and axis < out_rank - 2
  # Elementwise: the parameter is broadcast (size 1 or absent) on the batch
  # axis; size-1 axes move with it (a reshape of the parameter).
  padded = [1] * (out_rank - p_rank) + itf.param.shape.as_list()
  return p_rank <= out_rank and padded[axis] == 1 and all(
      entry.inputs[i].shape.rank == out_rank for i in itf.data_indices)


def normalise_batch_axis(itf: Interface, classifier: Classifier) -> Interface:
  """`itf` with the examples where its rule expects them.

  Rules take the examples on axis 0 of the data operand and the output (a
  MatMul's on the rows of the matrix that holds them). Where the tracked
  batch axis differs — time-major data, say — the data operand, the
  outputs and their gradients are transposed to put it first, for ops that
  stay the same op under that permutation.

  Raises:
    ValueError: the examples are on another axis of an op that cannot be
      permuted that way.
  """
  entry = itf.entry
  lays = [classifier.layout(entry.input_ids[i]) for i in itf.data_indices]
  outs = [classifier.layout(t) for t in entry.output_ids]
  known = [l for l in lays if l is not None]
  minor = any(l[1] for l in known)
  want_data, want_out = expected_axes(itf)
  if (all(l[0] == want_data for l in known) and
      all(l is None or want_out is None or l[0] == want_out for l in outs)):
    itf.batch_minor = itf.batch_minor or minor
    return itf
  axis = known[0][0] if known else None
  if entry.op_type == "Einsum" and len(known) == 1:
    return _batch_letter_first(itf, axis, minor)
  if (len({l[0] for l in known}) != 1 or want_data != 0 or
      not _permutable(itf, axis)):
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
  if (entry.op_type in _ELEMENTWISE and p.shape.rank == out_rank and
      p.shape.rank and p.shape[axis] == 1 and axis):
    original_id, original_shape = itf.param_id, p.shape
    moved_shape = [p.shape[axis]] + [n for a, n in enumerate(p.shape)
                                     if a != axis]
    inputs[itf.param_index] = tf.reshape(p, moved_shape)
  moved = Entry(entry.op_type, tuple(inputs), tuple(outputs), entry.attrs,
                entry.op, entry.scope, entry.index)
  return Interface(moved, itf.param_index, grads, itf.data_indices, minor,
                   itf.rule, original_param_id=original_id,
                   original_param_shape=original_shape)


def _batch_letter_first(itf: Interface, axis: int, minor: bool) -> Interface:
  """An Einsum whose data operand has the examples on `axis`: the operand is
  transposed to put them first and the equation rewritten to match."""
  entry = itf.entry
  eq = gradient_functions.get_attr(entry, "equation")
  eq = eq.decode() if isinstance(eq, bytes) else eq
  parsed = batch_axis.einsum_subscripts(
      eq, [t.shape.rank for t in entry.inputs])
  if parsed is None or len(entry.inputs) != 2:
    raise ValueError(
        f"{entry.describe()}: the examples are on axis {axis} of its data "
        "operand and the equation could not be rewritten; put the batch "
        "letter first.")
  subs, out = parsed
  d = itf.data_indices[0]
  sub = subs[d]
  subs = list(subs)
  subs[d] = sub[axis] + sub[:axis] + sub[axis + 1:]
  inputs = list(entry.inputs)
  inputs[d] = _move_to_front(inputs[d], axis)
  rewritten = Entry(entry.op_type, tuple(inputs), entry.outputs, entry.attrs,
                    entry.op, entry.scope, entry.index,
                    attr_overrides={"equation": f"{','.join(subs)}->{out}"})
  return Interface(rewritten, itf.param_index, itf.output_grads,
                   itf.data_indices, minor, itf.rule)
