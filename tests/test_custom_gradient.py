"""`tf.custom_gradient` through `tf_pxg.GradientTape`, eagerly and traced.

Eagerly, TF registers a custom gradient on its tape with `record_operation`
(no op callback); tf_pxg hears of it through `tf_pxg._compat`'s patch and
records one entry, so `gradient()` calls the custom gradient as
`tf.GradientTape` does. Every function here has a custom gradient that
differs from its forward ops' gradient, and each test asserts that too, so
a tape that differentiated the forward ops would fail it.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg.testing import check_per_example_gradients

DTYPES = (tf.float32, tf.float64)
BATCHES = (1, 5)


@tf.custom_gradient
def odd_square(x):
  """x**2 forward; gradient (3x + 1) dy (the forward's is 2x dy)."""
  def grad(dy):
    return dy * (3.0 * x + 1.0)
  return tf.square(x), grad


@tf.custom_gradient
def sine_times_five(x):
  """sin(x) forward; gradient 5 dy (the forward's is cos(x) dy)."""
  def grad(dy):
    return dy * 5.0
  return tf.sin(x), grad


@tf.custom_gradient
def outer(x):
  """2 sine_times_five(x) forward (a custom gradient inside); its own
  gradient, cos(x) dy / 2, is the one TF takes."""
  y = sine_times_five(x) * 2.0

  def grad(dy):
    return dy * tf.cos(x) * 0.5
  return y, grad


@tf.custom_gradient
def gradient_calls_custom(x):
  """exp(x) forward; the gradient function itself calls a custom-gradient
  function: sin(dy) x."""
  def grad(dy):
    return sine_times_five(dy) * x
  return tf.exp(x), grad


def _scaled_by(w):
  """x * w forward (reads the variable w inside); gradients 2 w dy for x
  and sum_b(x dy) / 2 for w."""

  @tf.custom_gradient
  def scaled(x):
    y = x * w

    def grad(dy, variables):
      assert len(variables) == 1
      return dy * 2.0 * w, [tf.reduce_sum(dy * x, axis=0) * 0.5]
    return y, grad

  return scaled


def _data(batch, dtype, seed=0, d=3):
  rng = np.random.default_rng(seed)
  return tf.constant(rng.uniform(-1.5, 1.5, size=(batch, d)), dtype)


def _gradients(tape_class, fn, x, variables=()):
  with tape_class(persistent=True) as tape:
    tape.watch(x)
    y = fn(x)
    loss = tf.reduce_sum(y * tf.cast(tf.range(1, 1 + y.shape[-1]), y.dtype))
  return [tape.gradient(loss, s) for s in [x, *variables]]


def _assert_same(got, want, dtype):
  tol = 1e-6 if dtype == tf.float32 else 1e-12
  for g, w in zip(got, want):
    assert g is not None and w is not None
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=tol, atol=tol)


def _assert_differs(got, other):
  assert any(not np.allclose(g.numpy(), o.numpy(), rtol=1e-3)
             for g, o in zip(got, other)), (
                 "the custom gradient equals the forward's: the test "
                 "cannot tell them apart")


def _forward_only(fn):
  """`fn` with its forward ops only: the gradient a tape gets if it misses
  the custom gradient."""
  return lambda x: tf.stop_gradient(fn(x) - _unwrap(fn)(x)) + _unwrap(fn)(x)


