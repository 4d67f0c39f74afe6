"""A parameter with two uses of different kinds (a tied embedding's lookup
and its LM head): the norm of the sum of the two per-example gradients from
outer-product factors (`tf_pxg.rules.factors`), without the `[B, V, d]`
gradient; against the batch-of-one `tf.GradientTape` loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg.rules import factors
from tf_pxg.testing import check_per_example_gradients, trace_rules

B, T, V, D = 3, 5, 40, 4


def _ids(rng, shape=(B, T), vocab=V):
  # Repeated tokens inside an example (their rows add before squaring).
  ids = rng.integers(0, vocab, shape).astype(np.int32)
  ids[:, 1] = ids[:, 0]
  return tf.constant(ids)


def _table(rng, dtype=tf.float64, shape=(V, D)):
  return tf.Variable(rng.normal(size=shape), dtype=dtype)


def _lm_transpose_b(e):
  """Lookup, then the head as `h @ E^T` via MatMul(transpose_b=True) on
  the `[B*T, d]` rows: per-token logits."""
  def fn(ids):
    h = tf.tanh(tf.gather(e, ids))                        # [B, T, d]
    logits = tf.linalg.matmul(tf.reshape(h, [-1, D]), e, transpose_b=True)
    return tf.reduce_sum(tf.reshape(logits, [B, T, V]) ** 2, axis=[1, 2])
  return fn


def _two_lookups(e):
  """Two gathers of one table with differently shaped ids (not merged):
  the cross term of two one-hot factors."""
  def fn(ids):
    a = tf.reduce_sum(tf.gather(e, ids) ** 2, axis=[1, 2])
    b = tf.reduce_sum(tf.gather(e, ids[:, :2]) * 3.0, axis=[1, 2])
    return a + b
  return fn


def _norms_and_trace(fn, variables, ids):
  @tf.function
  def norms(ids):
    with tf_pxg.GradientTape() as tape:
      losses = fn(ids)
    return tape.per_example_norms(losses, variables)
  with trace_rules() as records:
    n = norms(ids)
  return n, records


def _reference_norms(fn, variables, ids):
  sq = np.zeros(B)
  for b in range(B):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(fn_b(fn, ids, b))
    for g in tape.gradient(loss, variables):
      sq[b] += float(tf.reduce_sum(tf.convert_to_tensor(g) ** 2))
  return np.sqrt(sq)


def fn_b(fn, ids, b):
  """Example b's loss through the batch function (other examples' losses
  do not depend on it: the functions act row by row)."""
  return fn(ids)[b]


@pytest.mark.parametrize("build", [_lm_transpose_b, _two_lookups])
def test_cross_term_norms_exact_and_never_materialised(build):
  rng = np.random.default_rng(0)
  e = _table(rng)
  fn = build(e)
  ids = _ids(rng)
  norms, records = _norms_and_trace(fn, [e], ids)
  np.testing.assert_allclose(norms.numpy(), _reference_norms(fn, [e], ids),
                             rtol=1e-6)  # Norms are float32.
  forms = {(r["op_type"], r["form"]) for r in records}
  assert not any(f == "per_example" for _, f in forms), forms
  assert sum(f == "outer_factors" for _, f in forms) >= 1, forms


def test_keras_reversible_embedding_all_quantities_xla():
  """Keras' tied `ReversibleEmbedding` (the head reads the table through a
  Transpose, as GPT-2 in KerasHub): norms, per-example gradients and the
  clipped sum, under XLA, against the loop."""
  keras.utils.set_random_seed(1)
  emb = keras.layers.ReversibleEmbedding(V, D, dtype="float64")
  dense = keras.layers.Dense(D, activation="tanh", dtype="float64")
  ids = _ids(np.random.default_rng(1))

  def model(x):
    return emb(dense(emb(x)), reverse=True)                 # [B, T, V]

  def loss(labels, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True), axis=1)

  model(ids)
  variables = emb.trainable_variables + dense.trainable_variables
  check_per_example_gradients(loss, model, variables, ids, ids, mode="jit")

  @tf.function(jit_compile=True)
  def norms(x):
    with tf_pxg.GradientTape() as tape:
      losses = loss(x, model(x))
    return tape.per_example_norms(losses, variables)
  with trace_rules() as records:
    norms(ids)
  assert {(r["op_type"], r["form"]) for r in records
          if r["op_type"] in ("GatherV2", "ResourceGather", "MatMul")
          and r["form"] == "per_example"} == set()


def test_cheaper_to_materialise_still_exact():
  """A tiny table read by many rows: the cross terms' Grams (T^2) cost more
  than the `[B, V, d]` gradient, so it is materialised, still exact."""
  rng = np.random.default_rng(2)
  e = _table(rng, shape=(3, 2))

  def fn(ids):
    h = tf.gather(e, ids)                                   # [B, 16, 2]
    return tf.reduce_sum(tf.einsum("btd,vd->btv", h, e) ** 2, axis=[1, 2])

  ids = _ids(rng, (B, 16), vocab=3)
  norms, records = _norms_and_trace(fn, [e], ids)
  np.testing.assert_allclose(norms.numpy(), _reference_norms(fn, [e], ids),
                             rtol=1e-6)  # Norms are float32.
  assert ("ResourceGather", "per_example") in {(r["op_type"], r["form"])
                                               for r in records}


def test_inner_checks_shapes():
  a = factors.Dense(tf.zeros([1, 2, 3]))
  b = factors.Dense(tf.zeros([1, 2, 4]))
  with pytest.raises(ValueError, match="different shapes"):
    factors.inner(factors.OuterFactors(a, a), factors.OuterFactors(b, a))
