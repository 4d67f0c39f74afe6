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

`check_gradient_invariants` needs no reference loop: with a clip so large
that nothing is clipped, `clipped_gradient_sum` must equal the plain
`tf.GradientTape` gradient of the summed loss for every source, the
per-example gradients must sum to it, and a source whose plain gradient is
non-zero must never get a `None` or all-zero per-example gradient.

`expected_dp_sgd_weights` turns reference gradients into the weights one
noiseless DP-SGD step must give (`w - lr * mean_b min(1, C / n_b) g_b`), and
`assert_dp_step_matches_reference` checks a real step against them to `rtol`
of each variable's update size.

`check_example_independence` needs neither tf_pxg's engine nor a reference:
it changes one example of a batch and checks, with a plain
`tf.GradientTape`, that no other example's loss or gradient moves (the
random layers re-seeded identically in both runs). It catches layers that
mix examples (MixUp, BatchNormalization in training, batch statistics,
in-batch negatives...), as far as the chosen change exercises them.

`trace_rules` records which rule, and which form of it, tf_pxg ran at each
interface op (e.g. the ghost or the materialised squared norm, or the
vectorized fallback), so a test can tell a rule from the fallback.

Tolerances follow the gradients' scale: an array passes when
`|actual - expected| <= atol + rtol * max|expected| + floor`, where the
noise floor `64 * eps(dtype) * S` is relative to the largest per-example
gradient entry S over all the variables checked together. A gradient that is
zero in exact arithmetic (e.g. an attention key bias, softmax being
shift-invariant) is float noise at the scale of the gradients it was summed
from, and two such noises are never compared under a relative tolerance.

Use it to test a rule you registered with `tf_pxg.register` or a layer of
your own:

    err = tf_pxg.testing.check_per_example_gradients(
        keras.losses.SparseCategoricalCrossentropy(reduction="none"),
        model, model.trainable_variables, x, labels=y, mode="jit")

Warning:
  The contract is that of DP-SGD: the batch is axis 0 of every input and
  label, the loss is a `[B]` vector of per-example losses, and example b's
  loss depends on example b alone (no batch normalisation in training, no
  dropout or other randomness, which would also break the comparison with
  the reference loop; `check_gradient_invariants` allows randomness).

References:
  Opacus, `opacus.utils.tensor_utils` / `check_per_sample_gradients_are_correct`
  (the batch-of-one loop as a reference).
