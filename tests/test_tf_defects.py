"""TensorFlow kernel defects the engine refuses (`tf_pxg.tape.tf_defects`).

The defect's pattern is checked against the bare TensorFlow op, run in a
subprocess (it corrupts the heap of the process that runs it) under
glibc's checking allocator (`libc_malloc_debug`, `glibc.malloc.check=3`),
which aborts at the first free of a damaged chunk: where oneDNN is on,
every shape the rule calls defective gives wrong values or an abort, and
the shapes next to it that the rule lets through give the right values
with a clean heap. Where oneDNN is off, every shape is right (TF's Eigen
kernel) and nothing is refused.
"""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg import _compat
from tf_pxg.tape import tf_defects

_PROBE = """
import sys, numpy as np, tensorflow as tf
lhs, rhs, dtype = eval(sys.argv[1])
for _ in range(20):  # the heap damage shows within a few calls
  x = tf.cast(tf.random.normal(lhs), dtype)
  y = tf.cast(tf.random.normal(rhs), dtype)
  out = tf.cast(tf.matmul(x, y), tf.float32).numpy()
  ref = np.matmul(tf.cast(x, tf.float32).numpy(), tf.cast(y, tf.float32).numpy())
  if np.abs(out - ref).max() > 0.05 * (1 + np.abs(ref).max()):
    print("WRONG", flush=True)
    sys.exit(0)
print("RIGHT", flush=True)
"""

_MALLOC_DEBUG = pathlib.Path("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")


def _run_bare_matmul(lhs, rhs, dtype) -> str:
  """'RIGHT', 'WRONG' or 'CRASHED' for `tf.matmul` of random operands in a
  fresh process (with glibc's heap checks where the machine has them)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  if _MALLOC_DEBUG.exists():
    env.update(GLIBC_TUNABLES="glibc.malloc.check=3",
               LD_PRELOAD=str(_MALLOC_DEBUG))
  done = subprocess.run([sys.executable, "-c", _PROBE,
                         repr((lhs, rhs, dtype))], env=env,
                        capture_output=True, text=True, timeout=300)
  for word in ("WRONG", "RIGHT"):
    if word in done.stdout:
      return "CRASHED" if done.returncode else word
  return "CRASHED"


# (lhs, rhs, dtype, defective by the rule)
CASES = [
    ((9, 1, 3, 4), (4, 5), "float32", True),
    ((2, 1, 16, 16), (16, 16), "float32", True),
    ((9, 1, 3, 4), (1, 4, 5), "float32", True),
    ((9, 1, 3, 4), (4, 5), "bfloat16", True),
    # Next to the pattern: right whatever oneDNN does.
    ((1, 1, 16, 16), (16, 16), "float32", False),   # N = 1
    ((9, 1, 3, 4), (9, 1, 4, 5), "float32", False),  # no broadcast
    ((9, 2, 3, 4), (1, 4, 5), "float32", False),    # second axis not 1
    ((9, 3, 4), (4, 5), "float32", False),          # rank 3
    ((2, 9, 1, 3, 4), (4, 5), "float32", False),    # rank 5
    ((9, 1, 3, 4), (4, 5), "float64", False),       # Eigen kernel
]


NEIGHBOURS = [c for c in CASES if not c[3]]
DEFECTIVE = [c for c in CASES if c[3]]


@pytest.mark.parametrize("lhs,rhs,dtype,defective", NEIGHBOURS,
                         ids=[f"{c[0]}@{c[1]}-{c[2]}" for c in NEIGHBOURS])
def test_shapes_next_to_the_pattern_are_right_and_allowed(lhs, rhs, dtype,
                                                           defective):
  assert tf_defects.broadcast_batch_matmul_is_defective(
      list(lhs), list(rhs), dtype) == defective
  assert _run_bare_matmul(lhs, rhs, dtype) == "RIGHT"


def test_the_pattern_is_refused_and_shows_the_defect_where_onednn_is_on():
  """Every shape of the pattern is refused. Where oneDNN is on, the bare
  op shows the defect (wrong values or an abort) for at least one of them
  on this CPU (which sizes show it depends on the CPU's oneDNN kernels:
  measured on AMD Zen 4, all four but bfloat16's, whose rounding can hide
  a small wrong product); where it is off, every one is right."""
  results = {}
  for lhs, rhs, dtype, defective in DEFECTIVE:
    assert tf_defects.broadcast_batch_matmul_is_defective(
        list(lhs), list(rhs), dtype) == defective
    results[(lhs, rhs, dtype)] = _run_bare_matmul(lhs, rhs, dtype)
  if not _compat.onednn_enabled():
    assert set(results.values()) == {"RIGHT"}, results
  elif set(results.values()) == {"RIGHT"}:
    pytest.skip(f"oneDNN is on but this CPU's kernels computed every "
                f"shape of the pattern right ({results}); the refusal stays "
                "(it is conservative)")


def test_unknown_batch_is_refused_and_rank_unknown_is_not():
  assert tf_defects.broadcast_batch_matmul_is_defective(
      [None, 1, 2, 2], [2, 4], "float32")
  assert not tf_defects.broadcast_batch_matmul_is_defective(
      None, [2, 4], "float32")


class _BoxEncoding(keras.layers.Layer):
  """SAM's box-corner encoding (`[B, 1, 2, 2] @ [2, F]`, written as
  KerasHub's `SAMPositionalEmbedding` writes it: the `@` of TF tensors, a
  BatchMatMulV2; `keras.ops.matmul` reshapes to a 2-D MatMul in graphs)."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(2, 4), initializer="normal")

  def call(self, boxes):
    coords = boxes @ keras.ops.cast(self.w, self.compute_dtype)
    return keras.ops.sum(coords, axis=(1, 2))


