"""Finding the interface: where parameters meet the data.

Every tensor the tape saw is classified as

* PARAM: derived from the sources alone (a variable read, its cast to
  float16, `W + A @ B`, a reshaped kernel);
* DATA: carries examples (the inputs, and anything computed from them),
  on the batch axis tracked by `tf_pxg.interface.batch_axis` (axis 0 for inputs);
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
arithmetic never does — unless the shape they read depends on the values of
examples (`tf.where(cond)`, `tf.boolean_mask`, `tf.unique`, `tf.zeros([n])`
of a data `n`: `tf_pxg.interface.value_shapes.VALUE_SHAPED`): such a shape is a count
over the whole batch, so its read is data that mixes examples, checked on
the data path like any other value.

**Provenance, not positions.** Whatever the data touches is data: a recorded
tensor computed from values of examples (`_values`: float, integer, bool or
string) is DATA at every input of every op, whatever that input sets (a
size, depth, seed, condition, bound or index). A tensor made outside the
tape is the step's data unless it is a literal (`_external_values`: in a
graph, only constants, shape reads and variable reads lie behind it;
eagerly, it existed before the tape and has a row per example); a literal
made outside the tape counts as data only where its shape says so and, if
non-floating, at the positions of `INTEGER_DATA_INPUTS` (gather and one-hot
indices, casts, lookup keys), so a constant shape vector never passes for a
batch of examples. Data at an argument (`batch_axis.ROW_INPUTS`) is refused
(`argument_from_data`) unless interval arithmetic proves it one value
(`_clamped_to_constant`); a ragged partition of data rows must be proven
to follow example boundaries (`_unproven_partition`); writes and eager host
reads of data are refused (`check_no_data_writes`, `check_no_host_reads`).
The attacks this closes and their measured influence: docs/threat_model.md,
"Provenance".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.interface import batch_axis
from tf_pxg.interface import batch_copies
from tf_pxg.interface import value_shapes
from tf_pxg.interface import written_state
from tf_pxg.tape import library_constants
from tf_pxg.tape import recording
from tf_pxg.tape import side_effects
from tf_pxg.tape.recording import Entry, Recorder, tensor_id

PARAM, CONST, DATA = "param", "const", "data"

# Where a non-floating input made outside the tape carries examples (token
# ids, string keys): indices of gathers and one-hot, casts (Keras casts
# token ids to the input layer's dtype and back), table lookups, string
# ops, and the reshapes and slices that Keras applies to its inputs.
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
    "Identity": (0,),
    "Reshape": (0,),
    "ExpandDims": (0,),
    "Squeeze": (0,),
    "Transpose": (0,),
    "StridedSlice": (0,),
    "StringLower": (0,),
    "StringUpper": (0,),
    "StaticRegexReplace": (0,),
    "RegexReplace": (0,),
    "StringStrip": (0,),
    "StringSplitV2": (0,),
    "StringToNumber": (0,),
    "DenseBincount": (0,),
    "Bincount": (0,),
}

_NON_DATA_DTYPES = (tf.resource, tf.variant)

# Ops whose outputs never depend on parameter values (only on shapes).
_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank", "VariableShape",
              "TensorListLength", "TensorListElementShape")

# Ops creating a tensor from a shape; one of batch shape is data (it stands
# for the examples' initial RNN state, say), judged like an external tensor.
# Ops without inputs (graph constants, placeholders) are judged the same way.
_FILLS = ("Fill", "BroadcastTo")


# Ops whose non-floating inputs are shapes, seeds or ranges, never the token
# ids of examples (a `[4]` shape of a rank-4 tensor must not pass for a
# batch of 4 examples).
_SHAPE_CONSUMERS = ("BroadcastArgs", "BroadcastGradientArgs", "Range",
                    "Empty", "Fill")


# Inputs that set an output size (Keras' CategoryEncoding passes a bincount
# `size` clamped between constants computed from `max(ids)`; the shape of a
# broadcast, the multiples of a tile): the values of each example's row do
# not depend on them.
_SIZE_INPUTS = {"DenseBincount": (1,), "Bincount": (1,), "BroadcastTo": (1,),
                "Tile": (1,)}


def _takes_shapes(op_type: str) -> bool:
  return "Random" in op_type or op_type in _SHAPE_CONSUMERS


def _uniform(entry: Entry) -> bool:
  """Whether the entry (a fill, or a constant made without inputs) has the
  same value in every element, so no row belongs to one example."""
  if entry.op_type in _FILLS:
    return True
  value = tf.get_static_value(entry.outputs[0]) if entry.outputs else None
  if value is None:
    return False
  value = np.asarray(value)
  return value.size == 0 or bool(np.all(value == value.flat[0]))


def _shape_may_vary(t, layout=None) -> bool:
  """Whether a tensor's shape can differ from run to run of the same
  program other than through the batch size: a TensorList's length always
  can; in a graph, only where its static shape is not fully defined (XLA
  and TensorFlow enforce the static shape) outside its batch axis (`layout`,
  when the tensor holds rows of examples: a ragged batch padded to a static
  length, `[None, T]`, varies with B alone); eagerly, where it is not a
  scalar (every eager shape is known, so whether it would be the same on
  other data cannot be told)."""
  if t.dtype == tf.variant:
    return True
  if t.dtype == tf.resource or t.shape.rank == 0:
    return False
  if not tf.is_symbolic_tensor(t) or t.shape.rank is None:
    return True
  dims = t.shape.as_list()
  if layout is not None and 0 <= layout[0] < len(dims):
    dims = dims[:layout[0]] + dims[layout[0] + 1:]
  return any(d is None for d in dims)


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

  # Set on the chunks of one parameter's merged uses (`tf_pxg.per_example.merge_uses`):
  # a key shared by the chunks, whose per-example gradients add up.
  chunk_set: Any = None

  # Set for a parameter copied along the batch axis (`tf.broadcast_to`,
  # `tf.tile` of a weight; `tf_pxg.interface.batch_copies.copy_layout`), an interface
  # without data operands: the output axis that holds the examples.
  copy_axis: Optional[int] = None

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
    library_constants.load_for_loaded_libraries()  # TFP's tables, say.
    self._sources = set(source_ids)
    self._batch_size = batch_size
    self._producer = recorder.producer
    self._start_uid = getattr(recorder, "start_uid", None)
    self._graph_values_memo: Dict[int, bool] = {}
    # Resource reads in a graph that see state the data wrote.
    self._written = written_state.WrittenState(self._graph_values)
    self._captures: Dict[int, set] = {}
    # Integer data proven to lie in [lo, hi] (clamps by constants).
    self._bounds: Dict[int, tuple] = {}
    self.status: Dict[int, str] = {}
    self.layouts: Dict[int, batch_axis.Layout] = {}
    self.mixing: Dict[int, str] = {}  # id(entry) -> why it mixes examples.
    # Non-floating tensors holding values of examples (not shapes).
    self._values: set = set()
    # Constants and fills of a batch-like shape (a zero state [B, units],
    # a time-major [T, B, u] zeros): data by shape, but every row is the
    # same, so they take any layout and never pair rows of examples.
    self._fills: set = set()
    # Values reduced over the batch axis (allowed for a scalar target, which
    # sums over examples) and what is computed from them alone.
    self._batch_stats: set = set()
    # Tensors whose shape depends on the values of examples -> the entry
    # that made it so (`tf_pxg.interface.value_shapes.VALUE_SHAPED`).
    self.value_shaped: Dict[int, Entry] = {}
    # Entries with data at an argument (`argument_from_data`).
    self.argument_creators: set = set()
    for entry in recorder.entries:
      self._classify(entry)

  # The stages of one entry's classification, in order -----------------------

  def _classify(self, entry: Entry) -> None:
    """Classifies `entry`'s outputs from its inputs (entries come in
    program order, so every recorded input is classified already)."""
    st, values, layouts, data_args = self._read_inputs(entry)
    st, values, writer, shape_of = self._own_status(entry, st, values)
    out_layouts = [batch_axis.AXIS0] * len(entry.outputs)
    copy = batch_copies.copy_layout(entry, self._batch_size,
                                    self._layout_of_tensor) if (
                                        st in (PARAM, CONST)) else None
    if copy is not None:
      # A parameter (or a constant: a frozen weight) copied along the
      # batch axis: example b's rows are its own copy, data from here on
      # (for a parameter, the op is the interface).
      st, values = DATA, True
      out_layouts = [copy] * len(entry.outputs)
    if writer is not None or shape_of is not None:
      out_layouts = self._no_rows(entry, writer, shape_of)
    elif st == DATA and layouts:
      out_layouts = self._propagate(entry, layouts, data_args)
    self._note_value_shapes(entry, st, data_args, out_layouts)
    for tid, lay in zip(entry.output_ids, out_layouts):
      self.status[tid] = PARAM if tid in self._sources else st
      if st == DATA:
        self.layouts[tid] = lay
        if values:
          self._values.add(tid)

  def _read_inputs(self, entry: Entry) -> tuple:
    """Stage 1: `(status, carries values, {input index: layout}, argument
    indices holding values)` from the inputs' provenance."""
    st = CONST
    layouts = {}
    values = False
    data_args = []  # Arguments (not rows) that hold values of examples.
    rows = batch_axis.row_inputs(entry)
    for i, (tid, t) in enumerate(zip(entry.input_ids, entry.inputs)):
      s = self.input_status(entry, i, tid, t)
      if s == DATA:
        st = DATA
        if tid not in self._fills:  # Identical rows: any layout agrees.
          layouts[i] = self.layout(tid)
        # On the tape, provenance alone says whether a tensor carries
        # examples' values; the positions of `INTEGER_DATA_INPUTS` only
        # judge tensors made outside it (a shape slice whose spec is
        # DATA by shape at B = 1 carries none).
        carries = tid not in self._fills and (
            tid in self._values or
            (tid not in self.status and (
                i in INTEGER_DATA_INPUTS.get(entry.op_type, ()) or
                _is_float(t.dtype) or self._external_values(t))))
        values = values or carries
        if carries and i not in rows:
          data_args.append(i)
      elif s == PARAM and st != DATA:
        st = PARAM
    if st == DATA and self._clamped_to_constant(entry):
      return CONST, False, {}, []
    return st, values, layouts, data_args

  def _own_status(self, entry: Entry, st: str, values: bool) -> tuple:
    """Stage 2: what the op itself makes of its inputs' status: a read of
    state the data wrote, a shape that counts examples' values, a shape or
    integer literal, a fill of the batch's shape. Returns `(status,
    values, writer, shape_of)` (the last two: the entries behind the first
    two cases, else None)."""
    shape_of = self._value_shape_read(entry)
    writer = self._state_writer(entry)
    if writer is not None:
      # State written from the data (before the tape): the statistic
      # itself, with no rows of examples.
      st, values = DATA, True
    elif shape_of is not None:
      # A shape that counts the examples' values: data of the whole batch.
      st, values = DATA, True
    elif entry.op_type in _SHAPE_OPS:
      st = CONST
    elif entry.op_type == "Const" and entry.outputs and not _is_float(
        entry.outputs[0].dtype):
      st = CONST  # A shape vector or indices, not token ids of examples.
    elif (entry.op_type in _FILLS or not entry.inputs) and st == CONST:
      st = self._external(entry.outputs[0])  # A zero state [B, units]?
      if st == DATA and _uniform(entry):
        self._fills.update(entry.output_ids)
    return st, values, writer, shape_of

  def _no_rows(self, entry: Entry, writer, shape_of) -> list:
    """Stage 3a: outputs with no rows of examples (state the data wrote, a
    shape counting values): a statistic of the whole batch, which mixes
    examples unless there is only one."""
    if self._batch_size != 1:  # One example cannot mix with another.
      why = (written_state.why(writer) if writer is not None else
             value_shapes.value_shape_why(shape_of.describe()))
      self.mixing[id(entry)] = batch_axis.Mixing(batch_axis.MIXES, why)
    return [None] * len(entry.outputs)

  def _propagate(self, entry: Entry, layouts: dict, data_args) -> list:
    """Stage 3b: the outputs' layouts from the inputs' by the op's rule
    (`batch_axis.propagate`), noting why it mixes examples, if it does, and
    the batch statistics it makes or consumes."""
    batch_size = self._batch_size
    out_layouts, why = batch_axis.propagate(entry, layouts, batch_size,
                                            self._layout_of_tensor)
    if why is None and batch_size != 1:
      why = (argument_from_data(entry, data_args) or
             self._unproven_partition(entry))
    if batch_size == 1:
      # One example cannot mix with another; where a rule loses the
      # batch axis (a squeeze of every size-1 axis, say) it is axis 0.
      out_layouts = [batch_axis.AXIS0 if l is None else l
                     for l in out_layouts]
    elif why:
      self.mixing[id(entry)] = why
    stats = [i for i in layouts if entry.input_ids[i] in self._batch_stats]
    if batch_size != 1 and stats:
      if any(l is not None for l in layouts.values()) and not why:
        # E.g. x - mean(x, 0): refused for a scalar target too.
        self.mixing[id(entry)] = batch_axis.Mixing(
            batch_axis.MIXES, "combines a statistic of the whole batch "
            "with each example's rows")
      self._batch_stats.update(entry.output_ids)
    elif why is not None and why.kind == batch_axis.REDUCES:
      self._batch_stats.update(entry.output_ids)
    return out_layouts

  def _note_value_shapes(self, entry: Entry, st: str, data_args,
                         out_layouts) -> None:
    """Stage 4: outputs whose shape depends on the examples' values."""
    creator = self._value_shape_creator(entry, data_args)
    if creator is not None:
      self.value_shaped.update(
          (tid, creator) for tid, t, lay in zip(
              entry.output_ids, entry.outputs, out_layouts)
          if _shape_may_vary(t, lay if (
              st == DATA and
              entry.op_type in value_shapes.ONE_ROW_PER_EXAMPLE) else None))

  def _external_values(self, t) -> bool:
    """Whether a tensor made outside the tape holds values of examples
    rather than a literal: in a graph, unless every op it comes from is a
    constant, a shape read or a variable read (a placeholder, an iterator's
    element, anything computed from them holds values); eagerly, if it
    has a row per example and existed before the tape started (a Python
    value converted while the tape records, a literal shape say, was made
    after)."""
    if t.dtype in _NON_DATA_DTYPES:
      return False
    if tf.is_symbolic_tensor(t):
      return self._graph_values(t)
    # TF caches small eager constants (a slice's `[0]` may predate the
    # tape), so eagerly only a tensor with a row per example counts.
    lead = t.shape[0] if t.shape.rank else None
    if self._batch_size in (None, 0, 1) or lead is None or (
        lead % self._batch_size):
      return False
    tid = recording.tensor_id(t)
    return self._start_uid is not None and tid < self._start_uid

  def _captured(self, graph) -> set:
    """Ids of `graph`'s placeholders that stand for captured values (a
    tensor closed over from outside the function: a constant of the step,
    as `tf.function` treats it; the step's data are its arguments)."""
    key = id(graph)
    if key not in self._captures:
      self._captures[key] = {recording.tensor_id(t) for t in getattr(
          graph, "internal_captures", ())}
    return self._captures[key]

  def _pre_tape_statistic(self, tid: int, t) -> bool:
    """Whether `t`, made in the graph before the tape started, comes from
    the step's data but holds no row per example (a batch maximum, a
    count, column means computed before the tape): a statistic of the
    batch, data that mixes examples (`_batch_stats`)."""
    if tid in self._batch_stats:
      return True
    if not (tf.is_symbolic_tensor(t) and self._external_values(t) and
            self._external(t) == CONST):
      return False
    self._batch_stats.add(tid)
    self._values.add(tid)
    self.layouts[tid] = None
    return True

  def _graph_values(self, t) -> bool:
    """Whether graph tensor `t` carries the step's data: a post-order walk
    over its producers (literals, shapes, handles and captured constants
    carry none; a placeholder or an iterator's element does), where a read
    of state also depends on the inputs of the writes before it
    (`written_state.WrittenState.write_inputs`). Bounded: a walk past
    2,000 tensors counts what is left as data."""
    memo = self._graph_values_memo
    stack = [(t, False)]
    visited = 0
    while stack:
      u, expanded = stack.pop()
      key = recording.tensor_id(u)
      if expanded:
        memo[key] = any(memo.get(recording.tensor_id(v)) is not False
                        for v in self._dependencies(u))
        continue
      if key in memo:
        continue
      leaf = self._leaf_value(u, key)
      if leaf is not None or visited > 2000:
        memo[key] = True if leaf is None else leaf
        continue
      visited += 1
      memo[key] = None  # In progress: a cycle counts as data.
      stack.append((u, True))
      stack.extend((v, False) for v in self._dependencies(u))
    return memo[recording.tensor_id(t)] is not False

  def _leaf_value(self, u, key) -> Optional[bool]:
    """The value of `_graph_values` for a tensor that needs no walk, or None."""
    op = u.op
    if u.dtype in _NON_DATA_DTYPES or key in self._captured(u.graph):
      return False  # A handle, a captured constant.
    if op.type in side_effects.PURE_RESOURCE_READS:
      return None  # Depends on its inputs and the writes before it.
    if op.type in _LITERAL_OPS:
      return False  # A literal, a shape.
    if not any(v.dtype not in _NON_DATA_DTYPES for v in op.inputs):
      return True  # A placeholder, an iterator: the step's data.
    return None

  def _dependencies(self, u) -> list:
    op = u.op
    deps = [v for v in op.inputs if v.dtype not in _NON_DATA_DTYPES]
    if op.type in side_effects.PURE_RESOURCE_READS:
      deps += self._written.write_inputs(op)
    return deps

  def _state_writer(self, entry: Entry):
    """For a resource read recorded in a graph (a variable or table read):
    the op that wrote its state from the examples' values before it
    (`tf_pxg.interface.written_state`); None otherwise."""
    if entry.op is None or entry.op_type not in side_effects.PURE_RESOURCE_READS:
      return None
    return self._written.writer_from_data(entry.op)

  def _interval(self, tid: int, t) -> tuple:
    """`(lo, hi)` bounds of an integer tensor: numbers, or `_B` for a
    tensor proven to be the number of examples (a string split's row
    count); `(-inf, inf)` if unknown."""
    if tid in self._bounds:
      return self._bounds[tid]
    if self.status.get(tid, CONST) != DATA:
      v = tf.get_static_value(t)
      if v is not None and np.size(v) == 1:
        v = float(np.ravel(v)[0])
        return v, v
    elif self._split_part(t, 2):
      return _B, _B
    return -np.inf, np.inf

  def _clamped_to_constant(self, entry: Entry) -> bool:
    """Whether an integer `Maximum`/`Minimum` of data and constants has one
    possible value: interval arithmetic over clamps, e.g. `tf.math.bincount`'s
    size `min(maxlength, max(minlength, max(ids) + 1))` with `minlength ==
    maxlength` (Keras' CategoryEncoding; `RaggedTensor.from_value_rowids`
    with the batch's row count as both) is `maxlength` whatever the
    values. Records the bounds of any other clamp of data for later ones."""
    if entry.op_type not in ("Maximum", "Minimum", "Cast", "Identity") or not (
        entry.outputs and entry.outputs[0].dtype.is_integer):
      return False
    bounds = [self._interval(tid, t)
              for tid, t in zip(entry.input_ids, entry.inputs)]
    lo, hi = bounds[0]
    for b_lo, b_hi in bounds[1:]:
      if entry.op_type == "Maximum":
        lo = _bound(lo, b_lo, max, neutral=-np.inf, unknown=-np.inf)
        hi = _bound(hi, b_hi, max, neutral=None, unknown=np.inf)
      else:
        lo = _bound(lo, b_lo, min, neutral=None, unknown=-np.inf)
        hi = _bound(hi, b_hi, min, neutral=np.inf, unknown=np.inf)
    if lo == hi:
      return True
    if lo != -np.inf or hi != np.inf:
      self._bounds.update((o, (lo, hi)) for o in entry.output_ids)
    return False

  def _unproven_partition(self, entry: Entry):
    """Why a `RaggedTensorToTensor` of data may not give each example its
    own row, or None. Its output row r holds the values its row partition
    assigns to r, so the partition must be *proven* to follow example
    boundaries: the row ids of a string split (`tf.strings.split` of a
    `[B]` batch: column 0 of `StringSplitV2`'s indices, the example each
    token came from) with the number of rows `B` (its dense shape's first
    entry, or a constant). A constant partition over data rows (sequence
    packing: `RaggedTensor.from_row_lengths(flat, lengths)` over the
    flattened batch) or any other computed one is not proven."""
    if entry.op_type != "RaggedTensorToTensor":
      return None
    try:
      kinds = [k.decode() if isinstance(k, bytes) else str(k) for k in
               recording.get_attr(entry, "row_partition_types")]
    except (ValueError, KeyError, TypeError):
      kinds = []
    if self.input_status(entry, 1, entry.input_ids[1],
                         entry.inputs[1]) != DATA:
      return None  # Rows of constants: no example's values to move.
    for k, (tid, t) in enumerate(zip(entry.input_ids[3:], entry.inputs[3:])):
      kind = kinds[k] if k < len(kinds) else "?"
      if kind == "FIRST_DIM_SIZE" and (
          self.status.get(tid, CONST) != DATA or self._split_part(t, 2)):
        continue
      if kind == "VALUE_ROWIDS" and self._split_part(t, 0):
        continue
      return batch_axis.Mixing(
          batch_axis.MIXES, "rebuilds a dense tensor from data rows by a "
          f"row partition ({kind}) that tf_pxg cannot prove follows example "
          "boundaries (only a string split's own row ids do), so a row may "
          "hold values of several examples, as in sequence packing; keep "
          "each example in its own row (pad to a fixed length per example)")
    return None

  def _split_part(self, t, output_index: int) -> bool:
    """Whether `t` is column/entry 0 of output `output_index` of a
    `StringSplitV2` (0: indices -> the row id of each token; 2: dense shape
    -> the number of strings), through casts and identities."""
    entry = self._producer.get(recording.tensor_id(t))
    while entry is not None and entry.op_type in ("Cast", "Identity"):
      entry = self._producer.get(entry.input_ids[0])
    if entry is None or entry.op_type != "StridedSlice":
      return False
    source = self._producer.get(entry.input_ids[0])
    if source is None or source.op_type != "StringSplitV2" or (
        entry.input_ids[0] != source.output_ids[output_index]):
      return False
    begin = tf.get_static_value(entry.inputs[1])
    stride = tf.get_static_value(entry.inputs[3])
    shrink = int(batch_axis.attr(entry, "shrink_axis_mask", 0))
    if begin is None or stride is None or np.any(np.asarray(stride) != 1):
      return False
    begin = np.ravel(begin)
    if output_index == 2:
      return begin.size == 1 and begin[0] == 0 and bool(shrink & 1)
    return (begin.size == 2 and begin[1] == 0 and bool(shrink & 2) and
            bool(int(batch_axis.attr(entry, "begin_mask", 0)) & 1) and
            bool(int(batch_axis.attr(entry, "end_mask", 0)) & 1))

  def carries_values(self, tid: int, t) -> bool:
    """Whether a tensor holds values computed from the examples (DATA by
    provenance, not a fill of the batch's shape), or, made outside the
    tape, is one of the step's inputs (`_external_values`)."""
    if tid not in self.status:  # Made outside the tape: an input?
      return self._external_values(t) and (
          self._external(t) == DATA or tf.is_symbolic_tensor(t))
    return self.status[tid] == DATA and tid in self._values

  def _value_shape_creator(self, entry: Entry,
                           data_args: Sequence[int] = ()) -> Optional[Entry]:
    """The entry that made the shape of `entry`'s outputs depend on the
    values of examples: the creator behind an input with such a shape, or
    `entry` itself if an input that sets its output shape
    (`value_shapes.VALUE_SHAPED`) or any argument (`data_args`, e.g. a
    bincount's width) carries examples. None otherwise."""
    if entry.op_type in _SHAPE_OPS:
      return None  # A shape vector's own shape is its rank: static.
    if data_args:
      self.argument_creators.add(id(entry))
      return entry
    for tid in entry.input_ids:
      if tid in self.value_shaped:
        return self.value_shaped[tid]
    for i in value_shapes.value_shape_inputs(entry.op_type):
      if i < len(entry.inputs) and self.input_status(
          entry, i, entry.input_ids[i], entry.inputs[i]) == DATA:
        return entry
    return None

  def _value_shape_read(self, entry: Entry) -> Optional[Entry]:
    """For a shape read (`Shape`, `Size`, `Rank`, `ShapeN`,
    `TensorListLength`) of a tensor whose shape depends on the values of
    examples: the entry that made it so. None for every other entry and for
    static ranks."""
    if entry.op_type not in value_shapes.SHAPE_READS:
      return None
    for tid, t in zip(entry.input_ids, entry.inputs):
      if tid in self.value_shaped and not (
          entry.op_type == "Rank" and t.shape.rank is not None):
        return self.value_shaped[tid]
    return None

  def input_status(self, entry: Entry, i: int, tid: int, t) -> str:
    """Status of input `i` of `entry` as it affects the entry's outputs.

    A non-floating input of an op with floating outputs is shape arithmetic
    (CONST) unless it carries the values of examples: it was computed from
    floating data (a cast of float token ids to int) or from a position
    listed in `INTEGER_DATA_INPUTS`, or it sits at such a position.
    """
    if tid in self._sources:
      return PARAM
    status = self.status.get(tid)
    if status is not None and tid in self._values:
      return status  # Provenance: data at every input, whatever it sets.
    if status is None and self._external_values(t):
      if self._pre_tape_statistic(tid, t):
        return DATA
      return self._external(t)
    if (not _is_float(t.dtype) and entry.outputs and
        _is_float(entry.outputs[0].dtype) and tid not in self._values and
        i not in INTEGER_DATA_INPUTS.get(entry.op_type, ())):
      return CONST  # Shape arithmetic (or a mask) feeding a float op.
    if i in _SIZE_INPUTS.get(entry.op_type, ()):
      return CONST  # An output size, not values of examples.
    if tid in self.status:
      return self.status[tid]
    if not _is_float(t.dtype) and _takes_shapes(entry.op_type):
      return CONST  # A shape vector or seed made outside the tape.
    return self._external(t)

  def _external(self, t) -> str:
    """Status of a tensor made before/outside the tape.

    Scalars and handles are constants. With B known, a tensor whose leading
    dimension is not a multiple of B is a constant; anything else is data
    (this includes graph constants, as tf.function captures small eager
    inputs by value). With B unknown (scalar target), graph constants are
    constants. A value proven to be a library's own literal
    (`tf_pxg.tape.library_constants`, bit-identical to a constant traced
    on placeholders) is a constant whatever its shape.
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
      if lead is not None and (self._batch_size == 0 or lead == 0 or
                               lead % self._batch_size):
        return CONST
    elif getattr(getattr(t, "op", None), "type", None) == "Const" and not (
        hasattr(t, "numpy") and tf.executing_eagerly()):
      return CONST
    if library_constants.is_library_constant(t):
      # Bit for bit a literal a library builds with no example in scope
      # (TFP's lbeta coefficients): why this is safe is the docstring of
      # tf_pxg.tape.library_constants.
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

  def _layout_of_tensor(self, t) -> batch_axis.Layout:
    tid = tensor_id(t)
    status = self.status.get(tid) or self._external(t)
    return self.layout(tid) if status == DATA else None

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



# A bound that is the number of examples (`Classifier._interval`).
_B = "B"


def _bound(a, b, pick, neutral, unknown):
  """`pick(a, b)` for bounds that may be `_B`: exact where both are numbers
  or equal, `a`/`b` where the other is `neutral` (the identity of `pick`
  on that side), otherwise `unknown` (infinite, on the safe side)."""
  if a == b:
    return a
  if neutral is not None and a == neutral:
    return b
  if neutral is not None and b == neutral:
    return a
  if a != _B and b != _B:
    return pick(a, b)
  return unknown


# Ops whose output is a literal, never the step's data (a handle is no data
# by dtype; a variable's read or shape depends on the writes before it:
# `_leaf_value`).
_LITERAL_OPS = ("Const", "Shape", "ShapeN", "Size", "Rank")


def _argument_name(entry: Entry, i: int) -> str:
  op_def = _compat.op_def(entry.op_type)
  args = list(op_def.input_arg) if op_def is not None else []
  if len(args) == len(entry.inputs):  # No list inputs: one arg each.
    return f"'{args[i].name}'"
  return f"input {i}"


def argument_from_data(entry: Entry, data_args: Sequence[int]):
  """The refusal of an op with data at an argument (`batch_axis.ROW_INPUTS`:
  a shape, size, depth, axis, seed, slice bound...), or None.

  An argument is one value for the whole batch. Computed from the data, it
  is a function of every example (a longest length, a maximum id, a count,
  a sum of token ids as a seed), so each example's computation would depend
  on the others and clipping its gradient would not bound its influence;
  with one example's values at an argument, the others depend on it."""
  if not data_args:
    return None
  names = ", ".join(_argument_name(entry, i) for i in data_args)
  return batch_axis.Mixing(
      batch_axis.MIXES, f"takes its argument {names} (a shape, size, depth, "
      "axis, seed, bound or other value shared by the whole batch) from the "
      "data")


