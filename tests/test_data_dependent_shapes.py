"""Data-dependent shapes are data (issue 40, item 2).

A layer can read a count over the whole batch through a shape:
`n = tf.shape(tf.where(tf.abs(x) > 50))[0]`, then scale its output by
`1 + min(n, 1)`. One outlier example then doubles every other example's
activations. Shape ops used to give constants, so the op that made the shape
depend on the values (`Where`) was never on the checked data path, and DP
`fit` trained silently in `tf.function`, under XLA and eagerly (measured
before the fix: one example moved the clipped gradient sum by 15.8 where the
bound is 2C = 12; `test_attack_really_breaks_the_sensitivity_bound`).

Here, as attacks against closed forms computed independently:

* the attack and its variants (a `tf.boolean_mask` count, the size of
  `tf.unique`, the size of `tf.where`, a count laundered through
  `tf.zeros([n])`) are refused before any update by DP `fit` in
  `tf.function`, XLA and eager mode, and by the engine, with an error naming
  the op;
* shapes that depend only on the batch size (`tf.shape(x)[0]`,
  `tf.reshape(x, [-1, ...])`, `keras.ops.shape`, the padded Poisson batch)
  and elementwise masks (`tf.where(cond, x, 0)`) still train, one step equal
  to the clipped reference update from a plain `tf.GradientTape` loop over
  single examples;
* `tf.py_function` / `tf.numpy_function` stay refused.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing

B, D, U = 8, 4, 3
L = keras.layers
MODES = ("function", "jit", "eager")


def _one(n, dtype):
  return 1.0 + tf.cast(tf.minimum(n, 1), dtype)


# Layers whose output scales every example by a count over the whole batch.
ATTACKS = {
    # The layer: the number of outlier elements in the batch.
    "where_count": (
        "Where",
        lambda x: x * _one(tf.shape(tf.where(tf.abs(x) > 50))[0], x.dtype)),
    "boolean_mask_count": (
        "Where",
        lambda x: x * _one(tf.shape(tf.boolean_mask(x, tf.abs(x) > 50))[0],
                           x.dtype)),
    "unique_size": (
        "Unique",
        lambda x: x * tf.cast(tf.size(tf.unique(tf.reshape(
            tf.cast(tf.abs(x) > 50, tf.int32), [-1])).y), x.dtype)),
    "where_size_scale": (
        "Where",
        lambda x: x * _one(tf.size(tf.where(tf.abs(x) > 50)), x.dtype)),
    "count_through_fill": (
        "Where",
        lambda x: x * _one(tf.size(tf.zeros(
            tf.shape(tf.where(tf.abs(x) > 50))[:1])), x.dtype)),
}


class _Fn(L.Layer):
  """A layer that applies `fn` to its input."""

  def __init__(self, fn, **kwargs):
    super().__init__(**kwargs)
    self.fn = fn

  def call(self, x):
    return self.fn(x)


def _data(outlier=False, n=B):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, D)).astype("float32")
  y = rng.integers(0, U, n)
  if outlier:
    x[0] = 100.0
  return x, y


def _loss(reduction="sum_over_batch_size"):
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=reduction)


def _dp_model(fn, clip=6.0, **kwargs):
  keras.utils.set_random_seed(0)
  model = dpk.DPSequential([_Fn(fn), L.Dense(U)], l2_norm_clip=clip,
                           noise_multiplier=0.0, seed=0, **kwargs)
  model.build((None, D))
  return model


def _fit(model, x, y, mode, **kwargs):
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss=_loss(),
                run_eagerly=mode == "eager", jit_compile=mode == "jit")
  kwargs.setdefault("sampling", "shuffled")
  return model.fit(x, y, batch_size=len(x), epochs=1, verbose=0,
                   shuffle=False, **kwargs)


# The attack, measured without tf_pxg --------------------------------------------


def _clipped_sum(fn, x, y, weights, clip):
  """The clipped sum of the true per-example gradients of the batch-coupled
  model, by a plain `tf.GradientTape` Jacobian of the `[B]` losses (no
  tf_pxg)."""
  model = keras.Sequential([_Fn(fn), L.Dense(U)])
  model.build((None, D))
  model.set_weights(weights)
  with tf.GradientTape(persistent=True) as tape:
    losses = _loss("none")(y, model(tf.constant(x)))
  jac = [tape.jacobian(losses, v) for v in model.trainable_variables]
  flat = np.concatenate([np.reshape(j.numpy(), [len(x), -1]) for j in jac], 1)
  norms = np.linalg.norm(flat, axis=1)
  return (np.minimum(1.0, clip / norms)[:, None] * flat).sum(0)


def test_attack_really_breaks_the_sensitivity_bound():
  """Guards the attack: with the whole batch in one computation, changing
  example 0 into an outlier moves the clipped sum by more than 2C, which
  one example alone can never do (so refusing it is necessary)."""
  clip, n = 6.0, 32
  x, y = _data(n=n)
  x2, _ = _data(outlier=True, n=n)
  fn = ATTACKS["where_count"][1]
  weights = _dp_model(fn, clip).get_weights()
  moved = np.linalg.norm(_clipped_sum(fn, x, y, weights, clip) -
                         _clipped_sum(fn, x2, y, weights, clip))
  assert moved > 2 * clip * 1.2, moved  # 15.8 against 12.
  # Without the count the same change is within the bound.
  plain = lambda t: t
  moved = np.linalg.norm(_clipped_sum(plain, x, y, weights, clip) -
                         _clipped_sum(plain, x2, y, weights, clip))
  assert moved <= 2 * clip + 1e-4, moved


# Refused: DP fit and the engine ------------------------------------------------


def _eager_refused_outright(message: str) -> bool:
  """Another change may refuse `run_eagerly=True` under DP outright."""
  return "run_eagerly" in message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_dp_fit_refuses_shape_counts_before_any_update(name, mode):
  op, fn = ATTACKS[name]
  x, y = _data(outlier=True)
  model = _dp_model(fn)
  before = [v.numpy().copy() for v in model.trainable_variables]
  with pytest.raises(ValueError) as err:
    _fit(model, x, y, mode)
  message = str(err.value)
  for v, b in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), b)  # No update happened.
  if mode == "eager" and _eager_refused_outright(message):
    return
  assert f"op '{op}'" in message, message
  assert "mixes examples" in message
  assert "shape" in message and "tf.where(cond, x, 0)" in message
  assert "_fn" in message  # The layer's name scope.


def _run(fn, mode):
  if mode == "eager":
    return fn
  return tf.function(fn, jit_compile=(mode == "jit"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_engine_refuses_shape_counts(name, mode):
  """The engine alone (`tf_pxg.GradientTape`), eager ops included."""
  op, fn = ATTACKS[name]
  w = tf.Variable(np.random.default_rng(1).standard_normal((D, U)),
                  dtype=tf.float32)

  def norms(x):
    with tf_pxg.GradientTape() as tape:
      losses = tf.reduce_sum(tf.square(tf.matmul(fn(x), w)), axis=1)
    return tape.per_example_norms(losses, [w])

  with pytest.raises(ValueError, match="mixes examples") as err:
    _run(norms, mode)(tf.constant(_data()[0]))
  assert f"op '{op}'" in str(err.value), str(err.value)


@pytest.mark.parametrize("mode", MODES)
def test_shape_of_an_allowlisted_ragged_op_is_refused(mode):
  """`tf.strings.split` keeps each example's tokens its own (row-wise, on
  the allowlist), but the number of tokens in the batch is a count over
  every example: reading it is refused at the shape op, naming the split."""
  w = tf.Variable(tf.ones([D, U]))
  texts = tf.constant(["a b", "c", "d e f", "g", "h i", "j", "k l m n",
                       "o"])

  def norms(x, s):
    with tf_pxg.GradientTape() as tape:
      n = tf.shape(tf.strings.split(s).values)[0]
      h = x * tf.cast(n, x.dtype)
      losses = tf.reduce_sum(tf.square(tf.matmul(h, w)), axis=1)
    return tape.per_example_norms(losses, [w])

  if mode == "jit":  # XLA has no string ops: the split runs outside it.
    pytest.skip("string ops do not compile with XLA")
  with pytest.raises(ValueError, match="mixes examples") as err:
    _run(norms, mode)(tf.constant(_data()[0]), texts)
  message = str(err.value)
  assert "op 'Shape'" in message and "StringSplitV2" in message, message


def test_value_shaped_table_is_one_place():
  """The op kinds whose output shape is set by values: one table, with the
  selectors refused by a rule that says why."""
  from tf_pxg.interface import batch_axis, value_shapes
  for op in ("Where", "Unique", "UniqueWithCounts", "DynamicPartition",
             "ListDiff", "NonMaxSuppressionV3", "SparseSegmentSum",
             "SegmentSum", "RaggedRange", "StringSplitV2", "Fill", "Range",
             "Reshape"):
    assert value_shapes.value_shape_inputs(op), op
  for op in ("Where", "Unique", "DynamicPartition", "ListDiff",
             "SparseSegmentMean"):
    assert op not in batch_axis.row_wise_op_types(), op
    assert op in value_shapes._VALUE_SELECTORS, op
  for op in ("Shape", "Size", "ShapeN", "Rank", "TensorListLength"):
    assert op in value_shapes.SHAPE_READS


# py_function / numpy_function stay refused -------------------------------------


HOST = {
    "py_function": lambda x: tf.ensure_shape(
        tf.py_function(lambda a: a * 2.0, [x], tf.float32), x.shape),
    "numpy_function": lambda x: tf.ensure_shape(
        tf.numpy_function(lambda a: a * 2.0, [x], tf.float32), x.shape),
}


@pytest.mark.parametrize("mode", ["function", "jit"])
@pytest.mark.parametrize("name", sorted(HOST))
def test_host_functions_stay_refused(name, mode):
  x, y = _data()
  model = _dp_model(HOST[name])
  before = [v.numpy().copy() for v in model.trainable_variables]
  with pytest.raises(Exception) as err:
    _fit(model, x, y, mode)
  for v, b in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), b)
  if mode == "function":
    assert "PyFunc" in str(err.value), str(err.value)


# Shapes of the batch size, and elementwise masks, still train exactly ----------


def _flat_reshape(x):
  h = tf.reshape(x, [-1, 2, D // 2])
  return tf.reshape(tf.tanh(h), [-1, D])


NEGATIVES = {
    "tf_shape_batch": lambda x: tf.reshape(
        tf.reshape(x, [tf.shape(x)[0], 2, D // 2]) * 2.0,
        [tf.shape(x)[0], D]),
    "reshape_minus_one": _flat_reshape,
    "keras_ops_shape": lambda x: keras.ops.reshape(
        keras.ops.reshape(x, (keras.ops.shape(x)[0], D, 1)) + 1.0,
        (keras.ops.shape(x)[0], D)),
    "elementwise_mask": lambda x: tf.where(tf.abs(x) > 0.5, x, 0.0),
    "per_example_count": lambda x: x * (1.0 + tf.reduce_sum(
        tf.cast(tf.abs(x) > 0.5, x.dtype), axis=-1, keepdims=True)),
    "batch_size_scale": lambda x: x * tf.cast(tf.shape(x)[0], x.dtype) / B,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(NEGATIVES))
def test_batch_size_shapes_and_elementwise_masks_train_exactly(name, mode):
  fn = NEGATIVES[name]
  x, y = _data(outlier=True)
  model = _dp_model(fn)
  variables = model.trainable_variables
  w0 = [v.numpy().astype(np.float64) for v in variables]
  per_example = pxg_testing.reference_per_example_gradients(
      _loss("none"), model, variables, tf.constant(x), tf.constant(y))
  if name == "batch_size_scale":
    # The step scales by B / B = 1 (batch-size only); the reference,
    # batches of one, would scale by 1 / B.
    per_example = pxg_testing.reference_per_example_gradients(
        _loss("none"), lambda t: model.layers[1](t), variables,
        tf.constant(x), tf.constant(y))
  norms = pxg_testing.per_example_global_norms(per_example)
  clip = 0.5 * float(np.median(norms))  # Some clipped, some not.
  expected = pxg_testing.expected_dp_sgd_weights(w0, per_example, clip)
  model = _dp_model(fn, clip)
  _fit(model, x, y, mode)
  pxg_testing.assert_dp_step_matches_reference(
      model.trainable_variables, w0, expected)


def test_padded_poisson_batch_still_trains():
  """Poisson sampling pads the physical batch: its shape depends on the
  sampling only, never on the examples' values."""
  x, y = _data(n=32)
  model = _dp_model(NEGATIVES["tf_shape_batch"])
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
  history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                      sampling_seed=0, unprotected_training_metrics=True)
  assert np.isfinite(history.history["unprotected_loss"]).all()
  assert any(np.any(v.numpy() != b)
             for v, b in zip(model.trainable_variables, before))


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_check_example_independence_reports_the_shape_exit(name):
  """`tf_pxg.testing.check_example_independence` finds the count on a
  user's own model before training: an exit naming the op, even where the
  chosen change (a small perturbation, no outlier) moves no count."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((D,)), _Fn(ATTACKS[name][1]),
                            L.Dense(U)])
  x, y = _data()
  result = pxg_testing.check_example_independence(
      model, x, y, loss=_loss(None), raise_on_failure=False)
  assert not result.passed
  assert any("shape counts the examples' values" in e and
             f"'{ATTACKS[name][0]}'" in e for e in result.exits), result.exits


def test_check_example_independence_passes_batch_size_shapes():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((D,)),
      _Fn(lambda x: tf.reshape(x, [-1, D]) * tf.cast(
          tf.shape(x)[0], x.dtype) / B),
      L.Dense(U)])
  x, y = _data()
  result = pxg_testing.check_example_independence(model, x, y,
                                                  loss=_loss(None))
  assert result.passed and not result.exits
