"""What carries examples, and on which axis.

"Carries examples" is a property of the data: it flows through casts to
integer, one-hot and gathers (Keras casts token ids to a float input spec
and back). The batch axis is tracked through transposes, reshapes and the
operand order of contractions (`tf_pxg.interface.batch_axis`): time-major data and a
parameter as the first matmul operand are exact against the
`tf.GradientTape` loop over single examples, in eager mode, `tf.function`
and XLA; ops that really mix examples along the batch axis still raise.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing

from _keras_models import check_one_dp_fit_step

MODES = pxg_testing.MODES
B = 3
L = keras.layers


class Fn:
  """A function of raw TF ops on given variables, as the reference wants."""

  def __init__(self, fn, variables):
    self.fn, self.trainable_variables = fn, list(variables)

  def __call__(self, x):
    return self.fn(x)


def _var(shape, seed, dtype=tf.float32):
  return tf.Variable(np.random.default_rng(seed).standard_normal(shape),
                     dtype=dtype)


def _x(shape, seed=0):
  return tf.constant(np.random.default_rng(seed).standard_normal(shape),
                     tf.float32)


def _time_major_dense():
  layer = L.Dense(3, activation="tanh")
  layer.build((None, 2))

  def fn(x):  # [B, T, d] -> time-major [T, B, d] -> sum over time -> [B]
    h = layer(tf.transpose(x, [1, 0, 2]))
    return tf.reduce_sum(tf.square(tf.reduce_sum(h, axis=0)), axis=-1)
  return Fn(fn, layer.trainable_variables), _x((B, 4, 2))


def _param_first_matmul():
  w, v = _var((3, 5), 1), _var((3,), 2)

  def fn(x):  # [u, B]: examples on axis 1, then back on axis 0
    h = tf.tanh(tf.matmul(w, x, transpose_b=True))
    return tf.reduce_sum(tf.square(h), axis=0) + tf.reduce_sum(
        tf.transpose(h) * v, axis=1)
  return Fn(fn, [w, v]), _x((B, 5))


def _time_major_reshaped_matmul():
  w = _var((2, 3), 3)

  def fn(x):  # [T, B, d] -> [T*B, d] (examples minor) -> back -> sum(T)
    t, d = x.shape[1], x.shape[2]
    tm = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, d])
    h = tf.reshape(tf.tanh(tf.matmul(tm, w)), [t, -1, 3])
    return tf.reduce_sum(tf.square(h), axis=[0, 2])
  return Fn(fn, [w]), _x((B, 4, 2))


def _time_major_tokens():
  table = _var((7, 2), 4)

  def fn(ids):  # ids [B, L] -> [L, B] -> gather [L, B, D]
    e = tf.gather(table, tf.transpose(ids))
    return tf.reduce_sum(tf.square(tf.tanh(e)), axis=[0, 2])
  ids = tf.constant(np.random.default_rng(5).integers(0, 7, (B, 4)),
                    tf.int32)
  return Fn(fn, [table]), ids


def _float_tokens_one_hot():
  w = _var((6, 3), 6)

  def fn(x):  # float token ids, cast to int, one-hot
    h = tf.matmul(tf.one_hot(tf.cast(x, tf.int32), 6), w)  # [B, L, 3]
    return tf.reduce_sum(tf.square(tf.tanh(h)), axis=[1, 2])
  ids = tf.constant(np.random.default_rng(7).integers(0, 6, (B, 4)),
                    tf.float32)
  return Fn(fn, [w]), ids


def _column_major_layer():
  w, v = _var((3, 5), 11), _var((3, 1), 12)

  def fn(x):  # column-major: [u, B] with a [u, 1] bias on the batch axis
    h = tf.tanh(tf.matmul(w, x, transpose_b=True) + v)
    return tf.reduce_sum(tf.square(h * v), axis=0)
  return Fn(fn, [w, v]), _x((B, 5))


def _time_major_einsum():
  w = _var((2, 3), 13)

  def fn(x):  # time-major einsum, batch letter second in data and output
    h = tf.einsum("tbi,io->tbo", tf.transpose(x, [1, 0, 2]), w)
    return tf.reduce_sum(tf.square(tf.tanh(h)), axis=[0, 2])
  return Fn(fn, [w]), _x((B, 4, 2))


CASES = {
    "time_major_einsum": _time_major_einsum,
    "column_major_bias_broadcast_on_batch_axis": _column_major_layer,
    "time_major_dense": _time_major_dense,
    "param_first_matmul_batch_on_axis_1": _param_first_matmul,
    "time_major_reshaped_matmul": _time_major_reshaped_matmul,
    "time_major_token_gather": _time_major_tokens,
    "float_tokens_cast_one_hot": _float_tokens_one_hot,
    "rows_split_into_windows": lambda: _windows(),
    "fft2d_over_each_example": lambda: _fft2d(),
}


def _windows():
  """Swin-style: each example's 8 rows of [B*8, d] split into 2 windows of
  4 ([B*2, 4, d], still merged, the batch major), then a contraction."""
  w1, w2 = _var((3, 5), 16), _var((5, 2), 17)

  def fn(x):  # [B, 8, 3]
    rows = tf.matmul(tf.reshape(x, [-1, 3]), w1)            # [B*8, 5]
    windows = tf.reshape(tf.tanh(rows), [-1, 4, 5])         # [B*2, 4, 5]
    h = tf.einsum("wsd,de->wse", windows, w2)               # [B*2, 4, 2]
    return tf.reduce_sum(tf.square(tf.reshape(h, [-1, 16])), axis=1)
  return Fn(fn, [w1, w2]), _x((B, 8, 3), 18)


def _fft2d():
  """FNet's token mixing: the real part of a 2-D FFT over each example's
  sequence and hidden axes."""
  w = _var((3, 4), 19)

  def fn(x):  # [B, 5, 3]
    h = tf.cast(tf.matmul(x, w), tf.complex64)
    mixed = tf.math.real(tf.signal.fft2d(h))
    return tf.reduce_sum(tf.square(mixed), axis=[1, 2])
  return Fn(fn, [w]), _x((B, 5, 3), 20)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_axis_cases_match_reference(name, mode):
  model, x = CASES[name]()
  pxg_testing.check_per_example_gradients(
      None, model, model.trainable_variables, x, mode=mode)


@pytest.mark.parametrize("mode", ("eager", "function"))
def test_reduction_over_tracked_batch_axis_still_raises(mode):
  w = _var((2, 3), 8)

  def run(x):
    with tf_pxg.GradientTape() as tape:
      h = tf.matmul(tf.transpose(x, [1, 0, 2]), w)        # [T, B, u]
      centred = h - tf.reduce_mean(h, axis=1, keepdims=True)  # over B
      losses = tf.reduce_sum(tf.square(centred), axis=[0, 2])
    return tape.per_example_norms(losses, [w])

  if mode == "function":
    run = tf.function(run)
  with pytest.raises(ValueError, match="batch axis 1"):
    run(_x((B, 4, 2)))


def test_softmax_over_examples_raises():
  w = _var((2, 3), 9)

  @tf.function
  def run(x):
    with tf_pxg.GradientTape() as tape:
      h = tf.nn.softmax(tf.matmul(w, x, transpose_a=True, transpose_b=True))
      losses = tf.reduce_sum(tf.square(h), axis=0)
    return tape.per_example_norms(losses, [w])

  with pytest.raises(ValueError, match="mixes examples"):
    run(_x((B, 2)))


def test_int_tokens_behind_float_input_spec_train_exactly():
  """DPSequential built with a float input spec: Keras casts token ids."""
  rng = np.random.default_rng(10)
  ids = rng.integers(0, 50, (4, 12))
  y = rng.integers(0, 2, 4)

  def layers():
    return [L.Embedding(50, 4), L.Conv1D(3, 5), L.GlobalMaxPooling1D(),
            L.Dense(2)]

  check_one_dp_fit_step(layers, ids, y,
                        reference_x=tf.constant(ids, tf.float32),
                        build_shape=(None, 12))


# Parameters copied along the batch axis with a dynamic batch size ------------

_TABLE = _var((6, 5), 11)
_CLS = _var((1, 1, 5), 12)
_FROZEN = tf.constant(np.random.default_rng(14).standard_normal((3, 4)),
                      tf.float32)
_W = _var((4, 5), 15)
COPIES = {
    # KerasHub's PositionEmbedding: keras.ops.shape(x) holds tf.shape(x)[0].
    "broadcast_to_keras_shape": (lambda x: x + keras.ops.broadcast_to(
        _TABLE[:3], keras.ops.shape(x)), _TABLE),
    "broadcast_to_tf_shape": (
        lambda x: x * tf.broadcast_to(_TABLE[:3], tf.shape(x)), _TABLE),
    "repeat": (lambda x: x * keras.ops.repeat(
        _TABLE[None, :3], keras.ops.shape(x)[0], axis=0), _TABLE),
    "class_token": (lambda x: tf.concat(
        [keras.ops.tile(_CLS, (keras.ops.shape(x)[0], 1, 1)), x], 1), _CLS),
    # A frozen table repeated per example, then through a trained kernel
    # (DeBERTa's relative table under LoRA): the copy is data.
    "frozen_table_repeated": (lambda x: x * tf.einsum(
        "btd,de->bte", keras.ops.repeat(
            _FROZEN[None], keras.ops.shape(x)[0], axis=0), _W), _W),
}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_along_the_batch_match_reference(name, static):
  """In a tf.function traced for any batch size (`[None, T, d]`), a copy's
  count is `tf.shape(x)[0]`: read from the size vector, it is followed as
  exactly as a static one (`tf_pxg.interface.batch_copies.copy_layout`)."""
  batch = 4 if static else None
  fn, w = COPIES[name]
  x = _x((4, 3, 5), 13)

  def losses(out):
    return tf.reduce_sum(tf.reshape(tf.square(out), [tf.shape(out)[0], -1]),
                         axis=1)

  @tf.function(input_signature=[tf.TensorSpec([batch, 3, 5])])
  def run(inp):
    with tf_pxg.GradientTape() as tape:
      target = losses(fn(inp))
    return tape.per_example_gradient(target, [w])[0]

  want, = pxg_testing.reference_per_example_gradients(
      losses, fn, [w], x)
  np.testing.assert_allclose(run(x).numpy(), want.numpy(), rtol=1e-5,
                             atol=1e-6)
