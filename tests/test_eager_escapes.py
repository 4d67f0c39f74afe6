"""Attacks on the forward pass through Python (issue 40, item 3).

Eagerly, a layer can read a batch value in Python (an `if` on a batch
statistic, `.numpy()`, `tf.numpy_function` / `tf.py_function`) or keep a
tensor on `self` from one batch to the next: that value leaves the recorded
computation unseen, and one example moves every other example's gradient.
tf_pxg traces the DP step in every mode (`compile(run_eagerly=True)`, a
custom loop calling `train_step` or `dp_gradients` eagerly), so each exit is
refused at trace time or never happens. The closed form is a plain
`tf.GradientTape` loop over single examples
(`tf_pxg.testing.reference_per_example_gradients`) on a twin model whose
escape layer is replaced by what it should compute per example.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing

MODES = {"eager": dict(run_eagerly=True), "function": {},
         "jit": dict(jit_compile=True)}
CLIP = 1.0
LR = 0.1


class BranchOnBatch(keras.layers.Layer):
  """Doubles the whole batch when any entry exceeds 50 (a Python `if`)."""

  def call(self, x):
    if tf.reduce_max(x) > 50:
      return 2.0 * x
    return x


class ReadNumpy(keras.layers.Layer):
  """The same through `.numpy()`."""

  def call(self, x):
    return x * (2.0 if float(np.max(x.numpy())) > 50 else 1.0)


def _doubled_if_outlier(a):
  return (a * (2.0 if a.max() > 50 else 1.0)).astype(a.dtype)


class NumpyFunction(keras.layers.Layer):
  """The same through `tf.numpy_function`."""

  def call(self, x):
    y = tf.numpy_function(_doubled_if_outlier, [x], x.dtype)
    return tf.reshape(y, tf.shape(x))


class PyFunction(keras.layers.Layer):
  """The same through `tf.py_function`."""

  def call(self, x):
    y = tf.py_function(lambda a: _doubled_if_outlier(a.numpy()), [x],
                       x.dtype)
    return tf.reshape(y, tf.shape(x))


class KeptOnSelf(keras.layers.Layer):
  """Scales a batch by a statistic of the previous batch, kept on `self`
  (written eagerly only, as eager-first code does)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.kept = None

  def call(self, x):
    out = x if self.kept is None else x * self.kept
    if tf.executing_eagerly():
      self.kept = 1.0 + tf.cast(tf.reduce_max(x) > 50, x.dtype)
    return out


ESCAPES = {"branch": BranchOnBatch, "numpy": ReadNumpy,
           "numpy_function": NumpyFunction, "py_function": PyFunction}


class Net(keras.Model):
  """`Dense(2)` after a pre-processing layer (the escape, or Identity)."""

  def __init__(self, pre=None, **kwargs):
    super().__init__(**kwargs)
    self.pre = keras.layers.Identity() if pre is None else pre
    self.dense = keras.layers.Dense(
        2, kernel_initializer=keras.initializers.RandomNormal(seed=1),
        bias_initializer="zeros")

  def call(self, x):
    return self.dense(self.pre(x))


DPNet = dpk.make_dp_model_class(Net)


