"""tf_pxg's own code runs as written inside a user's `tf.function`.

A custom loop's `@tf.function` converts the user's code with autograph (on
by default) and, through `converted_call`, every function it calls that
is not marked `tf.autograph.experimental.do_not_convert`. tf_pxg's
gradient methods (`tf_pxg.GradientTape`) and the DP model's step methods
(`train_step`, `dp_gradients`, `dp_apply`) are marked, so autograph does
not rewrite tf_pxg's backward pass on each first trace (6–12 s of CPU for
a small model before, under 1 s after), and the DP step is the same graph
in a custom loop as in `fit` (whose step Keras marks too). The user's own
code, the forward pass under `with tape:`, is still converted.

The observable: code autograph converted runs from its generated files
(`__autograph_generated_file*.py`). A probe called inside tf_pxg's code (a
`tf.custom_gradient` gradient, called by the tape's backward pass; the
loss, called by the DP step's forward pass) finds no converted frame
between itself and the tape's or the DP model's method on its stack (a
converted method would run from a generated file, and call the rest of
tf_pxg converted).
"""

import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import keras as pxg_keras


# The files of the methods a user calls: the tape's and the DP model's
# (its step methods; `fit`, whose symbolic build calls the loss too).
_ENTRIES = tuple(os.path.join(os.path.dirname(tf_pxg.__file__), *f) for f in
                 (("gradient_tape.py",), ("keras", "models.py"),
                  ("keras", "_fit.py")))


def _converted_frames():
  """The functions on the stack (innermost first) that run autograph's
  generated code and are called from within the tape's or the DP model's
  method the user called (inner to the outermost frame of
  `_ENTRIES`); raises if no such frame is on the stack (a converted
  method runs from a generated file, not from tf_pxg's)."""
  stack = inspect.stack(0)
  entries = [i for i, f in enumerate(stack) if f.filename in _ENTRIES]
  assert entries, [(f.filename, f.function) for f in stack]
  return [f.function for f in stack[:max(entries)]
          if "__autograph_generated_file" in f.filename]


def _probe(seen):
  """Identity whose gradient records the converted frames in `seen`."""
  @tf.custom_gradient
  def probe(x):
    def grad(dy):
      seen.append(_converted_frames())
      return dy
    return tf.identity(x), grad
  return probe


def _data():
  rng = np.random.default_rng(0)
  return (tf.constant(rng.normal(size=(4, 3)), tf.float32),
          tf.constant(rng.normal(size=(4,)), tf.float32))


@pytest.mark.parametrize("method", ["gradient", "per_example_gradient",
                                    "per_example_norms",
                                    "clipped_gradient_sum"])
def test_tape_methods_are_not_converted(method):
  """The backward pass runs tf_pxg's code unconverted; the user's step,
  with a Python `if` on a tensor (which only autograph makes a graph
  branch), is converted and its gradient is right."""
  x, y = _data()
  w = tf.Variable([[0.5], [-1.0], [2.0]])
  seen = []
  probe = _probe(seen)

  @tf.function
  def step(x, y):
    with tf_pxg.GradientTape() as tape:
      loss = tf.square(probe(tf.matmul(x, w))[:, 0] - y)
      total = tf.reduce_sum(loss)
    if method == "gradient":
      result = tape.gradient(total, w)
    elif method == "clipped_gradient_sum":
      result = tape.clipped_gradient_sum(loss, [w], 1e9)[0][0]
    else:
      result = getattr(tape, method)(loss, [w])
    if tf.reduce_sum(w) > 1e6:  # autograph makes this a tf.cond
      result = tf.nest.map_structure(tf.zeros_like, result)
    return result

  result = step(x, y)
  assert seen, "the probe's gradient was not called"
  assert all(frames == [] for frames in seen), seen
  expected = tf.stack([2.0 * (tf.matmul(x[i:i + 1], w)[0, 0] - y[i]) *
                       x[i] for i in range(4)])  # [B, 3]
  got = {"gradient": lambda: tf.reshape(result, [3]),
         "clipped_gradient_sum": lambda: tf.reshape(result, [3]),
         "per_example_gradient": lambda: tf.reshape(result[0], [4, 3]),
         "per_example_norms": lambda: result}[method]()
  want = {"gradient": tf.reduce_sum(expected, 0),
          "clipped_gradient_sum": tf.reduce_sum(expected, 0),
          "per_example_gradient": expected,
          "per_example_norms": tf.norm(expected, axis=1)}[method]
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-6 * float(tf.reduce_max(tf.abs(want))))


def test_dp_step_methods_are_not_converted():
  """`train_step` and `dp_apply(dp_gradients(...))` called from a custom
  loop's `tf.function`: the loss (called by the DP step's forward pass)
  sees no converted frame inside tf_pxg's, and both give the same weights as
  `fit`'s step would (the same seed: the same update)."""
  seen = []

  def loss(y_true, y_pred):
    seen.append(_converted_frames())
    return keras.losses.mean_squared_error(y_true, y_pred)

  x, y = _data()

  def model():
    keras.utils.set_random_seed(1)
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    dp = pxg_keras.make_private(base, seed=3)
    dp.compile(optimizer=pxg_keras.DPSGD(1.0, 1.0, learning_rate=0.1),
               loss=loss)
    return dp

  one, two, three = model(), model(), model()

  @tf.function
  def whole(x, y):
    return one.train_step((x, y))

  @tf.function
  def halves(x, y):
    return two.dp_apply(two.dp_gradients((x, y)))

  whole(x, y)
  halves(x, y)
  assert seen and all(frames == [] for frames in seen), seen
  three.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
  for a, b, c in zip(one.weights, two.weights, three.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())  # the same graph
    # fit's step runs on a padded Poisson batch (q = 1 here: all 4 rows),
    # another shape, so another summation order on some CPUs: equal up to
    # float32 rounding, scaled to the weights' magnitude.
    np.testing.assert_allclose(
        a.numpy(), c.numpy(), rtol=1e-6,
        atol=1e-6 * max(1.0, float(np.max(np.abs(c.numpy())))))
