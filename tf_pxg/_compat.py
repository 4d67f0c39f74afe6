"""The one boundary between tf_pxg and TensorFlow / Keras internals.

Every use of `tensorflow.python.*`, `keras.src.*`, `tf.__internal__` or a
private attribute of a TensorFlow or Keras object, and every monkeypatch of
a TensorFlow or Keras module or class (the three process-wide patches,
"Process-wide patches" below), goes through this module; nothing else in
`tf_pxg` does (`tests/test_compat.py` reads the code of every other module
to check). Each access says why no public API serves. `ACCESSES` names
them all; `check(name)` exercises one, so an upgrade that moves one fails
`tests/test_compat.py` with a message naming it. The supported range is
`tf_pxg._versions`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any, Callable, Dict, Optional

import tensorflow as tf

from tf_pxg import _versions

_versions.check(tf_version=tf.__version__)


class CompatError(ImportError):
  """A TensorFlow / Keras internal tf_pxg relies on has moved."""


def _missing(name: str, error: Exception) -> CompatError:
  return CompatError(
      f"tf_pxg internal access '{name}' is not available in TensorFlow "
      f"{tf.__version__} / Keras {_keras_version()} ({error!r}); tf_pxg "
      f"supports {_versions.supported_range()}.")


def _keras_version() -> str:
  try:
    return importlib.metadata.version("keras")
  except Exception:  # pylint: disable=broad-except
    return "?"


@functools.lru_cache(maxsize=None)
def _tf_module(path: str):
  return importlib.import_module(path)


# TensorFlow: recording ------------------------------------------------------


def add_op_callback(callback) -> None:
  # No public API sees every op run eagerly and built in a graph: this is
  # the hook tfdbg v2 uses (tf.debugging.experimental has no callback API).
  _tf_module("tensorflow.python.framework.op_callbacks").add_op_callback(
      callback)


def remove_op_callback(callback) -> None:
  # Pair of add_op_callback (same reason).
  _tf_module("tensorflow.python.framework.op_callbacks").remove_op_callback(
      callback)


def eager_scope_name() -> str:
  # tf.name_scope has no public getter in eager mode (Graph.get_name_scope
  # covers graphs only); used for error messages.
  return _tf_module("tensorflow.python.eager.context").context().scope_name or ""


def variable_watcher():
  # TF's C++ fast path reads a variable passed directly to an eager op
  # without a Python op callback; only a VariableWatcher (what
  # tf.GradientTape's watch_accessed_variables uses) is notified.
  return _tf_module("tensorflow.python.eager.record").VariableWatcher()


def tensor_id(t: Any):
  # TF's unique tensor id (one counter for eager and graph tensors, so
  # keys are stable across re-wrapping); `id()` is not (Python reuses it).
  return getattr(t, "_id", None)


def op_id(op) -> int:
  # The same counter for graph ops: orders ops by creation, which the
  # public tf.Operation does not expose.
  return op._id  # pylint: disable=protected-access


def next_tensor_id() -> int:
  # TF's one id counter (`tensor_id`, `op_id`), advanced by one: every
  # tensor or op made afterwards has a larger id. Eagerly, it tells the
  # tensors that existed before a recording started from those made during
  # it without an op (a Python value converted where an op takes it).
  return _tf_module("tensorflow.python.framework.ops").uid()


def op_def(op_type: str):
  # The registered OpDef of `op_type` (its inputs' names), or None; TF's
  # public API gives it only for ops built in a graph (`tf.Operation.op_def`).
  return _tf_module("tensorflow.python.framework.op_def_registry").get(op_type)


def function_body(graph, name: str) -> Optional[list]:
  # The nodes of function `name` as `graph` (or a graph it is nested in)
  # defines it: `(op type, names of the functions the node calls)` each;
  # None if no graph on the way defines it. No public API reads a function
  # op's body (`If`'s branches, `While`'s body, a `PartitionedCall`'s `f`).
  g = graph
  while g is not None:
    fn = g._get_function(name)  # pylint: disable=protected-access
    if fn is not None:
      break
    g = getattr(g, "outer_graph", None)
  else:
    return None
  nodes = []
  for node in fn.definition.node_def:
    called = []
    for value in node.attr.values():
      if value.HasField("func"):
        called.append(value.func.name)
      elif value.HasField("list"):
        called.extend(f.name for f in value.list.func)
    nodes.append((node.op, called))
  return nodes


def captured_from(graph, internal):
  # The tensor of an enclosing graph that `internal` (a placeholder of the
  # `tf.function` graph `graph`) captures, or None. No public API maps a
  # function's placeholders to what they close over (`FuncGraph.captures`).
  for external, placeholder in getattr(graph, "captures", ()):
    if placeholder is internal or (
        placeholder.graph is internal.graph and
        placeholder.name == internal.name):
      return external
  return None


def is_resource_variable(v) -> bool:
  # isinstance(v, tf.Variable) also admits non-resource variables, and
  # misses objects that act as one (distributed values): TF's own test.
  return _tf_module(
      "tensorflow.python.ops.resource_variable_ops").is_resource_variable(v)


def keras_variable_value(v):
  # A Keras 3 variable's backing tf.Variable: the public `.value` may be an
  # autocast *tensor*, and the tape must watch the variable itself.
  return getattr(v, "_value", None)


def variable_shape(handle):
  # The shape of a variable from its resource handle alone (static when the
  # handle data knows it); tf.raw_ops.VariableShape is always dynamic.
  return _tf_module(
      "tensorflow.python.ops.resource_variable_ops").variable_shape(handle)


# TensorFlow: gradient functions ----------------------------------------------


def mock_op(attrs, inputs, outputs, op_type, skip_input_indices):
  # The light op object tf.GradientTape hands eager gradient functions;
  # they read `.get_attr`/`.inputs`/`.skip_input_indices` from it, and no
  # public constructor exists.
  return _tf_module("tensorflow.python.eager.backprop")._MockOp(  # pylint: disable=protected-access
      attrs, inputs, outputs, op_type, skip_input_indices)


def aggregate_grads(grads: list):
  # tf.GradientTape's own sum of Tensors and IndexedSlices (tf.add_n takes
  # no IndexedSlices); the result must equal tf.GradientTape's.
  return _tf_module("tensorflow.python.eager.backprop")._aggregate_grads(  # pylint: disable=protected-access
      grads)


def call_op_gradient(op, grads: list):
  # The symbolic gradient of a PartitionedCall, as tf.gradients takes it;
  # no public API differentiates one call op.
  return _tf_module("tensorflow.python.ops.gradients_util")._SymGrad(  # pylint: disable=protected-access
      op, grads)


def _gradient_registry():
  return _tf_module("tensorflow.python.framework.ops")._gradient_registry  # pylint: disable=protected-access


def gradient_function(op_type: str):
  # TF's registered gradient for an op type: tf.RegisterGradient writes the
  # registry but there is no public lookup. Raises LookupError if none.
  return _gradient_registry().lookup(op_type)


@contextlib.contextmanager
def swapped_gradient_functions(replacements: Dict[str, Callable]):
  """Temporarily replaces registered gradient functions: {op_type: wrap},
  `wrap(original) -> new`."""
  # tf.RegisterGradient refuses to re-register, and a swap must be undone.
  registry = _gradient_registry()._registry  # pylint: disable=protected-access
  saved = {t: registry[t]["type"] for t in replacements}
  try:
    for t, wrap in replacements.items():
      registry[t]["type"] = wrap(saved[t])
    yield
  finally:
    for t, original in saved.items():
      registry[t]["type"] = original


def graph_in_xla_context(graph) -> bool:
  # Whether a graph (or a parent) is compiled by XLA: no public API tells a
  # function being traced that it is under jit_compile=True.
  return _tf_module(
      "tensorflow.python.ops.control_flow_util").GraphOrParentsInXlaContext(
          graph)


# TensorFlow: tf.function inlining --------------------------------------------


def tf_function_class():
  # The class of `tf.function` objects, whose __call__ tf_pxg wraps while a
  # tape records (to inline nested functions); tf.types.experimental.
  # GenericFunction is an abstract base, not the class whose method runs.
  return _tf_module(
      "tensorflow.python.eager.polymorphic_function.polymorphic_function"
  ).Function


def inline_call(function, args, kwargs):
  """Runs a `tf.function`'s Python function in the caller's context,
  converted by AutoGraph in graphs as the function's own tracing would."""
  fn = function.python_function
  # `_autograph` / `_experimental_autograph_options`: the function's own
  # AutoGraph settings (no public getters); tf.autograph.to_graph would
  # not apply the function's options.
  if tf.executing_eagerly() or not function._autograph:  # pylint: disable=protected-access
    return fn(*args, **kwargs)
  ag_ctx = _tf_module("tensorflow.python.autograph.core.ag_ctx")
  autograph_util = _tf_module(
      "tensorflow.python.eager.polymorphic_function.autograph_util")
  converted = autograph_util.py_func_from_autograph(
      fn, function._experimental_autograph_options)  # pylint: disable=protected-access
  with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED):
    return converted(*args, **kwargs)