def _unwrap(fn):
  forward = {odd_square: tf.square, sine_times_five: tf.sin,
             outer: lambda x: 2.0 * tf.sin(x), gradient_calls_custom: tf.exp}
  return forward[fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("fn", [
    odd_square, sine_times_five, outer, gradient_calls_custom,
    lambda x: outer(odd_square(x)),
], ids=["odd_square", "sine_times_five", "nested", "gradient_calls_custom",
        "composed"])
def test_gradient_equals_tf_eagerly(fn, batch, dtype):
  x = _data(batch, dtype)
  want = _gradients(tf.GradientTape, fn, x)
  got = _gradients(tf_pxg.GradientTape, fn, x)
  _assert_same(got, want, dtype)
  if fn in (odd_square, sine_times_five, outer, gradient_calls_custom):
    _assert_differs(want, _gradients(tf.GradientTape, _forward_only(fn), x))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("batch", BATCHES)
def test_gradient_through_a_variable_read_inside(batch, dtype):
  x = _data(batch, dtype)
  w = tf.Variable(np.array([0.5, -1.0, 2.0]), dtype=dtype)
  fn = _scaled_by(w)
  want = _gradients(tf.GradientTape, fn, x, [w])
  got = _gradients(tf_pxg.GradientTape, fn, x, [w])
  _assert_same(got, want, dtype)
  _assert_differs(want, _gradients(tf.GradientTape, lambda x: x * w, x, [w]))
  # Also with the variable unwatched by default (read, not watched).
  with tf_pxg.GradientTape(watch_accessed_variables=False) as tape:
    tape.watch(x)
    loss = tf.reduce_sum(fn(x))
  gx, gw = tape.gradient(loss, [x, w])
  assert gw is None
  np.testing.assert_allclose(gx.numpy(), (2.0 * w * tf.ones_like(x)).numpy())


def test_gradient_in_tf_function_unchanged():
  x = _data(4, tf.float32)
  want = tf.function(lambda x: _gradients(tf.GradientTape, outer, x))(x)
  got = tf.function(lambda x: _gradients(tf_pxg.GradientTape, outer, x))(x)
  _assert_same(got, want, tf.float32)


def test_second_order_through_the_gradient_function():
  """An outer tape records the inner tape's call of the custom gradient."""
  x = _data(3, tf.float64)

  def second(tape_class):
    with tape_class() as t2:
      t2.watch(x)
      with tape_class() as t1:
        t1.watch(x)
        y = tf.reduce_sum(odd_square(x))
      g = tf.reduce_sum(t1.gradient(y, x))
    return t2.gradient(g, x)

  want = second(tf.GradientTape)
  np.testing.assert_allclose(want.numpy(), 3.0)  # d/dx of (3x + 1)
  _assert_same([second(tf_pxg.GradientTape)], [want], tf.float64)


def test_only_custom_gradients_are_recorded():
  """Other callers of TF's record_operation (an eager ConcreteFunction
  call, here) are not taken for a custom gradient, and nothing is recorded
  while no tf_pxg tape records."""
  x = _data(2, tf.float32)
  f = tf.function(lambda x: tf.sin(x) * 3.0).get_concrete_function(
      tf.TensorSpec([None, 3], tf.float32))
  with tf_pxg.GradientTape() as tape:
    tape.watch(x)
    y = odd_square(x) + f(x)
  assert [e.custom_gradient for e in tape._recorder.entries  # pylint: disable=protected-access
          if e.custom_gradient] == ["odd_square"]
  with tf.GradientTape() as plain:
    plain.watch(x)
    y = tf.reduce_sum(odd_square(x))
  np.testing.assert_allclose(plain.gradient(y, x).numpy(),
                             (3.0 * x + 1.0).numpy(), rtol=1e-6)


# Per-example ------------------------------------------------------------------


def _activation_model(dtype):
  """Dense -> custom-gradient activation (on data only) -> Dense."""
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  dense1 = keras.layers.Dense(4, dtype=dtype.name)
  dense2 = keras.layers.Dense(1, dtype=dtype.name)
  model = keras.Sequential([
      keras.Input((3,), dtype=dtype.name), dense1,
      keras.layers.Lambda(lambda h: outer(odd_square(h)), dtype=dtype.name),
      dense2])
  return model


def _mse(labels, outputs):
  return tf.reduce_sum(tf.square(outputs - labels), axis=-1)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("batch", BATCHES)
def test_per_example_through_a_data_custom_gradient(batch, dtype, mode):
  """The custom gradient sits between two parameters' interfaces: its
  gradient reaches the first layer's per-example gradients."""
  model = _activation_model(dtype)
  x = _data(batch, dtype, seed=2)
  y = _data(batch, dtype, seed=3, d=1)
  check_per_example_gradients(_mse, model, model.trainable_variables, x,
                              labels=y, mode=mode)
  # The forward ops' gradient would give other first-layer gradients.
  with tf_pxg.GradientTape() as tape:
    loss = _mse(y, model(x))
  got = tape.per_example_gradient(loss, model.trainable_variables[0])
  with tf.GradientTape() as tape:
    h = model.layers[0](x)
    out = model.layers[2](_forward_only(outer)(_forward_only(odd_square)(h)))
    loss = tf.reduce_sum(_mse(y, out))
  assert not np.allclose(
      tf.reduce_sum(got, 0).numpy(),
      tape.gradient(loss, model.trainable_variables[0]).numpy(), rtol=1e-3)


@tf.custom_gradient
def clipped_weight(w):
  """w forward; gradient dy clipped to norm 0.5 (the forward's is dy)."""
  def grad(dy):
    return tf.clip_by_norm(dy, 0.5)
  return tf.identity(w), grad


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("batch", BATCHES)
def test_per_example_through_a_parameter_custom_gradient(batch, mode):
  """A custom gradient on the parameter alone (before it meets the data)
  is applied to each example's gradient, not to their sum."""
  w = tf.Variable(np.random.default_rng(4).normal(size=(3, 2)), dtype=tf.float64)

  def model(x):
    return tf.reduce_sum(tf.tanh(x @ clipped_weight(w)), axis=-1)

  x = _data(batch, tf.float64, seed=5) * 3.0
  check_per_example_gradients(None, model, [w], x, mode=mode)
  if batch > 1:  # Clipping the sum is another result.
    with tf_pxg.GradientTape() as tape:
      g = tape.per_example_gradient(model(x), w)
    with tf.GradientTape() as plain:
      total = tf.reduce_sum(model(x))
    assert not np.allclose(tf.reduce_sum(g, 0).numpy(),
                           plain.gradient(total, w).numpy(), rtol=1e-3)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("question", ["per_example_gradient",
                                      "per_example_norms",
                                      "clipped_gradient_sum"])
def test_parameter_read_inside_is_refused(question, mode):
  """A custom gradient that reads a parameter and meets the data gives the
  parameter's gradient for the whole batch in Python: refused by name."""
  w = tf.Variable([0.5, -1.0, 2.0])
  fn = _scaled_by(w)
  x = _data(4, tf.float32)

  def run():
    with tf_pxg.GradientTape() as tape:
      loss = tf.reduce_sum(fn(x), axis=-1)
    args = (1.0,) if question == "clipped_gradient_sum" else ()
    return getattr(tape, question)(loss, [w], *args)

  name = "'scaled'" if mode == "eager" else "'CustomGradient-"
  with pytest.raises(ValueError, match=(
      rf"tf.custom_gradient function {name}.*uses 'Variable.*"
      r"a Python function of the whole batch.*Use the parameter outside")):
    run() if mode == "eager" else tf.function(run)()


@tf.custom_gradient
def batch_mean_gradient(x):
  """tanh(x) forward, row by row; its gradient scales each row by the
  batch's mean of x: example b's gradient depends on the others."""
  def grad(dy):
    return dy * (1.0 + tf.reduce_mean(x, axis=0))
  return tf.tanh(x), grad


@tf.custom_gradient
def centred_gradient(x):
  """x forward; gradient dy minus its batch mean."""
  def grad(dy):
    return dy - tf.reduce_mean(dy, axis=0, keepdims=True)
  return tf.identity(x), grad


@tf.custom_gradient
def looped_cumsum_gradient(x):
  """x forward; its gradient a running sum over the batch, in a while
  loop: example b's gradient adds the rows before it."""
  def grad(dy):
    def body(i, acc, out):
      acc = acc + dy[i]
      return i + 1, acc, out.write(i, acc)
    _, _, out = tf.while_loop(
        lambda i, acc, out: i < tf.shape(dy)[0], body,
        (0, tf.zeros_like(dy[0]),
         tf.TensorArray(dy.dtype, size=tf.shape(dy)[0])))
    return out.stack()
  return tf.identity(x), grad


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("fn", [batch_mean_gradient, centred_gradient,
                                looped_cumsum_gradient])
@pytest.mark.parametrize("question", ["per_example_gradient",
                                      "clipped_gradient_sum"])
def test_gradient_that_mixes_examples_is_refused(question, fn, mode):
  """The forward keeps examples apart, the custom gradient does not: its
  ops are checked as the forward's are, and refused by name (a wrong
  per-example gradient otherwise, not an error)."""
  w = tf.Variable(np.random.default_rng(6).normal(size=(3, 3)),
                  dtype=tf.float32)
  x = _data(4, tf.float32, seed=7)

  def run(x):
    with tf_pxg.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(fn(x @ w)), axis=-1)
    args = (1.0,) if question == "clipped_gradient_sum" else ()
    return getattr(tape, question)(loss, [w], *args)

  with pytest.raises(ValueError, match=(
      r"The gradient of tf.custom_gradient function .* does not keep "
      r"examples apart: .*mixes examples.*compute it from each example's "
      r"own rows")):
    run(x) if mode == "eager" else tf.function(run)(x)
  # One example cannot mix with another: exact, and checked against the
  # reference.
  check_per_example_gradients(
      None, lambda x: tf.reduce_sum(tf.square(fn(x @ w)), axis=-1), [w],
      x[:1], mode=mode)
