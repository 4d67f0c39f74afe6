"""A table gathered by constant ids made inside the model
(`tf_pxg.interface.batch_copies`): BERT's segment ids as `zeros_like(token_ids)`,
which TF folds into a constant `[B, T]` when B is static. Equal rows are a
copy of the gathered rows along the batch axis, exact against the
batch-of-one `tf.GradientTape` loop; unequal rows are each example's own
(exact against the Jacobian)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg.testing import check_per_example_gradients

B, T, V, D = 3, 4, 5, 2


def _model(segment_ids):
  """Token embedding plus a segment embedding gathered by
  `segment_ids(ids)` as Keras' `ops.take` does (negative ids wrapped by a
  select, so the ids are no graph constant)."""
  tokens = tf.Variable(np.random.default_rng(0).normal(size=(V, D)))
  segments = tf.Variable(np.random.default_rng(1).normal(size=(2, D)))

  def fn(ids):
    seg = keras.ops.take(segments, segment_ids(ids), axis=0)
    return tf.reduce_sum(tf.tanh(tf.gather(tokens, ids) + seg) ** 2,
                         axis=[1, 2])
  return fn, [tokens, segments]


def _ids():
  return tf.constant(np.random.default_rng(2).integers(0, V, (B, T)),
                     tf.int32)


@pytest.mark.parametrize("segment_ids", [
    keras.ops.zeros_like,
    lambda ids: tf.ones_like(ids) * tf.constant([[0, 0, 1, 1]])])
def test_equal_rows_of_constant_ids_are_a_copy(segment_ids):
  fn, variables = _model(segment_ids)
  check_per_example_gradients(None, fn, variables, _ids(), mode="function")


def test_unequal_rows_of_constant_ids_exact():
  """Ids made in the graph from constants alone, with unequal rows (not a
  copy: example b gathers other rows than example c). The batch-of-one
  loop cannot slice a constant made inside the function, so the reference
  is the Jacobian of the per-example losses of the whole batch."""
  rows = np.arange(B * T).reshape(B, T) % 2
  fn, variables = _model(lambda ids: tf.constant(rows, tf.int32))
  ids = _ids()

  @tf.function
  def norms(ids):
    with tf_pxg.GradientTape() as tape:
      losses = fn(ids)
    return tape.per_example_norms(losses, variables)
  with tf.GradientTape(persistent=True) as tape:
    losses = fn(ids)
  expected = np.sqrt(sum(
      tf.reduce_sum(tf.reshape(tape.jacobian(losses, v), [B, -1]) ** 2, 1)
      for v in variables))
  np.testing.assert_allclose(norms(ids).numpy(), expected, rtol=1e-6)
