"""Loops and function calls: making their ops visible to the tape.

The engine (record -> filter -> backprop -> interface -> rules) sees the ops
of one graph: the graph the tape records in (or the eager op stream). Two
constructs hide ops inside a function body that the op callback reports in
another graph, so a parameter used there would meet the data out of the
engine's sight:

* `While` loops: Keras' recurrent layers (`SimpleRNN`, `LSTM`, `GRU`,
  `ConvLSTM*`, `RNN(cell)`, `Bidirectional`) run `keras.backend.rnn` with
  `unroll=False`, a `While` in the TensorFlow backend;
* calls of nested `tf.function`s (`PartitionedCall`,
  `StatefulPartitionedCall`).

Mechanism: while a tf_pxg recorder is active on a thread (and is not paused
for the tape's own backward pass), this module, through the patches that
`tf_pxg._compat` installs (`install_function_inlining`,
`install_rnn_unrolling`, `install_custom_gradient_recording`; the only
monkeypatches in tf_pxg, installed when a recorder first starts, inert
while none records),

1. runs Keras' TF-backend `rnn` with `unroll=True` when the number of time
   steps is static, and declines the cuDNN kernels (`backend.lstm`,
   `backend.gru` raise `NotImplementedError`, which Keras answers with its
   generic `rnn`). The unrolled loop is the same computation (Keras keeps
   both paths equal, masks, `go_backwards` and `return_sequences`
   included). The engine then sees one interface per time step for each
   weight; `tf_pxg.per_example.backward` merges the uses of one weight by one kind of
   op into a single interface whose rows are all steps of all examples, so
   a weight shared across T steps costs one contraction (ghost norm over
   `T` rows, or a materialised `[B, *weight]`, whichever is cheaper) and its
   norm is the norm of the sum over steps.
2. runs a nested `tf.function` by calling its Python function in the
   caller's context (converted by AutoGraph in graphs, as the function's own
   tracing would), so its ops are built, and recorded, in the tape's graph
   or eagerly. The result is the same function inlined.
3. hands each eager `tf.custom_gradient` call to the eager recorders
   (`Recorder.record_custom_gradient`): TF registers its gradient with
   `record_operation`, which runs no op callback.

What stays opaque raises instead of giving a `None` or zero per-example
gradient: an op whose body the engine cannot see (`While` with a dynamic
trip count or a raw `tf.while_loop`, `If`/`Case`, a call of a
`ConcreteFunction` or of a function restored from a SavedModel) that
consumes a parameter is reported by `opaque_op_error`, naming the op, the
function and the variables.

References:
  Keras `keras.src.backend.tensorflow.rnn.rnn` (the `unroll` path).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from typing import Optional, Sequence

import tensorflow as tf

from tf_pxg import _compat

_local = threading.local()
_install_lock = threading.Lock()
_installed = {"function": False, "keras": False, "custom_gradient": False,
              "host_read": False}

# Op types whose computation lives in a function body the tape did not record.
LOOP_OPS = ("While", "StatelessWhile")
CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
BRANCH_OPS = ("If", "StatelessIf", "Case", "StatelessCase")
OPAQUE_OPS = LOOP_OPS + CALL_OPS + BRANCH_OPS


def _recorders() -> list:
  if not hasattr(_local, "recorders"):
    _local.recorders = []
  return _local.recorders


def recording() -> bool:
  """Whether a tf_pxg recorder is recording user ops on this thread."""
  return any(not r.paused for r in _recorders())


def enter(recorder) -> None:
  """Called by a recorder when it starts recording on this thread."""
  install()
  _recorders().append(recorder)


def leave(recorder) -> None:
  """Called by a recorder when it stops recording."""
  stack = _recorders()
  for i in range(len(stack) - 1, -1, -1):
    if stack[i] is recorder:
      del stack[i]
      return


# Keras recurrent layers ------------------------------------------------------


def _time_steps(inputs, time_major: bool) -> Optional[int]:
  flat = tf.nest.flatten(inputs)
  if not flat:
    return None
  shape = flat[0].shape
  if shape.rank is None or shape.rank < 2:
    return None
  return shape[0 if time_major else 1]


def _unrolling_rnn(rnn):
  """Keras' `rnn`, called with `unroll=True` while a recorder records and
  the number of time steps is static."""

  @functools.wraps(rnn)
  def unrolling_rnn(step_function, inputs, initial_states, *args, **kwargs):
    time_major = kwargs.get("time_major", False)
    if (recording() and not kwargs.get("unroll", False) and not args and
        _time_steps(inputs, time_major)):
      kwargs["unroll"] = True
      if kwargs.get("go_backwards", False):
        # Keras' unrolled go_backwards reverses a tuple in graphs (an
        # AttributeError); reversing the sequence first is the same loop.
        kwargs["go_backwards"] = False
        axis = 0 if time_major else 1
        inputs = tf.nest.map_structure(lambda t: tf.reverse(t, [axis]),
                                       inputs)
        if kwargs.get("mask") is not None:
          kwargs["mask"] = tf.reverse(kwargs["mask"], [axis])
    return rnn(step_function, inputs, initial_states, *args, **kwargs)

  return unrolling_rnn


def _no_cudnn(kernel):
  """A cuDNN kernel (`lstm`, `gru`) declined while a recorder records."""

  @functools.wraps(kernel)
  def wrapper(*args, **kwargs):
    if recording():  # Keras falls back to its generic `rnn`.
      raise NotImplementedError("tf_pxg records the generic RNN loop")
    return kernel(*args, **kwargs)

  return wrapper


def install() -> None:
  """Installs the hooks through `tf_pxg._compat` (idempotent): nested
  `tf.function` inlining, and Keras' loop unrolling once Keras is imported
  with the TensorFlow backend. They act only while a recorder records."""
  if all(_installed.values()):
    return
  with _install_lock:
    if not _installed["function"]:
      _compat.install_function_inlining(recording)
      _installed["function"] = True
    if not _installed["custom_gradient"]:
      _compat.install_custom_gradient_recording(recording,
                                                _record_custom_gradient)
      _installed["custom_gradient"] = True
    if not _installed["host_read"]:
      _compat.install_host_read_hook(recording, _record_host_read)
      _installed["host_read"] = True
    if not _installed["keras"]:
      _installed["keras"] = _compat.install_rnn_unrolling(_unrolling_rnn,
                                                          _no_cudnn)


def uninstall() -> None:
  """Removes the hooks (`install` puts them back on the next recording)."""
  with _install_lock:
    _compat.uninstall_function_inlining()
    _compat.uninstall_rnn_unrolling()
    _compat.uninstall_custom_gradient_recording()
    _compat.uninstall_host_read_hook()
    for name in _installed:
      _installed[name] = False


# tf.custom_gradient, eagerly -------------------------------------------------


def _record_custom_gradient(name, outputs, inputs, backward_function) -> None:
  """Hands an eager `tf.custom_gradient` call (reported by
  `_compat.install_custom_gradient_recording`) to every eager recorder
  recording on this thread, as TF's tape records it on every tape."""
  for recorder in _recorders():
    if not recorder.paused and recorder.graph is None:
      recorder.record_custom_gradient(name, outputs, inputs,
                                      backward_function)


