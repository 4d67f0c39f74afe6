"""Gram matrices of each example's rows, the ghost norms' main cost.

A ghost norm (Goodfellow 2015; Li et al. 2022, "Large language models can
be strong differentially private learners") needs, per example b, the Gram
`A_b B_b^T` of two `[R, n]` row matrices (a contraction's data rows, its
output gradient's rows, `tf_pxg.rules.contraction`; a tied embedding's
cross terms, `tf_pxg.rules.factors`). Two things make them cheaper:

* `row_gram`: on CPU, outside XLA, for a static batch of at most
  `MAX_UNSTACKED` examples, one 2-D `MatMul` per example instead of one
  batched matmul. TF 2.21's CPU `BatchMatMulV2` (what `tf.einsum` runs)
  was 1.1-1.6x slower on every shape measured, from 64 x 32 x 128 to
  8 x 256 x 16384 (`[B, R, n]`, docs/benchmarks.md, issue 28), and the
  Grams are about 15 % of a GPT-2 fine-tuning step's FLOPs at T = 256.
* `shared_product`: a Gram built once per backward pass for the same
  operands (`tf_pxg.rules.base.Context.grams`): an attention layer's query,
  key and value projections read one data tensor `x`, so their ghost norms
  share `x x^T`.
"""

from __future__ import annotations

import functools
from typing import Callable, Hashable, Optional

import tensorflow as tf

from tf_pxg import xla

# The most examples `row_gram` unstacks (a graph of one MatMul per example).
MAX_UNSTACKED = 32


@functools.lru_cache(maxsize=None)
def _has_gpu() -> bool:
  return bool(tf.config.list_logical_devices("GPU"))


def row_gram(a, b):
  """`[B, R, n]`, `[B, S, n]` -> `[B, R, S]`: `<a[e, r], b[e, s]>` for each
  example e, in the operands' dtype (float32 or float64, the same for
  both). `b` may be `a` (the Gram of one operand: unstacked once)."""
  n = a.shape[0]
  if (not isinstance(n, int) or not 0 < n <= MAX_UNSTACKED or
      xla.in_xla_context() or _has_gpu()):
    return tf.matmul(a, b, adjoint_b=True)
  rows_a = tf.unstack(a)
  rows_b = rows_a if b is a else tf.unstack(b)
  return tf.stack([tf.matmul(u, v, transpose_b=True)
                   for u, v in zip(rows_a, rows_b)])


def shared_product(store: Optional[dict], key: Hashable,
                   build: Callable[[], tf.Tensor]) -> tf.Tensor:
  """`build()`, built once per backward pass for `key` in `store`
  (`Context.grams`; None: always built). `key` names the product by its
  operand tensors' `ref()`s and how they are contracted. A product is
  reused only in the graph it was built in (a `tf.cond` branch builds its
  own)."""
  if store is None:
    return build()
  key = (key, id(tf.compat.v1.get_default_graph()))
  if key not in store:
    store[key] = build()
  return store[key]