# Process-wide patches ---------------------------------------------------------
#
# The only monkeypatches tf_pxg makes, installed by `tf_pxg.tape.control_flow`
# when a recorder first starts (`install_*`) and undone by `uninstall_*`.
# Each wrapper checks a predicate (`recording()`: a tf_pxg recorder is active
# on this thread) and otherwise calls the original, so code that runs while
# no tape records behaves as without tf_pxg. Written against TensorFlow
# 2.16-2.21 and Keras 3.7-3.15 (`tf_pxg._versions`); `ACCESSES` probes the
# patched attributes by name.

# name -> (owner, attribute, original), for `_unpatch`.
_PATCHES: Dict[str, tuple] = {}


def _patch(name: str, owner, attribute: str, wrap: Callable) -> None:
  """Replaces `owner.<attribute>` by `wrap(original)` (once per name)."""
  if name in _PATCHES:
    return
  original = getattr(owner, attribute)
  setattr(owner, attribute, wrap(original))
  _PATCHES[name] = (owner, attribute, original)


def _unpatch(name: str) -> None:
  owner, attribute, original = _PATCHES.pop(name, (None, None, None))
  if owner is not None:
    setattr(owner, attribute, original)


def patched(name: str) -> bool:
  """Whether patch `name` ("tf.function.__call__", "keras.backend.rnn",
  "keras.backend.lstm", "keras.backend.gru", "record.record_operation") is
  installed."""
  return name in _PATCHES