# Values read in Python, eagerly ------------------------------------------------


_TF_PATH = os.sep.join(("", "tensorflow", "python", ""))
_TENSOR_UTIL = os.sep.join(("framework", "tensor_util.py"))
# TF modules that read an eager value through `tensor_util.constant_value`
# only to give a result its static shape (a SparseTensor's dense shape, a
# ragged partition's row count), never to choose what to compute. `tf.cond`
# and `tf.while_loop` read their predicates the same way: not listed.
_SHAPE_INFERENCE_CALLERS = frozenset({
    "sparse_tensor.py", "row_partition.py", "ragged_tensor.py",
    "ragged_string_ops.py", "ragged_util.py", "dynamic_ragged_shape.py",
    "string_ops.py", "array_ops.py", "tensor_shape.py"})


def _tf_shape_inference() -> bool:
  """Whether TensorFlow itself reads the value to infer a static shape
  while it builds an eager result (`tensor_util.constant_value` called
  from one of `_SHAPE_INFERENCE_CALLERS`): the value is then not handed to
  user code. Eager shapes are covered by the value-shape check
  (`classify.data_path`)."""
  frame = inspect.currentframe()
  try:
    f, last_util = frame, None
    while f is not None:  # The outermost tensor_util frame of the read.
      if f.f_code.co_filename.endswith(_TENSOR_UTIL):
        last_util = f
      elif last_util is not None:
        break
      f = f.f_back
    if last_util is None or last_util.f_back is None:
      return False
    caller = last_util.f_back.f_code.co_filename
    return _TF_PATH in caller and (
        os.path.basename(caller) in _SHAPE_INFERENCE_CALLERS)
  finally:
    del frame