def _data():
  """8 examples in 2 batches of 4; example 0 is an outlier (> 50)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 3)).astype("float32")
  x[0] = 100.0
  y = rng.normal(size=(8, 2)).astype("float32")
  return x, y


def _dp_model(kind, pre, clip=CLIP, **compile_kw):
  dp = dict(l2_norm_clip=clip, noise_multiplier=0.0, seed=0)
  if kind == "subclassed":
    model = DPNet(pre, **dp)
  elif kind == "sequential":
    model = dpk.DPSequential([pre, keras.layers.Dense(2)], **dp)
  else:  # make_private of a Sequential built on its first call
    model = dpk.make_private(keras.Sequential([pre, keras.layers.Dense(2)]),
                             **dp)
  model.compile(keras.optimizers.SGD(LR), "mse", **compile_kw)
  return model


def _fit_batch(model, x, y):
  """One DP step on exactly these rows (a plain batch, divided by B)."""
  model.fit(x, y, batch_size=len(x), epochs=1, sampling="shuffled",
            shuffle=False, verbose=0)


def _expected(model, x, y, clip):
  """The weights one noiseless DP-SGD step must give: reference gradients
  of the twin model (Identity in place of the escape) at `model`'s weights,
  clipped per example to `clip`, averaged over the batch."""
  twin = Net()
  twin(x[:1])
  twin.set_weights(model.get_weights())
  grads = pxg_testing.reference_per_example_gradients(
      keras.losses.MeanSquaredError(reduction=None), twin,
      twin.trainable_variables, x, labels=y)
  return pxg_testing.expected_dp_sgd_weights(
      twin.get_weights(), grads, clip, learning_rate=LR)


def _relative_error(got, want):
  num = sum(float(np.sum((np.asarray(g, np.float64) - w) ** 2))
            for g, w in zip(got, want))
  den = sum(float(np.sum(w ** 2)) for w in want)
  return (num / den) ** 0.5


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("escape", list(ESCAPES))
def test_python_exit_is_refused_before_any_update(escape, mode):
  # Before the fix, run_eagerly=True trained through every one of these:
  # the outlier doubled the other examples' activations (relative error of
  # the step against the per-example closed form 0.8 to 1.0).
  x, y = _data()
  model = _dp_model("subclassed", ESCAPES[escape](), **MODES[mode])
  model(x[:1])  # built, so the weights can be compared
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(ValueError) as info:
    _fit_batch(model, x[:4], y[:4])
  message = str(info.value)
  if escape in ("branch", "numpy"):
    assert "reads a tensor's value in Python" in message
    assert "run_eagerly=True" in message and "tf.print" in message
  else:
    assert "PyFunc" in message and "mixes examples" in message
  for w, w0 in zip(model.get_weights(), before):
    np.testing.assert_array_equal(w, w0)


@pytest.mark.parametrize("kind", ["sequential", "make_private"])
def test_python_branch_is_refused_in_every_dp_model_class(kind):
  x, y = _data()
  model = _dp_model(kind, BranchOnBatch(), run_eagerly=True)
  with pytest.raises(ValueError, match="reads a tensor's value in Python"):
    _fit_batch(model, x[:4], y[:4])


def test_tensor_kept_on_self_cannot_carry_a_batch_into_the_next_step():
  # Eagerly (before the fix) batch 1's outlier doubled batch 2's inputs:
  # step 2's update was off the closed form by a relative error of ~1.
  # Traced, the attribute is never written from a batch: both steps equal
  # the per-example closed form.
  x, y = _data()
  clip = 1e4  # no clipping: a doubled input would show in the update
  model = _dp_model("subclassed", KeptOnSelf(), clip=clip, run_eagerly=True)
  model(x[:1])
  model.pre.kept = None  # the public build call's value: none
  for rows in (slice(0, 4), slice(4, 8)):
    want = _expected(model, x[rows], y[rows], clip)
    _fit_batch(model, x[rows], y[rows])
    assert _relative_error(model.get_weights(), want) < 1e-5
  assert model.pre.kept is None


@pytest.mark.parametrize("mode", list(MODES))
def test_eager_dp_training_matches_the_closed_form(mode):
  # The traced step behind run_eagerly=True is exact: two clipped steps
  # against the reference loop.
  x, y = _data()
  x[0] = 3.0  # no outlier needed; clipping is active at C = 1
  model = _dp_model("subclassed", None, **MODES[mode])
  model(x[:1])
  for rows in (slice(0, 4), slice(4, 8)):
    want = _expected(model, x[rows], y[rows], CLIP)
    _fit_batch(model, x[rows], y[rows])
    assert _relative_error(model.get_weights(), want) < 1e-5
  assert model.run_eagerly == (mode == "eager")  # the flag is left as set


def test_eager_train_step_call_is_traced_and_retraced_on_recompile():
  # A custom loop calling train_step eagerly gets the traced step: exact,
  # refusing the Python branch, and following a recompile's optimizer.
  x, y = _data()
  x[0] = 3.0
  model = _dp_model("subclassed", None)
  model(x[:1])
  want = _expected(model, x[:4], y[:4], CLIP)
  model.train_step((tf.constant(x[:4]), tf.constant(y[:4])))
  assert _relative_error(model.get_weights(), want) < 1e-5
  model.compile(keras.optimizers.SGD(2 * LR), "mse")
  before = model.get_weights()
  step = [w - b for w, b in zip(_expected(model, x[4:], y[4:], CLIP),
                                before)]
  model.train_step((tf.constant(x[4:]), tf.constant(y[4:])))
  got = [w - b for w, b in zip(model.get_weights(), before)]
  assert _relative_error(got, [2 * s for s in step]) < 1e-5

  escaping = _dp_model("subclassed", BranchOnBatch())
  escaping(x[:1])
  with pytest.raises(ValueError, match="reads a tensor's value in Python"):
    escaping.train_step((tf.constant(x[:4]), tf.constant(y[:4])))
  with pytest.raises(ValueError, match="reads a tensor's value in Python"):
    escaping.dp_gradients((tf.constant(x[:4]), tf.constant(y[:4]), None))


def test_run_functions_eagerly_is_refused_naming_the_flag():
  x, y = _data()
  for compile_kw in ({}, dict(run_eagerly=True)):
    model = _dp_model("subclassed", None, **compile_kw)
    model(x[:1])
    before = model.get_weights()
    tf.config.run_functions_eagerly(True)
    try:
      with pytest.raises(ValueError,
                         match=r"run_functions_eagerly\(True\).*"
                         r"run_functions_eagerly\(False\)"):
        _fit_batch(model, x[:4], y[:4])
      with pytest.raises(ValueError, match=r"run_functions_eagerly"):
        model.train_step((tf.constant(x[:4]), tf.constant(y[:4])))
    finally:
      tf.config.run_functions_eagerly(False)
    for w, w0 in zip(model.get_weights(), before):
      np.testing.assert_array_equal(w, w0)


@pytest.mark.parametrize("escape", list(ESCAPES) + ["kept_on_self"])
def test_check_example_independence_finds_the_eager_exit(escape):
  x, y = _data()
  layer = KeptOnSelf() if escape == "kept_on_self" else ESCAPES[escape]()
  model = Net(layer)
  model(x[:1])
  with pytest.raises(pxg_testing.ExampleMixingError) as info:
    pxg_testing.check_example_independence(
        model, x, y, loss=keras.losses.MeanSquaredError(reduction=None),
        index=0, change="swap", mode="eager")  # swaps the outlier out
  assert info.value.result.exits
  assert "exit" in str(info.value)


def test_check_example_independence_passes_a_closed_model():
  x, y = _data()
  model = Net()
  model(x[:1])
  result = pxg_testing.check_example_independence(
      model, x, y, loss=keras.losses.MeanSquaredError(reduction=None),
      index=0, change="swap", mode="eager")
  assert result.passed and not result.exits
