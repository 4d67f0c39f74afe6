"""Every invalid input is rejected with a clear error, before any update."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk


def _layers(norm=None):
  layers = [keras.Input((4,)), keras.layers.Dense(3)]
  if norm is not None:
    layers.append(norm)
  layers.append(keras.layers.Dense(2))
  return layers


def _data():
  rng = np.random.RandomState(0)
  return rng.randn(8, 4).astype("float32"), rng.randint(0, 2, 8)


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _weights(model):
  return [v.numpy() for v in model.variables]


def _assert_unchanged(model, before):
  for w, v in zip(before, model.variables):
    np.testing.assert_array_equal(v.numpy(), w)


@pytest.mark.parametrize("clip, noise, error, match", [
    (-1.0, 1.0, ValueError, "l2_norm_clip.*> 0"),
    (0.0, 1.0, ValueError, "l2_norm_clip.*> 0"),
    (math.nan, 1.0, ValueError, "l2_norm_clip"),
    (-math.inf, 1.0, ValueError, "l2_norm_clip"),
    ("1.0", 1.0, TypeError, "l2_norm_clip"),
    (1.0, -0.5, ValueError, "noise_multiplier.*>= 0"),
    (1.0, math.nan, ValueError, "noise_multiplier"),
    (1.0, math.inf, ValueError, "noise_multiplier"),
    (1.0, None, ValueError, "noise_multiplier.*missing"),
    (None, 1.0, ValueError, "l2_norm_clip.*missing"),
    (True, 1.0, TypeError, "l2_norm_clip"),
])
def test_invalid_dp_settings_rejected_everywhere(clip, noise, error, match):
  with pytest.raises(error, match=match):
    dpk.DPSequential(_layers(), l2_norm_clip=clip, noise_multiplier=noise)
  inp = keras.Input((4,))
  out = keras.layers.Dense(2)(inp)
  with pytest.raises(error, match=match):
    dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=noise)
  with pytest.raises(error, match=match):
    dpk.make_private(keras.Model(inp, out), clip, noise)
  if clip is not None and noise is not None:
    with pytest.raises(error, match=match):
      dpk.DPSGD(clip, noise)


def test_infinite_clip_is_allowed():
  model = dpk.DPSequential(_layers(), l2_norm_clip=math.inf,
                           noise_multiplier=0.0)
  assert model.l2_norm_clip == math.inf


@pytest.mark.parametrize("build", ["sequential", "functional", "make_private"])
def test_batch_normalization_named_and_rejected(build):
  bn = keras.layers.BatchNormalization(name="my_bn")
  layers = _layers(bn)
  with pytest.raises(ValueError, match="'my_bn'.*GroupNormalization"):
    if build == "sequential":
      model = dpk.DPSequential(layers, l2_norm_clip=1.0, noise_multiplier=1.0)
      model.compile(optimizer="sgd", loss=_sce())
    elif build == "functional":
      x = layers[0]
      for layer in layers[1:]:
        x = layer(x)
      model = dpk.DPModel(layers[0], x, l2_norm_clip=1.0,
                          noise_multiplier=1.0)
      model.compile(optimizer="sgd", loss=_sce())
    else:
      dpk.make_private(keras.Sequential(layers), 1.0, 1.0)


def test_batch_normalization_added_after_compile_rejected_at_fit():
  model = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0)
  model.compile(optimizer="sgd", loss=_sce())
  model.add(keras.layers.BatchNormalization(name="late_bn"))
  model.add(keras.layers.Dense(2))
  x, y = _data()
  model(x)
  before = _weights(model)
  with pytest.raises(ValueError, match="'late_bn'"):
    model.fit(x, y, verbose=0)
  _assert_unchanged(model, before)


def test_frozen_batch_normalization_is_allowed():
  bn = keras.layers.BatchNormalization()
  bn.trainable = False
  model = dpk.DPSequential(_layers(bn), l2_norm_clip=1.0,
                           noise_multiplier=0.5)
  model.compile(optimizer="sgd", loss=_sce())
  x, y = _data()
  model(x)
  frozen = [v.numpy() for v in model.non_trainable_variables]
  model.fit(x, y, verbose=0)
  assert int(model.optimizer.iterations) == 1
  # No noise (or anything else) reaches non-trainable variables.
  for w, v in zip(frozen, model.non_trainable_variables):
    np.testing.assert_array_equal(v.numpy(), w)


@pytest.mark.parametrize("loss", [
    lambda yt, yp: tf.reduce_mean(tf.square(tf.cast(yt, yp.dtype)[:, None]
                                            - yp)),
    lambda yt, yp: tf.reduce_mean(tf.square(yp), axis=0),
], ids=["scalar", "wrong_leading_dim"])
def test_loss_without_per_example_values_rejected(loss):
  model = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0)
  model.compile(optimizer="sgd", loss=loss)
  x, y = _data()
  model(x)
  before = _weights(model)
  with pytest.raises(ValueError, match="one loss value per example.*"
                     "reduction=None"):
    model.fit(x, y, batch_size=8, verbose=0)
  _assert_unchanged(model, before)
  assert int(model.optimizer.iterations) == 0


def test_no_loss_rejected():
  model = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0)
  model.compile(optimizer="sgd")
  x, y = _data()
  with pytest.raises(ValueError, match="no compiled loss"):
    model.fit(x, y, verbose=0)


def test_conflicting_model_and_optimizer_settings_rejected():
  model = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0)
  with pytest.raises(ValueError, match="in one place"):
    model.compile(optimizer=dpk.DPSGD(2.0, 1.0), loss=_sce())
  assert not model.compiled
  # Equal settings in both places are consistent.
  model.compile(optimizer=dpk.DPSGD(1.0, 1.0), loss=_sce())


def test_missing_settings_rejected_at_compile():
  model = dpk.DPSequential(_layers())
  with pytest.raises(ValueError, match="no DP settings.*DPOptimizer"):
    model.compile(optimizer="sgd", loss=_sce())


def test_plain_model_with_dp_optimizer_rejected_without_update():
  model = keras.Sequential(_layers())
  model.compile(optimizer=dpk.DPSGD(1.0, 1.0, learning_rate=0.1),
                loss=_sce())
  x, y = _data()
  model(x)
  before = _weights(model)
  with pytest.raises(RuntimeError, match="DPModel.*make_private"):
    model.fit(x, y, verbose=0)
  _assert_unchanged(model, before)


def test_dp_optimizer_argument_errors():
  with pytest.raises(ValueError, match="clipnorm.*inner optimizer"):
    dpk.DPOptimizer(keras.optimizers.SGD(), 1.0, 1.0, clipnorm=1.0)
  with pytest.raises(TypeError, match="inner_optimizer"):
    dpk.DPOptimizer("sgd", 1.0, 1.0)
  with pytest.raises(ValueError, match="another DPOptimizer"):
    dpk.DPOptimizer(dpk.DPSGD(1.0, 1.0), 1.0, 1.0)


def test_activity_regularizer_rejected():
  layers = [keras.Input((4,)),
            keras.layers.Dense(3, activity_regularizer="l2"),
            keras.layers.Dense(2)]
  model = dpk.DPSequential(layers, l2_norm_clip=1.0, noise_multiplier=1.0)
  with pytest.raises(ValueError, match="activity_regularizer"):
    model.compile(optimizer="sgd", loss=_sce())


def test_make_private_rejects_subclassed_and_dp_models():

  class Net(keras.Model):

    def call(self, x):
      return x

  with pytest.raises(TypeError, match="make_dp_model_class"):
    dpk.make_private(Net(), 1.0, 1.0)
  dp = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0)
  with pytest.raises(TypeError, match="already"):
    dpk.make_private(dp, 1.0, 1.0)
  with pytest.raises(TypeError, match="keras.Model subclass"):
    dpk.make_dp_model_class(int)


def test_privacy_callback_argument_errors():
  with pytest.raises(ValueError, match="batch_size"):
    dpk.PrivacyCallback(num_examples=10, batch_size=20)
  with pytest.raises(ValueError, match="target_epsilon"):
    dpk.PrivacyCallback(num_examples=10, batch_size=2, target_epsilon=-1.0)
  model = keras.Sequential(_layers())
  model.compile(optimizer="sgd", loss=_sce())
  x, y = _data()
  cb = dpk.PrivacyCallback(num_examples=8, batch_size=4)
  with pytest.raises(ValueError, match="noise_multiplier"):
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[cb])


def test_loss_scale_optimizer_accepted_and_trains():
  # mixed_float16's LossScaleOptimizer: the DP step scales the losses itself
  # (tests/test_mixed_precision.py checks it against float32).
  model = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0)
  model.compile(
      optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
      loss=_sce())
  x, y = _data()
  model.train_on_batch(x, y)
  assert int(model.optimizer.iterations) == 1