def _record_host_read(tensor) -> None:
  """Hands a Python read of an eager tensor's value (`.numpy()`, `bool()`,
  an eager `tf.cond` predicate) to every eager recorder recording on this
  thread (`Recorder.host_reads`); the engine refuses the read if the value
  was computed from the examples (`refusals.check_no_host_reads`)."""
  if _tf_shape_inference():
    return
  for recorder in _recorders():
    if not recorder.paused and recorder.graph is None:
      recorder.host_reads.append(tensor)


# Opaque ops ------------------------------------------------------------------


def function_names(op) -> list:
  """The functions a function-calling op runs (branches, body, cond, f)."""
  names = []
  for attr in ("f", "then_branch", "else_branch", "branches", "body",
               "cond"):
    try:
      value = op.get_attr(attr)
    except (ValueError, AttributeError):
      continue
    for v in value if isinstance(value, list) else [value]:
      name = getattr(v, "name", v)
      if isinstance(name, bytes):
        name = name.decode()
      if name:
        names.append(str(name))
  return names


def function_name(entry) -> str:
  """The function an opaque op runs (its body for loops), for messages."""
  names = function_names(entry.op) if entry.op is not None else []
  return ", ".join(names) or entry.op_type


def is_opaque(entry) -> bool:
  """Whether `entry` runs ops the tape did not record."""
  return (entry.op_type in OPAQUE_OPS or entry.op_type.startswith(
      ("__inference", "__forward", "__backward")))


def opaque_op_error(entry, variable_names: Sequence[str]) -> ValueError:
  """The error for a parameter consumed inside an unrecorded function body."""
  names = ", ".join(f"'{n}'" for n in variable_names) or "a parameter"
  if entry.op_type in LOOP_OPS:
    what = (f"a loop (`{entry.op_type}`, body {function_name(entry)})")
    how = ("Keras recurrent layers are unrolled while tf_pxg records when "
           "their number of time steps is static: give the input a fixed "
           "sequence length (e.g. keras.Input((T, d)) or pad batches to T). "
           "For a raw tf.while_loop, use a Python loop over a static count.")
  elif entry.op_type in BRANCH_OPS:
    what = f"a conditional (`{entry.op_type}`, {function_name(entry)})"
    how = ("Compute both branches and select with tf.where, or decide the "
           "branch in Python.")
  else:
    what = f"a function call (`{entry.op_type}` of {function_name(entry)})"
    how = ("tf_pxg inlines tf.function calls while it records, but not "
           "ConcreteFunctions or functions restored from a SavedModel: call "
           "the Python function (or the tf.function) instead.")
  return ValueError(
      f"{entry.describe()} uses {names} inside {what}, whose ops tf_pxg "
      "cannot see, so it cannot give that variable a per-example gradient "
      f"(and will not return None or zeros for it). {how}")


def custom_gradient_error(entry, variable_names: Sequence[str]) -> ValueError:
  """The error for a parameter consumed by a `tf.custom_gradient` function
  (`recording.custom_gradient_name`), eagerly or in a graph."""
  names = ", ".join(f"'{n}'" for n in variable_names) or "a parameter"
  return ValueError(
      f"{entry.describe()} uses {names}: its gradient is a Python function "
      "of the whole batch (it closes over the forward pass's tensors), which "
      "tf_pxg can neither split by example nor check, so it cannot give "
      "that variable a per-example gradient (and will not guess: eagerly or "
      "in tf.function alike). Use the parameter outside the custom-gradient "
      "function (apply the custom gradient to values computed from the data, "
      "e.g. f(x) * w rather than reading w inside f), or register a "
      "per-example rule for the computation.")

