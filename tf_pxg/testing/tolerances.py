"""Tolerances for comparing per-example quantities: `MODES`, the default
(rtol, atol) by dtype, and the noise floor relative to the gradients' scale
(see the package doc)."""

from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf


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


def _variable_dtype(v) -> tf.DType:
  return tf.as_dtype(v.dtype)


def _names(variables) -> List[str]:
  return [getattr(v, "path", None) or getattr(v, "name", f"variable {i}")
          for i, v in enumerate(variables)]
