"""TensorFlow kernel defects that make a recorded op's result wrong.

The engine trusts TensorFlow's kernels: the forward pass, TF's gradient
functions and our rules all run them. Where a kernel is known to compute
wrong values for some inputs, a model that reaches it trains on garbage
(in plain Keras too), and per-example gradients inherit it. Such an op is
refused when it is recorded, with the defect, the op, its layer and the
fix in the error, before it runs in a training step.

Known defects (each with a test that runs the bare TensorFlow op in a
subprocess, `tests/test_tf_defects.py`, so a TensorFlow release that
fixes one, or a new pattern, shows up there):

* **oneDNN broadcast batch matmul** (seen with the TF 2.16 and 2.21
  wheels, both ends of our range, with oneDNN on: TF's default on CPUs with AVX-512 VNNI/BF16 or AMX, e.g. Intel Xeon
  since Cascade Lake and AMD Zen 4). TensorFlow's oneDNN kernel for
  `BatchMatMulV2` / `BatchMatMulV3` (`_MklBatchMatMulV2`, float32 and
  bfloat16) multiplies a left operand of shape `[N, 1, M, K]` (N != 1) by a
  right operand whose batch dimensions are all 1 (`[K, P]`, `[1, K, P]`,
  `[1, 1, K, P]`) wrongly, and writes outside its buffers: the product's
  values are wrong (measured: errors of order 1 on N(0, 1) inputs at
  `[2, 1, 16, 16] @ [16, 16]` and `[9, 1, 3, 4] @ [4, 5]`) and the heap is
  corrupted, so the process later dies in an unrelated `free()`
  ("free(): invalid pointer", "corrupted size vs. prev_size"). A graph
  (`tf.function`, Keras `fit`) is refused while it is traced, before the
  op runs; an eager op is seen by the recorder only after it ran, so the
  error comes after the damage. Whether a
  given size shows it depends on M, K, P and N, so every N != 1 (and an
  unknown N) is refused. KerasHub's SAM prompt encoder has this matmul
  (`[B, 1, 2, 2] @ [2, F]` for box prompts). With oneDNN off
  (`TF_ENABLE_ONEDNN_OPTS=0`, or a CPU without those features) TF's Eigen
  kernel runs and is right.
"""

from __future__ import annotations

from tf_pxg import _compat

# The op types whose oneDNN kernel has the broadcast defect, and the
# dtypes that kernel is registered for (others run TF's Eigen kernel).
_BATCH_MATMULS = frozenset(("BatchMatMulV2", "BatchMatMulV3"))
_ONEDNN_DTYPES = frozenset(("float32", "bfloat16"))

# The op types this module checks: the recorder calls `check` only for
# these (one set lookup per recorded op).
CHECKED_OPS = _BATCH_MATMULS


def broadcast_batch_matmul_is_defective(lhs_shape, rhs_shape,
                                        dtype_name: str) -> bool:
  """Whether oneDNN's batch matmul computes `lhs @ rhs` wrongly.

  Args:
    lhs_shape, rhs_shape: the operands' shapes (lists; `None` for an
      unknown dimension; `None` for an unknown rank).
    dtype_name: the operands' dtype name (`"float32"`...).

  Returns:
    True for the defect's pattern (module docstring): dtype float32 or
    bfloat16, `lhs` of rank 4 `[N, 1, M, K]` with N != 1 or unknown, and
    every batch dimension of `rhs` equal to 1. Does not look at whether
    oneDNN is on (`check` does).
  """
  if dtype_name not in _ONEDNN_DTYPES or lhs_shape is None or (
      rhs_shape is None):
    return False
  if len(lhs_shape) != 4 or len(rhs_shape) < 2 or lhs_shape[1] != 1:
    return False
  if lhs_shape[0] == 1:
    return False
  return all(d == 1 for d in rhs_shape[:-2])


def _shape(t):
  shape = getattr(t, "shape", None)
  if shape is None or shape.rank is None:
    return None
  return shape.as_list()


def check(op_type: str, inputs, describe) -> None:
  """Raises ValueError (a type autograph passes through a `tf.function`
  unchanged) if the op `op_type` with `inputs` would
  run a defective TensorFlow kernel here.

  Args:
    op_type: the op's type.
    inputs: its input tensors (eager or graph).
    describe: a zero-argument callable naming the op and its layer, for
      the message (called only to raise).
  """
  if op_type not in _BATCH_MATMULS or len(inputs) < 2:
    return
  lhs, rhs = inputs[0], inputs[1]
  dtype = getattr(getattr(lhs, "dtype", None), "name", "")
  lhs_shape, rhs_shape = _shape(lhs), _shape(rhs)
  if not broadcast_batch_matmul_is_defective(lhs_shape, rhs_shape, dtype):
    return
  if not _compat.onednn_enabled():
    return
  raise ValueError(
      f"{describe()} multiplies a {lhs_shape} {dtype} tensor by a "
      f"{rhs_shape} one. TensorFlow's oneDNN kernel for this broadcast "
      "(_MklBatchMatMulV2: a left operand [N, 1, M, K] with N != 1 times a "
      "right operand whose batch dimensions are all 1) computes wrong "
      "values and corrupts the heap (the process later dies in free()); "
      "plain Keras training of this model is affected too. oneDNN is on in "
      "this process (TensorFlow's default on CPUs with AVX-512 VNNI/BF16 or "
      "AMX). Fix: set TF_ENABLE_ONEDNN_OPTS=0 in the environment before "
      "TensorFlow is imported; or, in the layer, drop the size-1 axis "
      "before the matmul (tf.squeeze(x, 1) @ w, then expand it back), or "
      "broadcast the right operand to the left's batch shape "
      "(tf.broadcast_to).")
