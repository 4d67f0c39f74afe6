"""Models built lazily by their first `fit` / `train_on_batch` train under DP.

Each model is created without an `Input`, so its variables (and the
optimizer's slots) are made inside the first traced training step. With
`noise_multiplier=0` and `SGD(learning_rate=1)` one step must move the weights
by exactly `-mean_b clip(g_b)`, where the `g_b` come from a plain
`tf.GradientTape` loop over single examples of an identically initialised,
eagerly built twin.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk

CLIP = 0.2


def _init(seed):
  return keras.initializers.RandomNormal(stddev=0.5, seed=seed)


def _layers():
  return [keras.layers.Flatten(),
          keras.layers.Dense(16, activation="tanh", kernel_initializer=_init(1),
                             bias_initializer=_init(2)),
          keras.layers.Dense(3, kernel_initializer=_init(3))]


def _data(n=8):
  rng = np.random.RandomState(0)
  return rng.randn(n, 4, 2).astype("float32"), rng.randint(0, 3, n)


def _reference_update(model, x, y, loss_fn, clip, sample_weight=None):
  """-mean_b clip(g_b) on the built `model`, one example at a time."""
  total = None
  for b in range(len(y)):
    xb = tf.nest.map_structure(lambda t: t[b:b + 1], x)
    with tf.GradientTape() as tape:
      loss = loss_fn(y[b:b + 1], model(xb, training=True))
      if sample_weight is not None:
        loss = loss * sample_weight[b]
    g = tape.gradient(loss, model.trainable_variables)
    norm = math.sqrt(sum(float(tf.reduce_sum(t * t)) for t in g))
    c = min(1.0, clip / max(norm, 1e-12))
    g = [c * t.numpy() for t in g]
    total = g if total is None else [a + t for a, t in zip(total, g)]
  return [-t / len(y) for t in total]


def _check_one_step(dp_model, twin, x, y, loss_fn, run, sample_weight=None):
  # The twin has the same initializers, so its first weights are dp_model's.
  twin(tf.nest.map_structure(lambda t: t[:1], x))
  before = [v.numpy() for v in twin.trainable_variables]
  want = _reference_update(twin, x, y, loss_fn, CLIP, sample_weight)
  dp_model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss_fn)
  run(dp_model, x, y, sample_weight)
  got = [v.numpy() for v in dp_model.trainable_variables]
  assert len(got) == len(before)
  scale = max(np.abs(w).max() for w in want)
  assert scale > 0
  for w0, w, g in zip(before, want, got):
    np.testing.assert_allclose(g - w0, w, atol=1e-5 * scale)
  assert int(dp_model.optimizer.iterations) == 1


def _fit(model, x, y, sample_weight):
  model.fit(x, y, sample_weight=sample_weight, batch_size=len(y), epochs=1,
            shuffle=False, verbose=0)


def _train_on_batch(model, x, y, sample_weight):
  model.train_on_batch(x, y, sample_weight=sample_weight)


_SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("run", [_fit, _train_on_batch])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_unbuilt_sequential_matches_reference(run, jit_compile):
  x, y = _data()
  dp = dpk.DPSequential(_layers(), l2_norm_clip=CLIP, noise_multiplier=0.0)
  assert not dp.built
  dp.jit_compile = jit_compile
  weights = np.linspace(0.2, 1.5, len(y)).astype("float32")
  _check_one_step(dp, keras.Sequential(_layers()), x, y, _SCE, run,
                  sample_weight=weights)


@pytest.mark.parametrize("optimizer, loss", [
    ("adam", "sparse_categorical_crossentropy"),
    ("sgd", keras.losses.SparseCategoricalCrossentropy()),
    ("rmsprop", "sparse_categorical_crossentropy"),
])
def test_unbuilt_sequential_string_optimizer_and_loss_trains(optimizer, loss):
  x, y = _data(32)
  layers = _layers()[:-1] + [keras.layers.Dense(3, activation="softmax")]
  dp = dpk.DPSequential(layers, l2_norm_clip=1.0, noise_multiplier=0.5)
  dp.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
  history = dp.fit(x, y, batch_size=8, epochs=2, verbose=0,
                   unprotected_training_metrics=True)
  assert np.isfinite(history.history["unprotected_loss"]).all()
  assert int(dp.optimizer.iterations) > 0
  assert all(np.isfinite(v.numpy()).all() for v in dp.trainable_variables)
  # train_on_batch on a second, fresh unbuilt model.
  dp2 = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=0.5,
                         unprotected_training_metrics=True)
  dp2.compile(optimizer=optimizer, loss=_SCE)
  logs = dp2.train_on_batch(x, y, return_dict=True)
  assert math.isfinite(logs["unprotected_loss"])
  assert int(dp2.optimizer.iterations) == 1


def test_make_private_of_unbuilt_sequential_matches_reference():
  x, y = _data()
  dp = dpk.make_private(keras.Sequential(_layers()), l2_norm_clip=CLIP,
                        noise_multiplier=0.0)
  _check_one_step(dp, keras.Sequential(_layers()), x, y, _SCE, _fit)


class _TwoInputNet(keras.Model):
  """Subclassed, dict inputs, built on first call."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.a = keras.layers.Dense(5, activation="tanh",
                                kernel_initializer=_init(4))
    self.b = keras.layers.Dense(5, activation="tanh",
                                kernel_initializer=_init(5))
    self.out = keras.layers.Dense(3, kernel_initializer=_init(6))

  def call(self, inputs):
    return self.out(self.a(inputs["left"]) + self.b(inputs["right"]))


@pytest.mark.parametrize("run", [_fit, _train_on_batch])
def test_subclassed_dict_input_model_matches_reference(run):
  rng = np.random.RandomState(2)
  x = {"left": rng.randn(8, 3).astype("float32"),
       "right": rng.randn(8, 4).astype("float32")}
  y = rng.randint(0, 3, 8)
  dp = dpk.make_dp_model_class(_TwoInputNet)(l2_norm_clip=CLIP,
                                             noise_multiplier=0.0)
  _check_one_step(dp, _TwoInputNet(), x, y, _SCE, run)


def test_functional_two_input_model_with_sample_weight_matches_reference():
  rng = np.random.RandomState(3)
  x = [rng.randn(8, 3).astype("float32"), rng.randn(8, 2).astype("float32")]
  y = rng.randint(0, 3, 8)

  def build(dp_cls=None, **dp):
    a, b = keras.Input((3,)), keras.Input((2,))
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(6, activation="tanh", kernel_initializer=_init(7))(h)
    out = keras.layers.Dense(3, kernel_initializer=_init(8))(h)
    return (keras.Model([a, b], out) if dp_cls is None
            else dp_cls([a, b], out, **dp))

  dp = build(dpk.DPModel, l2_norm_clip=CLIP, noise_multiplier=0.0)
  weights = np.linspace(0.0, 2.0, 8).astype("float32")
  _check_one_step(dp, build(), x, y, _SCE, _fit, sample_weight=weights)
