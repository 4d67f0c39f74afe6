"""What the recorded forward pass computed from the data, besides the loss.

DP-SGD releases the data only through the clipped, noised gradient sum. A
forward pass can also carry the data out another way: an op that *writes*
state (a variable assignment such as a running statistic's, a scatter
update, a stateful RNN's carried state, a summary write) keeps a value that
is saved with the model, checkpointed or logged, un-clipped and un-noised.
Such ops have no outputs, so they are on no path to the loss and the
backward pass never sees them; the recorder keeps them apart
(`Recorder.writes`), and this module decides which of them depend on the
data.

**Data dependence** is forward reachability over the recording: a tensor
depends on the data if it is one of the data tensors (the step's inputs,
labels and weights) or an output of a recorded op with such an input. The
recording is in topological order (ops are recorded as they run or are
built), so one pass decides it. A variable's value read back after a
data-dependent write is not followed: that write is refused first. Writes
whose value is data-independent (a step counter, a seed generator's state)
are allowed.

The privacy argument (invariant 4 of docs/design.md's guarantee): a write
whose value depends on the data stores, for every step it runs, a function
of the batch that is neither clipped per example nor noised; the saved
variable then reveals, e.g., whether one example was sampled (a shift of one
of 32 examples by 100 moves a running mean by 100 * 0.1 / 32). Refusing it
before any update leaves only the noised sum as the data's way out.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence

from tf_pxg.tape import control_flow

# Function-calling ops whose bodies the tape does not record op by op.
FUNCTION_OPS = frozenset(control_flow.OPAQUE_OPS)

# Every op that takes a resource (a variable, a lookup table, a TensorArray,
# a stack, a queue, an iterator, a random generator's state) either only
# reads it or may change it. The readers are listed; every other op with a
# resource input, and every op with no outputs (a state write, a summary or
# print, a table insert, a queue enqueue), may carry the data out of the
# step, so it is a *write*: refused when its inputs depend on the data.
# Refuse what is not proven safe: a resource op tf_pxg does not know is a
# write.
PURE_RESOURCE_READS = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "LookupTableFindV2", "LookupTableFind",
    "LookupTableSizeV2", "LookupTableSize", "LookupTableExportV2",
    "TensorArrayReadV3", "TensorArraySizeV3", "TensorArrayGatherV3",
    "IsBoostedTreesEnsembleInitialized",
})

# Ops with no outputs that change nothing a run releases: `NoOp` (control
# dependencies) and `Assert` (a failed assertion stops the step; XLA drops
# it: docs/threat_model.md lists this as not covered).
_HARMLESS_WITHOUT_OUTPUTS = frozenset({"NoOp", "Assert"})

_RESOURCE_DTYPES = ("resource",)


def is_write(op_type: str) -> bool:
  """Whether an op of `op_type` with no outputs may carry data out (every
  one but `NoOp` and `Assert`)."""
  return op_type not in _HARMLESS_WITHOUT_OUTPUTS


def _is_resource(t) -> bool:
  return getattr(getattr(t, "dtype", None), "name", None) in _RESOURCE_DTYPES


def is_resource_writer(entry) -> bool:
  """Whether a recorded op with outputs takes a resource it may change (an
  op with a resource input that `PURE_RESOURCE_READS` does not list)."""
  return (entry.op_type not in PURE_RESOURCE_READS and
          entry.op_type not in FUNCTION_OPS and
          any(_is_resource(t) for t in entry.inputs))


def body_writes(graph, function_names: Iterable[str],
                body: Callable[..., Optional[list]]) -> List[str]:
  """The op types in the bodies of `function_names` (and the functions they
  call, transitively) that may change state: outputless ops but `NoOp` and
  `Assert`, and ops whose type reads like a resource update. An unreadable
  body counts as writing (`"<unreadable body>"`).

  Args:
    graph: the graph that holds the calling op.
    function_names: the functions the op calls (`If`'s branches...).
    body: `tf_pxg._compat.function_body`.
  """
  found, seen, stack = [], set(), list(function_names)
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    nodes = body(graph, name)
    if nodes is None:
      found.append("<unreadable body>")
      continue
    for op_type, called in nodes:
      stack.extend(called)
      if op_type in FUNCTION_OPS or op_type in PURE_RESOURCE_READS:
        continue
      if writes_by_name(op_type):
        found.append(op_type)
  return found


# Op types (or prefixes) that change state, as read in a function body,
# where a node's inputs are names, not tensors.
_WRITE_PREFIXES = ("Assign", "ResourceScatter", "ResourceStridedSliceAssign",
                   "ResourceApply", "ResourceSparseApply", "Write",
                   "TensorSummary", "ScalarSummary", "HistogramSummary",
                   "ImageSummary", "AudioSummary", "Print", "LookupTableInsert",
                   "LookupTableRemove", "LookupTableImport", "InitializeTable",
                   "TensorArrayWrite", "TensorArrayScatter", "TensorArraySplit",
                   "StackPush", "QueueEnqueue", "Stateful", "RngSkip",
                   "RngReadAndSkip", "ResourceAccumulator", "Barrier",
                   "MutexLock", "PyFunc", "EagerPyFunc")


def writes_by_name(op_type: str) -> bool:
  """Whether `op_type` is a known state update (`_WRITE_PREFIXES`), as read
  where only the op's type is at hand (a function body's node)."""
  return op_type.startswith(_WRITE_PREFIXES)


def data_dependent_ids(entries: Sequence, seed_ids: Iterable[int]) -> set:
  """Ids of the recorded tensors that depend on the `seed_ids` tensors.

  Args:
    entries: `recording.Entry` objects in recording (topological) order.
    seed_ids: `recording.tensor_id` of the data tensors.

  Returns:
    The seed ids and every output id of an entry with a dependent input.
  """
  dependent = set(seed_ids)
  for entry in entries:
    if any(i in dependent for i in entry.input_ids):
      dependent.update(entry.output_ids)
  return dependent


def _written_from(entry, dependent) -> bool:
  return any(i in dependent for i, t in zip(entry.input_ids, entry.inputs)
             if not _is_resource(t))


def data_dependent_writes(writes: Sequence, dependent,
                          entries: Sequence = (),
                          body: Optional[Callable] = None) -> List:
  """The writes whose value depends on the data.

  Args:
    writes: the recorded ops without outputs that may write
      (`Recorder.writes`, filtered by `is_write`).
    dependent: ids of the data-dependent tensors.
    entries: the recorded ops with outputs; those that may change a
      resource (`is_resource_writer`) and function calls whose bodies may
      (`body_writes`) count too.
    body: `tf_pxg._compat.function_body`, to read function bodies.

  Returns:
    The write entries (in recording order within each kind) with a
    data-dependent input other than a resource handle.
  """
  found = [w for w in writes if _written_from(w, dependent)]
  for entry in entries:
    if not _written_from(entry, dependent):
      continue
    if is_resource_writer(entry):
      found.append(entry)
    elif (entry.op_type in FUNCTION_OPS and entry.op is not None and
          body is not None and body_writes(entry.op.graph,
                                           control_flow.function_names(
                                               entry.op), body)):
      found.append(entry)
  return found
