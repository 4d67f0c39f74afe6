"""The engine through TFP's math: library constants, and the attacks on them.

TFP's `lbeta` (StudentT, NegativeBinomial, Beta) reads a `[6]` table of
Stirling-series coefficients with `coeffs[5]`. At B = 2, 3 or 6 the
classifier must not take that table for a batch of examples, and must
still take a real batch of the same shape and dtype for data
(`tf_pxg.tape.library_constants` gives the argument).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

tfp = pytest.importorskip("tensorflow_probability")

import tf_pxg  # noqa: E402
import tf_pxg.probability  # noqa: E402,F401  (registers TFP's tables)
from tf_pxg.tape import library_constants  # noqa: E402

tfd = tfp.distributions
MODES = ("eager", "function", "jit")


def _run(fn, mode):
  if mode == "eager":
    return fn()
  return tf.function(fn, jit_compile=mode == "jit")()


def _model(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])


def _lbeta_table(dtype):
  """The table as TFP builds it, read from a trace on placeholders."""
  found = library_constants._CONSTANTS.get((tf.as_dtype(dtype).name, (6,)))  # pylint: disable=protected-access
  assert found, "importing tf_pxg.probability registers lbeta's table"
  return found[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", range(1, 9))
def test_student_t_at_every_batch_size(batch, mode):
  """B = 2, 3, 6 divide the table's length: they were refused before."""
  model = _model()
  rng = np.random.default_rng(batch)
  x = tf.constant(rng.normal(size=(batch, 3)), tf.float32)
  y = tf.constant(rng.normal(size=(batch,)), tf.float32)

  def grads():
    with tf_pxg.GradientTape() as tape:
      p = model(x)
      losses = -tfd.StudentT(1.0 + tf.nn.softplus(p[:, 2]), p[:, 0],
                             tf.nn.softplus(p[:, 1]) + 1e-3).log_prob(y)
    return tape.per_example_gradient(losses, model.trainable_variables)

  got = _run(grads, mode)
  for b in range(batch):
    with tf.GradientTape() as tape:
      p = model(x[b:b + 1])
      loss = -tfd.StudentT(1.0 + tf.nn.softplus(p[:, 2]), p[:, 0],
                           tf.nn.softplus(p[:, 1]) + 1e-3).log_prob(y[b:b + 1])
    for g, r in zip(got, tape.gradient(loss, model.trainable_variables)):
      np.testing.assert_allclose(g[b], r, rtol=1e-4,
                                 atol=1e-5 * float(np.abs(r).max()))


def _picks_row_five(table_fn, mode):
  """Each example's loss reads row 5 of a `[6]` float32 tensor made
  outside the tape: with B = 2 that row belongs to example 1 if the
  tensor is a batch of examples, so the engine must refuse."""
  model = _model()
  x = tf.constant(np.random.default_rng(0).normal(size=(2, 3)), tf.float32)

  def grads():
    table = table_fn()
    with tf_pxg.GradientTape() as tape:
      p = model(x)
      losses = tf.reduce_sum(p, axis=1) * table[5]
    return tape.per_example_gradient(losses, model.trainable_variables)

  return _run(grads, mode)


@pytest.mark.parametrize("mode", MODES)
def test_attack_data_shaped_like_the_table_is_still_refused(mode):
  """Labels of the table's shape and dtype, whose values differ from it by
  one ulp in one place: data, refused."""
  labels = np.array(_lbeta_table(tf.float32), np.float32)
  labels[2] = np.nextafter(labels[2], np.float32(1.0))
  with pytest.raises(ValueError, match="mixes examples"):
    _picks_row_five(lambda: tf.constant(labels), mode)


@pytest.mark.parametrize("mode", MODES)
def test_attack_an_unregistered_literal_is_still_refused(mode):
  """A literal table of that shape that no library registered (the rule is
  not "every Const"): refused."""
  with pytest.raises(ValueError, match="mixes examples"):
    _picks_row_five(lambda: tf.constant([1., 2., 3., 4., 5., 6.]), mode)


@pytest.mark.parametrize("mode", MODES)
def test_attack_random_labels_of_the_shape_are_refused(mode):
  y = np.random.default_rng(1).normal(size=6).astype(np.float32)
  with pytest.raises(ValueError, match="mixes examples"):
    _picks_row_five(lambda: tf.constant(y), mode)


@pytest.mark.parametrize("mode", MODES)
def test_the_registered_table_itself_passes(mode):
  """The bit-identical table is a constant: the gradient is example b's
  own (`sum(x_b W + c) * table[5]`)."""
  table = _lbeta_table(tf.float32)
  got = _picks_row_five(lambda: tf.constant(table), mode)
  x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
  kernel = np.repeat(x[:, :, None], 3, axis=2) * table[5]
  np.testing.assert_allclose(got[0], kernel, rtol=1e-6)


