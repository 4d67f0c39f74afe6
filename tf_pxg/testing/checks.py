"""`check_per_example_gradients` (tf_pxg against the reference, in each
mode) and `check_gradient_invariants` (no reference needed)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg.testing.dilated_conv import _dilation_free_conv_gradients
from tf_pxg.testing.reference import (_batch_size, _per_example_loss,
                                      reference_per_example_gradients)
from tf_pxg.testing.tolerances import (MODES, _NOISE_ULPS, _compare, _eps,
                                       _names, _numpy, _tolerances,
                                       _variable_dtype)


def _run_in_mode(compute: Callable, inputs, labels, mode: str):
  """`compute(inputs, labels)` eagerly, in a `tf.function` or under XLA.

  Raises:
    ValueError: if `mode` is not one of `MODES`.
  """
  if mode == "eager":
    return compute(inputs, labels)
  if mode == "function":
    return tf.function(compute)(inputs, labels)
  if mode == "jit":
    return tf.function(compute, jit_compile=True)(inputs, labels)
  raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")


def _run_tf_pxg(loss_fn, model_or_fn, variables, inputs, labels, training,
                l2_norm_clip, mode: str) -> Dict[str, Any]:
  """tf_pxg's three quantities, each from a fresh (non-persistent) tape."""
  from tf_pxg.gradient_tape import GradientTape  # pylint: disable=g-import-not-at-top

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

  return _run_in_mode(compute, inputs, labels, mode)


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
      passes when `|actual - expected| <= atol + rtol * max|expected| +
      floor` elementwise, the noise floor being `64 * eps * S` with S the
      largest per-example gradient entry over all `variables` (for clipped
      sums, the sum over examples of the clipped ones), so a gradient that
      is zero in exact arithmetic is held to the rounding of the gradients
      it is computed from. Norms are float32 by contract, and so are the clip
      factors derived from them, so norms and clipped sums are held to at
      least float32 tolerances (1e-5, 1e-6) even for float64 variables.
    reference: precomputed `reference_per_example_gradients` (to reuse one
      reference across modes).

  Returns:
    The largest relative error over all quantities and variables:
    `rtol * max|actual - expected| / allowed`, about
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

  rtol, atol, eps = _tolerances(variables, rtol, atol)
  # Norms (and so the clip factors) are float32 by contract.
  n_rtol, n_atol = max(rtol, 1e-5), max(atol, 1e-6)
  n_eps = max(eps, _eps(tf.float32))
  # Noise floors: float rounding at the scale of the largest per-example
  # gradient entry (over all variables), and of the clipped terms summed.
  pe_scale = max((float(np.max(np.abs(e))) for e in expected if e.size),
                 default=0.0)
  sum_scale = float(sum(
      f * max((float(np.max(np.abs(e[b]))) for e in expected if e.size),
              default=0.0) for b, f in enumerate(factors)))
  pe_floor = _NOISE_ULPS * eps * pe_scale
  sum_floor = _NOISE_ULPS * n_eps * sum_scale

  actual = _run_tf_pxg(loss_fn, model_or_fn, variables, inputs, labels,
                       training, l2_norm_clip, mode)

  errors, failures = [], []

  def record(name, act, exp, rt, at, per_example, floor=0.0):
    rel, msg = _compare(name, act, exp, rt, at, per_example, floor)
    errors.append(rel)
    if msg:
      failures.append(msg)

  names = _names(variables)
  for name, v, g, e in zip(names, variables, actual["per_example_gradient"],
                           expected):
    record(f"per_example_gradient[{name} {list(v.shape)}]", _numpy(g), e,
           rtol, atol, True, pe_floor)
  record("per_example_norms", _numpy(actual["per_example_norms"]),
         expected_norms, n_rtol, n_atol, True)
  for name, v, s, e in zip(names, variables, actual["clipped_gradient_sum"],
                           expected_sums):
    record(f"clipped_gradient_sum[{name} {list(v.shape)}] (C={l2_norm_clip:.4g})",
           _numpy(s), e, n_rtol, n_atol, False, sum_floor)
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


# A clip no per-example gradient norm reaches (finite in float32).
_NO_CLIP = 1e30


