"""`tf_pxg.GradientTape`: a drop-in for `tf.GradientTape` that also answers
per-example questions.

`gradient()` is computed by our own Python port of TF's `imperative_grad`
(`tf_pxg.backprop.imperative_grad`) over the ops the tape recorded through
TF's op-callback hook, eagerly and inside `tf.function`, calling TF's
registered gradient functions; it equals `tf.GradientTape.gradient`.

On top of that (batch is axis 0 of the data; the target is a `[B]` vector of
per-example values, or a scalar that is a sum over examples):

* `per_example_gradient(target, sources)` -> `[B, *source.shape]` each;
* `per_example_norms(target, sources)` -> `[B]` global L2 norms;
* `clipped_gradient_sum(target, sources, l2_norm_clip)` ->
  `(sum_b min(1, C/||g_b||) g_b per source, norms)` in one backward pass;
* `group_clipped_gradient_sum(target, sources, C, clipping)` -> the same
  with a bound per group of sources (`tf_pxg.clipping.PerLayer`), and the
  `[G, B]` group norms.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.backprop import gradient_functions
from tf_pxg.backprop.imperative_grad import imperative_grad
from tf_pxg.dp.clipping import clip_factors
from tf_pxg.interface import pre_tape
from tf_pxg.per_example.backward import PerExampleBackprop
from tf_pxg.tape import side_effects
from tf_pxg.tape.recording import Recorder, tensor_id


# The tape's methods run as written, never converted by autograph: called
# from a user's `tf.function` (autograph on by default), autograph would
# otherwise rewrite tf_pxg's whole backward pass (the engine, the rules,
# `imperative_grad`: over a hundred functions, about 6 s of CPU on the first
# trace of a small model's clipped sum) into the same ops. Keras traces
# `fit`'s step without autograph too. The user's own code (the forward
# pass under `with tape:`) is converted as before.
_as_written = tf.autograph.experimental.do_not_convert


def _tf_variable(v):
  """The `tf.Variable` behind a Keras 3 variable (or `v` itself)."""
  inner = _compat.keras_variable_value(v)
  if inner is not None and _compat.is_resource_variable(inner):
    return inner
  return v


def _is_variable(v) -> bool:
  return _compat.is_resource_variable(_tf_variable(v))


class GradientTape:
  """Records operations for automatic and per-example differentiation.

  Same constructor and methods as `tf.GradientTape` (`watch`,
  `stop_recording`, `reset`, `watched_variables`, `gradient` with
  `output_gradients` and `unconnected_gradients`), plus the per-example
  methods. Nested tapes work as with TF: an outer tape records the inner
  tape's gradient computation.

  Args:
    persistent: allow several gradient computations (per-example ones
      included) from one recording.
    watch_accessed_variables: watch trainable variables read while recording.
    examples: optional, a nest of the eager tensors that hold the batch
      (inputs, labels). Eagerly, the per-example methods then refuse any
      tensor the recorded ops take that was computed after these and before
      the tape started (a batch statistic computed outside the record:
      `tf_pxg.interface.pre_tape`). Inside `tf.function` the whole step's
      graph is analysed and this is not needed.
  """

  def __init__(self, persistent: bool = False,
               watch_accessed_variables: bool = True, examples=None):
    self._persistent = persistent
    self._watch_accessed_variables = watch_accessed_variables
    self._recorder = Recorder(None if examples is None else
                              pre_tape.ExampleWindow(examples))
    self._watched_tensors: dict = {}
    self._watched_vars: dict = {}
    self._variable_watcher = None
    self._accessed: list = []
    self._used = False
    self._in_context = False

  # Context ------------------------------------------------------------------

  def __enter__(self):
    self._in_context = True
    self._push()
    return self

  def __exit__(self, typ, value, traceback):
    self._pop()
    self._in_context = False

  def _push(self):
    self._recorder.start()
    self._variable_watcher = _compat.variable_watcher()
    self._variable_watcher.__enter__()

  def _pop(self):
    if self._variable_watcher is not None:
      self._accessed.extend(self._variable_watcher.watched_variables())
      self._variable_watcher.__exit__(None, None, None)
      self._variable_watcher = None
    self._recorder.stop()

  @contextlib.contextmanager
  def stop_recording(self):
    """Temporarily stops recording; ops run inside are not differentiated."""
    if not self._recorder.active:
      raise ValueError("Tape must be recording when stop_recording is used.")
    self._pop()
    try:
      yield
    finally:
      self._push()

  def reset(self):
    """Clears everything recorded so far (and keeps recording if active)."""
    self._recorder.clear()
    self._accessed = []
    self._watched_tensors.clear()
    self._watched_vars.clear()
    self._used = False

  def watch(self, tensor) -> None:
    """Ensures `tensor` (a tensor, variable, or nest of them) is traced."""
    for t in tf.nest.flatten(tensor):
      if _is_variable(t):
        self._watched_vars[id(_tf_variable(t))] = t
      elif isinstance(t, (tf.Tensor, _compat.composite_tensor_class())):
        if not (t.dtype.is_floating or t.dtype.is_complex):
          tf.get_logger().warning(
              "tf_pxg.GradientTape.watch: %s has dtype %s; only floating "
              "tensors have gradients.", getattr(t, "name", "tensor"), t.dtype)
        self._watched_tensors[tensor_id(t)] = t
      else:
        raise ValueError(f"Passed in object {t!r} of type {type(t).__name__}, "
                         "not a tf.Tensor or tf.Variable to watch.")

  def watched_variables(self) -> tuple:
    """Variables watched explicitly or read while recording (trainable)."""
    seen, out = set(), []
    accessed = list(self._accessed)
    if self._variable_watcher is not None:
      accessed += list(self._variable_watcher.watched_variables())
    candidates = list(self._watched_vars.values())
    if self._watch_accessed_variables:
      candidates += [v for v in accessed if getattr(v, "trainable", False)]
    for v in candidates:
      if id(_tf_variable(v)) not in seen:
        seen.add(id(_tf_variable(v)))
        out.append(v)
    return tuple(out)

  @_as_written
  def recorded_uses(self, source) -> Optional[tuple]:
    """What the recording did with `source` (a watched variable or tensor):
    `(id, entries)`, the recorded id of its value (a variable's resource
    handle; inside a `tf.function`, its captured placeholder) and the
    recorded operations in order, each with `op_type`, `inputs`,
    `input_ids` and `output_ids`; None if `source` is not watched. Read-only
    (a mechanism that reads the recorded batch, e.g.
    `tf_pxg.dp.sparse_selection`, follows the id through the entries)."""
    source_id = self._source_id(source)
    if source_id is None:
      return None
    return source_id, tuple(self._recorder.entries)

  # Sources and targets ------------------------------------------------------

  def _source_id(self, s) -> Optional[int]:
    if _is_variable(s):
      var = _tf_variable(s)
      watched = id(var) in self._watched_vars or (
          self._watch_accessed_variables and var.trainable)
      if not watched:
        return None
      return self._handle_id(var)
    if s is None:
      raise TypeError("A source is None; expected tensors or variables.")
    tid = tensor_id(s)
    return tid if tid in self._watched_tensors else None

  def _handle_id(self, var) -> Optional[int]:
    """The recorded id of `var`'s resource handle (inside a `tf.function`
    its captured placeholder), or None if the recording's graph does not
    capture it."""
    handle = var.handle
    graph = self._recorder.graph
    if graph is not None and getattr(handle, "graph", None) is not graph:
      handle = {id(ext): inner for ext, inner in
                getattr(graph, "captures", ())}.get(id(handle))
      if handle is None:
        return None
    return tensor_id(handle)

  # Side effects -----------------------------------------------------------

  def _dependent_ids(self, data) -> set:
    return side_effects.data_dependent_ids(
        self._recorder.entries,
        [tensor_id(t) for t in tf.nest.flatten(data) if t is not None])

  @_as_written
  def data_dependence(self, data) -> Callable[[Any], bool]:
    """A predicate: whether a tensor recorded so far depends on `data`.

    `data` is a nest of the tensors that carry the examples (inputs,
    labels, weights); see `tf_pxg.tape.side_effects`. Tensors the tape did
    not record (variables' values read outside it, constants made before
    it) are data-independent unless they are in `data`.
    """
    dependent = self._dependent_ids(data)
    return lambda t: tensor_id(t) in dependent

  @_as_written
  def data_dependent_writes(self, data, variables=()) -> list:
    """The state writes recorded so far whose value depends on `data`.

    Args:
      data: a nest of the tensors that carry the examples.
      variables: variables to name the written ones by (e.g. all of a
        model's variables, trainable or not).

    Returns:
      `(entry, variable)` pairs: the write's `recording.Entry` (its op type
      and scope) and the variable of `variables` it writes, or None.
    """
    dependent = self._dependent_ids(data)
    writes = side_effects.data_dependent_writes(
        self._recorder.writes, dependent, self._recorder.entries,
        _compat.function_body)
    if not writes:
      return []
    by_handle = {}
    for v in variables:
      var = _tf_variable(v)
      if _compat.is_resource_variable(var):
        by_handle.setdefault(self._handle_id(var), v)
    return [(w, by_handle.get(w.input_ids[0])) for w in writes]

  def _begin_gradient(self):
    if self._used and not self._persistent:
      raise RuntimeError(
          "A non-persistent GradientTape can only be used to compute one set "
          "of gradients (or per-example quantities); pass persistent=True.")
    if self._recorder.active and not self._persistent:
      self._pop()
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if self._recorder.graph is not None and graph is not self._recorder.graph:
      raise RuntimeError(
          "tf_pxg.GradientTape recorded inside one tf.function graph and is "
          "asked for gradients in another context; compute the gradient in "
          "the same tf.function as the forward pass.")
    self._recorder.paused += 1

  def _end_gradient(self):
    self._recorder.paused -= 1
    if not self._persistent:
      self._used = True
      self._recorder.clear()

  @contextlib.contextmanager
  def _computing(self):
    self._begin_gradient()
    try:
      yield
    finally:
      self._end_gradient()

  def _sources(self, sources):
    flat = tf.nest.flatten(sources)
    return flat, [self._source_id(s) for s in flat]

  @staticmethod
  def _unconnected(s, unconnected_gradients, batch_shape=()):
    if tf.UnconnectedGradients(unconnected_gradients) == tf.UnconnectedGradients.ZERO:
      shape = list(batch_shape) + list(tf.TensorShape(s.shape).as_list())
      return tf.zeros(shape, s.dtype if not _is_variable(s) else
                      _tf_variable(s).dtype)
    return None

  # Gradients ----------------------------------------------------------------

  @_as_written
  def gradient(self, target, sources, output_gradients=None,
               unconnected_gradients=tf.UnconnectedGradients.NONE):
    """Same contract as `tf.GradientTape.gradient`."""
    if target is None:
      raise TypeError("Argument `target` should be a list or nested structure "
                      "of Tensors, but received None.")
    with self._computing():
      flat_targets = [tf.convert_to_tensor(t) if _is_variable(t) else t
                      for t in tf.nest.flatten(target)]
      if output_gradients is not None:
        output_gradients = tf.nest.flatten(output_gradients)
      initial = {}
      for i, t in enumerate(flat_targets):
        g = None if output_gradients is None else output_gradients[i]
        g = tf.ones_like(t) if g is None else tf.convert_to_tensor(g, t.dtype)
        initial.setdefault(tensor_id(t), []).append(g)
      flat_sources, ids = self._sources(sources)
      stop = {i for i in ids if i is not None}
      results = imperative_grad(
          self._recorder.producer, initial, stop,
          lambda e, g, skip: gradient_functions.call_gradient_function(
              e, g, skip))
      out = []
      for s, i in zip(flat_sources, ids):
        g = results.get(i) if i is not None else None
        out.append(g if g is not None else
                   self._unconnected(s, unconnected_gradients))
    return tf.nest.pack_sequence_as(sources, out)

  def _per_example(self, target, sources):
    flat_sources, ids = self._sources(sources)
    target = tf.convert_to_tensor(target)
    names = [getattr(s, "path", None) or getattr(s, "name", None) or
             f"source {i}" for i, s in enumerate(flat_sources)]
    engine = PerExampleBackprop(self._recorder, target, ids,
                                source_names=names)
    return flat_sources, engine

  @_as_written
  def per_example_gradient(self, target, sources,
                           unconnected_gradients=tf.UnconnectedGradients.NONE):
    """One gradient per example and source.

    Args:
      target: `[B]` per-example values (e.g. unreduced losses), or a scalar
        that is a sum over examples.
      sources: a tensor/variable or nest of them.
      unconnected_gradients: as in `gradient`.

    Returns:
      The structure of `sources`, each `[B, *source.shape]`.

    Raises:
      ValueError: for ops that mix examples (batch normalisation) or a
        target that is not `[B]` or scalar.
      NotImplementedError: an op consuming a parameter has no per-example
        rule and the vectorized fallback cannot handle it.
    """
    with self._computing():
      flat_sources, engine = self._per_example(target, sources)
      grads = engine.per_example_gradients()
      b = engine.batch_size
      out = [g if g is not None else self._unconnected(
          s, unconnected_gradients, [b] if isinstance(b, int) else [0])
             for s, g in zip(flat_sources, grads)]
    return tf.nest.pack_sequence_as(sources, out)

  @_as_written
  def per_example_norms(self, target, sources):
    """`[B]` float32: each example's gradient norm over all sources jointly."""
    with self._computing():
      _, engine = self._per_example(target, sources)
      return tf.sqrt(engine.sq_norms())

  @_as_written
  def clipped_gradient_sum(self, target, sources, l2_norm_clip,
                           clipping=None, gradient_scale=None):
    """Sum over examples of per-example gradients clipped to `l2_norm_clip`.

    Flat clipping: example b's gradient over all sources together is scaled
    by `c_b = min(1, l2_norm_clip / ||g_b||)`, so each example contributes at
    most `l2_norm_clip` in L2 norm to the sum (the DP-SGD sensitivity).
    Computed in one backward pass: norms first, then each interface's
    clip-weighted sum `sum_b c_b g_b` (Book-keeping, Bu et al. 2023).

    Non-finite examples: an example whose gradient norm is NaN/inf, or
    whose entry of a `[B]` target is NaN/inf (e.g. a NaN loss), gets
    `c_b = 0` by a select, and every rule's weighted sum selects its rows
    to exactly 0 (also in the data operands: `inf * 0 = NaN`). It adds
    exactly 0 to the sums and the other examples' terms are unchanged, so
    the sums stay finite and each example still moves them by at most
    `l2_norm_clip`, whatever it holds (`tf_pxg.dp.clipping` gives the
    privacy argument). Non-finite values that are not an example's (a
    parameter, a scalar target) still propagate.

    Args:
      target: `[B]` per-example values (e.g. unreduced losses), or a scalar
        that is a sum over examples.
      sources: a tensor/variable or nest of them.
      l2_norm_clip: the clip C, a Python number or scalar tensor (e.g. an
        adaptive clip's variable: no retracing when it changes).
      clipping: a `tf_pxg.clipping` policy (default `Flat()`, the factors
        above); `Automatic()` uses `c_b = C / (||g_b|| + gamma)`. Either
        way `c_b ||g_b|| <= C`. A grouped policy (`PerLayer`) scales each
        group g of the sources by its own `c_{b,g}` with
        `||c_{b,g} g_{b,g}|| <= C_g`, `sum_g C_g^2 = C^2`.
      gradient_scale: None, or the scalar S that `target` was multiplied by
        (a loss scale, so that float16 backward passes do not underflow):
        the norms are divided by S before the clip factors, and the factors
        by S in the weighted sums, so the results are those of the
        unscaled target, `sum_b c_b g_b` with `||c_b g_b|| <= C`, whose
        terms stay at the gradient's own magnitude (no overflow of S
        times a sum of B examples).

    Returns:
      `(sums, norms)`: the structure of `sources` with `sum_b c_b g_b` each
      (None for unconnected sources), and the `[B]` unclipped norms (NaN or
      inf for a non-finite example; its factor was 0); for a grouped
      policy, the sums of each group's clipped gradients and the `[B]`
      global norms (the root of the groups' squared norms).
    """
    with self._computing():
      flat_sources, engine = self._per_example(target, sources)
      if getattr(clipping, "grouped", False):
        sums, norms, _ = self._group_clipped_sums(
            engine, target, flat_sources, l2_norm_clip, clipping,
            gradient_scale)
        return tf.nest.pack_sequence_as(sources, sums), norms
      norms = tf.sqrt(engine.sq_norms())
      if gradient_scale is not None:
        norms = norms / tf.cast(gradient_scale, norms.dtype)
      c = (clip_factors(norms, l2_norm_clip) if clipping is None else
           clipping.factors(norms, l2_norm_clip))
      target = tf.convert_to_tensor(target)
      if engine.vector_target and target.dtype.is_floating:
        c = tf.where(tf.math.is_finite(target), c,
                     tf.zeros_like(c))
      if gradient_scale is not None:
        c = c / tf.cast(gradient_scale, c.dtype)
      sums = engine.weighted_sums(c)
    return tf.nest.pack_sequence_as(sources, sums), norms

  @_as_written
  def group_clipped_gradient_sum(self, target, sources, l2_norm_clip,
                                 clipping, gradient_scale=None,
                                 group_scales=None):
    """`clipped_gradient_sum` for a grouped policy
    (`tf_pxg.clipping.PerLayer`), also returning the group norms.

    `[G, B]` group norms in the one backward pass
    (`PerExampleBackprop.group_sq_norms`), `[G, B]` factors
    `min(1, C_g / ||g_{b,g}||)`, one weighted pass with each source's
    group's factors (`group_weighted_sums`).

    Args:
      target, sources, l2_norm_clip, gradient_scale: as in
        `clipped_gradient_sum`; `l2_norm_clip` is the total C.
      clipping: the grouped policy.
      group_scales: None, or the `[G]` adaptive bounds' quantile
        estimates (the policy's `GroupQuantileCount` states), which set
        `C_g = C s_g / ||s||`.

    Returns:
      `(sums, norms, group_norms)`: the structure of `sources`, the `[B]`
      global norms and the `[G, B]` group norms (unclipped; the groups in
      `clipping.assign(sources)`'s order).
    """
    with self._computing():
      flat_sources, engine = self._per_example(target, sources)
      sums, norms, group_norms = self._group_clipped_sums(
          engine, target, flat_sources, l2_norm_clip, clipping,
          gradient_scale, group_scales)
    return tf.nest.pack_sequence_as(sources, sums), norms, group_norms

  def _group_clipped_sums(self, engine, target, flat_sources, l2_norm_clip,
                          clipping, gradient_scale, group_scales=None):
    index, names = clipping.assign(flat_sources)
    _, ids = self._sources(flat_sources)
    group_of = {i: g for i, g in zip(ids, index) if i is not None}
    norms = tf.sqrt(engine.group_sq_norms(group_of, len(names)))
    if gradient_scale is not None:
      norms = norms / tf.cast(gradient_scale, norms.dtype)
    c = clipping.group_factors(norms, clipping.group_bounds(
        names, l2_norm_clip, group_scales))
    target = tf.convert_to_tensor(target)
    if engine.vector_target and target.dtype.is_floating:
      c = tf.where(tf.math.is_finite(target)[None, :], c, tf.zeros_like(c))
    if gradient_scale is not None:
      c = c / tf.cast(gradient_scale, c.dtype)
    sums = engine.group_weighted_sums(tf.unstack(c, num=len(names)),
                                      group_of)
    return (sums, tf.sqrt(tf.reduce_sum(tf.square(norms), axis=0)), norms)
