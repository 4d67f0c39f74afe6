"""Library constants: tensors a library makes from literals in its own code.

The classifier (`tf_pxg.interface.classify`) must treat a tensor made outside the
tape whose leading dimension is a multiple of the batch size B as possible
data: a batch of labels or inputs looks exactly like that, and misreading
data as a constant would let one example's rows reach another example's
loss unclipped. Libraries also make such tensors from literals: TFP's
`log_gamma_correction` (behind `tfp.math.lbeta`, hence StudentT,
NegativeBinomial, Beta...) builds a `[6]` vector of minimax coefficients
with `tf.constant([...])` and reads it with `coeffs[5]`, which at B = 2, 3
or 6 looks like one example's row handed to every example.

Neither the op type nor the creation site tells them apart: eagerly both
are `EagerTensor`s made without a recorded op, and in a graph a NumPy array
of examples converted inside a `tf.function` is a `Const` op like the
literal. What does tell them apart is where the *value* comes from. This
module proves it by construction:

* `register_traced(fn, signatures)` traces `fn` (e.g. a head's
  log-probability) in a `tf.function` whose arguments are all placeholders
  (`tf.TensorSpec`s, with an unknown batch dimension), recording the ops
  it builds as a tape does (nested `tf.function`s inlined). Every floating
  `Const` op of rank >= 1 so recorded is a value the library's code
  computes on its own: at trace time no example exists, and a placeholder
  has no value to fold into a constant. These values are registered,
  keyed by `(dtype, shape)`.
* `is_library_constant(t)` is true only for a floating tensor of rank >= 1
  whose static value (an eager tensor's value, a graph `Const`'s value) is
  *bit-identical*, with the same dtype and shape, to a registered one.
  Anything else — a placeholder, a value not known statically, a tensor
  that differs in one bit, a registered value of another dtype — is not
  proven and stays possible data (fail safe).

Why treating a match as a constant is safe (invariant 1, one example one
clipped contribution). Let T be a tensor classified CONST by this rule.

1. In a graph (`tf.function`, XLA, and always in Keras' DP train step), T
   is a `Const` op: its value is frozen into the graph at trace time and
   is the same on every run, whatever batch the run is fed. The examples of
   a step arrive as the function's arguments (placeholders) and what is
   computed from them, never as a `Const`, so no run's examples reach any
   example's loss through T: T is literally a constant of the program.
2. Eagerly, T's value is read on every call. If T happens to hold rows of
   examples (a custom loop's labels), the match means those rows are
   bit-for-bit the library's literal, so every computation reading T
   computes exactly what it computes on the literal: each example's loss
   is the function of its own rows and of a public, data-independent
   value that the program would compute with the library's constant in
   place of T. Its gradient is then the one the library's own code gives,
   clipped per example as usual. The residual: whether the step runs or is
   refused depends on T matching, a coincidence of private values with
   specific library literals (e.g. six labels equal, in order and in every
   bit, to Stirling-series coefficients), never on the Keras path (1.).
3. Nothing but registered values matches, and registration only accepts
   traces on placeholders, so the rule cannot be widened by the batch. A
   value the traced function captures (a closure's array) is registered
   too: it is the same on every call, a constant of the program and never
   the examples of a step (whether it was computed from private data is
   a question about preprocessing, outside this check: threat model,
   "Data outside the model").

The attack tests (`tests/test_probability_engine.py`) check that a data
tensor of the constant's shape and dtype is still caught when its values
differ, eagerly and in a `tf.function`, and that an unregistered literal
of that shape stays refused.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_pxg.tape import recording

# Registered constants are small literal tables; a larger tensor is never
# read back to compare (an eager read of a large batch would cost a copy).
_MAX_SIZE = 4096

_lock = threading.Lock()
# (dtype name, shape) -> the registered values of that dtype and shape.
_CONSTANTS: Dict[Tuple[str, Tuple[int, ...]], List[np.ndarray]] = {}


def _key(dtype: tf.DType, shape: Sequence[int]) -> Tuple[str, Tuple[int, ...]]:
  return tf.as_dtype(dtype).name, tuple(int(d) for d in shape)


def _add(value: np.ndarray, dtype: tf.DType) -> bool:
  key = _key(dtype, value.shape)
  with _lock:
    known = _CONSTANTS.setdefault(key, [])
    if any(np.array_equal(k, value) for k in known):
      return False
    known.append(value)
    return True


def _recorded_constants(fn, signature) -> List[Tuple[np.ndarray, tf.DType]]:
  """Floating `Const` values of rank >= 1 that `fn` builds when traced on
  `signature`, recorded as a tape records them (nested `tf.function`s
  inlined, as `tf.function`-decorated TFP functions are in a DP step)."""
  recorder = recording.Recorder()

  def traced(*args):
    recorder.start()
    try:
      fn(*args)
    finally:
      recorder.stop()

  tf.function(traced).get_concrete_function(*signature)
  found = []
  for entry in recorder.entries:
    if entry.op_type != "Const" or len(entry.outputs) != 1:
      continue
    out = entry.outputs[0]
    if not out.dtype.is_floating or out.shape.rank in (None, 0):
      continue
    value = tf.get_static_value(out)
    if value is not None and 1 < np.size(value) <= _MAX_SIZE:
      found.append((np.asarray(value), out.dtype))
  return found


def register_traced(fn: Callable[..., Any],
                    signatures: Sequence[Sequence[tf.TensorSpec]]) -> int:
  """Registers the literals `fn` builds, traced on placeholders.

  Args:
    fn: a function of tensors (e.g. `lambda p, y: make(p).log_prob(y)`).
    signatures: one or more argument lists of `tf.TensorSpec`s; each is
      traced once (a `tf.function` concrete function), so every argument is
      a placeholder and no value of any example exists during the trace.

  Returns:
    The number of new constants registered.

  Raises:
    TypeError: if an argument spec is not a `tf.TensorSpec` (a Python or
      NumPy value would be folded into the graph as a `Const`, and could
      be data).
  """
  added = 0
  for signature in signatures:
    signature = list(signature)
    for spec in signature:
      if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
            f"register_traced takes tf.TensorSpec arguments only, got "
            f"{spec!r}: a value would be traced into the graph as a "
            "constant and might hold examples.")
    added += sum(_add(v, d) for v, d in _recorded_constants(fn, signature))
  return added


def _static_value(t) -> Any:
  if hasattr(t, "numpy") and not tf.is_symbolic_tensor(t):
    return t.numpy()
  op = getattr(t, "op", None)
  if getattr(op, "type", None) != "Const":
    return None  # A placeholder or a computed tensor: not proven.
  return tf.get_static_value(t)


def is_library_constant(t) -> bool:
  """Whether `t` holds, bit for bit, a registered library literal.

  Args:
    t: a tensor made outside the tape, or the output of a recorded `Const`.

  Returns:
    True only for a floating tensor of rank >= 1 with a fully known shape
    whose dtype, shape and value equal a registered constant's (NaNs never
    match); False for everything else, which stays possible data.
  """
  dtype = getattr(t, "dtype", None)
  if dtype is None or not dtype.is_floating:
    return False
  shape = t.shape
  if shape.rank in (None, 0) or not shape.is_fully_defined():
    return False
  known = _CONSTANTS.get(_key(dtype, shape.as_list()))
  if not known:
    return False
  value = _static_value(t)
  if value is None:
    return False
  value = np.asarray(value)
  return any(np.array_equal(k.view(np.uint8), value.view(np.uint8))
             for k in known if k.dtype == value.dtype)


# Libraries whose literal tables tf_pxg registers, and the module that does
# it (each registers at import). `load_for_loaded_libraries` imports it the
# first time the engine classifies a recording after the library itself was
# imported, so TFP used directly under the tape needs no extra import.
LIBRARY_LITERALS = {"tensorflow_probability": "tf_pxg.probability.constants"}

# module -> why importing it failed (a TFP that does not match TensorFlow):
# the refusal that follows names it (`missing_literals_hint`).
_FAILED: Dict[str, str] = {}


def load_for_loaded_libraries() -> None:
  """Imports the literal-registering module of each library in
  `LIBRARY_LITERALS` that is loaded (in `sys.modules`) and whose module is
  not yet: one dict lookup per library once done. A module that fails to
  import is remembered, not raised: the engine then treats that library's
  literals as possible data, and its refusal says why
  (`missing_literals_hint`)."""
  for library, module in LIBRARY_LITERALS.items():
    if (library in sys.modules and module not in sys.modules and
        module not in _FAILED):
      try:
        importlib.import_module(module)
      except ImportError as err:
        _FAILED[module] = f"{type(err).__name__}: {err}"


def missing_literals_hint() -> str:
  """For an error message: the libraries that are loaded but whose literals
  could not be registered, with the import that failed and why ("" if
  none)."""
  hints = [f" {library} is loaded, but importing {module} (which registers "
           f"its literal tables) failed ({why}); until it imports, the "
           "library's constant tables look like rows of examples."
           for library, module in LIBRARY_LITERALS.items()
           for why in [_FAILED.get(module)] if why]
  return "".join(hints)