def _run_invariants(loss_fn, model_or_fn, variables, inputs, labels,
                    training, mode: str) -> Dict[str, Any]:
  """One forward pass recorded by a plain and a (persistent) tf_pxg tape."""
  from tf_pxg.gradient_tape import GradientTape  # pylint: disable=g-import-not-at-top
  plain = tf.autograph.experimental.do_not_convert

  def compute(inputs, labels):
    with tf.GradientTape() as ref_tape:
      with GradientTape(persistent=True) as tape:
        losses = _per_example_loss(loss_fn, model_or_fn, inputs, labels,
                                   training)
      total = tf.reduce_sum(losses)
    with _dilation_free_conv_gradients():
      grads = ref_tape.gradient(total, variables)
    sums, _ = plain(tape.clipped_gradient_sum)(losses, variables, _NO_CLIP)
    per_example = plain(tape.per_example_gradient)(losses, variables)
    # None stays None (it is what the check is about); dense otherwise.
    dense = lambda ts: [None if t is None else tf.convert_to_tensor(t)
                        for t in ts]
    return {"gradient": dense(grads), "clipped_gradient_sum": dense(sums),
            "per_example_gradient": dense(per_example)}

  return _run_in_mode(compute, inputs, labels, mode)


def check_gradient_invariants(
    loss_fn: Optional[Callable],
    model_or_fn: Callable,
    variables: Sequence[Any],
    inputs: Any,
    labels: Any = None,
    *,
    mode: str = "eager",
    training: Optional[bool] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
) -> float:
  """Checks what must hold for any model, without a reference loop.

  One forward pass is recorded by a plain `tf.GradientTape` and a persistent
  `tf_pxg.GradientTape` (so random layers, e.g. Dropout, see the same
  draws). With `G_v` the plain gradient of `sum_b loss_b` for variable v
  (dilated convolutions differentiated as in
  `reference_per_example_gradients`):

  1. `clipped_gradient_sum` with a clip no example reaches (1e30) equals
     `G_v` for every variable;
  2. the per-example gradients sum to `G_v`: `sum_b g_{b,v} = G_v`;
  3. no variable whose `G_v` is non-zero (above the float noise floor) gets
     a `None` or all-zero per-example gradient or clipped sum: in DP
     training such a variable would silently get noise only.

  Args:
    loss_fn, model_or_fn, variables, inputs, labels, training: as in
      `check_per_example_gradients`.
    mode: "eager", "function" or "jit".
    rtol, atol: as in `check_per_example_gradients` (defaults from the
      variables' dtype); the noise floor is `64 * eps * S`, S the largest
      `|G_v|` entry over all variables, times sqrt(B) for the summed
      quantities.

  Returns:
    The largest relative error (as in `check_per_example_gradients`).

  Raises:
    AssertionError: listing every violated invariant (variable and mode).
    ValueError, NotImplementedError: from tf_pxg, as in
      `check_per_example_gradients`.
  """
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
  variables = list(variables)
  if not variables:
    raise ValueError("`variables` is empty: nothing to check.")
  b_total = _batch_size(inputs)
  out = _run_invariants(loss_fn, model_or_fn, variables, inputs, labels,
                        training, mode)
  rtol, atol, eps = _tolerances(variables, rtol, atol)
  grads = [np.zeros(v.shape) if g is None else _numpy(g)
           for g, v in zip(out["gradient"], variables)]
  scale = max((float(np.max(np.abs(g))) for g in grads if g.size),
              default=0.0)
  # Clip factors are float32, so sums are held to float32 rounding at least.
  floor = _NOISE_ULPS * max(eps, _eps(tf.float32)) * scale * np.sqrt(
      max(b_total, 1))
  errors, failures = [], []
  for name, v, g, s, pe in zip(_names(variables), variables, grads,
                               out["clipped_gradient_sum"],
                               out["per_example_gradient"]):
    label = f"{name} {list(v.shape)}"
    nonzero = g.size and float(np.max(np.abs(g))) > floor + atol
    for what, t in (("per_example_gradient", pe),
                    ("clipped_gradient_sum", s)):
      if nonzero and (t is None or not np.any(_numpy(t))):
        failures.append(
            f"{what}[{label}] is {'None' if t is None else 'all zero'} but "
            f"the plain gradient is non-zero (max |G| = "
            f"{float(np.max(np.abs(g))):.3g}): DP training would give this "
            "variable noise only.")
    for what, act in (
        (f"clipped_gradient_sum[{label}] (clip {_NO_CLIP:g}) vs "
         "tf.GradientTape", s),
        (f"sum_b per_example_gradient[{label}] vs tf.GradientTape",
         None if pe is None else tf.reduce_sum(pe, axis=0))):
      rel, msg = _compare(what, _numpy(act), g, rtol, atol, False, floor)
      errors.append(rel)
      if msg:
        failures.append(msg)
  if failures:
    raise AssertionError(
        f"tf_pxg violates the gradient invariants (mode {mode!r}, "
        f"B={b_total}, {len(failures)} violation(s)):\n  " +
        "\n  ".join(failures))
  return max(errors) if errors else 0.0
