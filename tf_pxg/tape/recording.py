"""Recording: the op-callback hook that turns executed or built ops into entries.

A `Recorder` registers a TensorFlow op callback (the hook tfdbg v2 uses). The
callback fires for every op executed eagerly and for every op *built* while a
`tf.function` is traced, so one mechanism records both modes:

* eager: the recorder's graph is `None` and only eagerly executed ops count;
* inside `tf.function`: only ops built in the graph that was the default graph
  when recording started count. Ops of nested function bodies are made
  visible by `tf_pxg.tape.control_flow` while the recorder is active (Keras RNN
  loops unrolled, nested `tf.function` calls inlined); other branch/body
  graphs are reached through their outer functional op.

Op callbacks are thread-local, so a recorder records the thread that started
it; this is what a replica thread of `tf.distribute` needs.

One gap of the hook is filled here: an eager op called directly with a
`tf.Variable` (`x * w`) reads the variable inside TF's C++ fast path, which
runs no Python op callback for that read. The recorder keeps a
`VariableWatcher` per op (the fast path does notify watchers), and records
the missing `ReadVariableOp` from the variable's handle to the op input that
holds its value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.tape import control_flow
from tf_pxg.tape import side_effects
from tf_pxg.tape import tf_defects


def tensor_id(t: Any) -> int:
  """A key for a tensor: TF's unique `_id` (eager and graph tensors share
  one counter), or `id()` for objects without one."""
  i = _compat.tensor_id(t)
  return i if isinstance(i, int) else id(t)


@dataclasses.dataclass(eq=False)
class Entry:
  """One recorded op.

  Attributes:
    op_type: the TF op type, e.g. "MatMul".
    inputs: the op's input tensors.
    outputs: the op's output tensors.
    attrs: eager attrs as a flat (name, value, ...) tuple; `None` in graphs.
    op: the `tf.Operation` when built in a graph, else `None`.
    scope: the name scope (graph: the op name) for error messages.
    index: position in recording order (a topological order).
  """
  op_type: str
  inputs: tuple
  outputs: tuple
  attrs: Optional[tuple]
  op: Optional[Any]
  scope: str
  index: int = 0
  input_ids: tuple = ()
  output_ids: tuple = ()
  # Attribute values that replace the op's (an entry the engine rewrote).
  attr_overrides: Optional[dict] = None
  # An eager `tf.custom_gradient` call (`Recorder.record_custom_gradient`):
  # the function's name, and its gradient, one per input.
  custom_gradient: Optional[str] = None
  backward: Optional[Callable[..., list]] = None

  def __post_init__(self):
    self.input_ids = tuple(tensor_id(t) for t in self.inputs)
    self.output_ids = tuple(tensor_id(t) for t in self.outputs)

  def describe(self) -> str:
    where = f" in '{self.scope}'" if self.scope else ""
    name = custom_gradient_name(self)
    if name is not None:
      return (f"tf.custom_gradient function '{name}' (op '{self.op_type}'"
              f"{where})")
    return f"op '{self.op_type}'{where}"


def custom_gradient_name(entry: Entry) -> Optional[str]:
  """The `tf.custom_gradient` an entry stands for, or None: eagerly the
  function's name, in graphs the gradient TF registered for the IdentityN
  that carries it (`_gradient_op_type`)."""
  if entry.custom_gradient is not None:
    return entry.custom_gradient
  if entry.op is None or entry.op_type != "IdentityN":
    return None
  try:
    name = entry.op.get_attr("_gradient_op_type")
  except (ValueError, AttributeError):
    return None
  return name.decode() if isinstance(name, bytes) else str(name)


class Recorder:
  """Collects `Entry` objects while active.

  `start()`/`stop()` may be called repeatedly (`stop_recording`); `paused` is a
  counter that also suppresses recording while the owning tape runs its own
  backward pass, so those ops are never recorded by the tape that builds them.
  """

  def __init__(self, examples=None):
    self.entries: list[Entry] = []
    # The examples declared to the tape (`tf_pxg.interface.pre_tape`), or
    # None.
    self.examples = examples
    self.producer: dict[int, Entry] = {}
    # Ops with no outputs that write state (`side_effects.WRITE_OPS`):
    # not on any gradient path, kept for the data-dependence check.
    self.writes: list[Entry] = []
    # Eager tensors whose value Python read while recording
    # (`control_flow._record_host_read`).
    self.host_reads: list = []
    self._graph = None
    self._first_op_id = 0
    # The id counter when recording first started: eagerly, a tensor with a
    # smaller id existed before the tape (an input), one with a larger id
    # that no recorded op made is a Python value converted during it.
    self.start_uid: Optional[int] = None
    self._active = False
    self._watcher = None
    self.paused = 0

  @property
  def graph(self):
    return self._graph

  def start(self):
    if self._active:
      return
    self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if self.start_uid is None:
      self.start_uid = _compat.next_tensor_id()
    if self._graph is None:
      self._renew_watcher()
    else:
      self._first_op_id = self._graph.version  # The last op id so far.
    _compat.add_op_callback(self._callback)
    control_flow.enter(self)
    self._active = True

  def stop(self):
    if not self._active:
      return
    _compat.remove_op_callback(self._callback)
    control_flow.leave(self)
    self._end_watcher()
    self._active = False

  def _renew_watcher(self):
    self._end_watcher()
    self._watcher = _compat.variable_watcher()
    self._watcher.__enter__()

  def _end_watcher(self):
    if self._watcher is not None:
      self._watcher.__exit__(None, None, None)
      self._watcher = None

  def _fast_path_reads(self, op_type, inputs, scope):
    """Entries for variables the C++ fast path read for this eager op."""
    accessed = self._watcher.watched_variables() if self._watcher else ()
    if not accessed:
      return
    self._renew_watcher()
    input_ids = [tensor_id(t) for t in inputs]
    taken = set()
    for var in accessed:
      handle = getattr(var, "handle", None)
      if handle is None or tensor_id(handle) in input_ids:
        continue  # Read in Python (its ReadVariableOp was recorded) or by handle.
      candidates = [
          i for i, (tid, t) in enumerate(zip(input_ids, inputs))
          if i not in taken and tid not in self.producer and
          t.dtype == var.dtype and t.shape == var.shape]
      if len(candidates) > 1:
        self.paused += 1  # The recorder's own reads, not the model's.
        try:
          value = var.read_value()
          same = [i for i in candidates
                  if bool(tf.reduce_all(tf.equal(inputs[i], value)))]
        finally:
          self.paused -= 1
        candidates = same or candidates
      if not candidates:
        continue
      i = candidates[0]
      taken.add(i)
      self._append(Entry("ReadVariableOp", (handle,), (inputs[i],),
                         ("dtype", var.dtype.as_datatype_enum), None, scope))

  @property
  def active(self) -> bool:
    return self._active

  def clear(self):
    self.entries = []
    self.producer = {}
    self.writes = []
    self.host_reads = []

  def _callback(self, op_type, inputs, attrs, outputs, op_name=None,
                graph=None):
    # Always hand the outputs back unchanged: in graphs TF chains callbacks,
    # passing each one's return value to the next as its `outputs`.
    if self.paused or graph is not self._graph:
      if self.paused and graph is None and self._watcher is not None:
        self._renew_watcher()  # Forget reads made by our own backward pass.
      return outputs
    if isinstance(op_type, bytes):
      op_type = op_type.decode()
    if not outputs:
      self._record_write(op_type, inputs, op_name, graph)
      return outputs
    if graph is None:
      op = None
      scope = _compat.eager_scope_name()
      self._fast_path_reads(op_type, inputs, scope)
    else:
      op = outputs[0].op
      scope = op.name
      attrs = None
      self._record_silent_producers(inputs)
    entry = Entry(op_type, tuple(inputs), tuple(outputs), attrs, op, scope)
    if op_type in tf_defects.CHECKED_OPS:
      tf_defects.check(op_type, entry.inputs, entry.describe)
    self._append(entry)
    return outputs

  def record_custom_gradient(self, name, outputs, inputs, backward_function):
    """Records an eager `tf.custom_gradient` call as one entry, as TF's tape
    does (`record_operation`), in the form it takes inside `tf.function`:
    an IdentityN whose inputs are the forward's results (the tensors the
    Identity ops just recorded copy), then the function's inputs and the
    variables it read, and whose outputs are those Identity copies. Its
    gradient is the function's (None for the results), and being recorded
    last it is the producer of the outputs, so backprop takes it instead of
    the forward ops; these stay recorded, and on the data path through the
    results, where the examples-never-mix check sees them."""
    outputs, inputs = tuple(outputs), tuple(inputs)
    copied = [self.producer.get(tensor_id(o)) for o in outputs]
    if all(e is not None and e.op_type == "Identity" and e.inputs
           for e in copied):
      results = tuple(e.inputs[0] for e in copied)
    else:  # Not as TF 2.16-2.21 builds it: the inputs alone.
      results = ()

    def backward(*out_grads):
      return [None] * len(results) + list(backward_function(*out_grads))

    self._append(Entry("IdentityN", results + inputs, outputs, (), None,
                       _compat.eager_scope_name(), custom_gradient=name,
                       backward=backward))

  def _record_write(self, op_type, inputs, op_name, graph):
    """Keeps an output-less op that writes state (a variable assignment, a
    scatter update, a summary write) in `writes`."""
    if not side_effects.is_write(op_type):
      return
    if graph is None:
      op, scope = None, _compat.eager_scope_name()
    else:
      name = op_name.decode() if isinstance(op_name, bytes) else op_name
      op = graph.get_operation_by_name(name) if name else None
      scope = name or ""
    entry = Entry(op_type, tuple(inputs), (), None, op, scope)
    entry.index = len(self.entries)  # recorded after entries[:index]
    self.writes.append(entry)

  def _record_silent_producers(self, inputs):
    """Records call ops built without an op callback (a `ConcreteFunction`
    called in a graph) that produce `inputs`, so that their use is seen."""
    for t in inputs:
      op = getattr(t, "op", None)
      if (tensor_id(t) in self.producer or op is None or
          op.graph is not self._graph or
          _compat.op_id(op) <= self._first_op_id or
          op.type not in control_flow.OPAQUE_OPS):
        continue
      self._record_silent_producers(op.inputs)
      self._append(Entry(op.type, tuple(op.inputs), tuple(op.outputs), None,
                         op, op.name))

  def _append(self, entry: Entry):
    entry.index = len(self.entries)
    self.entries.append(entry)
    for i in entry.output_ids:
      self.producer[i] = entry


def flat_tensors(xs: Sequence[Any]) -> list:
  return list(tf.nest.flatten(xs))


# Op views ----------------------------------------------------------------------
#
# Eager entries are presented as TF's own light mock op (TF's `_MockOp`, the
# object `tf.GradientTape` hands gradient functions; `tf_pxg._compat.mock_op`),
# graph entries as the real `tf.Operation` through a thin view; both read
# attrs the same way (`get_attr`).


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
  # (`tf_pxg.per_example.merge_uses`) carries other tensors for the same op.
  return _GraphOpView(entry.op, skip,
                      entry.inputs if inputs is None else inputs,
                      entry.outputs if outputs is None else outputs,
                      entry.attr_overrides)


def get_attr(entry: Entry, name: str):
  """Reads attr `name` of a recorded op (eager or graph)."""
  return op_view(entry).get_attr(name)
