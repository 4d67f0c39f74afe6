"""`check_example_independence`: change one example, check with a plain
`tf.GradientTape` that no other example's loss or gradient moves."""

from __future__ import annotations

from typing import (Any, Callable, List, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.interface import batch_axis
from tf_pxg.testing.checks import _run_in_mode
from tf_pxg.testing.dilated_conv import _dilation_free_conv_gradients
from tf_pxg.testing.reference import _batch_size, _dense, _per_example_loss
from tf_pxg.testing.tolerances import MODES, _names, _numpy, _variable_dtype


# Default rtol by the dtype of the compared quantity: a model in which
# examples do not mix gives bit-identical other examples in both runs (the
# same program on the same shapes), so this only absorbs non-deterministic
# kernels; mixing moves them by far more.
_INDEPENDENCE_RTOL = {
    tf.float16: 1e-3,
    tf.bfloat16: 1e-2,
    tf.float32: 1e-5,
    tf.float64: 1e-12,
}

CHANGES = ("perturb", "swap")


class ExampleIndependenceResult(NamedTuple):
  """What `check_example_independence` measured.

  Attributes:
    indices: the examples changed, one at a time.
    moved: `(changed, moved)` pairs: changing example `changed` moved the
      loss or the gradient of example `moved` beyond the tolerance. Empty
      when the check passes.
    max_loss_change: the largest `|loss_b' - loss_b|` over every changed
      example and every OTHER example b.
    max_gradient_change: the largest `|g_b' - g_b|` entry (over all the
      variables) over every changed example and every other example b; 0.0
      when gradients were not checked.
    loss_tolerance: the largest loss tolerance used (`atol + rtol * loss
      scale`, the scale being the largest |loss| of the batch in either run).
    gradient_tolerance: the same for the gradients (scale: the largest
      per-example gradient entry over all variables, in either run).
    changed_loss_change: the smallest, over the changed examples, of the
      change of the changed example's OWN loss: evidence that the change was
      exercised at all (a model that ignores the changed input gives 0.0).
    changed_gradient_change: the same for its own gradient.
    details: one line per moved example (the failure message's lines).
    exits: one line per exit of the forward pass found (see
      `check_example_independence`, "Exits"): a Python read of a tensor
      at trace time, a Python op (`tf.numpy_function`/`tf.py_function`),
      or an output that depends on an earlier call. Empty when none.
  """
  indices: Tuple[int, ...]
  moved: Tuple[Tuple[int, int], ...]
  max_loss_change: float
  max_gradient_change: float
  loss_tolerance: float
  gradient_tolerance: float
  changed_loss_change: float
  changed_gradient_change: float
  details: Tuple[str, ...]
  exits: Tuple[str, ...] = ()

  @property
  def passed(self) -> bool:
    return not self.moved and not self.exits


class ExampleMixingError(AssertionError):
  """Changing one example moved another example's loss or gradient.

  An `AssertionError` (so test frameworks report it as a failed check);
  `result` is the `ExampleIndependenceResult`.
  """

  def __init__(self, message: str, result: ExampleIndependenceResult):
    super().__init__(message)
    self.result = result


def _keras_seed_states(model) -> set:
  """ids of the state variables of the Keras `SeedGenerator`s in `model`."""
  ids = set()
  for layer in _compat.flatten_layers(model, include_self=True):
    for generator in _compat.seed_generators(layer):
      state = getattr(generator, "state", None)
      if state is not None:
        ids.add(id(state))
  return ids


def _model_state(model) -> List[Any]:
  """The model's non-trainable state: Keras' `non_trainable_variables`
  (moving statistics, SeedGenerator states, power-iteration vectors...)."""
  variables = getattr(model, "non_trainable_variables", None)
  if variables is None:
    return []
  return [v for v in variables if hasattr(v, "assign")]


def _reseed(seed: int) -> None:
  """`keras.utils.set_random_seed(seed)` and a fresh global Keras
  SeedGenerator made eagerly (so unseeded `keras.random` calls draw the same
  values in every run, eagerly and in a `tf.function`)."""
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - tf_pxg's tests always have Keras
    tf.random.set_seed(seed)
    return
  keras.utils.set_random_seed(seed)
  try:
    _compat.reset_global_seed_generator()
  except (ImportError, AttributeError):  # pragma: no cover - other Keras
    pass


def _float_leaf(t) -> bool:
  return t.dtype.is_floating


def _change_batch(nest, index: int, source: int, how: str,
                  rng: np.random.Generator, b_total: int, what: str):
  """`nest` with example `index` replaced (see `check_example_independence`).

  Returns (new nest of tensors, whether anything changed).
  """
  changed = False

  def change(t):
    nonlocal changed
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0 or t.shape[0] != b_total:
      raise ValueError(
          f"Every tensor of `{what}` must have the batch ({b_total} examples) "
          f"on axis 0; got shape {t.shape}.")
    a = t.numpy()
    new = a.copy()
    if how == "perturb" and _float_leaf(t):
      wide = a.astype(np.float64)
      finite = wide[np.isfinite(wide)]
      scale = float(np.std(finite)) if finite.size else 0.0
      if not scale > 0:
        scale = float(np.max(np.abs(finite))) if finite.size else 0.0
      if not scale > 0:
        scale = 1.0
      wide[index] = wide[index] + scale * rng.standard_normal(a.shape[1:])
      new = wide.astype(a.dtype)
    else:
      new[index] = a[source]
    if not np.array_equal(new, a):
      changed = True
    return tf.constant(new, dtype=t.dtype)

  if nest is None:
    return None, False
  return tf.nest.map_structure(change, nest), changed


def _independence_pass(loss_fn, model, variables, inputs, labels, training,
                       mode: str, gradients: bool):
  """Per-example losses `[B]` and (if `gradients`) per-example gradients
  `[B, *v.shape]` per variable: the gradient of `loss[b]` with the whole
  batch in the forward pass, from a plain persistent `tf.GradientTape`."""

  def compute(inputs, labels):
    with tf.GradientTape(persistent=True) as tape:
      losses = _per_example_loss(loss_fn, model, inputs, labels, training)
      # Sliced on the tape, so that each row is differentiable.
      rows = tf.unstack(losses) if gradients else []
    if not gradients:
      return losses, []
    per_b = []
    for row in rows:
      grads = tape.gradient(row, variables)
      per_b.append([tf.cast(_dense(g, v), _variable_dtype(v))
                    for g, v in zip(grads, variables)])
    del tape
    return losses, [tf.stack([gs[i] for gs in per_b])
                    for i in range(len(variables))]

  with _dilation_free_conv_gradients():
    losses, grads = _run_in_mode(compute, inputs, labels, mode)
  return losses.dtype, _numpy(losses), [_numpy(g) for g in grads]


def _abs_change(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """|a - b|, 0 where both are equal (inf == inf) or both NaN, inf where
  only one is NaN."""
  with np.errstate(invalid="ignore"):
    diff = np.abs(a - b)
  diff[(a == b) | (np.isnan(a) & np.isnan(b))] = 0.0
  diff[np.isnan(diff)] = np.inf
  return diff


def _finite_max(*arrays) -> float:
  values = [float(np.max(np.abs(x[np.isfinite(x)])))
            for x in arrays if x.size and np.any(np.isfinite(x))]
  return max(values, default=0.0)



def _is_keras_layer(model) -> bool:
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - tf_pxg's tests always have Keras
    return False
  return isinstance(model, keras.layers.Layer)


# Ops that run Python on their inputs: an exit from the traced graph.
_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def _forward_exits(loss_fn, model, inputs, labels, training,
                   variables=()) -> Tuple[Tuple[str, ...], bool]:
  """The forward pass's exits visible in its trace, and whether it traces.

  The per-example loss is traced once into a graph, as the DP train step
  traces it (a Keras model without autograph, as Keras does): a Python
  read of a tensor (a branch on it, `.numpy()`, a tensor kept on a layer
  from another trace) fails there, and `tf.numpy_function` /
  `tf.py_function` appear as Python ops; a shape that counts the
  examples' values is refused by the engine's check of the same trace
  (`_shape_exits`). Nothing is run.
  """
  from tf_pxg.keras import _train_step  # pylint: disable=g-import-not-at-top

  def forward(inputs, labels):
    return _per_example_loss(loss_fn, model, inputs, labels, training)

  autograph = not _is_keras_layer(model)
  try:
    graph = tf.function(forward, autograph=autograph).get_concrete_function(
        inputs, labels).graph
  except Exception as e:  # pylint: disable=broad-except
    if not _train_step.is_python_read(e):
      raise
    text = " ".join(str(e).split())[:400]
    return ((f"exit: the forward pass reads a tensor's value in Python "
             f"({type(e).__name__}: {text}); DP training traces the step "
             "in every mode and refuses it"),), False
  found = sorted({op.type for op in graph.get_operations()} & _PYTHON_OPS)
  return tuple(
      f"exit: the forward pass runs Python on the batch (op {op}: "
      "tf.numpy_function or tf.py_function); DP training refuses it"
      for op in found) + _shape_exits(forward, variables, inputs,
                                      labels), True


def _shape_exits(forward, variables, inputs, labels) -> Tuple[str, ...]:
  """The engine's check of the traced forward pass for shapes that count
  examples' values (`tf.shape(tf.where(x > t))[0]`, `tf.size(tf.unique(
  ...))`): a per-example question asked through `tf_pxg.GradientTape`
  inside a `tf.function`, as DP training asks it; its refusal, if it is of
  that kind, is an exit (a count over the batch that no per-example
  change of one example may move without moving the others). Other
  refusals are left to the empirical check."""
  from tf_pxg import gradient_tape  # pylint: disable=g-import-not-at-top
  if not variables:
    return ()

  def norms(inputs, labels):
    with gradient_tape.GradientTape() as tape:
      losses = forward(inputs, labels)
    return tape.per_example_norms(losses, list(variables))

  try:
    tf.function(norms, autograph=False).get_concrete_function(inputs, labels)
  except ValueError as e:
    text = " ".join(str(e).split())
    if any(phrase in text for phrase in batch_axis.VALUE_SHAPE_PHRASES):
      return (f"exit: a shape counts the examples' values ({text[:400]}); "
              "DP training refuses it",)
  except Exception:  # pylint: disable=broad-except
    pass  # not this check's kind of exit; the empirical check decides
  return ()


def check_example_independence(
    model: Callable,
    x: Any,
    y: Any = None,
    *,
    loss: Optional[Callable] = None,
    sample_weight: Any = None,
    variables: Optional[Sequence[Any]] = None,
    index: Union[int, Sequence[int]] = 0,
    change: Union[str, Callable] = "perturb",
    source: Optional[int] = None,
    change_labels: bool = True,
    gradients: bool = True,
    training: Optional[bool] = True,
    seed: Optional[int] = 0,
    mode: str = "eager",
    rtol: Optional[float] = None,
    atol: float = 0.0,
    raise_on_failure: bool = True,
) -> ExampleIndependenceResult:
  """Checks empirically that no example's loss or gradient depends on another.

  DP-SGD's guarantee needs example b's loss (and so its gradient) to depend
  on example b alone. This runs the model on the batch, then on the same
  batch with ONE example changed, and checks that no OTHER example's
  per-example loss or per-example gradient moved. Layers that compute across
  the batch axis fail it: `keras.layers.MixUp` / `CutMix`,
  `BatchNormalization` in training, batch statistics (`x - mean(x, 0)`),
  `tf.roll` / `reverse` / `sort` / `gather` over axis 0, in-batch negatives
  (`z_a @ z_b^T` logits).

  Per-example gradients come from a plain persistent `tf.GradientTape`
  (`tape.gradient(loss[b], variables)` for each b, the whole batch in the
  forward pass), never from tf_pxg's engine: this is the gradient of example
  b's loss given the batch, which is exactly what must not depend on the
  other examples. Both runs are made in training mode with the same
  randomness: before each run the model's non-trainable state (Keras
  `non_trainable_variables`: SeedGenerator states, BatchNormalization moving
  statistics, SpectralNormalization's vector...) is restored and
  `keras.utils.set_random_seed(seed)` is called, so Dropout, GaussianNoise
  and random augmentation layers draw the same values in both runs. In
  "function"/"jit" modes each run traces its own `tf.function` after
  re-seeding, so unseeded TF random ops (`tf.random.uniform` without a seed)
  get the same op seeds and fresh kernels. Under XLA ("jit") the Keras
  random layers repeat too (their draws are stateless ops seeded by the
  restored states), but unseeded stateful TF random ops do not (XLA keeps
  its own RNG state): use "eager" or "function" for models with those. The
  model's non-trainable state is restored when the check returns; the
  global Python/NumPy/TF seeds are left set to `seed`.

  Exits: the forward pass must have no exit besides its outputs, in every
  mode (docs/threat_model.md, "The forward pass is closed: eager mode").
  Before the runs, the per-example loss is traced once into a graph as the
  DP train step traces it (a Keras model without autograph, as Keras
  does), whatever `mode`: a Python read of a tensor (an `if` on a batch
  statistic, `.numpy()`) fails there, and `tf.numpy_function` /
  `tf.py_function` show as Python ops; each is an exit, found whatever the
  change. After the changed runs the unchanged batch is run again: if its
  losses or gradients moved, the model keeps a value from an earlier call
  outside its variables (a tensor kept on a layer), an exit too (found
  when the change reaches the kept value: e.g. swap out the example a kept
  batch statistic was taken from). In "function"
  and "jit" modes a model whose trace fails is not run: the result holds
  the exit alone. Tracing calls the model's Python once without running
  it (a layer that writes Python attributes at trace time does so).

  Contract: the batch is axis 0 of every tensor of `x`, `y` and
  `sample_weight` (B >= 2, static), the per-example loss is a `[B]` vector;
  `x` and `y` are concrete values (numpy arrays or eager tensors: call the
  check eagerly, `mode` says how the model runs).

  The change (`change`):
    * "perturb" (default): every floating tensor of example `index` gets
      Gaussian noise scaled to that tensor's standard deviation over the
      batch (seeded by `seed`); integer, boolean and string tensors (token
      ids, categories, class labels) take example `source`'s row instead.
    * "swap": every tensor of example `index` takes example `source`'s row.
    * a callable `change(x, y, index) -> (x, y)` returning the changed batch.
    Labels are changed too when `change_labels` (default); `sample_weight`
    never is.

  Caveat: an empirical check only finds the mixing that the chosen change
  exercises, on this batch, with this randomness. It is a complement to a
  static check of the model's ops, not a proof: e.g. a random permutation
  (MixUp) that maps the changed example to itself in this draw, mixing only
  in branches this batch does not take, or a change the model ignores,
  pass. Check several `index` values (and seeds) for more confidence;
  `changed_loss_change` > 0 shows the change reached the model at all.

  Args:
    model: a Keras model/layer or any callable `model(x, training=...)`.
    x: inputs: a tensor, numpy array or nest (list, dict) of them.
    y: labels (a tensor or nest), or None.
    loss: `loss(y_true, y_pred) -> [B]` (`loss(y_pred)` when `y` is None),
      e.g. a Keras loss with `reduction=None`; by default the model's
      compiled loss, per example (`tf_pxg.keras.per_example_losses`, with
      `sample_weight`).
    sample_weight: per-example weights for the compiled loss (unchanged).
    variables: the variables whose per-example gradients are compared;
      default `model.trainable_variables`.
    index: the example to change, or a sequence of them (each changed alone,
      in its own run, against one unchanged run).
    change: "perturb", "swap" or a callable (see above).
    source: the example whose rows replace example `index`'s ("swap", and
      non-floating tensors under "perturb"); default `(index + 1) % B`.
    change_labels: change example `index`'s labels too.
    gradients: also compare per-example gradients (B backward passes per
      run); False compares losses only.
    training: passed as `training=` to `model` (None: not passed).
    seed: the seed set before each run, and of the perturbation; None
      re-seeds nothing and does not restore the random layers' states
      between the runs (random layers then draw differently: the check is
      expected to fail on them).
    mode: "eager", "function" (`tf.function`) or "jit" (XLA).
    rtol: tolerance relative to the scale of the compared quantity (the
      largest |loss| of the batch in either run for losses; the largest
      per-example gradient entry over all the variables for gradients);
      default by dtype (float32 1e-5, float64 1e-12, float16 1e-3,
      bfloat16 1e-2). Examples that do not mix are normally bit-identical
      between the two runs.
    atol: absolute tolerance added to it.
    raise_on_failure: raise `ExampleMixingError` when an example moved
      (default); False returns the result with `moved` filled in.

  Returns:
    An `ExampleIndependenceResult`.

  Raises:
    ExampleMixingError: (an `AssertionError`) if changing an example moved
      another one, or the forward pass has an exit (see "Exits"); the
      message names every moved example (which change,
      which example, by how much, against which tolerance) and `.result`
      holds the result.
    ValueError: B < 2, an `index`/`source` out of range, an unknown `change`
      or `mode`, a change that leaves the batch unchanged, a loss that is
      not `[B]`, or no loss (`loss` None and the model not compiled).
  """
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
  if not callable(change) and change not in CHANGES:
    raise ValueError(f"Unknown change {change!r}; expected one of {CHANGES} "
                     "or a callable change(x, y, index) -> (x, y).")
  b_total = _batch_size(x)
  if b_total < 2:
    raise ValueError(f"The batch has {b_total} example(s); checking that "
                     "examples do not mix needs at least 2.")
  indices = (int(index),) if isinstance(index, (int, np.integer)) else tuple(
      int(i) for i in index)
  if not indices:
    raise ValueError("`index` is empty: no example to change.")
  for i in indices + (() if source is None else (int(source),)):
    if not 0 <= i < b_total:
      raise ValueError(f"Example {i} is out of range for a batch of "
                       f"{b_total}.")
  if variables is None:
    variables = getattr(model, "trainable_variables", None)
    if variables is None:
      raise ValueError("`model` has no `trainable_variables`: pass "
                       "`variables=`.")
  variables = list(variables)

  if loss is None:
    if _compat.compile_loss(model) is None:
      raise ValueError(
          "No loss: pass `loss=` (a callable loss(y_true, y_pred) -> [B]) "
          "or compile the model with a loss.")
    from tf_pxg.keras.losses import per_example_losses  # pylint: disable=g-import-not-at-top

    def loss_fn(labels, outputs):
      return per_example_losses(model, labels, outputs, sample_weight)
  else:
    loss_fn = loss

  def as_tensors(nest):
    return None if nest is None else tf.nest.map_structure(
        tf.convert_to_tensor, nest)

  x, y = as_tensors(x), as_tensors(y)
  # Build the model (a lazily built one creates its variables on its first
  # call) before its state is saved; in inference mode, so that the build
  # call updates no moving statistics and draws no random numbers.
  if not variables or not getattr(model, "built", True):
    model(x, **({} if training is None else {"training": False}))
    if not variables:
      variables = list(getattr(model, "trainable_variables", []))
  if gradients and not variables:
    raise ValueError("No variables to differentiate: pass `variables=` or "
                     "gradients=False.")

  state = _model_state(model)
  saved = [tf.identity(v) for v in state]
  seed_ids = _keras_seed_states(model)

  def restore(include_seed_states: bool):
    for v, value in zip(state, saved):
      if include_seed_states or id(v) not in seed_ids:
        v.assign(value)

  def run(inputs, labels):
    restore(include_seed_states=seed is not None)
    if seed is not None:
      _reseed(seed)
    return _independence_pass(loss_fn, model, variables, inputs, labels,
                              training, mode, gradients)

  exits, traceable = _forward_exits(loss_fn, model, x, y, training,
                                    variables if gradients else ())
  if not traceable and mode != "eager":  # the runs could not trace either
    return _report(ExampleIndependenceResult(
        indices=indices, moved=(), max_loss_change=0.0,
        max_gradient_change=0.0, loss_tolerance=0.0, gradient_tolerance=0.0,
        changed_loss_change=0.0, changed_gradient_change=0.0, details=(),
        exits=exits), b_total, change, mode, training, seed,
        raise_on_failure)
  rng = np.random.default_rng(0 if seed is None else seed)
  names = _names(variables)
  try:
    loss_dtype, loss0, grads0 = run(x, y)
    moved, details = [], []
    max_dl = max_dg = ltol_max = gtol_max = 0.0
    own_dl, own_dg = float("inf"), float("inf")
    for i in indices:
      j = (i + 1) % b_total if source is None else int(source)
      if callable(change):
        x1, y1 = change(x, y, i)
        x1, y1 = as_tensors(x1), as_tensors(y1)
        x_changed = any(not np.array_equal(np.asarray(a), np.asarray(b))
                        for a, b in zip(tf.nest.flatten(x1),
                                        tf.nest.flatten(x)))
        y_changed = y is not None and any(
            not np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(tf.nest.flatten(y1), tf.nest.flatten(y)))
      else:
        x1, x_changed = _change_batch(x, i, j, change, rng, b_total, "x")
        y1, y_changed = (_change_batch(y, i, j, change, rng, b_total, "y")
                         if change_labels and y is not None else (y, False))
      if not (x_changed or y_changed):
        raise ValueError(
            f"Changing example {i} left the batch unchanged (its rows equal "
            f"example {j}'s?): the check would prove nothing. Choose another "
            "`index`, `source` or `change`.")
      _, loss1, grads1 = run(x1, y1)

      dl = _abs_change(loss1, loss0)
      lscale = _finite_max(loss0, loss1)
      lrtol = _INDEPENDENCE_RTOL.get(loss_dtype, 1e-5) if (
          rtol is None) else rtol
      ltol = atol + lrtol * lscale
      if gradients:
        gscale = _finite_max(*grads0, *grads1)
        grtol = (max(_INDEPENDENCE_RTOL.get(_variable_dtype(v), 1e-5)
                     for v in variables) if rtol is None else rtol)
        gtol = atol + grtol * gscale
        # [B, V]: the largest entry change per example and variable.
        dg = np.stack([
            np.max(np.reshape(_abs_change(g1, g0), [b_total, -1]), axis=1)
            if g0.size else np.zeros([b_total])
            for g0, g1 in zip(grads0, grads1)], axis=1)
      else:
        gtol = 0.0
        dg = np.zeros([b_total, 1])
      ltol_max, gtol_max = max(ltol_max, ltol), max(gtol_max, gtol)
      own_dl = min(own_dl, float(dl[i]))
      own_dg = min(own_dg, float(np.max(dg[i])) if dg.size else 0.0)
      for b in range(b_total):
        if b == i:
          continue
        db = float(np.max(dg[b])) if dg.size else 0.0
        max_dl, max_dg = max(max_dl, float(dl[b])), max(max_dg, db)
        loss_moved = not dl[b] <= ltol
        grad_moved = gradients and not db <= gtol
        if not (loss_moved or grad_moved):
          continue
        moved.append((i, b))
        parts = [f"loss {loss0[b]:.6g} -> {loss1[b]:.6g} (|change| "
                 f"{dl[b]:.3g}{' > ' if loss_moved else ' <= '}tolerance "
                 f"{ltol:.3g})"]
        if gradients:
          v = int(np.argmax(dg[b]))
          parts.append(f"gradient max |change| {db:.3g}"
                       f"{' > ' if grad_moved else ' <= '}tolerance "
                       f"{gtol:.3g} (largest at {names[v]})")
        details.append(f"changing example {i} moved example {b}: " +
                       "; ".join(parts))
    # The unchanged batch again, after the changed ones: an output that
    # moved depends on an earlier call (state outside the variables, e.g. a
    # tensor kept on a layer), which eager training would carry from one
    # batch into the next.
    _, loss2, grads2 = run(x, y)
    history = max([float(np.max(_abs_change(loss2, loss0)))
                   / max(ltol_max, np.finfo(np.float64).tiny)] +
                  [float(np.max(_abs_change(g2, g0)))
                   / max(gtol_max, np.finfo(np.float64).tiny)
                   for g0, g2 in zip(grads0, grads2) if g0.size])
    if history > 1.0:
      exits = exits + (
          "exit: the same batch gave other losses or gradients after the "
          f"changed batches ({history:.3g} times the tolerance): the model "
          "keeps a value from an earlier call outside its variables (a "
          "tensor kept on a layer?), which would carry one batch's examples "
          "into the next step's gradients",)
  finally:
    restore(include_seed_states=True)

  return _report(ExampleIndependenceResult(
      indices=indices, moved=tuple(moved), max_loss_change=max_dl,
      max_gradient_change=max_dg, loss_tolerance=ltol_max,
      gradient_tolerance=gtol_max, changed_loss_change=own_dl,
      changed_gradient_change=own_dg if gradients else 0.0,
      details=tuple(details), exits=exits), b_total, change, mode,
      training, seed, raise_on_failure)


def _report(result: ExampleIndependenceResult, b_total: int, change, mode,
            training, seed, raise_on_failure: bool
            ) -> ExampleIndependenceResult:
  """`result`, or raises `ExampleMixingError` for its moved examples and
  exits when `raise_on_failure`."""
  if result.passed or not raise_on_failure:
    return result
  parts = []
  if result.moved:
    moved_examples = sorted({b for _, b in result.moved})
    parts.append(
        f"Examples mix: changing example(s) {list(result.indices)} "
        f"({'by `change`' if callable(change) else change}) moved the loss "
        f"or gradient of example(s) {moved_examples} of {b_total} (mode "
        f"{mode!r}, training={training}, seed={seed}). For DP-SGD, example "
        "b's loss must depend on example b alone; look for layers that "
        "compute over the batch axis (BatchNormalization in training, "
        "MixUp/CutMix, batch statistics, tf.roll/reverse/sort/gather over "
        "axis 0, in-batch negatives).\n  " + "\n  ".join(result.details))
  if result.exits:
    parts.append(
        "The forward pass has an exit besides its outputs (a value read or "
        "kept in Python lets one example change the others' gradients, "
        "unseen by the recorded computation; docs/threat_model.md, \"The "
        "forward pass is closed: eager mode\"):\n  " +
        "\n  ".join(result.exits))
  raise ExampleMixingError("\n".join(parts), result)
