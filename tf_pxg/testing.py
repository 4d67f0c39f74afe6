"""Reference checks for per-example gradients (for rule and layer authors).

`reference_per_example_gradients` is the ground truth: a plain
`tf.GradientTape` loop that runs the model on one example at a time (a batch
of one, sliced out of axis 0) and stacks the gradients. It knows nothing of
tf_pxg, so it is slow but obviously right.

`check_per_example_gradients` runs tf_pxg's three per-example questions
(`per_example_gradient`, `per_example_norms`, `clipped_gradient_sum`) on the
whole batch, eagerly, in a `tf.function` or under XLA, and compares them with
the quantities derived from the reference:

* norms: `n_b = sqrt(sum over variables of ||g_b||^2)` (flat, global L2);
* clipped sum: `sum_b min(1, C / n_b) g_b` per variable.

Use it to test a rule you registered with `tf_pxg.register` or a layer of
your own:

    err = tf_pxg.testing.check_per_example_gradients(
        keras.losses.SparseCategoricalCrossentropy(reduction="none"),
        model, model.trainable_variables, x, labels=y, mode="jit")

Warning:
  The contract is that of DP-SGD: the batch is axis 0 of every input and
  label, the loss is a `[B]` vector of per-example losses, and example b's
  loss depends on example b alone (no batch normalisation in training, no
  dropout or other randomness, which would also break the comparison).

References:
  Opacus, `opacus.utils.tensor_utils` / `check_per_sample_gradients_are_correct`
  (the batch-of-one loop as a reference).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import indexed_slices

MODES = ("eager", "function", "jit")

# Default (rtol, atol) by the variables' dtype.
_DEFAULT_TOLERANCES = {
    tf.float16: (1e-2, 1e-3),
    tf.bfloat16: (2e-2, 1e-2),
    tf.float32: (1e-4, 1e-6),
    tf.float64: (1e-10, 1e-12),
}


def _batch_size(inputs) -> int:
  flat = tf.nest.flatten(inputs)
  if not flat:
    raise ValueError("`inputs` is empty; it must hold at least one tensor "
                     "with the batch on axis 0.")
  b = tf.convert_to_tensor(flat[0]).shape[0]
  if b is None:
    raise ValueError("The batch size (axis 0 of the inputs) must be static.")
  return int(b)


def _slice(nest, b: int):
  """Example b of every tensor of `nest` as a batch of one (axis 0)."""
  if nest is None:
    return None
  return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[b:b + 1],
                               nest)


def _variable_dtype(v) -> tf.DType:
  return tf.as_dtype(v.dtype)


def _per_example_loss(loss_fn: Optional[Callable], model_or_fn: Callable,
                      inputs, labels, training: Optional[bool]):
  """Calls the model and the loss; checks the `[B]` contract."""
  kwargs = {} if training is None else {"training": training}
  outputs = model_or_fn(inputs, **kwargs)
  if loss_fn is None:
    losses = outputs
  elif labels is None:
    losses = loss_fn(outputs)
  else:
    losses = loss_fn(labels, outputs)
  losses = tf.convert_to_tensor(losses)
  b = _batch_size(inputs)
  if losses.shape.rank != 1 or (losses.shape[0] is not None and
                                losses.shape[0] != b):
    raise ValueError(
        f"The per-example loss must have shape [B] = [{b}] (one value per "
        f"example, batch on axis 0); got shape {losses.shape}. Use a Keras "
        "loss with reduction='none', or reduce the non-batch axes yourself.")
  return losses


def _dense(g, like):
  if g is None:
    return tf.zeros(like.shape, _variable_dtype(like))
  if isinstance(g, indexed_slices.IndexedSlices):
    return tf.convert_to_tensor(g)
  return g


def reference_per_example_gradients(
    loss_fn: Optional[Callable],
    model_or_fn: Callable,
    variables: Sequence[Any],
    inputs: Any,
    labels: Any = None,
    training: Optional[bool] = None,
) -> List[tf.Tensor]:
  """Per-example gradients by a `tf.GradientTape` loop over single examples.

  For each b, example b is sliced out of axis 0 of every tensor in `inputs`
  (and `labels`) as a batch of one, the loss is computed and differentiated
  with a plain `tf.GradientTape`, eagerly. Unconnected variables get zeros and
  `tf.IndexedSlices` (gathers) are densified.

  Args:
    loss_fn: `loss_fn(labels, outputs)` (or `loss_fn(outputs)` when `labels`
      is None) returning per-example losses of shape `[B]`, e.g. a Keras loss
      with `reduction="none"`; None if `model_or_fn` returns them itself.
    model_or_fn: a Keras model/layer or function called as
      `model_or_fn(inputs)` (plus `training=` if given).
    variables: the tf/Keras variables to differentiate.
    inputs: a tensor or nest of tensors, the batch on axis 0 of each.
    labels: None, or a tensor/nest with the batch on axis 0.
    training: if not None, passed as `training=` to `model_or_fn`.

  Returns:
    One tensor per variable, of shape `[B, *variable.shape]` and the
    variable's dtype.
  """
  variables = list(variables)
  b_total = _batch_size(inputs)
  per_var: List[List[tf.Tensor]] = [[] for _ in variables]
  for b in range(b_total):
    with tf.GradientTape() as tape:
      loss = _per_example_loss(loss_fn, model_or_fn, _slice(inputs, b),
                               _slice(labels, b), training)
      loss = tf.reduce_sum(loss)
    grads = tape.gradient(loss, variables)
    for i, (g, v) in enumerate(zip(grads, variables)):
      per_var[i].append(tf.cast(_dense(g, v), _variable_dtype(v)))
  return [tf.stack(gs) if gs else tf.zeros([0] + list(v.shape),
                                           _variable_dtype(v))
          for gs, v in zip(per_var, variables)]


def _numpy(t) -> np.ndarray:
  if t is None:
    return None
  if isinstance(t, indexed_slices.IndexedSlices):
    t = tf.convert_to_tensor(t)
  return np.asarray(tf.cast(t, tf.float64).numpy(), dtype=np.float64)


def _compare(name: str, actual, expected: np.ndarray, rtol: float,
             atol: float, per_example: bool) -> tuple:
  """(relative error, message or None) for one quantity.

  An array passes when `|actual - expected| <= atol + rtol * max|expected|`
  elementwise (a normwise tolerance, so tiny entries are not held to a
  relative bound); the reported relative error is
  `rtol * max|actual - expected| / (atol + rtol * max|expected|)`, which is
  about `max|actual - expected| / max|expected|` and at most rtol iff the
  array passes.
  """
  if actual is None:
    actual = np.zeros_like(expected)
  actual = np.asarray(actual, dtype=np.float64)
  if actual.shape != expected.shape:
    return float("inf"), (f"{name}: shape {actual.shape}, expected "
                          f"{expected.shape}")
  if actual.size == 0:
    return 0.0, None
  if not np.all(np.isfinite(actual)):
    return float("inf"), f"{name}: non-finite values {actual.ravel()[:8]}"
  diff = np.abs(actual - expected)
  scale = float(np.max(np.abs(expected)))
  max_diff = float(np.max(diff))
  allowed = atol + rtol * scale
  # In units of rtol: <= rtol iff the check passes; ~max_diff / scale unless
  # the tensor is at rounding level (a gradient that is zero in exact
  # arithmetic), where atol dominates.
  rel = rtol * max_diff / allowed if allowed > 0 else (
      0.0 if max_diff == 0 else float("inf"))
  if max_diff <= allowed:
    return rel, None
  where = np.unravel_index(int(np.argmax(diff)), diff.shape)
  detail = f"at index {tuple(int(i) for i in where)}"
  if per_example and diff.ndim:
    worst = [float(np.max(diff[b])) for b in range(diff.shape[0])]
    detail += f" (example {int(where[0])}; max |diff| per example {worst})"
  return rel, (f"{name}: max |actual - expected| = {max_diff:.3g} {detail}, "
               f"relative {rel:.3g} > rtol {rtol:g} (atol {atol:g}, "
               f"max |expected| = {scale:.3g}); actual "
               f"{actual[where]:.6g}, expected {expected[where]:.6g}")


def _run_tf_pxg(loss_fn, model_or_fn, variables, inputs, labels, training,
                l2_norm_clip, mode: str) -> Dict[str, Any]:
  """tf_pxg's three quantities, each from a fresh (non-persistent) tape."""
  from tf_pxg.tape.gradient_tape import GradientTape  # pylint: disable=g-import-not-at-top

  # The model may rely on autograph; tf_pxg's backward passes need none.
  plain = tf.autograph.experimental.do_not_convert

  def compute(inputs, labels):
    out = {}
    with GradientTape() as tape:
      losses = _per_example_loss(loss_fn, model_or_fn, inputs, labels,
                                 training)
    out["per_example_gradient"] = plain(tape.per_example_gradient)(
        losses, variables, unconnected_gradients="zero")
    with GradientTape() as tape:
      losses = _per_example_loss(loss_fn, model_or_fn, inputs, labels,
                                 training)
    out["per_example_norms"] = plain(tape.per_example_norms)(losses,
                                                             variables)
    with GradientTape() as tape:
      losses = _per_example_loss(loss_fn, model_or_fn, inputs, labels,
                                 training)
    sums, norms = plain(tape.clipped_gradient_sum)(losses, variables,
                                                   l2_norm_clip)
    out["clipped_gradient_sum"] = [
        tf.zeros(v.shape, _variable_dtype(v)) if s is None else
        tf.convert_to_tensor(s) for s, v in zip(sums, variables)]
    out["clipped_gradient_sum norms"] = norms
    return out

  if mode == "eager":
    return compute(inputs, labels)
  if mode == "function":
    return tf.function(compute)(inputs, labels)
  if mode == "jit":
    return tf.function(compute, jit_compile=True)(inputs, labels)
  raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")


