"""Ghost norms of parameters that read one data tensor share its Gram.

An attention layer's query, key and value projections (Keras'
`MultiHeadAttention`, KerasHub's GPT-2 and BERT) are three contractions of
the same input `x`; each ghost norm needs `x x^T` per example
(`tf_pxg.rules.contraction`), which `tf_pxg.rules.grams.shared_product`
builds once per backward pass. Exact against the batch-of-one
`tf.GradientTape` loop, and the graph holds each Gram once.
"""

import collections

import keras
import numpy as np
import tensorflow as tf

import tf_pxg
from tf_pxg.testing import check_per_example_gradients, trace_rules

B, T, D, HEADS = 3, 4, 16, 2


def _attention():
  keras.utils.set_random_seed(0)
  mha = keras.layers.MultiHeadAttention(HEADS, D // HEADS, dtype="float64")
  x = tf.constant(np.random.default_rng(0).normal(size=(B, T, D)))
  mha(x, x)
  return mha, x


def _loss(labels, y):
  del labels
  return tf.reduce_sum(tf.tanh(y) ** 2, axis=[1, 2])


def test_attention_projections_exact_with_shared_gram():
  mha, x = _attention()
  check_per_example_gradients(_loss, lambda v: mha(v, v),
                              mha.trainable_variables, x, x, mode="function")


def test_gram_of_shared_data_built_once():
  mha, x = _attention()

  @tf.function
  def norms(v):
    with tf_pxg.GradientTape() as tape:
      losses = _loss(None, mha(v, v))
    return tape.per_example_norms(losses, mha.trainable_variables)

  with trace_rules() as records:
    graph = norms.get_concrete_function(x).graph
  # T (d + d') < d d' for every projection: all four take ghost norms.
  assert [r.get("sq_norm") for r in records
          if r["form"] == "sq_norm" and r["op_type"] in (
              "Einsum", "BatchMatMulV2")] == (
              ["ghost"] * 4)
  # Products of a tensor with itself (Grams: one batched matmul each),
  # by the tensor they start from.
  grams = collections.Counter(
      _root(op.inputs[0]) for op in graph.get_operations()
      if op.type in ("Einsum", "BatchMatMulV2", "MatMul")
      and op.inputs[0] is op.inputs[1])
  # x's Gram once (not once per projection), the attention output's (the
  # output projection's data) and each projection's output gradient's.
  assert len(grams) == 6 and set(grams.values()) == {1}, grams


def _root(t):
  while t.op.type == "Reshape":
    t = t.op.inputs[0]
  return t.name
