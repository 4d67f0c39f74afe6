"""Finding the interface: where parameters meet the data.

Every tensor the tape saw is classified as

* PARAM: derived from the sources alone (a variable read, its cast to
  float16, `W + A @ B`, a reshaped kernel);
* DATA: carries examples on axis 0 (the inputs, and anything computed from
  them);
* CONST: neither (scalars, graph constants, reads of non-source variables,
  shape arithmetic).

An *interface* entry consumes a PARAM tensor and produces DATA. Backprop
(phase 1) runs from the target down to the interfaces, and the per-example
rule of each interface op turns its output gradients into per-example
quantities for its PARAM input. The PARAM-only region between the interface
and the sources is then differentiated with ordinary (or batched) gradient
functions (phase 2).

Integer inputs are shape arithmetic except at the positions that carry
examples as indices (gathers), listed in `INTEGER_DATA_INPUTS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg.backprop import gradient_functions
from tf_pxg.tape.recording import Entry, Recorder

PARAM, CONST, DATA = "param", "const", "data"

# Where an integer input of an op with floating outputs carries examples:
# gather indices, and the shape of a batch-sized fill (an RNN's zero state).
INTEGER_DATA_INPUTS = {
    # Token ids cast to float and back (Keras casts model inputs to the
    # input layer's dtype) stay data.
    "Cast": (0,),
    "GatherV2": (1,),
    "Gather": (1,),
    "ResourceGather": (1,),
    "GatherNd": (1,),
    "ResourceGatherNd": (1,),
    "Fill": (0,),
    "BroadcastTo": (1,),
}

_NON_DATA_DTYPES = (tf.resource, tf.variant, tf.string)

# Ops whose outputs never depend on parameter values (only on shapes).
_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank", "VariableShape")

# Ops creating a tensor from a shape; one of batch shape is data (it stands
# for the examples' initial RNN state, say), judged like an external tensor.
# Ops without inputs (graph constants, placeholders) are judged the same way.
_FILLS = ("Fill", "BroadcastTo")

# Ops that move spatial blocks into the batch axis with the example index
# minor ([blocks * B]), and their inverses.
_TO_BATCH_MINOR = ("SpaceToBatchND", "SpaceToBatch")
_FROM_BATCH_MINOR = ("BatchToSpaceND", "BatchToSpace")


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

  @property
  def param_id(self) -> int:
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
    self.batch_minor: set = set()
    for entry in recorder.entries:
      st = CONST
      minor = False
      for i, (tid, t) in enumerate(zip(entry.input_ids, entry.inputs)):
        s = self.input_status(entry, i, tid, t)
        if s == DATA:
          st = DATA
          minor = minor or tid in self.batch_minor
        elif s == PARAM and st != DATA:
          st = PARAM
      if entry.op_type in _SHAPE_OPS and st == PARAM:
        st = CONST
      elif (entry.op_type in _FILLS or not entry.inputs) and st == CONST:
        st = self._external(entry.outputs[0])  # A zero state [B, units]?
      if entry.op_type in _TO_BATCH_MINOR:
        minor = True
      elif entry.op_type in _FROM_BATCH_MINOR:
        minor = False
      for tid in entry.output_ids:
        self.status[tid] = PARAM if tid in self._sources else st
        if minor and st == DATA:
          self.batch_minor.add(tid)

  def input_status(self, entry: Entry, i: int, tid: int, t) -> str:
    """Status of input `i` of `entry` as it affects the entry's outputs.

    Integer inputs of ops with floating outputs are shape arithmetic, except
    at the positions in `INTEGER_DATA_INPUTS`.
    """
    if tid in self._sources:
      return PARAM
    if (not _is_float(t.dtype) and entry.outputs and
        _is_float(entry.outputs[0].dtype) and
        i not in INTEGER_DATA_INPUTS.get(entry.op_type, ())):
      return CONST
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

  def is_batch_minor(self, entry: Entry) -> bool:
    """Whether the entry's data inputs hold examples minor on axis 0."""
    return any(t in self.batch_minor for t in entry.input_ids)

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
  elif vector_target and entry.op_type in _REDUCTIONS:
    data, axis = entry.inputs[0], tf.get_static_value(entry.inputs[1])
    rank = data.shape.rank
    if (axis is not None and rank and rank >= 2 and
        classifier.status.get(entry.input_ids[0]) == DATA):
      if 0 in {int(a) % rank for a in np.reshape(axis, [-1])}:
        why = "reduces over the batch axis 0 (batch statistics)"
  if why:
    raise ValueError(
        f"{entry.describe()} mixes examples: it {why}, so "
        "an example's gradient depends on the other examples and has no "
        "per-example value. BatchNormalization in training does this; use "
        "keras.layers.GroupNormalization or keras.layers.LayerNormalization "
        "instead (or freeze the layer and call it with training=False).")
