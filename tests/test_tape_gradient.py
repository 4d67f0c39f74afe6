"""`tf_pxg.GradientTape` is a drop-in for `tf.GradientTape`.

Every test writes its computation once, as a function of the tape class, and
runs it with `tf.GradientTape` and with `tf_pxg.GradientTape`, eagerly and
inside `tf.function`; the results must agree (within 1e-6 relative for
gradients, normwise per tensor, and `None` exactly where TensorFlow gives `None`).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import indexed_slices

import tf_pxg

MODES = ("eager", "function")
RTOL = 1e-6
# For gradients that are zero in exact arithmetic (an attention key bias),
# where both tapes give float32 rounding noise of different summation order.
ATOL = 1e-7
L = keras.layers


def _run(fn, mode):
  if mode == "eager":
    return fn()
  return tf.function(fn)()


def _dense(g):
  if isinstance(g, indexed_slices.IndexedSlices):
    return tf.convert_to_tensor(g)
  return g


def assert_same_gradients(actual, expected, rtol=RTOL):
  """Same structure, None where TF has None, values within rtol (normwise:
  `|a - e| <= rtol * max|e| + ATOL`)."""
  flat_a = tf.nest.flatten(actual, expand_composites=False)
  flat_e = tf.nest.flatten(expected, expand_composites=False)
  assert len(flat_a) == len(flat_e), (actual, expected)
  for i, (a, e) in enumerate(zip(flat_a, flat_e)):
    if e is None:
      assert a is None, f"gradient {i}: TF gives None, tf_pxg gives {a}"
      continue
    assert a is not None, f"gradient {i}: tf_pxg gives None, TF a value"
    a = np.asarray(_dense(a).numpy(), np.float64)
    e = np.asarray(_dense(e).numpy(), np.float64)
    assert a.shape == e.shape, (i, a.shape, e.shape)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    diff = float(np.max(np.abs(a - e))) if e.size else 0.0
    assert diff <= rtol * scale + ATOL, (
        f"gradient {i}: max |tf_pxg - tf| = {diff:.3g} > {rtol:g} * "
        f"{scale:.3g} + {ATOL:g}")


def compare(body, mode, rtol=RTOL):
  """Runs `body(TapeClass)` with both tapes in `mode` and compares."""
  expected = _run(lambda: body(tf.GradientTape), mode)
  actual = _run(lambda: body(tf_pxg.GradientTape), mode)
  # Drop-in means the same result types too (IndexedSlices for gathers).
  assert ([type(g).__name__ for g in tf.nest.flatten(actual)] ==
          [type(g).__name__ for g in tf.nest.flatten(expected)])
  assert_same_gradients(actual, expected, rtol)
  return actual


# Models ---------------------------------------------------------------------


def _mlp():
  return keras.Sequential([keras.Input((5,)), L.Dense(8, activation="relu"),
                           L.Dense(6, activation="tanh"), L.Dense(3)])


def _cnn():
  return keras.Sequential([
      keras.Input((8, 8, 2)),
      L.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
      L.Conv2D(4, 3, dilation_rate=1),
      L.MaxPooling2D(2),
      L.Flatten(),
      L.Dense(3),
  ])


def _rnn():
  return keras.Sequential([
      keras.Input((5, 3)),
      L.SimpleRNN(4, unroll=True, return_sequences=True),
      L.LSTM(4, unroll=True, return_sequences=True),
      L.GRU(4, unroll=True),
      L.Dense(3),
  ])


def _embedding():
  return keras.Sequential([
      keras.Input((6,), dtype="int32"),
      L.Embedding(10, 4),
      L.GlobalAveragePooling1D(),
      L.Dense(3),
  ])


def _attention():
  inp = keras.Input((5, 6))
  h = L.MultiHeadAttention(num_heads=2, key_dim=3)(inp, inp)
  h = L.LayerNormalization()(h + inp)
  h = L.GlobalAveragePooling1D()(h)
  return keras.Model(inp, L.Dense(3)(h))


def _rnn_loops():
  """Default unroll=False (a While loop; unrolled while tf_pxg records)."""
  return keras.Sequential([
      keras.Input((5,), dtype="int32"),
      L.Embedding(10, 3, mask_zero=True),
      L.Bidirectional(L.GRU(4, return_sequences=True)),
      L.LSTM(4, go_backwards=True),
      L.Dense(3),
  ])


class _WithNestedFunction(keras.layers.Layer):
  """Calls a tf.function (inlined while tf_pxg records)."""

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], 3), name="kernel")

  @tf.function
  def _project(self, x):
    return keras.ops.matmul(x, self.kernel)

  def call(self, x):
    return self._project(x)


def _nested_function():
  return keras.Sequential([keras.Input((5,)), L.Dense(4, activation="tanh"),
                           _WithNestedFunction()])


MODELS = {
    "rnn_loops_masked": (_rnn_loops, (4, 5), 10),
    "nested_tf_function": (_nested_function, (4, 5), None),
    "mlp": (_mlp, (4, 5), None),
    "cnn": (_cnn, (4, 8, 8, 2), None),
    "rnn_unroll": (_rnn, (4, 5, 3), None),
    "embedding": (_embedding, (4, 6), 10),
    "attention": (_attention, (4, 5, 6), None),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_equals_tf_on_models(name, mode):
  make, shape, vocab = MODELS[name]
  keras.utils.set_random_seed(0)
  model = make()
  rng = np.random.default_rng(0)
  if vocab:
    ids = rng.integers(0, vocab, size=shape)
    ids[:, 1] = ids[:, 0]  # repeated tokens
    x = tf.constant(ids, tf.int32)
  else:
    x = tf.constant(rng.standard_normal(shape), tf.float32)
  y = tf.constant(rng.integers(0, 3, size=shape[0]), tf.int32)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  model(x)

  def body(tape_cls):
    with tape_cls() as tape:
      loss = loss_fn(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)

  grads = compare(body, mode)
  assert all(g is not None for g in grads)


# The drop-in API ------------------------------------------------------------


@pytest.fixture
def w():
  return tf.Variable([[1.0, -2.0], [0.5, 3.0]], name="w")


@pytest.fixture
def v():
  return tf.Variable([0.3, -0.7], name="v")


X = tf.constant([[1.0, 2.0], [-1.0, 0.5], [0.25, 4.0]])


@pytest.mark.parametrize("mode", MODES)
def test_persistent_several_calls(mode, w, v):

  def body(tape_cls):
    with tape_cls(persistent=True) as tape:
      h = tf.tanh(tf.matmul(X, w) + v)
      l1 = tf.reduce_sum(h * h)
      l2 = tf.reduce_mean(tf.exp(h))
    return (tape.gradient(l1, [w, v]), tape.gradient(l2, [w, v]),
            tape.gradient(l1, w), tape.gradient(h, v))

  compare(body, mode)


@pytest.mark.parametrize("mode", MODES)
def test_non_persistent_second_call_raises(mode, w):

  def body():
    with tf_pxg.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(X, w))
    tape.gradient(loss, w)
    tape.gradient(loss, w)

  with pytest.raises(RuntimeError):
    _run(body, mode)


@pytest.mark.parametrize("mode", MODES)
def test_watch_tensors(mode):

  def body(tape_cls):
    x = tf.constant([1.0, 2.0, 3.0])
    unwatched = tf.constant([4.0, 5.0, 6.0])
    with tape_cls() as tape:
      tape.watch(x)
      y = tf.reduce_sum(x * x * unwatched)
    return tape.gradient(y, [x, unwatched])

  grads = compare(body, mode)
  assert grads[1] is None


@pytest.mark.parametrize("mode", MODES)
def test_watch_nested_structure(mode):

  def body(tape_cls):
    a, b = tf.constant(2.0), tf.constant([1.0, -1.0])
    with tape_cls() as tape:
      tape.watch({"a": a, "b": [b]})
      y = a * tf.reduce_sum(b * b)
    return tape.gradient(y, {"a": a, "b": b})

  compare(body, mode)


@pytest.mark.parametrize("mode", MODES)
def test_watch_accessed_variables_false(mode, w, v):

  def body(tape_cls):
    with tape_cls(watch_accessed_variables=False) as tape:
      tape.watch(w)
      loss = tf.reduce_sum(tf.matmul(X, w) * v)
    return tape.gradient(loss, [w, v])

  grads = compare(body, mode)
  assert grads[0] is not None and grads[1] is None


@pytest.mark.parametrize("mode", MODES)
def test_stop_recording(mode, w, v):

  def body(tape_cls):
    with tape_cls(persistent=True) as tape:
      h = tf.matmul(X, w)
      with tape.stop_recording():
        h_unrecorded = h * v
      out = tf.reduce_sum(h * v)
    return (tape.gradient(out, [w, v]),
            tape.gradient(tf.reduce_sum(h_unrecorded), [w, v]))

  grads = compare(body, mode)
  assert grads[1] == [None, None]


@pytest.mark.parametrize("mode", MODES)
def test_reset(mode, w, v):

  def body(tape_cls):
    with tape_cls() as tape:
      first = tf.reduce_sum(tf.matmul(X, w))
      tape.reset()
      second = tf.reduce_sum(tf.matmul(X, w) * v)
    return tape.gradient(second, [w, v]), first

  def grads_of_first(tape_cls):
    with tape_cls(persistent=True) as tape:
      first = tf.reduce_sum(tf.matmul(X, w))
      tape.reset()
      tf.reduce_sum(v * v)
    return tape.gradient(first, [w, v])

  compare(body, mode)
  assert compare(grads_of_first, mode) == [None, None]


@pytest.mark.parametrize("mode", MODES)
def test_output_gradients(mode, w):
  dy = tf.constant([[1.0, 0.0], [2.0, -1.0], [0.5, 3.0]])

  def body(tape_cls):
    with tape_cls(persistent=True) as tape:
      y = tf.sin(tf.matmul(X, w))
      z = tf.reduce_sum(y, axis=1)
    return (tape.gradient(y, w, output_gradients=dy),
            tape.gradient([y, z], w,
                          output_gradients=[dy, tf.constant([1., 2., 3.])]))

  compare(body, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unconnected", ["none", "zero"])
def test_unconnected_gradients(mode, unconnected, w, v):
  kind = (tf.UnconnectedGradients.NONE if unconnected == "none" else
          tf.UnconnectedGradients.ZERO)
  x_unused = tf.constant([1.0, 2.0])

  def body(tape_cls):
    with tape_cls() as tape:
      tape.watch(x_unused)
      _ = v * 2.0
      loss = tf.reduce_sum(tf.matmul(X, w))
    return tape.gradient(loss, [w, v, x_unused], unconnected_gradients=kind)

  grads = compare(body, mode)
  if unconnected == "none":
    assert grads[1] is None and grads[2] is None
  else:
    assert grads[1].shape == v.shape and not np.any(grads[1].numpy())
    assert grads[2].shape == x_unused.shape


@pytest.mark.parametrize("mode", MODES)
def test_multiple_targets(mode, w, v):

  def body(tape_cls):
    with tape_cls() as tape:
      h = tf.matmul(X, w)
      t1 = tf.reduce_sum(tf.tanh(h))
      t2 = tf.reduce_mean(h * v)
    return tape.gradient({"a": t1, "b": [t2, h]}, [w, v])

  compare(body, mode)


@pytest.mark.parametrize("mode", MODES)
def test_nested_tapes_second_derivative(mode):

  def body(tape_cls):
    x = tf.constant([0.5, -1.5, 2.0])
    with tape_cls() as outer:
      outer.watch(x)
      with tape_cls() as inner:
        inner.watch(x)
        y = x ** 3
      dy = inner.gradient(y, x)
    return dy, outer.gradient(dy, x)

  dy, d2y = compare(body, mode)
  x = np.array([0.5, -1.5, 2.0])
  np.testing.assert_allclose(dy.numpy(), 3 * x ** 2, rtol=1e-6)
  np.testing.assert_allclose(d2y.numpy(), 6 * x, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_nested_tapes_hessian_vector_product(mode, w):
  vec = tf.constant([[1.0, 0.0], [-1.0, 2.0]])

  def body(tape_cls):
    with tape_cls() as outer:
      with tape_cls() as inner:
        loss = tf.reduce_sum(tf.sin(tf.matmul(X, w)) ** 2)
      g = inner.gradient(loss, w)
      gv = tf.reduce_sum(g * vec)
    return outer.gradient(gv, w)

  compare(body, mode)


@pytest.mark.parametrize("mode", MODES)
def test_watched_variables(mode, w, v):
  untrainable = tf.Variable([1.0, 1.0], trainable=False, name="untrainable")

  def body(tape_cls, names):
    with tape_cls() as tape:
      _ = tf.matmul(X, w) * untrainable + v
    names.append(sorted(x.name for x in tape.watched_variables()))
    with tape_cls(watch_accessed_variables=False) as tape:
      tape.watch(v)
      _ = tf.matmul(X, w) * v
    names.append([x.name for x in tape.watched_variables()])
    return tf.constant(0.0)

  expected, actual = [], []
  _run(lambda: body(tf.GradientTape, expected), mode)
  _run(lambda: body(tf_pxg.GradientTape, actual), mode)
  assert actual == expected == [["v:0", "w:0"], ["v:0"]]


def test_watched_variables_keras_model():
  keras.utils.set_random_seed(0)
  model = _mlp()
  model(X[:, :1] * tf.ones([3, 5]))
  x = tf.ones([2, 5])
  with tf_pxg.GradientTape() as tape:
    model(x)
  with tf.GradientTape() as ref:
    model(x)
  ids = lambda vs: sorted(id(getattr(u, "_value", u)) for u in vs)
  assert ids(tape.watched_variables()) == ids(ref.watched_variables())
  assert len(tape.watched_variables()) == len(model.trainable_variables)