def check_per_example_gradients(
    loss_fn: Optional[Callable],
    model_or_fn: Callable,
    variables: Sequence[Any],
    inputs: Any,
    labels: Any = None,
    *,
    mode: str = "eager",
    training: Optional[bool] = None,
    l2_norm_clip: Optional[float] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    reference: Optional[Sequence[Any]] = None,
) -> float:
  """Checks tf_pxg's per-example quantities against the reference loop.

  Computes, with `tf_pxg.GradientTape` on the whole batch in `mode`,
  `per_example_gradient`, `per_example_norms` and `clipped_gradient_sum`
  (each from its own forward pass and tape) and compares them with
  `reference_per_example_gradients` and the quantities derived from it:
  norms `n_b = sqrt(sum_v ||g_{b,v}||^2)` over all `variables` together, and
  `sum_b min(1, C / n_b) g_b` for each variable.

  Args:
    loss_fn: as in `reference_per_example_gradients` (per-example losses
      `[B]`).
    model_or_fn: as in `reference_per_example_gradients`. In "function" and
      "jit" modes it is traced inside a `tf.function` that takes `inputs` and
      `labels` as arguments (build Keras models before, e.g. by calling them
      once; the reference loop does that).
    variables: the variables to differentiate (`tf.Variable` or Keras).
    inputs: a tensor or nest of tensors, the batch on axis 0 of each.
    labels: None, or a tensor/nest with the batch on axis 0.
    mode: "eager", "function" (`tf.function`) or "jit"
      (`tf.function(jit_compile=True)`, XLA).
    training: if not None, passed as `training=` to `model_or_fn`.
    l2_norm_clip: the clip C; by default 0.9 times the median reference norm,
      so that some examples are clipped and (for B > 2) some are not.
    rtol, atol: tolerances; by default from the variables' dtype (float32:
      1e-4, 1e-6, since the batch-of-one reference itself carries float32
      rounding; float64: 1e-10, 1e-12; float16: 1e-2, 1e-3). An array
      passes when `|actual - expected| <= atol + rtol * max|expected|`
      elementwise. Norms are float32 by contract, and so are the clip
      factors derived from them, so norms and clipped sums are held to at
      least float32 tolerances (1e-5, 1e-6) even for float64 variables.
    reference: precomputed `reference_per_example_gradients` (to reuse one
      reference across modes).

  Returns:
    The largest relative error over all quantities and variables:
    `rtol * max|actual - expected| / (atol + rtol * max|expected|)`, about
    `max|actual - expected| / max|expected|` (atol only matters for tensors
    at rounding level), and at most `rtol` when the check passes.

  Raises:
    AssertionError: if any quantity is off, listing every mismatch (which
      quantity, variable, example and mode).
    ValueError: if the loss is not a `[B]` vector, or from tf_pxg (e.g. an
      op that mixes examples).
    NotImplementedError: from tf_pxg, if an op consuming a variable has no
      per-example rule and the vectorized fallback cannot handle it.
  """
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
  variables = list(variables)
  if not variables:
    raise ValueError("`variables` is empty: nothing to check.")
  if reference is None:
    reference = reference_per_example_gradients(
        loss_fn, model_or_fn, variables, inputs, labels, training)
  expected = [_numpy(r) for r in reference]
  b_total = _batch_size(inputs)
  sq = np.zeros([b_total])
  for e in expected:
    sq += np.sum(np.reshape(np.square(e), [b_total, -1]), axis=1)
  expected_norms = np.sqrt(sq)
  if l2_norm_clip is None:
    med = float(np.median(expected_norms)) if b_total else 0.0
    l2_norm_clip = 0.9 * med if med > 0 else 1.0
  factors = np.minimum(1.0, l2_norm_clip / np.maximum(expected_norms, 1e-12))
  expected_sums = [np.tensordot(factors, e, axes=1) for e in expected]

  dtypes = {_variable_dtype(v) for v in variables}
  worst = max(dtypes, key=lambda d: _DEFAULT_TOLERANCES.get(d, (1e-5,))[0])
  d_rtol, d_atol = _DEFAULT_TOLERANCES.get(worst, (1e-5, 1e-6))
  rtol = d_rtol if rtol is None else rtol
  atol = d_atol if atol is None else atol
  # Norms (and so the clip factors) are float32 by contract.
  n_rtol, n_atol = max(rtol, 1e-5), max(atol, 1e-6)

  actual = _run_tf_pxg(loss_fn, model_or_fn, variables, inputs, labels,
                       training, l2_norm_clip, mode)

  errors, failures = [], []

  def record(name, act, exp, rt, at, per_example):
    rel, msg = _compare(name, act, exp, rt, at, per_example)
    errors.append(rel)
    if msg:
      failures.append(msg)

  names = [getattr(v, "path", None) or getattr(v, "name", f"variable {i}")
           for i, v in enumerate(variables)]
  for name, v, g, e in zip(names, variables, actual["per_example_gradient"],
                           expected):
    record(f"per_example_gradient[{name} {list(v.shape)}]", _numpy(g), e,
           rtol, atol, True)
  record("per_example_norms", _numpy(actual["per_example_norms"]),
         expected_norms, n_rtol, n_atol, True)
  for name, v, s, e in zip(names, variables, actual["clipped_gradient_sum"],
                           expected_sums):
    record(f"clipped_gradient_sum[{name} {list(v.shape)}] (C={l2_norm_clip:.4g})",
           _numpy(s), e, n_rtol, n_atol, False)
  record("clipped_gradient_sum norms",
         _numpy(actual["clipped_gradient_sum norms"]), expected_norms, n_rtol,
         n_atol, True)
  max_rel = max(errors) if errors else 0.0
  if failures:
    raise AssertionError(
        f"tf_pxg disagrees with the tf.GradientTape reference loop (mode "
        f"{mode!r}, B={b_total}, {len(failures)} mismatch(es)):\n  " +
        "\n  ".join(failures))
  return max_rel


__all__ = ["MODES", "check_per_example_gradients",
           "reference_per_example_gradients"]
