"""A `tf.function` called inside the model.

While a tf_pxg tape records, a nested `tf.function` call runs its Python
function in the caller's context (`tf_pxg.tape.control_flow`), so its ops are
recorded: per-example quantities equal the `tf.GradientTape` loop over
single examples in eager mode, `tf.function` and XLA. A call the tape cannot
see into (a `ConcreteFunction`) raises, naming the function and the
variable, instead of returning None or zeros.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import testing as pxg_testing

MODES = pxg_testing.MODES
B = 3


class Model(tf.Module):
  """Raw variables and a nested tf.function (decorated helper)."""

  def __init__(self):
    rng = np.random.default_rng(0)
    self.w = tf.Variable(rng.standard_normal((4, 3)), dtype=tf.float32,
                         name="inner_kernel")
    self.b = tf.Variable(rng.standard_normal((3,)), dtype=tf.float32,
                         name="outer_bias")

  @tf.function
  def project(self, x):
    return tf.matmul(x, self.w)

  def __call__(self, x):
    return tf.tanh(self.project(x) + self.b)


class DenseWithFunction(keras.layers.Layer):
  """A Keras layer whose call goes through a jit-compiled tf.function."""

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], 2), name="kernel")

  @tf.function(jit_compile=True)
  def _apply(self, x):
    return keras.ops.matmul(x, self.kernel)

  def call(self, x):
    return self._apply(x)


def _sq_loss(outputs):
  return tf.reduce_sum(tf.square(outputs), axis=-1)


@pytest.mark.parametrize("mode", MODES)
def test_nested_tf_function_matches_reference(mode):
  model = Model()
  x = tf.constant(np.random.default_rng(1).standard_normal((B, 4)),
                  tf.float32)
  pxg_testing.check_per_example_gradients(
      _sq_loss, model, [model.w, model.b], x, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_keras_layer_calling_jit_function_matches_reference(mode):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.layers.Dense(4, activation="tanh"),
                            DenseWithFunction()])
  x = tf.constant(np.random.default_rng(2).standard_normal((B, 5)),
                  tf.float32)
  model(x)
  pxg_testing.check_per_example_gradients(
      _sq_loss, model, model.trainable_variables, x, mode=mode)


@pytest.mark.parametrize("mode", ("eager", "function"))
def test_unclipped_sum_equals_gradient_for_every_source(mode):
  """With a clip nothing reaches, the clipped sum is the plain gradient, and
  every source with a non-zero gradient has non-zero per-example ones."""
  model = Model()
  x = tf.constant(np.random.default_rng(3).standard_normal((B, 4)),
                  tf.float32)
  variables = [model.w, model.b]

  def run(x):
    with tf_pxg.GradientTape(persistent=True) as tape:
      losses = _sq_loss(model(x))
      total = tf.reduce_sum(losses)
    grads = tape.gradient(total, variables)
    sums, _ = tape.clipped_gradient_sum(losses, variables, 1e9)
    per_example = tape.per_example_gradient(losses, variables)
    return grads, sums, per_example

  if mode == "function":
    run = tf.function(run)
  grads, sums, per_example = run(x)
  for g, s, p in zip(grads, sums, per_example):
    scale = float(np.max(np.abs(g.numpy())))
    assert scale > 0
    np.testing.assert_allclose(s.numpy(), g.numpy(), rtol=0,
                               atol=1e-5 * scale)
    assert p is not None and float(np.max(np.abs(p.numpy()))) > 0


@pytest.mark.parametrize("mode", ("eager", "function"))
def test_concrete_function_call_raises_naming_function_and_variable(mode):
  model = Model()
  concrete = model.project.get_concrete_function(
      tf.TensorSpec([None, 4], tf.float32))
  x = tf.ones([B, 4])

  def run(x):
    with tf_pxg.GradientTape() as tape:
      losses = _sq_loss(concrete(x) + model.b)
    return tape.per_example_gradient(losses, [model.w, model.b])

  if mode == "function":
    run = tf.function(run)
  with pytest.raises(ValueError, match=r"(?s)inner_kernel.*project"):
    run(x)


def test_gradient_through_concrete_function_call_equals_tf():
  """The call op of a ConcreteFunction is recorded: `gradient` still works."""
  model = Model()
  concrete = model.project.get_concrete_function(
      tf.TensorSpec([None, 4], tf.float32))
  x = tf.constant(np.random.default_rng(4).standard_normal((B, 4)),
                  tf.float32)

  @tf.function
  def both(x):
    with tf_pxg.GradientTape() as tape:
      ours = tf.reduce_sum(tf.tanh(concrete(x) + model.b))
    with tf.GradientTape() as ref_tape:
      ref = tf.reduce_sum(tf.tanh(concrete(x) + model.b))
    return (tape.gradient(ours, [model.w, model.b]),
            ref_tape.gradient(ref, [model.w, model.b]))

  ours, ref = both(x)
  for g, r in zip(ours, ref):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-6,
                               atol=1e-6 * float(np.max(np.abs(r.numpy()))))
