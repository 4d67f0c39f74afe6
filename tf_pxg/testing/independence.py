"""`check_example_independence`: change one example, check with a plain
`tf.GradientTape` that no other example's loss or gradient moves.

The check runs in named stages:

1. `_check_arguments` and `_prepare`: the batch size, the examples to
   change, the variables and the loss; the model is built.
2. `_forward_exits`: the exits that the traced forward pass shows.
3. The changes. `_run_search` runs the default search, whose changes are
   in `independence_changes.py`. `_run_changes` runs an explicit change.
   The runs themselves are in `independence_runs.py`, and `_Tally`
   compares them.
4. `_history_exits`: the unchanged batch is run again.
5. `_report`: returns the result, or raises `ExampleMixingError`.
"""

from __future__ import annotations

import functools

from typing import (Any, Callable, List, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.interface import value_shapes
from tf_pxg.testing import independence_changes as changes_lib
from tf_pxg.testing import independence_runs as runs
from tf_pxg.testing.reference import _batch_size, _per_example_loss
from tf_pxg.testing.tolerances import MODES, _names, _variable_dtype


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

# The changes (`change=`): "search" (the default) and the explicit ones.
CHANGES = changes_lib.CHANGES


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
      when gradients were not checked. Under the search, a change whose
      screen moved nothing adds the largest entry change of the screen's
      random combination of the other examples' gradients instead (the
      tolerances likewise).
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
    changes: one line per change made (which example, which direction,
      what it set), in order.
    skipped: one line per change the search dropped: one the model could
      not run (an id it refuses), or one whose gradients could not be
      compared (the changed example's own gradient not finite).
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
  changes: Tuple[str, ...] = ()
  skipped: Tuple[str, ...] = ()

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


def _abs_change(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """|a - b|, 0 where both are equal (inf == inf) or both NaN, inf where
  only one is NaN."""
  a, b = np.atleast_1d(a), np.atleast_1d(b)  # a scalar variable's gradient
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
    if any(phrase in text for phrase in value_shapes.VALUE_SHAPE_PHRASES):
      return (f"exit: a shape counts the examples' values ({text[:400]}); "
              "DP training refuses it",)
  except Exception:  # pylint: disable=broad-except
    pass  # not this check's kind of exit; the empirical check decides
  return ()


class _Tally:
  """What the changes measured so far: the result's fields."""

  def __init__(self, setup: runs.Setup):
    self.setup = setup
    self.moved: List[Tuple[int, int]] = []
    self.details: List[str] = []
    self.changes: List[str] = []
    self.skipped: List[str] = []
    self.max_dl = self.max_dg = self.ltol = self.gtol = 0.0
    self.own_dl, self.own_dg = {}, {}  # per changed example: the largest
    # `(rerun, reference)`: the unchanged batch's run, rerun after the
    # changes (see `_history_exits`).
    self.history: Optional[Tuple[Callable[[], runs.Pass], runs.Pass]] = None

  def _own(self, i: int, dl: float, dg: float) -> None:
    self.own_dl[i] = max(self.own_dl.get(i, 0.0), dl)
    self.own_dg[i] = max(self.own_dg.get(i, 0.0), dg)

  def _tolerances(self, loss_dtype, losses, grads) -> Tuple[float, float]:
    """`atol + rtol * scale` for the losses and the gradients, the scale
    being the largest finite |entry| of `losses` / `grads`."""
    setup = self.setup
    lrtol = (_INDEPENDENCE_RTOL.get(loss_dtype, 1e-5) if setup.rtol is None
             else setup.rtol)
    ltol = setup.atol + lrtol * _finite_max(*losses)
    gtol = 0.0
    if setup.gradients:
      grtol = (max(_INDEPENDENCE_RTOL.get(_variable_dtype(v), 1e-5)
                   for v in setup.variables) if setup.rtol is None
               else setup.rtol)
      gtol = setup.atol + grtol * _finite_max(*grads)
    self.ltol, self.gtol = max(self.ltol, ltol), max(self.gtol, gtol)
    return ltol, gtol

  def full(self, i: int, p0: runs.Pass, p1: runs.Pass, label: str = "",
           search: bool = False) -> bool:
    """Compares two full passes (example `i` changed in `p1`); records each
    other example that moved; True if any did. Under the search the scales
    leave the changed example out (its extreme values would widen the
    tolerance) and gradients whose own gradient is not finite are not
    compared (0 * inf in the batch's backward pass spreads NaN)."""
    setup, b_total = self.setup, self.setup.b_total
    keep = [b for b in range(b_total) if b != i] if search else slice(None)
    ltol, gtol = self._tolerances(
        p0.loss_dtype, (p0.losses[keep], p1.losses[keep]),
        [g[keep] for g in p0.grads + p1.grads])
    dl = _abs_change(p1.losses, p0.losses)
    dg = _entry_changes(setup, p0.grads, p1.grads)
    compare_grads = setup.gradients and not (search and not all(
        np.all(np.isfinite(g[i])) for g in p1.grads))
    if setup.gradients and not compare_grads:
      self.skipped.append(f"{label}: gradients not compared (example {i}'s "
                          "own gradient is not finite)")
    self._own(i, float(dl[i]), float(np.max(dg[i])) if dg.size else 0.0)
    found = False
    for b in (b for b in range(b_total) if b != i):
      db = float(np.max(dg[b])) if dg.size and compare_grads else 0.0
      self.max_dl, self.max_dg = max(self.max_dl, float(dl[b])), max(
          self.max_dg, db)
      loss_moved = not dl[b] <= ltol
      grad_moved = compare_grads and not db <= gtol
      if loss_moved or grad_moved:
        found = True
        if (i, b) not in self.moved:
          self.moved.append((i, b))
        self.details.append(_detail(
            setup, (i, b), (p0.losses[b], p1.losses[b], dl[b], ltol,
                            loss_moved), (db, dg[b], gtol, grad_moved),
            label))
    return found

  def screen(self, i: int, s0: runs.Pass, s1: runs.Pass, label: str) -> bool:
    """Compares two screens of example `i`'s change (`runs.screen_pass`): True
    when another example's loss, or the weighted sum of the other
    examples' gradients, moved (for full passes to confirm and name)."""
    setup = self.setup
    n = len(setup.variables) if setup.gradients else 0
    others0, own0 = s0.grads[:n], s0.grads[n:]
    others1, own1 = s1.grads[:n], s1.grads[n:]
    keep = [b for b in range(setup.b_total) if b != i]
    ltol, gtol = self._tolerances(
        s0.loss_dtype, (s0.losses, s1.losses[keep]),
        others0 + others1 + own0)
    dl = _abs_change(s1.losses, s0.losses)
    self._own(i, float(dl[i]), _largest_change(own0, own1))
    own_finite = all(np.all(np.isfinite(g)) for g in own1)
    if setup.gradients and not own_finite:
      self.skipped.append(f"{label}: gradients not compared (example {i}'s "
                          "own gradient is not finite)")
    dg = _largest_change(others0, others1) if own_finite else 0.0
    dl_others = float(np.max(dl[keep]))
    self.max_dl, self.max_dg = max(self.max_dl, dl_others), max(
        self.max_dg, dg)
    return not (dl_others <= ltol and dg <= gtol)

  def result(self, indices, exits) -> ExampleIndependenceResult:
    gradients = self.setup.gradients
    return ExampleIndependenceResult(
        indices=tuple(indices), moved=tuple(self.moved),
        max_loss_change=self.max_dl, max_gradient_change=self.max_dg,
        loss_tolerance=self.ltol, gradient_tolerance=self.gtol,
        changed_loss_change=min(self.own_dl.get(i, 0.0) for i in indices),
        changed_gradient_change=min(self.own_dg.get(i, 0.0)
                                    for i in indices) if gradients else 0.0,
        details=tuple(self.details), exits=tuple(exits),
        changes=tuple(self.changes), skipped=tuple(self.skipped))


def _largest_change(before: Sequence[np.ndarray],
                    after: Sequence[np.ndarray]) -> float:
  return max([float(np.max(_abs_change(a, b)))
              for a, b in zip(after, before) if a.size], default=0.0)


def _entry_changes(setup: runs.Setup, grads0, grads1) -> np.ndarray:
  """`[B, V]`: the largest entry change per example and variable."""
  b_total = setup.b_total
  if not setup.gradients:
    return np.zeros([b_total, 1])
  return np.stack([
      np.max(np.reshape(_abs_change(g1, g0), [b_total, -1]), axis=1)
      if g0.size else np.zeros([b_total])
      for g0, g1 in zip(grads0, grads1)], axis=1)


def _detail(setup: runs.Setup, pair, loss, grad, label: str) -> str:
  """The failure message's line for one moved example."""
  (i, b), (before, after, dl, ltol, loss_moved) = pair, loss
  db, dgb, gtol, grad_moved = grad
  parts = [f"loss {before:.6g} -> {after:.6g} (|change| "
           f"{dl:.3g}{' > ' if loss_moved else ' <= '}tolerance "
           f"{ltol:.3g})"]
  if setup.gradients:
    v = int(np.argmax(dgb))
    parts.append(f"gradient max |change| {db:.3g}"
                 f"{' > ' if grad_moved else ' <= '}tolerance "
                 f"{gtol:.3g} (largest at {setup.names[v]})")
  line = f"changing example {i} moved example {b}: " + "; ".join(parts)
  return line + (f" [{label}]" if label else "")


def _as_tensors(nest):
  return None if nest is None else tf.nest.map_structure(
      tf.convert_to_tensor, nest)


def _differs(new, old) -> bool:
  return old is not None and any(
      not np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(tf.nest.flatten(new), tf.nest.flatten(old)))


def _explicit_change(setup: runs.Setup, change, i: int, j: int,
                     rng: np.random.Generator, change_labels: bool):
  """`(x1, y1, changed)`: the batch with example `i` changed by `change`
  ("perturb", "swap" or the user's callable)."""
  x, y = setup.x, setup.y
  if callable(change):
    x1, y1 = change(x, y, i)
    x1, y1 = _as_tensors(x1), _as_tensors(y1)
    return x1, y1, _differs(x1, x) or _differs(y1, y)
  x1, x_changed = changes_lib.change_batch(x, i, j, change, rng,
                                           setup.b_total, "x")
  y1, y_changed = (changes_lib.change_batch(y, i, j, change, rng,
                                            setup.b_total, "y")
                   if change_labels and y is not None else (y, False))
  return x1, y1, x_changed or y_changed


def _run_changes(setup: runs.Setup, runner: runs.Runner, tally: _Tally, indices,
                 change, source: Optional[int], rng: np.random.Generator,
                 change_labels: bool) -> None:
  """The explicit change: each example of `indices` changed once, full
  per-example losses and gradients compared against one unchanged run."""
  p0 = runner.full(setup.x, setup.y)
  tally.history = (lambda: runner.full(setup.x, setup.y), p0)
  for i in indices:
    j = (i + 1) % setup.b_total if source is None else int(source)
    x1, y1, changed = _explicit_change(setup, change, i, j, rng,
                                       change_labels)
    if not changed:
      raise ValueError(
          f"Changing example {i} left the batch unchanged (its rows equal "
          f"example {j}'s?): the check would prove nothing. Choose another "
          "`index`, `source` or `change`.")
    tally.changes.append(
        f"{'`change`' if callable(change) else change}: example {i}")
    tally.full(i, p0, runner.full(x1, y1))


def _first_that_runs(runner: runs.Runner, tally: _Tally, variants, weights):
  """`(change, screen)` for the first variant the model runs, or None (the
  model refused them all: an id out of its range...)."""
  errors = []
  for change in variants:
    try:
      return change, runner.screen(change.x, change.y, change.index, weights)
    except (tf.errors.OpError, ValueError, TypeError) as e:
      errors.append(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
  tally.skipped.append(
      f"{variants[0].direction}: example {variants[0].index}: the model "
      f"refused every form of the change ({'; '.join(errors)})")
  return None


def _run_search(setup: runs.Setup, runner: runs.Runner, tally: _Tally, indices,
                source: Optional[int], rng: np.random.Generator,
                change_labels: bool) -> None:
  """The default search (`independence_changes`): each example of
  `indices` changed in each direction, screened cheaply; a screen that
  moved is confirmed with full per-example passes, which name the moved
  examples; an example's remaining directions are skipped once one of its
  changes moved another example."""
  ranges = changes_lib.id_ranges(setup.model)
  baselines, failed, full0 = {}, set(), []
  for i, _, variants in changes_lib.search_changes(
      setup.x, setup.y, indices, source, setup.b_total, rng, ranges,
      change_labels):
    if i in failed:
      continue
    if i not in baselines:
      weights = rng.uniform(0.5, 1.5, setup.b_total)
      weights[i] = 0.0
      baselines[i] = (weights, runner.screen(setup.x, setup.y, i, weights))
      if tally.history is None:
        tally.history = (functools.partial(runner.screen, setup.x, setup.y,
                                           i, weights), baselines[i][1])
    weights, s0 = baselines[i]
    tried = _first_that_runs(runner, tally, variants, weights)
    if tried is None:
      continue
    change, s1 = tried
    label = changes_lib.describe(change, setup.x)
    tally.changes.append(label)
    if tally.screen(i, s0, s1, label):
      if not full0:
        full0.append(runner.full(setup.x, setup.y))
      if tally.full(i, full0[0], runner.full(change.x, change.y), label,
                    search=True):
        failed.add(i)
  if not tally.changes:
    raise ValueError(
        "The search could not change the batch (every example equal, or "
        "every change refused by the model): the check would prove "
        "nothing. Pass `change=` (a callable) or another batch."
        + ("".join("\n  " + s for s in tally.skipped)))


def _history_exits(tally: _Tally) -> Tuple[str, ...]:
  """The unchanged batch again, after the changed ones: an output that
  moved depends on an earlier call (state outside the variables, e.g. a
  tensor kept on a layer), which eager training would carry from one
  batch into the next."""
  if tally.history is None:
    return ()
  rerun, reference = tally.history
  again = rerun()
  tiny = np.finfo(np.float64).tiny
  history = max(
      [float(np.max(_abs_change(again.losses, reference.losses)))
       / max(tally.ltol, tiny)] +
      [float(np.max(_abs_change(g2, g0))) / max(tally.gtol, tiny)
       for g0, g2 in zip(reference.grads, again.grads) if g0.size])
  if history <= 1.0:
    return ()
  return (
      "exit: the same batch gave other losses or gradients after the "
      f"changed batches ({history:.3g} times the tolerance): the model "
      "keeps a value from an earlier call outside its variables (a "
      "tensor kept on a layer, a variable or table written from the "
      "data?), which would carry one batch's examples into the next "
      "step's gradients",)


def _check_arguments(x, index, source, change, mode):
  """`(B, the examples to change)`; None: the search chooses them."""
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
  if not callable(change) and change not in CHANGES:
    raise ValueError(f"Unknown change {change!r}; expected one of {CHANGES} "
                     "or a callable change(x, y, index) -> (x, y).")
  b_total = _batch_size(x)
  if b_total < 2:
    raise ValueError(f"The batch has {b_total} example(s); checking that "
                     "examples do not mix needs at least 2.")
  if index is None:
    indices = None if change == "search" else (0,)
  elif isinstance(index, (int, np.integer)):
    indices = (int(index),)
  else:
    indices = tuple(int(i) for i in index)
    if not indices:
      raise ValueError("`index` is empty: no example to change.")
  for i in (indices or ()) + (() if source is None else (int(source),)):
    if not 0 <= i < b_total:
      raise ValueError(f"Example {i} is out of range for a batch of "
                       f"{b_total}.")
  return b_total, indices


def _resolve_loss(model, loss, sample_weight) -> Callable:
  if loss is not None:
    return loss
  if _compat.compile_loss(model) is None:
    raise ValueError(
        "No loss: pass `loss=` (a callable loss(y_true, y_pred) -> [B]) "
        "or compile the model with a loss.")
  from tf_pxg.keras.losses import per_example_losses  # pylint: disable=g-import-not-at-top

  def loss_fn(labels, outputs):
    return per_example_losses(model, labels, outputs, sample_weight)
  return loss_fn


def _prepare(model, x, y, *, loss, sample_weight, variables, training,
             mode, gradients, rtol, atol, b_total) -> runs.Setup:
  """The variables, the loss and the batch as tensors; builds the model."""
  if variables is None:
    variables = getattr(model, "trainable_variables", None)
    if variables is None:
      raise ValueError("`model` has no `trainable_variables`: pass "
                       "`variables=`.")
  variables = list(variables)
  loss_fn = _resolve_loss(model, loss, sample_weight)
  x, y = _as_tensors(x), _as_tensors(y)
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
  return runs.Setup(model, loss_fn, variables, x, y, training, mode, gradients,
                b_total, rtol, atol, _names(variables))


def check_example_independence(
    model: Callable,
    x: Any,
    y: Any = None,
    *,
    loss: Optional[Callable] = None,
    sample_weight: Any = None,
    variables: Optional[Sequence[Any]] = None,
    index: Union[int, Sequence[int], None] = None,
    change: Union[str, Callable] = "search",
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
  (`z_a @ z_b^T` logits), and a statistic of the batch at any argument of
  any op: a one-hot depth or a slice bound from the batch's largest id or
  longest sequence, a `tf.where` condition, tile multiples, a broadcast
  shape, a bincount width, a random seed, state written and read back (in
  a `tf.cond` branch, a `tf.lookup` table), a ragged row partition across
  examples (sequence packing).

  The default search (`change="search"`) needs no outlier planted in the
  batch: example 0 and the examples holding the batch's extremes (largest
  value, longest sequence, smallest value; at most 3) are each changed in
  five directions, one at a time: "perturb" (Gaussian noise), "swap"
  (another example's rows), "high" (floats +100 * max|x|; integer ids the
  largest the model's Embedding / CategoryEncoding layers accept, or one
  above the batch's largest; every position, so a padded sequence becomes
  full length), "low" (floats -100 * max|x|; id 1 everywhere) and "zeros"
  (an all-padding example); labels move the same way (integer labels
  within the model's output classes). A change the model refuses (an id
  out of its range) falls back to the batch's largest id, or is skipped
  (`result.skipped`). Each change is screened cheaply (the losses, and the
  gradient of a random positive combination of the OTHER examples'
  losses: two backward passes, not B); a screen that moved is confirmed
  with full per-example passes, which name the moved examples (and the
  change, in brackets). On small models the search takes a second or
  two eagerly; in "function"/"jit" modes each run traces anew.

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
  global Python/NumPy/TF seeds are left set to `seed`. State outside the
  Keras variables (a `tf.lookup` table, a `tf.Variable` the model holds
  untracked) is not restored: if the data writes it, the runs differ.

  Exits: the forward pass must have no exit besides its outputs, in every
  mode (docs/threat_model.md, "The forward pass is closed: eager mode").
  Before the runs, the per-example loss is traced once into a graph as the
  DP train step traces it (a Keras model without autograph, as Keras
  does), whatever `mode`: a Python read of a tensor (an `if` on a batch
  statistic, `.numpy()`) fails there, and `tf.numpy_function` /
  `tf.py_function` show as Python ops; each is an exit, found whatever the
  change. After the changed runs the unchanged batch is run again: if its
  losses or gradients moved, the model keeps a value from an earlier call
  outside its variables (a tensor kept on a layer, a table written from
  the data), an exit too. In "function" and "jit" modes a model whose
  trace fails is not run: the result holds the exit alone. Tracing calls
  the model's Python once without running it (a layer that writes Python
  attributes at trace time does so).

  Contract: the batch is axis 0 of every tensor of `x`, `y` and
  `sample_weight` (B >= 2, static), the per-example loss is a `[B]` vector;
  `x` and `y` are concrete values (numpy arrays or eager tensors: call the
  check eagerly, `mode` says how the model runs).

  The change (`change`):
    * "search" (default): the search above.
    * "perturb": every floating tensor of example `index` gets Gaussian
      noise scaled to that tensor's standard deviation over the batch
      (seeded by `seed`); integer, boolean and string tensors (token ids,
      categories, class labels) take example `source`'s row instead.
    * "swap": every tensor of example `index` takes example `source`'s row.
    * a callable `change(x, y, index) -> (x, y)` returning the changed batch.
    Labels are changed too when `change_labels` (default); `sample_weight`
    never is.

  Caveat: an empirical check only finds the mixing that its changes
  exercise, on this batch, with this randomness. It is a complement to a
  static check of the model's ops, not a proof: e.g. a random permutation
  (MixUp) that maps every changed example to itself in this draw, mixing
  only in branches no change takes, or a statistic no direction moves,
  pass. Check several batches, `index` values and seeds for more
  confidence; `changed_loss_change` > 0 shows the changes reached the
  model at all.

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
      in its own run, against one unchanged run); default (None): the
      search's choice, or example 0 for the other changes.
    change: "search", "perturb", "swap" or a callable (see above).
    source: the example whose rows replace example `index`'s ("swap", and
      non-floating tensors under "perturb"); default `(index + 1) % B`.
    change_labels: change example `index`'s labels too.
    gradients: also compare per-example gradients; False compares losses
      only.
    training: passed as `training=` to `model` (None: not passed).
    seed: the seed set before each run, and of the perturbation; None
      re-seeds nothing and does not restore the random layers' states
      between the runs (random layers then draw differently: the check is
      expected to fail on them).
    mode: "eager", "function" (`tf.function`) or "jit" (XLA).
    rtol: tolerance relative to the scale of the compared quantity (the
      largest |loss| of the batch in either run for losses; the largest
      per-example gradient entry over all the variables for gradients;
      under the search, without the changed example's); default by dtype
      (float32 1e-5, float64 1e-12, float16 1e-3, bfloat16 1e-2). Examples
      that do not mix are normally bit-identical between the two runs.
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
  b_total, indices = _check_arguments(x, index, source, change, mode)
  setup = _prepare(model, x, y, loss=loss, sample_weight=sample_weight,
                   variables=variables, training=training, mode=mode,
                   gradients=gradients, rtol=rtol, atol=atol,
                   b_total=b_total)
  if indices is None:
    indices = changes_lib.search_indices(setup.x, setup.y, b_total)
  report = functools.partial(_report, b_total=b_total, change=change,
                             mode=mode, training=training, seed=seed,
                             raise_on_failure=raise_on_failure)
  exits, traceable = _forward_exits(setup.loss_fn, model, setup.x, setup.y,
                                    training,
                                    setup.variables if gradients else ())
  tally = _Tally(setup)
  if not traceable and mode != "eager":  # the runs could not trace either
    return report(tally.result(indices, exits))
  runner = runs.Runner(setup, seed)
  rng = np.random.default_rng(0 if seed is None else seed)
  try:
    if change == "search":
      _run_search(setup, runner, tally, indices, source, rng, change_labels)
    else:
      _run_changes(setup, runner, tally, indices, change, source, rng,
                   change_labels)
    exits = exits + _history_exits(tally)
  finally:
    runner.restore(include_seed_states=True)
  return report(tally.result(indices, exits))


def _report(result: ExampleIndependenceResult, *, b_total: int, change,
            mode, training, seed, raise_on_failure: bool
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
        "axis 0, in-batch negatives) and for a statistic of the batch at "
        "an op's argument (a depth, slice bound, condition, size, seed or "
        "row partition from the batch's largest id or longest sequence; "
        "state written from the data and read back).\n  " +
        "\n  ".join(result.details))
  if result.exits:
    parts.append(
        "The forward pass has an exit besides its outputs (a value read or "
        "kept in Python lets one example change the others' gradients, "
        "unseen by the recorded computation; docs/threat_model.md, \"The "
        "forward pass is closed: eager mode\"):\n  " +
        "\n  ".join(result.exits))
  raise ExampleMixingError("\n".join(parts), result)
