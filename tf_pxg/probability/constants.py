"""Registering the literals TFP builds, so the engine does not take them for data.

`tf_pxg.tape.library_constants` states the rule and why it is safe: only a
value traced on placeholders (no example in scope) is registered, and only
a bit-identical value is then treated as a constant. This module does the
tracing for TFP:

* at import, `tfp.math.lbeta` (behind StudentT, NegativeBinomial, Beta,
  Binomial...) in float32 and float64, for users who call TFP directly
  under `tf_pxg.GradientTape`;
* `register_for(log_likelihood, y, params)`, called by
  `NegativeLogLikelihood` before each use, traces the loss's own
  log-likelihood once per (function, dtypes, shapes) with the batch
  dimension unknown.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import tensorflow as tf

from tf_pxg.probability._tfp_import import import_tfp
from tf_pxg.tape import library_constants

tfp = import_tfp()

_lock = threading.Lock()
_done = set()


def _spec(t) -> tf.TensorSpec:
  t = tf.convert_to_tensor(t) if not isinstance(t, tf.TensorSpec) else t
  shape = t.shape
  if shape.rank is None or shape.rank == 0:
    return tf.TensorSpec(None if shape.rank is None else [], t.dtype)
  return tf.TensorSpec([None] + shape.as_list()[1:], t.dtype)


def register_for(fn: Callable[[Any, Any], Any], *args) -> None:
  """Traces `fn(*args)` once on placeholders of the args' dtypes and shapes
  (batch dimension unknown) and registers its literals.

  Tracing runs under `tf.init_scope()`, outside any graph being built and
  outside the tape's recording (a separate `FuncGraph`); results are cached
  per function, dtypes and shapes.
  """
  specs = tuple(_spec(a) for a in args)
  key = (id(getattr(fn, "__func__", fn)), id(getattr(fn, "__self__", None)),
         tuple((s.dtype.name, tuple(s.shape.as_list())) for s in specs))
  with _lock:
    if key in _done:
      return
    _done.add(key)
  with tf.init_scope():
    library_constants.register_traced(fn, [specs])


def _register_lbeta() -> None:
  for dtype in (tf.float32, tf.float64):
    spec = tf.TensorSpec([None], dtype)
    library_constants.register_traced(tfp.math.lbeta, [(spec, spec)])


_register_lbeta()
