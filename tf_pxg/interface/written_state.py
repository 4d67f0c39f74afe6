"""Which resource reads in a graph see state that the data wrote.

A variable is a constant of the step only if no data-dependent op wrote it
(issue 49, docs/threat_model.md "Provenance"). The tape refuses writes it
records (`tf_pxg.interface.refusals.check_no_data_writes`); this module
finds the ones made *before* the tape started, in the graph the step is
traced into: a batch statistic assigned to a variable, or inserted into a
lookup table, then read inside the tape, is the statistic itself
("laundered" through state).

Derivation. Inside `tf.function`, TF2's automatic control dependencies run
the stateful ops that touch one resource in program order, so a read sees
exactly the writes to its resource created before it in its graph, and,
for a resource captured from an enclosing graph, every write to it there
(the function is called after them: the enclosing graph is still being
built while the function traces). A write's new value is computed from its
inputs other than the resource (the value, indices, a table's keys and
values) and from the resource's old value. So the read carries the
examples' values iff one of those writes has an input that does (by
`values`, the classifier's provenance through the graph), or, transitively,
reads state that does. A function-calling op (`If`, `While`, a
`PartitionedCall`) that takes the resource counts as a write when its body
may write (`tf_pxg.tape.side_effects.body_writes`).

Eagerly there is no graph: what ran before the tape is not visible to it
(docs/threat_model.md "Provenance", not covered).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.tape import control_flow, recording, side_effects


def _resources(op) -> list:
  return [t for t in op.inputs if t.dtype.name == "resource"]


def _resource_key(handle) -> int:
  """One key per resource across nested graphs: a function's placeholder
  for a captured handle is keyed by what it captures (a variable's eager
  handle, or the enclosing graph's tensor), followed to the end."""
  while tf.is_symbolic_tensor(handle) and handle.op.type == "Placeholder":
    outer = _compat.captured_from(handle.graph, handle)
    if outer is None:
      break
    handle = outer
  return recording.tensor_id(handle)


class WrittenState:
  """Finds the writes from data behind a graph's resource reads.

  Args:
    values: whether a graph tensor carries the examples' values (the
      classifier's provenance walk, which takes a read's `write_inputs` as
      its dependencies).
  """

  def __init__(self, values: Callable[..., bool]):
    self._values = values
    # id(graph) -> (op name -> position, handle tensor id -> [(pos, op)]).
    self._index: Dict[int, Tuple[dict, dict]] = {}

  def _graph_index(self, graph) -> Tuple[dict, dict]:
    key = id(graph)
    if key not in self._index:
      position, writers = {}, {}
      for i, op in enumerate(graph.get_operations()):
        position[op.name] = i
        if op.type in side_effects.PURE_RESOURCE_READS:
          continue
        handles = _resources(op)
        if not handles:
          continue
        if op.type in side_effects.FUNCTION_OPS and not side_effects.body_writes(
            graph, control_flow.function_names(op), _compat.function_body):
          continue  # Reads its resources only.
        for h in handles:
          writers.setdefault(_resource_key(h), []).append((i, op))
      self._index[key] = (position, writers)
    return self._index[key]

  def _writers(self, handle, before: Optional[int]) -> List:
    """The ops that may write `handle`'s resource: in its graph, those
    before position `before` (all if None); in the graphs it is nested in,
    all of them."""
    key, found, graph = _resource_key(handle), [], handle.graph
    while graph is not None:
      _, writers = self._graph_index(graph)
      found.extend(op for i, op in writers.get(key, ())
                   if before is None or i < before)
      graph, before = getattr(graph, "outer_graph", None), None
    return found

  def _writes_before(self, op):
    """`(writer, its inputs other than resources)` for every op that may
    write, before resource read `op` (a `tf.Operation` in a graph), a
    resource `op` reads."""
    position, _ = self._graph_index(op.graph)
    at = position.get(op.name)
    for h in _resources(op):
      for w in self._writers(h, at):
        yield w, [t for t in w.inputs if t.dtype.name != "resource"]

  def write_inputs(self, op) -> list:
    """What the state read `op` returns was computed from: the inputs of
    the writes before it (`_writes_before`)."""
    return [t for _, inputs in self._writes_before(op) for t in inputs]

  def writer_from_data(self, op) -> Optional[object]:
    """The first op that wrote, from the examples' values, the state that
    resource read `op` (a `tf.Operation` in a graph) returns; None if every
    write before it depends on constants and weights alone."""
    for w, inputs in self._writes_before(op):
      if any(self._values(t) for t in inputs):
        return w
    return None


def why(writer) -> str:
  """Completes "<read> ..." in a refusal: which op wrote the state."""
  return (f"reads state that op '{writer.type}' ('{writer.name}') wrote "
          "from the examples' values before the tape read it: a statistic of "
          "the batch laundered through a variable or table (write such state "
          "from public data or constants, outside the DP step)")
