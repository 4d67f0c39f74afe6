"""Expected DP-SGD steps: `per_example_global_norms`,
`expected_dp_sgd_weights` and `assert_dp_step_matches_reference`."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg.testing.tolerances import _numpy


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