"""

from __future__ import annotations

import contextlib
from typing import (Any, Callable, Dict, List, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import numpy as np
import tensorflow as tf

from tf_pxg import _compat

MODES = ("eager", "function", "jit")

# Default (rtol, atol) by the variables' dtype.
_DEFAULT_TOLERANCES = {
    tf.float16: (1e-2, 1e-3),
    tf.bfloat16: (2e-2, 1e-2),
    tf.float32: (1e-4, 1e-6),
    tf.float64: (1e-10, 1e-12),
}

# The noise floor, in units of eps(dtype) times the largest gradient entry.
_NOISE_ULPS = 64.0


def _eps(dtype) -> float:
  dtype = tf.as_dtype(dtype)
  if dtype == tf.bfloat16:
    return 2.0 ** -7
  return float(np.finfo(dtype.as_numpy_dtype).eps)


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
  if isinstance(g, tf.IndexedSlices):
    return tf.convert_to_tensor(g)
  return g


# Convolutions whose TF gradient needs a dilated Conv*BackpropInput kernel,
# which some CPU builds lack ("Current CPU implementations do not yet support
# dilation rates larger than 1"), with the attrs their raw op takes.
_DILATED_CONV_ATTRS = {
    "Conv2D": ("strides", "padding", "explicit_paddings", "data_format",
               "use_cudnn_on_gpu"),
    "Conv3D": ("strides", "padding", "data_format"),
    "DepthwiseConv2dNative": ("strides", "padding", "explicit_paddings",
                              "data_format"),
}


def _attr(op, name):
  value = op.get_attr(name)
  return value.decode() if isinstance(value, bytes) else value


def _spatial_rates(op) -> List[int]:
  dilations = list(op.get_attr("dilations"))
  if _attr(op, "data_format").startswith("NC"):
    return dilations[2:]
  return dilations[1:-1]


def _dilate_filter(w, rates):
  """Inserts `rate - 1` zeros between the taps of each spatial filter axis.

  A convolution with the result and no dilation equals the dilated one
  exactly (the inserted taps multiply by zero).
  """
  for axis, r in enumerate(rates):
    if r == 1:
      continue
    k = w.shape[axis]
    zeros = tf.zeros(w.shape[:axis + 1] + [r - 1] + w.shape[axis + 1:],
                     w.dtype)
    w = tf.concat([tf.expand_dims(w, axis + 1), zeros], axis + 1)
    w = tf.reshape(w, w.shape[:axis] + [k * r] + w.shape[axis + 2:])
    w = w[(slice(None),) * axis + (slice(0, (k - 1) * r + 1),)]
  return w


def _undilate(g, rates):
  """The gradient of `_dilate_filter`: the taps at multiples of the rate."""
  return g[tuple(slice(None, None, r) for r in rates)]


def _dilation_free_gradient(original):
  """`original` (TF's conv gradient), or for dilations > 1 an exact version
  that differentiates the same conv written with a zero-dilated filter and no
  dilation, so it needs no dilated backprop kernel."""

  def gradient(op, *grads):
    rates = _spatial_rates(op)
    if all(r == 1 for r in rates):
      return original(op, *grads)
    x, w = op.inputs[0], op.inputs[1]
    attrs = {a: _attr(op, a) for a in _DILATED_CONV_ATTRS[op.type]}
    ones = [1] * len(op.get_attr("dilations"))
    with tf.GradientTape() as tape:
      wd = _dilate_filter(w, rates)
      tape.watch([x, wd])
      y = getattr(tf.raw_ops, op.type)(input=x, filter=wd, dilations=ones,
                                       **attrs)
    gx, gwd = tape.gradient(y, [x, wd], output_gradients=grads[0])
    return [gx, _undilate(gwd, rates)]

  return gradient


@contextlib.contextmanager
def _dilation_free_conv_gradients():
  """Swaps in `_dilation_free_gradient` for the dilated convolutions (eager
  tapes look gradient functions up at each backward pass)."""
  with _compat.swapped_gradient_functions(
      {t: _dilation_free_gradient for t in _DILATED_CONV_ATTRS}):
    yield


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
  `tf.IndexedSlices` (gathers) are densified. Dilated convolutions
  (`Conv2D`, `Conv3D`, `DepthwiseConv2dNative` with dilations > 1) are
  differentiated as the same convolution with a zero-dilated filter, which is
  exact and needs no dilated `Conv*BackpropInput` kernel (some CPU builds have
  none).

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
    with _dilation_free_conv_gradients():
      grads = tape.gradient(loss, variables)
    for i, (g, v) in enumerate(zip(grads, variables)):
      per_var[i].append(tf.cast(_dense(g, v), _variable_dtype(v)))
  return [tf.stack(gs) if gs else tf.zeros([0] + list(v.shape),
                                           _variable_dtype(v))
          for gs, v in zip(per_var, variables)]


def _numpy(t) -> np.ndarray:
  if t is None:
    return None
  if isinstance(t, tf.IndexedSlices):
    t = tf.convert_to_tensor(t)
  return np.asarray(tf.cast(t, tf.float64).numpy(), dtype=np.float64)


def _compare(name: str, actual, expected: np.ndarray, rtol: float,
             atol: float, per_example: bool, floor: float = 0.0) -> tuple:
  """(relative error, message or None) for one quantity.

  An array passes when
  `|actual - expected| <= atol + rtol * max|expected| + floor` elementwise (a
  normwise tolerance, so tiny entries are not held to a relative bound;
  `floor` is the float noise of the quantities it was computed from, see the
  module docstring); the reported relative error is
  `rtol * max|actual - expected| / allowed`, which is about
  `max|actual - expected| / max|expected|` and at most rtol iff the array
  passes.
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
  allowed = atol + rtol * scale + floor
  # In units of rtol: <= rtol iff the check passes; ~max_diff / scale unless
  # the tensor is at rounding level (a gradient that is zero in exact
  # arithmetic), where atol and the noise floor dominate.
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
               f"relative {rel:.3g} > rtol {rtol:g} (atol {atol:g}, noise "
               f"floor {floor:.3g}, max |expected| = {scale:.3g}); actual "
               f"{actual[where]:.6g}, expected {expected[where]:.6g}")


def _tolerances(variables, rtol, atol):
  """(rtol, atol, eps) for the least precise of the variables' dtypes."""
  dtypes = {_variable_dtype(v) for v in variables}
  worst = max(dtypes, key=lambda d: _DEFAULT_TOLERANCES.get(d, (1e-5,))[0])
  d_rtol, d_atol = _DEFAULT_TOLERANCES.get(worst, (1e-5, 1e-6))
  eps = max(_eps(d) if d.is_floating else 0.0 for d in dtypes)
  return (d_rtol if rtol is None else rtol, d_atol if atol is None else atol,
          eps)


