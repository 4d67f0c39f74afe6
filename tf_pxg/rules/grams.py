"""Gram matrices of each example's rows, the ghost norms' main cost.

A ghost norm (Goodfellow 2015; Li et al. 2022, "Large language models can
be strong differentially private learners") needs, per example b, the Gram
`A_b B_b^T` of two `[R, n]` row matrices (a contraction's data rows, its
output gradient's rows, `tf_pxg.rules.contraction`; a tied embedding's
cross terms, `tf_pxg.rules.factors`). Two things make them cheaper:

* `row_gram`: one batched matmul (`BatchMatMulV2`, or XLA's batched dot)
  over all examples: no loop over examples. Unstacking it into one 2-D
  `MatMul` per example was measured (issue 28) and left out: alone, TF
  2.21's CPU `BatchMatMulV2` ran 1.1-1.6x slower than the 2-D MatMuls on
  `[B, R, n]` from 64 x 32 x 128 to 8 x 256 x 16384, but in a whole GPT-2
  fine-tuning step (4 x 768, T = 256, B = 8) the DP/Keras step ratio was
  1.17x with the unstacked Grams against 1.18x batched, within noise.
* `shared_product`: a Gram built once per backward pass for the same
  operands (`tf_pxg.rules.base.Context.grams`): an attention layer's query,
  key and value projections read one data tensor `x`, so their ghost norms
  share `x x^T`.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

import tensorflow as tf


def row_gram(a, b):
  """`[B, R, n]`, `[B, S, n]` -> `[B, R, S]`: `<a[e, r], b[e, s]>` for each
  example e, in the operands' dtype (float32 or float64, the same for
  both); one batched matmul. `b` may be `a` (the Gram of one operand)."""
  return tf.matmul(a, b, adjoint_b=True)


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