# Examples never mix ----------------------------------------------------------

def data_path(recorder: Recorder, target_id: int,
              classifier: Classifier) -> List[Entry]:
  """The entries, in program order, that produce data the target depends on:
  every op from the model's inputs to the per-example target, before and
  after the first parameter (preprocessing included).

  Eagerly, Python reads a shape without an op (`tf.size`, `x.shape`,
  `keras.ops.shape`, `len`), so the target may depend on a value-dependent
  shape through no recorded edge: there, every op that selects elements of
  examples by their values (`value_shapes.is_value_selector`: `tf.where(c)`,
  `tf.boolean_mask`, `tf.unique`...) is on the path."""
  producer = recorder.producer
  seen, stack = set(), [target_id]
  stack.extend(tid for tid, creator in classifier.value_shaped.items()
               if (value_shapes.is_value_selector(creator.op_type) or
                   id(creator) in classifier.argument_creators) and
               creator.outputs and
               not tf.is_symbolic_tensor(creator.outputs[0]))
  while stack:
    entry = producer.get(stack.pop())
    if entry is None or id(entry) in seen:
      continue
    seen.add(id(entry))
    stack.extend(tid for i, (tid, t) in enumerate(zip(entry.input_ids,
                                                      entry.inputs))
                 if classifier.input_status(entry, i, tid, t) == DATA)
  return [e for e in recorder.entries if id(e) in seen and any(
      classifier.status.get(t) == DATA for t in e.output_ids)]
