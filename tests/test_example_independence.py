"""`tf_pxg.testing.check_example_independence`: the empirical check that
changing one example of a batch moves no other example's loss or gradient.

1. Every model of the zoo (`test_model_zoo.ZOO`: Dense, CNN, RNNs,
   transformer blocks, Dropout, augmentation, GroupNormalization, ...)
   passes, in eager mode, and a selection in `tf.function`.
2. Every mixer (MixUp, CutMix, BatchNormalization in training, batch
   standardisation before and after the first Dense, tf.roll / reverse /
   sort / gather over axis 0, in-batch negatives, a gradient-only mixer)
   fails it with an `ExampleMixingError` naming the moved examples, in eager
   mode and in `tf.function`.
3. Random layers (Dropout, RandomFlip, GaussianNoise, unseeded TF random
   ops) pass thanks to the re-seeding between the two runs; with `seed=None`
   (no re-seeding) the same models fail.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import testing as pxg_testing

import test_model_zoo as zoo_module

L = keras.layers
B = 4
CHECK = pxg_testing.check_example_independence


# 1. The zoo --------------------------------------------------------------


def _zoo_model(name):
  zoo = zoo_module._ZOO[name]  # pylint: disable=protected-access
  x, y, sw = zoo_module._data(zoo)  # pylint: disable=protected-access
  model = zoo_module._make(zoo)  # pylint: disable=protected-access
  model.compile(loss=zoo.loss)
  return model, x, y, sw


ZOO_NAMES = [z.name for z in zoo_module.ZOO]
# Also in tf.function: one of each family, and every random one.
ZOO_FUNCTION = ["mlp_unbuilt_sequential", "mnist_convnet",
                "text_embedding_lstm", "text_embedding_gru",
                "text_bidirectional_lstm", "transformer_block",
                "small_resnet_groupnorm_add", "dict_inputs",
                "two_input_functional", "frozen_base_new_head",
                *zoo_module.STOCHASTIC]


def test_zoo_covers_the_asked_families():
  for name in ("mlp_unbuilt_sequential", "mnist_convnet",
               "text_embedding_lstm", "text_embedding_gru",
               "text_bidirectional_lstm", "transformer_block",
               "transformer_block_dropout", "dropout_mlp",
               "augmentation_cnn", "small_resnet_groupnorm_add"):
    assert name in ZOO_NAMES, name
  assert len(ZOO_NAMES) >= 40


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_passes(name):
  model, x, y, sw = _zoo_model(name)
  # The explicit "perturb" (one change of example 0): the default search
  # is tested on its own (test_independence_search.py) and run over the
  # whole zoo once (issue 49's closing note), not in every CI run.
  result = CHECK(model, x, y, sample_weight=sw, change="perturb")
  assert result.passed and result.moved == ()
  assert result.max_loss_change <= result.loss_tolerance
  assert result.max_gradient_change <= result.gradient_tolerance
  # The change reached the model: the changed example's own loss moved.
  assert result.changed_loss_change > 0, result


@pytest.mark.parametrize("name", ZOO_FUNCTION)
def test_zoo_model_passes_in_function(name):
  model, x, y, sw = _zoo_model(name)
  result = CHECK(model, x, y, sample_weight=sw, mode="function",
                 change="perturb")
  assert result.passed, result
  assert result.changed_loss_change > 0, result


# 2. The mixers -------------------------------------------------------------


class BatchOp(L.Layer):
  """`fn(h)` of the whole batch (a Lambda that needs no shape inference)."""

  def __init__(self, fn, **kwargs):
    super().__init__(**kwargs)
    self.fn = fn

  def call(self, h):
    return self.fn(h)

  def compute_output_shape(self, input_shape):
    return input_shape


def _standardise(h):
  return h - tf.reduce_mean(h, axis=0, keepdims=True)


def _dense_model(*middle, first=()):
  """Input(5) -> first -> Dense(6, relu) -> middle -> Dense(3)."""
  inputs = keras.Input((5,))
  h = inputs
  for layer in first:
    h = layer(h)
  h = L.Dense(6, activation="relu")(h)
  for layer in middle:
    h = layer(h)
  model = keras.Model(inputs, L.Dense(3)(h))
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


def _image_model(mixer):
  inputs = keras.Input((6, 6, 3))
  h = mixer(inputs)
  h = L.Conv2D(4, 3, activation="relu")(h)
  h = L.GlobalAveragePooling2D()(h)
  model = keras.Model(inputs, L.Dense(3)(h))
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


def _two_tower():
  """In-batch negatives: logits[a, b] = z_a(query a) . z_b(item b), label a."""
  query = keras.Input((5,), name="query")
  item = keras.Input((5,), name="item")
  za = L.Dense(4)(query)
  zb = L.Dense(4)(item)
  logits = L.Lambda(lambda t: tf.matmul(t[0], t[1], transpose_b=True),
                    output_shape=(None,))([za, zb])
  model = keras.Model({"query": query, "item": item}, logits)
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


def _vectors(rng):
  return (rng.standard_normal((B, 5)).astype("float32"),
          rng.integers(0, 3, size=B))


def _images(rng):
  return (rng.standard_normal((B, 6, 6, 3)).astype("float32"),
          rng.integers(0, 3, size=B))


def _pairs(rng):
  return ({"query": rng.standard_normal((B, 5)).astype("float32"),
           "item": rng.standard_normal((B, 5)).astype("float32")},
          np.arange(B))


PERMUTATION = [2, 0, 3, 1]
EVERY = tuple(range(B))
# name -> (build, data, the examples that must move when example 0 changes
# (None: at least one), optionally the `index` to check (default 0)).
# MixUp and CutMix mix example k with example perm[k] for a random
# permutation: when perm fixes the changed example (probability 1/B per
# draw, and so here for example 0, see `test_mixup_caveat`), changing it
# moves no other example, so every example is changed in turn.
MIXERS = {
    "mixup": (lambda: _image_model(L.MixUp(alpha=0.2, seed=3)), _images,
              None, EVERY),
    "cutmix": (lambda: _image_model(L.CutMix(seed=3)), _images, None, EVERY),
    "batchnorm_training": (lambda: _dense_model(L.BatchNormalization()),
                           _vectors, [1, 2, 3]),
    "batch_standardise_before_dense": (
        lambda: _dense_model(first=[BatchOp(_standardise)]), _vectors,
        [1, 2, 3]),
    "batch_standardise_after_dense": (
        lambda: _dense_model(BatchOp(_standardise)), _vectors, [1, 2, 3]),
    "roll_axis0_after_dense": (
        lambda: _dense_model(BatchOp(lambda h: tf.roll(h, 1, axis=0))),
        _vectors, [1]),
    "reverse_axis0": (
        lambda: _dense_model(BatchOp(lambda h: tf.reverse(h, [0]))),
        _vectors, [3]),
    "sort_axis0": (
        lambda: _dense_model(BatchOp(lambda h: tf.sort(h, axis=0))),
        _vectors, None),
    "gather_batch_permutation": (
        lambda: _dense_model(BatchOp(lambda h: tf.gather(h, PERMUTATION))),
        _vectors, [PERMUTATION.index(0)]),
    "in_batch_negatives": (_two_tower, _pairs, [1, 2, 3]),
    # Forward per example, backward mixed: only the gradients can tell.
    "stop_gradient_centring": (
        lambda: _dense_model(BatchOp(lambda h: _standardise(h) + (
            tf.stop_gradient(tf.reduce_mean(h, 0, keepdims=True))))),
        _vectors, [1, 2, 3]),
}


def _mixer(name):
  build, data, expected, *index = MIXERS[name]
  keras.utils.set_random_seed(7)
  model = build()
  x, y = data(np.random.default_rng(11))
  return model, x, y, expected, (index[0] if index else 0)


# Keras' MixUp and CutMix sample a Beta distribution, which XLA cannot
# compile (RandomGamma): they are checked in eager and tf.function only.
NO_XLA = ("mixup", "cutmix")


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
@pytest.mark.parametrize("name", list(MIXERS))
def test_mixer_is_caught(name, mode):
  if mode == "jit" and name in NO_XLA:
    pytest.skip(f"{name} samples a Beta distribution, which XLA cannot "
                "compile")
  model, x, y, expected, index = _mixer(name)
  with pytest.raises(pxg_testing.ExampleMixingError) as info:
    CHECK(model, x, y, mode=mode, index=index, change="perturb")
  result = info.value.result
  assert result.moved, result
  assert all(i != b for i, b in result.moved), result
  moved = sorted({b for _, b in result.moved})
  if expected is not None:
    assert moved == expected, (moved, expected)
  message = str(info.value)
  assert "Examples mix" in message
  for i, b in result.moved:
    assert f"changing example {i} moved example {b}:" in message, message
  assert f"moved the loss or gradient of example(s) {moved}" in message
  assert result.max_loss_change > result.loss_tolerance or (
      result.max_gradient_change > result.gradient_tolerance)


def test_mixup_caveat():
  """The empirical check's limit: MixUp's draw here maps example 0 to
  itself, so changing example 0 alone moves nothing else."""
  model, x, y, _, _ = _mixer("mixup")
  assert CHECK(model, x, y, change="perturb").passed
  assert not CHECK(model, x, y, index=EVERY, change="perturb",
                   raise_on_failure=False).passed


def test_gradient_only_mixer_needs_the_gradients():
  """Forward per example, gradient mixed: the losses do not move at all."""
  model, x, y, _, _ = _mixer("stop_gradient_centring")
  result = CHECK(model, x, y, gradients=False, change="perturb")
  assert result.passed and result.max_loss_change <= result.loss_tolerance
  result = CHECK(model, x, y, raise_on_failure=False, change="perturb")
  assert not result.passed
  assert result.max_gradient_change > 100 * result.gradient_tolerance


# 3. Random layers: no false alarm thanks to the re-seeding ----------------


RANDOM_MODELS = {
    "dropout": lambda: _dense_model(L.Dropout(0.5)),
    "random_flip": lambda: _image_model(L.RandomFlip("horizontal")),
    "random_flip_rotation": lambda: _image_model(keras.Sequential(
        [L.RandomFlip("horizontal"), L.RandomRotation(0.2)])),
    "gaussian_noise": lambda: _dense_model(L.GaussianNoise(0.5)),
    # Unseeded TF op: same op seeds after re-seeding, fresh kernels per trace.
    "unseeded_tf_random": lambda: _dense_model(BatchOp(
        lambda h: h * tf.cast(tf.random.uniform(tf.shape(h)) > 0.5,
                              h.dtype))),
}


def _random_model(name):
  keras.utils.set_random_seed(5)
  model = RANDOM_MODELS[name]()
  data = _images if "flip" in name else _vectors
  x, y = data(np.random.default_rng(13))
  return model, x, y


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", list(RANDOM_MODELS))
def test_random_layers_pass_with_seeding_and_fail_without(name, mode):
  model, x, y = _random_model(name)
  result = CHECK(model, x, y, mode=mode, index=(0, 1), change="perturb")
  assert result.passed, result
  # Without re-seeding the two runs draw differently: other examples move.
  if name == "unseeded_tf_random":
    # A fresh tf.function trace under a set global TF seed repeats the op
    # seeds, and so the draws, even without re-seeding: clear it.
    tf.random.set_seed(None)
  with pytest.raises(pxg_testing.ExampleMixingError):
    CHECK(model, x, y, mode=mode, index=(0, 1), seed=None,
          change="perturb")


@pytest.mark.parametrize("name", ["dropout", "random_flip", "gaussian_noise"])
def test_keras_random_layers_pass_under_xla(name):
  """Keras' random layers draw from their SeedGenerator states (stateless
  ops), which the check restores, so XLA repeats them too. (Unseeded
  stateful TF ops, e.g. `tf.random.uniform` without a seed, do not repeat
  under XLA; RandomRotation has no XLA kernel.)"""
  model, x, y = _random_model(name)
  assert CHECK(model, x, y, mode="jit", index=(0, 1),
               change="perturb").passed


# API details ---------------------------------------------------------------


def test_state_is_restored_after_the_check():
  keras.utils.set_random_seed(1)
  model = _dense_model(L.BatchNormalization(), L.Dropout(0.3))
  x, y = _vectors(np.random.default_rng(0))
  model(x)
  before = [np.array(v.numpy()) for v in model.non_trainable_variables]
  assert len(before) >= 3  # moving mean, variance, dropout seed state
  CHECK(model, x, y, raise_on_failure=False)
  for v, w in zip(model.non_trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), w, err_msg=v.path)


def test_spectral_normalization_state_does_not_false_alarm():
  zoo_model = _zoo_model("spectral_normalization")
  assert CHECK(*zoo_model[:3], index=(0, 1, 2, 3)).passed


@pytest.mark.parametrize("change", ["perturb", "swap"])
def test_changes_and_indices(change):
  model, x, y, _, _ = _mixer("roll_axis0_after_dense")
  with pytest.raises(pxg_testing.ExampleMixingError) as info:
    CHECK(model, x, y, change=change, index=(0, 2))
  # roll by 1: example i's row feeds example i + 1.
  assert info.value.result.moved == ((0, 1), (2, 3))
  assert info.value.result.indices == (0, 2)
  model = _dense_model()
  result = CHECK(model, x, y, change=change, index=[0, 1, 2, 3])
  assert result.passed and result.changed_loss_change > 0


def test_callable_change_and_loss_callable():
  model, x, y, _, _ = _mixer("reverse_axis0")

  def change(x, y, index):
    x = np.array(x)
    x[index] *= -2.0
    return x, y

  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None)
  with pytest.raises(pxg_testing.ExampleMixingError, match="example 3"):
    CHECK(model, x, y, loss=loss, change=change)
  keras.utils.set_random_seed(2)
  plain = keras.Sequential([L.Dense(4), L.Dense(3)])  # not compiled
  assert CHECK(plain, x, y, loss=loss, change=change).passed


def test_string_and_integer_inputs_are_swapped():
  lookup = L.StringLookup(vocabulary=["a", "b", "c"])
  inputs = keras.Input((2,), dtype="string")
  h = L.Flatten()(L.Embedding(5, 3)(lookup(inputs)))
  model = keras.Model(inputs, L.Dense(2)(h))
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  x = np.array([["a", "b"], ["c", "a"], ["b", "b"], ["a", "c"]], dtype=object)
  y = np.array([0, 1, 1, 0])
  result = CHECK(model, x, y, index=(0, 3))
  assert result.passed and result.changed_loss_change > 0


def test_batch_axis_and_size_errors():
  model = _dense_model()
  x, y = _vectors(np.random.default_rng(0))
  with pytest.raises(ValueError, match="at least 2"):
    CHECK(model, x[:1], y[:1])
  with pytest.raises(ValueError, match="out of range"):
    CHECK(model, x, y, index=B)
  with pytest.raises(ValueError, match="unchanged"):
    CHECK(model, np.ones_like(x), np.zeros_like(y), change="swap")
  with pytest.raises(ValueError, match="Unknown change"):
    CHECK(model, x, y, change="shuffle")
  with pytest.raises(ValueError, match="Unknown mode"):
    CHECK(model, x, y, mode="graph")
  keras.utils.set_random_seed(2)
  with pytest.raises(ValueError, match="No loss"):
    CHECK(keras.Sequential([L.Dense(3)]), x, y)


def test_mixing_error_is_an_assertion_error():
  assert issubclass(pxg_testing.ExampleMixingError, AssertionError)
  assert "check_example_independence" in pxg_testing.__all__
  assert "ExampleMixingError" in pxg_testing.__all__