def install_host_read_hook(active: Callable[[], bool],
                           on_read: Callable[[Any], None]) -> None:
  """Calls `on_read(tensor)` whenever Python reads an eager tensor's value
  while `active()` is true: `.numpy()`, `bool()` (an `if`, a `tf.cond` or
  `tf.while_loop` predicate run eagerly), `int()`, `float()`, `np.asarray`.

  Why: such a read takes a value out of the recorded computation, so what
  Python then does with it (a branch, a count, a shape) is invisible to the
  tape; TF has no public hook for it. Patched: `_numpy` of TF's
  `_EagerTensorBase`, which every one of those reads calls (TensorFlow
  2.16-2.21). Idempotent; `uninstall_host_read_hook` undoes it.
  """
  def wrap(original):
    @functools.wraps(original)
    def _numpy(self):
      if active():
        on_read(self)
      return original(self)
    return _numpy

  _patch("EagerTensor._numpy", _eager_tensor_base(), "_numpy", wrap)


def uninstall_host_read_hook() -> None:
  _unpatch("EagerTensor._numpy")


def _eager_tensor_base():
  return _tf_module("tensorflow.python.framework.ops")._EagerTensorBase  # pylint: disable=protected-access


def install_function_inlining(inline: Callable[[], bool]) -> None:
  """Makes a call of a `tf.function` run its Python function in the
  caller's context (`inline_call`) while `inline()` is true.

  Why: a nested `tf.function` builds its ops in its own function graph,
  which the tape's op callback does not record, and TF has no public way
  to build a nested function's ops in the caller's graph. Patched:
  `__call__` of TF's
  `polymorphic_function.Function`, the class of `tf.function` objects
  (TensorFlow 2.16-2.21). Idempotent; `uninstall_function_inlining` undoes
  it.
  """
  def wrap(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
      if inline():
        return inline_call(self, args, kwargs)
      return original(self, *args, **kwargs)
    return __call__

  _patch("tf.function.__call__", tf_function_class(), "__call__", wrap)


def uninstall_function_inlining() -> None:
  """Restores `tf.function`'s own `__call__`."""
  _unpatch("tf.function.__call__")


def install_rnn_unrolling(wrap_rnn: Callable, wrap_kernel: Callable) -> bool:
  """Wraps the functions Keras' recurrent layers run their loop through:
  `rnn` by `wrap_rnn(original)`, the cuDNN kernels `lstm` and `gru` by
  `wrap_kernel(original)` (a kernel that raises `NotImplementedError` makes
  Keras fall back to its generic `rnn`).

  Why: Keras' `SimpleRNN`/`LSTM`/`GRU`/`ConvLSTM`/`RNN` layers call
  `keras.src.backend.rnn` (a `While` loop unless `unroll=True`, which the
  layers take only at construction), and no public option unrolls a built
  layer's loop. Patched: the attributes `rnn`, `lstm`, `gru` of the module
  `keras.src.backend` with the TensorFlow backend (Keras 3.7-3.15); the
  public `keras.backend` is another module object.

  Returns:
    Whether the patches are installed: False before Keras is imported, or
    with another backend (then `tf_pxg.tape.control_flow` tries again on the
    next recording).
  """
  backend = keras_backend_module()
  if backend is None or getattr(backend, "backend", lambda: None)() != (
      "tensorflow"):
    return False
  _patch("keras.backend.rnn", backend, "rnn", wrap_rnn)
  for name in ("lstm", "gru"):
    if hasattr(backend, name):
      _patch(f"keras.backend.{name}", backend, name, wrap_kernel)
  return True


def uninstall_rnn_unrolling() -> None:
  """Restores Keras' own `rnn`, `lstm` and `gru`."""
  for name in ("rnn", "lstm", "gru"):
    _unpatch(f"keras.backend.{name}")


def install_custom_gradient_recording(active: Callable[[], bool],
                                      record: Callable) -> None:
  """Reports each eager `tf.custom_gradient` call to `record(name, outputs,
  inputs, backward_function)` while `active()` is true.

  Why: eagerly, `tf.custom_gradient` registers its gradient on TF's tape
  with `record_operation` (a C++ call that runs no op callback), so a
  recorder built on op callbacks sees the forward ops and never the custom
  gradient; no public API reports it (a `tf.GradientTape` cannot be
  asked). Patched: `record_operation` of TF's module
  `tensorflow.python.eager.record` (TensorFlow 2.16-2.21), which
  `custom_gradient._eager_mode_decorator` calls through the module
  attribute. TF's tape still gets every call; `record` is told only of the
  calls made by that decorator (its backward function's code), not of the other
  callers of `record_operation` (eager function calls, copies, variable
  reads), so nothing else changes. Idempotent;
  `uninstall_custom_gradient_recording` undoes it.
  """
  # The decorator's backward function (`actual_grad_fn`) is a closure
  # defined in it: its code object is a constant of the decorator's code,
  # which tells its calls from the others whatever calls the wrapper (a
  # wrapper installed while AutoGraph converts tf_pxg's code is converted
  # too, so the caller's frame is not the decorator's).
  gradient_codes = frozenset(
      c for c in _tf_module("tensorflow.python.ops.custom_gradient")
      ._eager_mode_decorator.__code__.co_consts  # pylint: disable=protected-access
      if isinstance(c, type(_missing.__code__)))

  def wrap(original):
    @functools.wraps(original)
    def record_operation(op_type, output_tensors, input_tensors,
                         backward_function, forward_function=None):
      original(op_type, output_tensors, input_tensors, backward_function,
               forward_function)
      if (getattr(backward_function, "__code__", None) in gradient_codes and
          active()):
        record(op_type, output_tensors, input_tensors, backward_function)
    return record_operation

  _patch("record.record_operation",
         _tf_module("tensorflow.python.eager.record"), "record_operation",
         wrap)


def uninstall_custom_gradient_recording() -> None:
  """Restores TF's own `record_operation`."""
  _unpatch("record.record_operation")


# Keras -----------------------------------------------------------------------


def keras_backend_module():
  # The module Keras' recurrent layers call `rnn`/`lstm`/`gru` through
  # (keras.src.backend); patched while a tape records to unroll static
  # loops. The public keras.backend is a different module object. None if
  # Keras is not imported yet.
  return sys.modules.get("keras.src.backend")


def get_keras_mask(x):
  # Keras' mask on a tensor (an attribute or Keras' side table); Keras
  # exports no getter.
  return importlib.import_module(
      "keras.src.backend.common.masking").get_keras_mask(x)


def functional_class():
  # keras.Model(inputs, outputs) builds this class; Keras exports no name
  # to tell a functional model from a subclassed one.
  return importlib.import_module("keras.src.models.functional").Functional


def no_automatic_dependency_tracking(method):
  # Keeps Keras from tracking the inner optimizer's variables twice while a
  # wrapper optimizer builds; no public decorator.
  tracking = importlib.import_module("keras.src.utils.tracking")
  return tracking.no_automatic_dependency_tracking(method)


def compile_loss(model):
  # The compiled loss object (`model.compute_loss` reduces over the batch;
  # DP needs the per-example values of the same losses and weights).
  return getattr(model, "_compile_loss", None)


def flat_losses(compile_loss_obj) -> list:
  # The resolved (loss, weight, ...) entries of a CompileLoss, swapped for
  # per-example adapters for one call; no public accessor.
  return list(compile_loss_obj._flat_losses)  # pylint: disable=protected-access


def set_flat_losses(compile_loss_obj, entries) -> None:
  # Pair of flat_losses (same reason).
  compile_loss_obj._flat_losses = entries  # pylint: disable=protected-access


@contextlib.contextmanager
def loss_trackers_suspended(compile_loss_obj):
  # A multi-output CompileLoss updates one Mean per output with the batch's
  # loss inside its call (logged as "<output>_loss"): a variable written
  # from the data. The DP step computes per-example losses with it and
  # must write nothing from the data, so the trackers' update_state is a
  # no-op for the call (no public switch).
  trackers = [m for m in (getattr(compile_loss_obj, "metrics", None) or ())
              if m is not None]
  for m in trackers:
    m.update_state = lambda *args, **kwargs: None
  try:
    yield
  finally:
    for m in trackers:
      del m.update_state


@contextlib.contextmanager
def when_built(obj, fn):
  # Calls `fn()` once `obj` (a Keras CompileLoss) is built: now if it is,
  # else right after its build() inside the body (build is patched for the
  # duration; it has no public hook).
  if obj.built:
    fn()
    yield
    return
  original = obj.build

  def build(*args, **kwargs):
    original(*args, **kwargs)
    fn()

  obj.build = build
  try:
    yield
  finally:
    del obj.build


def compile_metrics(model):
  # The compiled metrics container, whose update_state is wrapped so padding
  # rows are masked for unweighted metrics too; no public accessor.
  return getattr(model, "_compile_metrics", None)


def compile_metrics_parts(cm):
  """(flatten_y, flat_metrics, flat_weighted_metrics) of a CompileMetrics."""
  # The container's own flattening and per-output metric lists (private),
  # so a masked update matches Keras' update output for output.
  return (cm._flatten_y, cm._flat_metrics, cm._flat_weighted_metrics)  # pylint: disable=protected-access


@contextlib.contextmanager
def metrics_masked(model, mask):
  """Compiled metrics see `mask` as a sample weight, weighted or not.

  A monkeypatch of the compiled metrics' `update_state` for one call (no
  public hook), hence here.

  Keras passes sample weights only to `weighted_metrics`; padding rows must
  not count in `metrics` either, so for the call their `update_state` gets
  `sample_weight=mask` (weighted metrics get the given weights, which
  already include the mask).
  """
  cm = compile_metrics(model)
  if cm is None:
    yield
    return

  def update_state(y_true, y_pred, sample_weight=None):
    if not cm.built:
      cm.build(y_true, y_pred)
    flatten_y, flat_metrics, flat_weighted = compile_metrics_parts(cm)
    y_true = flatten_y(y_true)
    y_pred = flatten_y(y_pred)
    weights = (flatten_y(sample_weight) if sample_weight is not None
               else [None])
    if len(weights) < len(y_true):
      weights = [weights[0]] * len(y_true)
    for m, w_m, t, p, w in zip(flat_metrics, flat_weighted,
                               y_true, y_pred, weights):
      if m:
        m.update_state(t, p, sample_weight=mask)
      if w_m:
        w_m.update_state(t, p, sample_weight=w)

  cm.update_state = update_state
  try:
    yield
  finally:
    del cm.update_state


def optimizer_own_variables(optimizer) -> list:
  # A Keras optimizer's own variables (iterations, learning rate) without
  # the ones `variables` may add in a subclass (DPOptimizer adds its inner
  # optimizer's); no public accessor.
  return list(optimizer._variables)  # pylint: disable=protected-access


def loss_tracker(model):
  # The Mean that `fit` logs as "loss"; Keras updates it inside its own
  # train_step, which the DP step replaces.
  return model._loss_tracker  # pylint: disable=protected-access


def regularization_losses(model) -> list:
  # Weight-regularizer losses only: `model.losses` also holds add_loss /
  # activity terms, which are per batch and which DP training refuses.
  return model._get_regularization_losses()  # pylint: disable=protected-access


def strategy_supports_no_merge_call() -> bool:
  # Whether the current strategy's optimizer step may run in replica
  # context (no merge_call); Keras' LossScaleOptimizer asks the same.
  return tf.__internal__.distribute.strategy_supports_no_merge_call()


def composite_tensor_class() -> type:
  # The base class of composite tensors (SparseTensor, RaggedTensor, ...),
  # which a tape may watch; tf.Tensor is not one.
  return tf.__internal__.CompositeTensor


def added_losses(layer) -> list:
  # The terms `layer.add_loss` added in its last call (activity
  # regularizers' included), without weight regularizers; `layer.losses`
  # mixes both.
  return list(layer._get_own_losses())  # pylint: disable=protected-access


def call_has_training_arg(model) -> bool:
  # Whether `call` takes `training` (Keras inspects the signature once and
  # caches it; calling with training= on a model without it raises).
  return bool(model._call_has_training_arg)  # pylint: disable=protected-access


def flatten_layers(model, include_self: bool = True):
  # Every layer, nested ones included, as Keras tracks them (`model.layers`
  # is one level deep and misses layers held in attributes of subclasses).
  # () for an object that is not a Keras layer.
  flatten = getattr(model, "_flatten_layers", None)
  return () if flatten is None else flatten(include_self=include_self)


def seed_generators(layer) -> list:
  # A layer's keras.random.SeedGenerators (their states must be saved and
  # restored to repeat a random forward pass); no public accessor.
  return list(getattr(layer, "_seed_generators", ()) or ())


def reset_global_seed_generator() -> None:
  # A fresh global SeedGenerator made eagerly, so unseeded keras.random
  # calls repeat after keras.utils.set_random_seed (which resets it lazily).
  seed_generator = importlib.import_module("keras.src.random.seed_generator")
  with tf.init_scope():
    seed_generator.global_seed_generator()


def symbolic_build(model, data_batch) -> None:
  # Builds a lazily built model, its compiled loss and metrics from one
  # batch, as `fit` does before its first step; no public equivalent.
  model._symbolic_build(data_batch=data_batch)  # pylint: disable=protected-access


@functools.lru_cache(maxsize=None)
def onednn_enabled() -> bool:
  # Whether TensorFlow runs its oneDNN kernels (`_Mkl*` ops) in this
  # process: TF decides once, from TF_ENABLE_ONEDNN_OPTS and the CPU (on by
  # default where it has AVX-512 VNNI/BF16 or AMX), and exposes the answer
  # only through this internal (tf_pxg.tape.tf_defects needs it).
  return bool(_tf_module("tensorflow.python.util._pywrap_util_port")
              .IsMklEnabled())


def rdp_curve(accountant) -> list:
  # The RDP values at each order of a dp_accounting RdpAccountant after its
  # compositions: dp-accounting exposes epsilon and delta but not the curve,
  # which tf_pxg.tuning needs to check that one run's event dominates
  # another's at every order (Papernot & Steinke's per-run condition).
  return list(accountant._rdp)  # pylint: disable=protected-access


# The accesses, by name: a zero-argument probe per access that fails when
# an upgrade moves it (tests/test_compat.py runs each).


def _probe_keras_model():
  import keras  # pylint: disable=import-outside-toplevel
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(
      2, kernel_regularizer="l2")(inputs))
  model.compile(loss="mse", metrics=["mae"])
  symbolic_build(model, (tf.zeros([2, 3]), tf.zeros([2, 2]), None))
  return model