def _model():
  model = dpk.DPSequential([keras.Input((1, 2, 2)), _BoxEncoding(),
                            keras.layers.Dense(2)],
                           l2_norm_clip=1.0, noise_multiplier=0.0)
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def test_defective_matmul_refused_in_a_traced_step_before_it_runs():
  if not _compat.onednn_enabled():
    pytest.skip("oneDNN is off here: TF's Eigen kernel runs, nothing to "
                "refuse")
  x = np.random.RandomState(0).rand(12, 1, 2, 2).astype("float32")
  y = np.arange(12) % 2
  with pytest.raises(ValueError,
                     match=r"BatchMatMulV2.*oneDNN.*TF_ENABLE_ONEDNN_OPTS=0"):
    _model().fit(x, y, batch_size=12, epochs=1, verbose=0)


def test_plain_tape_refuses_in_a_function_and_passes_otherwise():
  w = tf.Variable(tf.random.normal([2, 4]))

  @tf.function
  def grads(x):
    with tf_pxg.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(x, w) ** 2, axis=[1, 2, 3])
    return tape.per_example_gradient(loss, [w])[0]

  x = tf.random.normal([3, 1, 2, 2])
  if _compat.onednn_enabled():
    with pytest.raises(ValueError,
                       match="'BatchMatMulV2'.*wrong values"):
      grads(x)
  else:
    expected = [tf.einsum("imk,imp->kp", x[b], 2 * tf.matmul(x[b], w))
                for b in range(3)]
    np.testing.assert_allclose(grads(x).numpy(), np.stack(expected),
                               rtol=1e-5, atol=1e-5)
  # The same product without the broadcast (the error's advice) is never
  # refused, and is exact.
  xs = tf.squeeze(x, 1)

  @tf.function
  def squeezed(xs):
    with tf_pxg.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(xs, w) ** 2, axis=[1, 2])
    return tape.per_example_gradient(loss, [w])[0]

  expected = [tf.matmul(xs[b], 2 * tf.matmul(xs[b], w), transpose_a=True)
              for b in range(3)]
  np.testing.assert_allclose(squeezed(xs).numpy(), np.stack(expected),
                             rtol=1e-5, atol=1e-5)