def test_is_library_constant_refuses_what_is_not_proven():
  table = _lbeta_table(tf.float32)
  assert library_constants.is_library_constant(tf.constant(table))
  # Another dtype, another shape, a flipped sign bit on a zero-free table.
  assert not library_constants.is_library_constant(
      tf.constant(table.astype(np.float16)))
  assert not library_constants.is_library_constant(
      tf.constant(table[None]))
  assert not library_constants.is_library_constant(tf.constant(-table))
  assert not library_constants.is_library_constant(
      tf.constant(np.arange(6), tf.int32))

  seen = []

  @tf.function(input_signature=[tf.TensorSpec([6], tf.float32)])
  def trace(placeholder):
    seen.append((library_constants.is_library_constant(placeholder),
                 library_constants.is_library_constant(tf.constant(table))))
    return placeholder

  trace(tf.constant(table))
  assert seen == [(False, True)]


def test_register_traced_takes_placeholders_only():
  with pytest.raises(TypeError, match="TensorSpec"):
    library_constants.register_traced(lambda a: a * 2.0,
                                      [[np.ones(6, np.float32)]])
  # A function of placeholders registers its own literals, not the values
  # it is later called with.
  made = np.array([0.5, 0.25, 0.125], np.float64)
  added = library_constants.register_traced(
      lambda a: a * tf.constant(made),
      [[tf.TensorSpec([None, 3], tf.float64)]])
  assert added == 1
  assert library_constants.is_library_constant(tf.constant(made))
  assert not library_constants.is_library_constant(tf.constant(made * 2))


@pytest.mark.parametrize("mode", MODES)
def test_beta_cdf_through_betainc_custom_gradient(mode):
  """TFP's betainc has a tf.custom_gradient (TF's Betainc op has no
  gradient for a and b): a censored Beta likelihood through it. Eagerly
  the custom gradient is recorded through `tf_pxg._compat`'s hook on TF's
  `record_operation` (issue 43; without it tf_pxg differentiated the
  forward ops and lost the a, b gradients), and its ops are checked one
  by one: exact. In a tf.function (and XLA) its series is a graph loop
  whose body is not recorded op by op, so tf_pxg cannot show that it
  keeps each example's rows and refuses it by name (fail-safe)."""
  model = _model()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 3)).astype(np.float32)
  y = rng.uniform(0.1, 0.9, size=(6,)).astype(np.float32)

  def loss_fn(labels, p):
    return -tfd.Beta(tf.nn.softplus(p[:, 0]) + 0.1,
                     tf.nn.softplus(p[:, 1]) + 0.1).log_cdf(labels)

  check = lambda: tf_pxg.testing.check_per_example_gradients(  # noqa: E731
      loss_fn, model, model.trainable_variables, x, labels=y, mode=mode)
  if mode != "eager":
    with pytest.raises(ValueError, match="graph loop.*cannot be shown"):
      check()
    return
  assert check() <= 1e-4


_WITHOUT_IMPORT = r"""
import sys
import numpy as np, tensorflow as tf, keras
import tensorflow_probability as tfp
import tf_pxg
assert "tf_pxg.probability.constants" not in sys.modules
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
rng = np.random.default_rng(6)
x = tf.constant(rng.normal(size=(6, 3)), tf.float32)
y = tf.constant(rng.normal(size=(6,)), tf.float32)
with tf_pxg.GradientTape() as tape:
  p = model(x)
  losses = -tfp.distributions.StudentT(
      1.0 + tf.nn.softplus(p[:, 2]), p[:, 0],
      tf.nn.softplus(p[:, 1]) + 1e-3).log_prob(y)
g = tape.per_example_gradient(losses, model.trainable_variables)
assert "tf_pxg.probability.constants" in sys.modules
print("SHAPES", [tuple(t.shape) for t in g])
"""


def test_tfp_under_the_tape_needs_no_extra_import():
  """Issue 52: TFP used directly under the tape (StudentT at B = 6, the
  length of lbeta's table) was refused, naming StridedSlice, unless
  `tf_pxg.probability` was imported first. The engine now loads the module
  that registers TFP's literals once TFP itself is loaded
  (`library_constants.LIBRARY_LITERALS`). A fresh process, so nothing was
  imported before."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  proc = subprocess.run([sys.executable, "-c", _WITHOUT_IMPORT],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "SHAPES [(6, 3, 3), (6, 3)]" in proc.stdout, proc.stdout


def test_a_failed_literal_import_is_named_in_the_refusal(monkeypatch):
  """Where the registering module cannot import (a TFP that does not match
  TensorFlow, here a module that does not exist), the refusal says which
  import failed and why, instead of blaming the op alone."""
  monkeypatch.setitem(library_constants.LIBRARY_LITERALS, "numpy",
                      "tf_pxg.no_such_literals_module")
  monkeypatch.setattr(library_constants, "_FAILED", {})
  with pytest.raises(ValueError, match="numpy is loaded, but importing "
                     "tf_pxg.no_such_literals_module .*ModuleNotFoundError"):
    _picks_row_five(lambda: tf.constant(np.arange(6.0, dtype=np.float32)),
                    "eager")