def _names(variables) -> List[str]:
  return [getattr(v, "path", None) or getattr(v, "name", f"variable {i}")
          for i, v in enumerate(variables)]


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


@contextlib.contextmanager
def trace_rules():
  """Records which rule, and which form of it, runs at each interface op.

  Yields a list that receives one dict per rule call made by tf_pxg's
  per-example engine while the context is active (in `tf.function` and XLA
  at trace time): `op_type`, `rule` (the rule's class name;
  `"_VectorizedFallback"` for an op type without a rule or outside its
  rule's scope), `form` (`"per_example"`, `"sq_norm"` or `"weighted_sum"`)
  and, where the rule says, how it computed it: `sq_norm` is `"ghost"`,
  `"materialised"` or `"native"` (a native op, e.g. a 2-D convolution's
  norms on CPU outside XLA); `per_example` is `"vectorized"` when TF's gradient ran
  under `tf.vectorized_map` (the generic fallback) instead of a closed form.

    with tf_pxg.testing.trace_rules() as records:
      tape.per_example_norms(losses, variables)
    assert {r["sq_norm"] for r in records if r["op_type"] == "MatMul"} == {
        "ghost"}
  """
  from tf_pxg.rules import base  # pylint: disable=g-import-not-at-top
  saved = base._trace  # pylint: disable=protected-access
  records: List[Dict[str, str]] = []
  base._trace = records  # pylint: disable=protected-access
  try:
    yield records
  finally:
    base._trace = saved  # pylint: disable=protected-access


# A clip no per-example gradient norm reaches (finite in float32).
_NO_CLIP = 1e30


def _run_invariants(loss_fn, model_or_fn, variables, inputs, labels,
                    training, mode: str) -> Dict[str, Any]:
  """One forward pass recorded by a plain and a (persistent) tf_pxg tape."""
  from tf_pxg.tape.gradient_tape import GradientTape  # pylint: disable=g-import-not-at-top
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


def per_example_global_norms(per_example_grads: Sequence[Any]) -> np.ndarray:
  """Flat global L2 norms `n_b = sqrt(sum_v ||g_{b,v}||^2)`, in float64.

  Args:
    per_example_grads: one array (or tensor) per variable, of shape
      `[B, *variable.shape]`, as `reference_per_example_gradients` returns.

  Returns:
    A float64 numpy array of shape `[B]`.

  Raises:
    ValueError: if `per_example_grads` is empty.
  """
  grads = [_numpy(g) for g in per_example_grads]
  if not grads:
    raise ValueError("`per_example_grads` is empty: no variable to norm.")
  b_total = grads[0].shape[0]
  return np.sqrt(sum(np.sum(np.reshape(np.square(g), [b_total, -1]), axis=1)
                     for g in grads))


def expected_dp_sgd_weights(
    weights: Sequence[Any],
    per_example_grads: Sequence[Any],
    l2_norm_clip: float,
    batch_size: Optional[int] = None,
    learning_rate: float = 1.0,
) -> List[np.ndarray]:
  """The weights after one noiseless DP-SGD step from the reference gradients.

  `w_v - learning_rate * sum_b min(1, C / n_b) g_{b,v} / batch_size` for each
  variable v, with `n_b` the flat global norm of example b over all the
  variables (`per_example_global_norms`). This is what one `fit` step of a
  DP model with `noise_multiplier=0` and plain SGD must give.

  Args:
    weights: the V weights before the step, numpy arrays or tensors.
    per_example_grads: V arrays of shape `[B, *weights[v].shape]` (e.g. from
      `reference_per_example_gradients`).
    l2_norm_clip: the clip C (> 0).
    batch_size: the divisor of the clipped sum; by default B, the number of
      examples (give the expected batch size for Poisson sampling).
    learning_rate: the SGD learning rate.

  Returns:
    V float64 numpy arrays, the expected weights after the step.

  Raises:
    ValueError: if the lengths or shapes of the two lists differ.
  """
  weights = [_numpy(w) for w in weights]
  grads = [_numpy(g) for g in per_example_grads]
  if len(weights) != len(grads):
    raise ValueError(f"{len(weights)} weights but {len(grads)} per-example "
                     "gradients: give one `[B, *shape]` array per weight.")
  for i, (w, g) in enumerate(zip(weights, grads)):
    if g.shape[1:] != w.shape:
      raise ValueError(f"per_example_grads[{i}] has shape {g.shape}; expected "
                       f"[B, *{list(w.shape)}] for weight {i}.")
  norms = per_example_global_norms(grads)
  factors = np.minimum(1.0, l2_norm_clip / np.maximum(norms, 1e-300))
  divisor = float(norms.shape[0] if batch_size is None else batch_size)
  return [w - learning_rate * np.tensordot(factors, g, axes=1) / divisor
          for w, g in zip(weights, grads)]