def _probe_graph_op():
  g = tf.Graph()
  with g.as_default():
    t = tf.constant(1.0) * 2.0
  return t.op


def _probe_function_op():
  """A graph, and the name of the body of a `tf.cond` built in it."""
  g = tf.Graph()
  with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [])
    tf.cond(x > 0, lambda: x * 2.0, lambda: x)
  op = next(o for o in g.get_operations() if o.type in ("If", "StatelessIf"))
  return g, op.get_attr("then_branch").name


def _probe_capture():
  """A `tf.function` graph and the placeholder of a variable's handle it
  captures."""
  v = tf.Variable(1.0)
  graph = tf.function(lambda: v.read_value() * 2.0).get_concrete_function(
  ).graph
  read = next(o for o in graph.get_operations() if o.type == "ReadVariableOp")
  return graph, read.inputs[0]


ACCESSES: Dict[str, Callable[[], Any]] = {
    "op_callbacks": lambda: (add_op_callback(_noop_callback),
                             remove_op_callback(_noop_callback)),
    "eager_scope_name": lambda: isinstance(eager_scope_name(), str) or _fail(),
    "VariableWatcher": lambda: variable_watcher().__enter__ and None,
    "tensor_id": lambda: isinstance(tensor_id(tf.constant(1)), int) or _fail(),
    "op_id": lambda: isinstance(op_id(_probe_graph_op()), int) or _fail(),
    "op_def_registry": lambda: op_def("MatMul").input_arg[0].name == "a"
        or _fail(),
    "EagerTensor._numpy": lambda: callable(_eager_tensor_base()._numpy)  # pylint: disable=protected-access
        or _fail(),
    "ops.uid": lambda: next_tensor_id() < tensor_id(tf.constant(1)) or _fail(),
    "FuncGraph.captures": lambda: captured_from(*_probe_capture()) is not None
        or _fail(),
    "Graph._get_function": lambda: any(
        t == "Mul" for t, _ in function_body(*_probe_function_op())) or _fail(),
    "is_resource_variable":
        lambda: is_resource_variable(tf.Variable(1.0)) or _fail(),
    "keras_variable_value": lambda: is_resource_variable(
        keras_variable_value(__import__("keras").Variable(1.0))) or _fail(),
    "variable_shape": lambda: variable_shape(tf.Variable([1.0]).handle),
    "_MockOp": lambda: mock_op((), [], [], "Identity", None).get_attr,
    "_aggregate_grads":
        lambda: aggregate_grads([tf.constant(1.0), tf.constant(2.0)]),
    "_SymGrad": lambda: _tf_module(
        "tensorflow.python.ops.gradients_util")._SymGrad,  # pylint: disable=protected-access
    "gradient_registry": lambda: (gradient_function("MatMul"),
                                  _gradient_registry()._registry["MatMul"]),  # pylint: disable=protected-access
    "GraphOrParentsInXlaContext":
        lambda: graph_in_xla_context(tf.compat.v1.get_default_graph()),
    "polymorphic_function.Function":
        lambda: isinstance(tf.function(lambda: 1), tf_function_class())
        or _fail(),
    "tf.function._autograph": lambda: (
        tf.function(lambda: 1)._autograph,  # pylint: disable=protected-access
        tf.function(lambda: 1)._experimental_autograph_options,  # pylint: disable=protected-access
        _tf_module("tensorflow.python.eager.polymorphic_function."
                   "autograph_util").py_func_from_autograph,
        _tf_module("tensorflow.python.autograph.core.ag_ctx").ControlStatusCtx),
    "record.record_operation/_eager_mode_decorator": lambda: (
        _tf_module("tensorflow.python.eager.record").record_operation,
        _tf_module("tensorflow.python.ops.custom_gradient")
        ._eager_mode_decorator.__code__),  # pylint: disable=protected-access
    "keras.src.backend.rnn/lstm/gru": lambda: (
        __import__("keras").layers,
        keras_backend_module().rnn, keras_backend_module().lstm,
        keras_backend_module().gru),
    "get_keras_mask": lambda: get_keras_mask(tf.constant(1.0)),
    "Functional": lambda: isinstance(_probe_keras_model(),
                                     functional_class()) or _fail(),
    "no_automatic_dependency_tracking":
        lambda: no_automatic_dependency_tracking(lambda self: None),
    "_compile_loss/_flat_losses": lambda: set_flat_losses(
        compile_loss(_probe_keras_model()), flat_losses(
            compile_loss(_probe_keras_model()))),
    "CompileLoss.metrics": lambda: isinstance(
        compile_loss(_probe_keras_model()).metrics, list) or _fail(),
    "_compile_metrics": lambda: compile_metrics_parts(
        compile_metrics(_probe_keras_model())),
    "optimizer._variables": lambda: optimizer_own_variables(
        __import__("keras").optimizers.SGD()),
    "_loss_tracker": lambda: loss_tracker(_probe_keras_model()).update_state,
    "_get_regularization_losses":
        lambda: len(regularization_losses(_probe_keras_model())) == 1
        or _fail(),
    "strategy_supports_no_merge_call": lambda: isinstance(
        strategy_supports_no_merge_call(), bool) or _fail(),
    "CompositeTensor": lambda: isinstance(
        tf.sparse.from_dense([1.0]), composite_tensor_class()) or _fail(),
    "_get_own_losses": lambda: added_losses(_probe_keras_model()) == []
        or _fail(),
    "_call_has_training_arg":
        lambda: call_has_training_arg(_probe_keras_model()),
    "_flatten_layers": lambda: list(flatten_layers(_probe_keras_model())),
    "_seed_generators": lambda: seed_generators(
        __import__("keras").layers.Dropout(0.5)) or _fail(),
    "global_seed_generator": reset_global_seed_generator,
    "_symbolic_build": _probe_keras_model,
    "IsMklEnabled": lambda: isinstance(onednn_enabled(), bool) or _fail(),
    "RdpAccountant._rdp": lambda: len(rdp_curve(
        __import__("dp_accounting").rdp.RdpAccountant([2.0, 4.0]))) == 2
        or _fail(),
}


def _noop_callback(*args, **kwargs):  # pylint: disable=unused-argument
  return None


def _fail():
  raise AssertionError("unexpected value")


def check(name: str) -> None:
  """Exercises access `name`; raises CompatError naming it if it moved."""
  try:
    ACCESSES[name]()
  except Exception as e:  # pylint: disable=broad-except
    raise _missing(name, e) from e


# TensorFlow: checkpoint restoration -------------------------------------------


def deferred_restore_names(trackable) -> list:
  # No public API lists the checkpoint values waiting for an object's
  # children (deferred restoration): TF keeps them in the trackable's
  # `_deferred_dependencies` until a child of that name is tracked. The
  # DPOptimizer's DP state reads it after its build to refuse a saved
  # value its plan did not create (`tf_pxg.keras._dp_state.check_restored`).
  return sorted(getattr(trackable, "_deferred_dependencies", {}) or {})


ACCESSES["_deferred_dependencies"] = lambda: isinstance(
    deferred_restore_names(tf.Module()), list) or _fail()