def assert_dp_step_matches_reference(
    actual: Sequence[Any],
    initial: Sequence[Any],
    expected: Sequence[Any],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-7,
    names: Optional[Sequence[str]] = None,
) -> float:
  """Asserts one training step moved the weights to `expected`.

  For every variable v, `max |actual_v - expected_v| <= rtol * s_v + atol`,
  where `s_v = max |expected_v - initial_v|` is that variable's own update
  size: the step is checked to `rtol` of itself, not of the weights.

  Args:
    actual: the V weights after the step (numpy arrays, tensors or variables).
    initial: the V weights before the step.
    expected: the V expected weights after it (e.g. from
      `expected_dp_sgd_weights`).
    rtol: tolerance relative to each variable's update size.
    atol: absolute tolerance added to it (for variables that barely move).
    names: optional V names for the failure message (e.g. variable paths).

  Returns:
    The largest error relative to its variable's tolerance (<= 1 on pass).

  Raises:
    AssertionError: if a variable is off, listing every such variable with
      its error and update size.
    ValueError: if the three lists have different lengths.
  """
  actual, initial, expected = ([_numpy(tf.convert_to_tensor(t)) for t in ts]
                               for ts in (actual, initial, expected))
  if not len(actual) == len(initial) == len(expected):
    raise ValueError(f"{len(actual)} actual, {len(initial)} initial and "
                     f"{len(expected)} expected weights: give one per "
                     "variable in each.")
  names = list(names) if names is not None else [
      f"weight {i}" for i in range(len(actual))]
  failures, worst = [], 0.0
  for name, a, w0, e in zip(names, actual, initial, expected):
    if a.shape != e.shape:
      failures.append(f"{name}: shape {a.shape}, expected {e.shape}")
      continue
    if not a.size:
      continue
    step = float(np.max(np.abs(e - w0)))
    err = float(np.max(np.abs(a - e)))
    bound = rtol * step + atol
    worst = max(worst, err / bound)
    if not err <= bound:
      failures.append(f"{name}: off by {err:.3g}, update size {step:.3g}, "
                      f"bound {bound:.3g}")
  if failures:
    raise AssertionError("The step differs from the reference update (rtol "
                         f"{rtol:g} of each update, atol {atol:g}):\n  " +
                         "\n  ".join(failures))
  return worst


# Example independence: an empirical check that examples never mix ----------

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

  @property
  def passed(self) -> bool:
    return not self.moved


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
      another one; the message names every moved example (which change,
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
  finally:
    restore(include_seed_states=True)

  result = ExampleIndependenceResult(
      indices=indices, moved=tuple(moved), max_loss_change=max_dl,
      max_gradient_change=max_dg, loss_tolerance=ltol_max,
      gradient_tolerance=gtol_max, changed_loss_change=own_dl,
      changed_gradient_change=own_dg if gradients else 0.0,
      details=tuple(details))
  if moved and raise_on_failure:
    moved_examples = sorted({b for _, b in moved})
    raise ExampleMixingError(
        f"Examples mix: changing example(s) {list(indices)} "
        f"({'by `change`' if callable(change) else change}) moved the loss "
        f"or gradient of example(s) {moved_examples} of {b_total} (mode "
        f"{mode!r}, training={training}, seed={seed}). For DP-SGD, example "
        "b's loss must depend on example b alone; look for layers that "
        "compute over the batch axis (BatchNormalization in training, "
        "MixUp/CutMix, batch statistics, tf.roll/reverse/sort/gather over "
        "axis 0, in-batch negatives).\n  " + "\n  ".join(details), result)
  return result


__all__ = ["CHANGES", "ExampleIndependenceResult", "ExampleMixingError",
           "MODES", "assert_dp_step_matches_reference",
           "check_example_independence", "check_gradient_invariants",
           "check_per_example_gradients", "expected_dp_sgd_weights",
           "per_example_global_norms", "reference_per_example_gradients",
           "trace_rules"]
