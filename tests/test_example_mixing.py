"""Examples never mix unnoticed: the allowlist of row-wise ops.

Every op on the data path, from the model's inputs to the per-example losses
and before or after the first parameter, must be on `tf_pxg.interface.batch_axis`'s
allowlist with a rule that can follow the batch axis. Here:

* ops that move rows across the batch axis (roll, reverse, sort, top_k,
  gather of a permutation, scatter, segment sums, dynamic stitch, slices of
  the batch) make `per_example_gradient` raise — before and after the
  first parameter, in eager mode, `tf.function` and XLA — where it used to
  return values 50-100 % off the true Jacobian rows;
* the same ops along any other axis, and the slicing/gathering forms that
  keep each example's rows its own, stay exact against
  `tf.GradientTape.jacobian`;
* Keras' mixing layers (MixUp, CutMix, BatchNormalization), batch-wise
  standardisation and in-batch negatives make DP `fit` raise before any
  update, weights untouched; Keras' per-example preprocessing layers still
  train;
* the allowlist is public (`tf_pxg.register_row_wise`).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg.interface import batch_axis

MODES = ("eager", "function", "jit")
B, D, U = 6, 4, 3
L = keras.layers


def _run(fn, mode):
  if mode == "eager":
    return fn
  return tf.function(fn, jit_compile=(mode == "jit"))


def _weights(seed=0):
  rng = np.random.default_rng(seed)
  return tf.Variable(rng.standard_normal((D, U)), dtype=tf.float32)


def _inputs(seed=1):
  return tf.constant(np.random.default_rng(seed).standard_normal((B, D)),
                     tf.float32)


# Ops that move rows across the batch axis: (name, fn of a [B, ...] tensor).
_PERM = tf.constant([3, 0, 5, 1, 4, 2])
ROW_MOVERS = {
    "roll": lambda h: tf.roll(h, 1, axis=0),
    "reverse": lambda h: tf.reverse(h, [0]),
    "sort": lambda h: tf.sort(h, axis=0),
    "top_k_over_batch": lambda h: tf.transpose(
        tf.math.top_k(tf.transpose(h), k=B).values),
    "gather_permutation": lambda h: tf.gather(h, _PERM),
    "tensor_scatter_nd_update": lambda h: tf.tensor_scatter_nd_update(
        h, [[0]], h[2:3]),
    "unsorted_segment_sum": lambda h: tf.gather(
        tf.math.unsorted_segment_sum(h, [0, 0, 1, 1, 2, 2], B), tf.range(B)),
    "dynamic_stitch": lambda h: tf.dynamic_stitch(
        [tf.range(0, B, 2), tf.range(1, B, 2)], [h[1::2], h[::2]]),
    "slice_shifted": lambda h: tf.concat([h[1:], h[:1]], axis=0),
    "batch_standardisation": lambda h: h - tf.reduce_mean(h, 0),
    "in_batch_similarity": lambda h: h + tf.matmul(
        h, h, transpose_b=True)[:, 2:3],
}


def _loss_after_param(mover):
  def fn(w, x):
    h = mover(tf.tanh(tf.matmul(x, w)))
    return tf.reduce_sum(tf.square(h), axis=list(range(1, h.shape.rank)))
  return fn


def _loss_before_param(mover):
  def fn(w, x):
    h = mover(x)[:, :D]
    return tf.reduce_sum(tf.square(tf.tanh(tf.matmul(h, w))), axis=1)
  return fn


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["before_param", "after_param"])
@pytest.mark.parametrize("name", sorted(ROW_MOVERS))
def test_row_movers_raise_instead_of_wrong_per_example_gradients(
    name, where, mode):
  make = _loss_after_param if where == "after_param" else _loss_before_param
  loss = make(ROW_MOVERS[name])
  w = _weights()

  def per_example(x):
    with tf_pxg.GradientTape() as tape:
      losses = loss(w, x)
    return tape.per_example_gradient(losses, [w])

  with pytest.raises(ValueError, match="mixes examples") as err:
    _run(per_example, mode)(_inputs())
  assert "op '" in str(err.value)


def test_row_movers_really_mix():
  """Guards the table: each mover changes other examples' losses when one
  example changes (so refusing it is necessary, not just cautious)."""
  w = _weights()
  x = _inputs()
  x2 = tf.tensor_scatter_nd_update(x, [[2]], [tf.ones([D]) * 3.0])
  for name, mover in ROW_MOVERS.items():
    for make in (_loss_after_param, _loss_before_param):
      a, b = make(mover)(w, x).numpy(), make(mover)(w, x2).numpy()
      others = np.delete(np.abs(a - b), 2)
      assert others.max() > 1e-3, (name, make.__name__)


# The same kinds of ops along other axes, or keeping each example's rows:
# exact against the Jacobian rows.
ROW_WISE = {
    "roll_features": lambda h: tf.roll(h, 1, axis=1),
    "reverse_features": lambda h: tf.reverse(h, [1]),
    "sort_features": lambda h: tf.sort(h, axis=1),
    "top_k_features": lambda h: tf.math.top_k(h, k=2).values,
    "gather_features": lambda h: tf.gather(h, [2, 0, 1], axis=1),
    "gather_per_example": lambda h: tf.gather(
        h, tf.argsort(h, axis=1), batch_dims=1),
    "gather_nd_features": lambda h: tf.transpose(tf.gather_nd(
        tf.transpose(h), [[1], [0]])),
    "slice_ellipsis": lambda h: h[..., 1:],
    "slice_new_axis": lambda h: h[:, None, :2],
    "slice_whole_batch": lambda h: h[0:B, ::2],
    "tile_features": lambda h: tf.tile(h, [1, 2]),
    "pad_features": lambda h: tf.pad(h, [[0, 0], [1, 2]]),
    "cumsum_features": lambda h: tf.cumsum(h, axis=1),
    "softmax_features": tf.nn.softmax,
    "per_example_standardisation": lambda h: (
        h - tf.reduce_mean(h, 1, keepdims=True)),
    "where_rows": lambda h: tf.where(h[:, :1] > 0, h, -h),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROW_WISE))
def test_row_wise_ops_are_exact_jacobian_rows(name, mode):
  loss = _loss_after_param(ROW_WISE[name])
  w = _weights()
  x = _inputs()

  def per_example(x):
    with tf_pxg.GradientTape() as tape:
      losses = loss(w, x)
    return tape.per_example_gradient(losses, [w])[0]

  with tf.GradientTape() as tape:
    jac = tape.jacobian(loss(w, x), w).numpy()  # [B, D, U]
  got = _run(per_example, mode)(x).numpy()
  scale = np.abs(jac).max() + 1e-6
  np.testing.assert_allclose(got, jac, rtol=0, atol=1e-5 * scale)


def test_unlisted_op_raises_then_registers():
  """An op off the allowlist is refused with a message that shows how to
  register it; once registered (it is row-wise), per-example gradients are
  exact."""
  w = _weights()
  x = _inputs()
  op_type = "Sinh"  # Temporarily taken off the list for the test.
  saved = batch_axis._RULES.pop(op_type)
  try:
    def per_example(x):
      with tf_pxg.GradientTape() as tape:
        losses = tf.reduce_sum(tf.sinh(tf.matmul(x, w)), axis=1)
      return tape.per_example_gradient(losses, [w])[0]

    with pytest.raises(ValueError, match="register_row_wise\\('Sinh'\\)"):
      per_example(x)
    tf_pxg.register_row_wise(op_type)
    assert op_type in tf_pxg.row_wise_op_types()
    with pytest.raises(ValueError, match="already on"):
      tf_pxg.register_row_wise(op_type)
    tf_pxg.register_row_wise(op_type, override=True)
    got = per_example(x).numpy()
    with tf.GradientTape() as tape:
      jac = tape.jacobian(tf.reduce_sum(tf.sinh(tf.matmul(x, w)), 1), w)
    np.testing.assert_allclose(got, jac.numpy(), rtol=0,
                               atol=1e-5 * np.abs(jac.numpy()).max())
  finally:
    batch_axis._RULES[op_type] = saved


def test_scalar_target_may_sum_over_examples_but_not_mix():
  w = _weights()
  x = _inputs()
  with tf_pxg.GradientTape(persistent=True) as tape:
    total = tf.reduce_sum(tf.square(tf.matmul(x, w)))
    rolled = tf.reduce_sum(tf.square(tf.roll(tf.matmul(x, w), 1, axis=0)))
    h = tf.matmul(x, w)
    centred = tf.reduce_sum(tf.square(h - tf.reduce_mean(h, axis=0)))
  assert tape.per_example_gradient(total, [w])[0].shape == (B, D, U)
  with pytest.raises(ValueError, match="rolls rows"):
    tape.per_example_gradient(rolled, [w])
  with pytest.raises(ValueError, match="statistic of the whole batch"):
    tape.per_example_gradient(centred, [w])


# Keras: mixing layers refuse before any update --------------------------------


def _images(n=8, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.uniform(0, 1, (n, 8, 8, 3)).astype("float32"),
          rng.integers(0, 3, n))


class _BatchStandardise(L.Layer):
  def call(self, x):
    return (x - keras.ops.mean(x, axis=0)) / (keras.ops.std(x, axis=0) + 1.0)


def _mixers():
  conv = lambda: [L.Conv2D(4, 3, activation="relu"),
                  L.GlobalAveragePooling2D(), L.Dense(3)]
  return {
      "MixUp": lambda: [L.MixUp()] + conv(),
      "CutMix": lambda: [L.CutMix()] + conv(),
      "BatchNormalization": lambda: [L.Conv2D(4, 3),
                                     L.BatchNormalization(),
                                     L.GlobalAveragePooling2D(), L.Dense(3)],
      "batch_standardise_inputs": lambda: [_BatchStandardise()] + conv(),
      "batch_standardise_hidden": lambda: [L.Conv2D(4, 3),
                                           _BatchStandardise(),
                                           L.GlobalAveragePooling2D(),
                                           L.Dense(3)],
  }


def _model_error(layers_fn, jit=False, x=None, y=None):
  """Compiles and fits; returns the error, raised at compile or in the first
  step, after checking that no update happened."""
  if x is None:
    x, y = _images()
  model = dpk.DPSequential(layers_fn(), l2_norm_clip=1.0,
                           noise_multiplier=0.0, seed=0)
  model.build(x.shape)
  before = [v.numpy().copy() for v in model.trainable_variables]
  optimizer = keras.optimizers.SGD(0.5)
  with pytest.raises(ValueError) as err:
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=jit)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, sampling_seed=0)
  for v, b in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), b)  # No update happened.
  assert int(optimizer.iterations.numpy()) == 0
  return str(err.value)


def _mixing_op(layers_fn, mode):
  """The engine's own refusal, without the compile-time layer check: one
  per-example norm of the model's losses in `mode`."""
  x, y = _images(6)
  model = keras.Sequential(layers_fn())
  model.build(x.shape)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None)

  def norms(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = loss(y, model(x, training=True))
    return tape.per_example_norms(losses, model.trainable_variables)

  with pytest.raises(ValueError, match="mixes examples") as err:
    _run(norms, mode)(tf.constant(x), tf.constant(y))
  return str(err.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(_mixers()))
def test_engine_refuses_mixing_layers_as_ops(name, mode):
  message = _mixing_op(_mixers()[name], mode)
  if name in ("MixUp", "CutMix"):
    assert "gathers along the batch axis" in message
  elif name == "BatchNormalization":
    assert "statistics" in message


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", sorted(_mixers()))
def test_keras_mixing_layers_refused_before_any_update(name, jit):
  message = _model_error(_mixers()[name], jit=jit)
  assert "other examples" in message
  if name in ("MixUp", "CutMix", "BatchNormalization"):
    assert f"is a {name} layer" in message  # Named at compile.


def test_in_batch_negatives_refused_before_any_update():
  """A two-tower model whose logits are z_a @ z_b^T, labels arange(B)."""
  rng = np.random.default_rng(3)
  a = keras.Input((5,))
  b = keras.Input((5,))
  za, zb = L.Dense(4)(a), L.Dense(4)(b)
  logits = L.Lambda(lambda z: keras.ops.matmul(z[0], keras.ops.transpose(
      z[1])))([za, zb])
  model = dpk.DPModel([a, b], logits, l2_norm_clip=1.0, noise_multiplier=0.0)
  model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  xa, xb = (rng.standard_normal((4, 5)).astype("float32") for _ in range(2))
  before = [v.numpy().copy() for v in model.trainable_variables]
  with pytest.raises(ValueError, match="pairs the examples|contracts"):
    model.fit([xa, xb], np.arange(4), batch_size=4, epochs=1, verbose=0,
              sampling="shuffled")
  for v, w in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), w)


def test_per_example_augmentation_layers_still_train():
  """RandomFlip, RandomCrop, RandomRotation, RandomTranslation, RandomZoom,
  RandomContrast and Rescaling act per example: DP fit trains through them
  (the Keras-typical unbuilt Sequential, numpy data, string optimizer)."""
  x, y = _images(16)
  model = dpk.DPSequential([
      L.Rescaling(2.0, offset=-1.0), L.RandomFlip(), L.RandomCrop(6, 6),
      L.RandomRotation(0.1), L.RandomTranslation(0.1, 0.1),
      L.RandomZoom(0.1), L.RandomContrast(0.2),
      L.Conv2D(4, 3, activation="relu"), L.GlobalAveragePooling2D(),
      L.Dense(3)], l2_norm_clip=1.0, noise_multiplier=0.5)
  model.compile("adam", "sparse_categorical_crossentropy")
  history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                      unprotected_training_metrics=True)
  assert np.isfinite(history.history["unprotected_loss"]).all()
  assert model.optimizer.iterations.numpy() == 4


def _optional_layers():
  """Keras 3 augmentation layers that act per example (some only exist in
  newer Keras versions)."""
  make = {
      "RandomShear": lambda: L.RandomShear(0.2, 0.2),
      "RandomPerspective": lambda: L.RandomPerspective(),
      "RandomErasing": lambda: L.RandomErasing(value_range=(0, 1)),
      "RandomBrightness": lambda: L.RandomBrightness(0.2),
      "RandomGrayscale": lambda: L.RandomGrayscale(),
      "RandomColorJitter": lambda: L.RandomColorJitter(
          value_range=(0, 1), brightness_factor=0.2, contrast_factor=0.2),
      "RandomSharpness": lambda: L.RandomSharpness(0.2, value_range=(0, 1)),
      "RandomGaussianBlur": lambda: L.RandomGaussianBlur(value_range=(0, 1)),
      "Resizing": lambda: L.Resizing(6, 6),
      "CenterCrop": lambda: L.CenterCrop(6, 6),
  }
  return {k: v for k, v in make.items() if hasattr(L, k)}


@pytest.mark.parametrize("name", sorted(_optional_layers()))
def test_more_per_example_augmentations_train(name):
  x, y = _images(8)
  model = dpk.DPSequential([_optional_layers()[name](), L.Conv2D(2, 3),
                            L.GlobalAveragePooling2D(), L.Dense(3)],
                           l2_norm_clip=1.0, noise_multiplier=0.5)
  model.compile("sgd", "sparse_categorical_crossentropy")
  history = model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                      unprotected_training_metrics=True)
  assert np.isfinite(history.history["unprotected_loss"]).all()


@pytest.mark.parametrize("mode", MODES)
def test_category_encoding_per_example_gradients_are_exact(mode):
  """Multi-hot CategoryEncoding (a bincount whose size is clamped from
  max(ids)): the size is not example data, each row counts its own ids."""
  layer = L.CategoryEncoding(10, output_mode="multi_hot")
  w = _weights()
  dense = tf.Variable(np.random.default_rng(2).standard_normal((10, D)),
                      dtype=tf.float32)
  ids = tf.constant(np.random.default_rng(3).integers(0, 10, (B, 4)),
                    tf.int32)

  def loss(ids):
    h = tf.tanh(tf.matmul(tf.matmul(layer(ids), dense), w))
    return tf.reduce_sum(tf.square(h), axis=1)

  def per_example(ids):
    with tf_pxg.GradientTape() as tape:
      losses = loss(ids)
    return tape.per_example_gradient(losses, [dense, w])

  got = _run(per_example, mode)(ids)
  with tf.GradientTape(persistent=True) as tape:
    losses = loss(ids)
  for g, v in zip(got, [dense, w]):
    jac = tape.jacobian(losses, v).numpy()
    np.testing.assert_allclose(g.numpy(), jac, rtol=0,
                               atol=1e-5 * np.abs(jac).max())


def test_text_vectorization_trains_per_example():
  """TextVectorization splits strings into ragged rows and rebuilds a
  dense [B, T] tensor: every step is on the allowlist (per-example)."""
  texts = np.array(["the cat sat", "a dog ran far away", "the bird",
                    "cats and dogs", "a cat", "dogs run"])
  y = np.array([0, 1, 0, 1, 0, 1])
  tv = L.TextVectorization(max_tokens=30, output_sequence_length=6)
  tv.adapt(texts)
  inputs = keras.Input((), dtype="string")
  h = L.Embedding(30, 4)(tv(inputs))
  out = L.Dense(2)(L.GlobalAveragePooling1D()(h))
  model = dpk.DPModel(inputs, out, l2_norm_clip=1.0, noise_multiplier=0.5)
  model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  history = model.fit(tf.constant(texts), y, batch_size=3, epochs=1,
                      verbose=0, sampling="shuffled",
                      unprotected_training_metrics=True)
  assert np.isfinite(history.history["unprotected_loss"]).all()
  # And per-example gradients through it equal the single-example loop.
  variables = model.trainable_variables
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None)
  with tf_pxg.GradientTape() as tape:
    losses = loss(y, model(tf.constant(texts), training=True))
  got = tape.per_example_gradient(losses, variables)
  for b in range(len(texts)):
    with tf.GradientTape() as ref:
      lb = loss(y[b:b + 1], model(tf.constant(texts[b:b + 1]),
                                  training=True))[0]
    for g, r in zip(got, ref.gradient(lb, variables)):
      r = tf.convert_to_tensor(r).numpy()
      np.testing.assert_allclose(g[b].numpy(), r, rtol=0,
                                 atol=1e-5 * (np.abs(r).max() + 1e-6))


def test_allowlist_lists_row_wise_ops_and_no_mixers():
  ops = set(tf_pxg.row_wise_op_types())
  assert {"MatMul", "Conv2D", "Relu", "Reshape", "Transpose", "GatherV2",
          "StridedSlice", "SparseSoftmaxCrossEntropyWithLogits"} <= ops
  for mixer in ("TensorScatterUpdate", "UnsortedSegmentSum", "DynamicStitch",
                "Unique", "Where", "CropAndResize"):
    assert mixer not in ops


@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_batch_reshape_is_followed_and_a_wrong_one_refused(jit):
  """`reshape(h, [tf.shape(h)[0], -1])` with a `None` batch keeps the
  examples on axis 0 (exact Jacobian rows); reshaping by another axis's
  size, which moves rows across examples when sizes differ, raises."""
  w = tf.Variable(np.random.default_rng(4).standard_normal((2, 3)),
                  dtype=tf.float32)
  x = tf.constant(np.random.default_rng(5).standard_normal((B, 4, 2)),
                  tf.float32)

  def make(by_axis):
    def per_example(x):
      with tf_pxg.GradientTape() as tape:
        losses = tf.reduce_sum(tf.reshape(
            tf.square(tf.tanh(tf.einsum("bti,io->bto", x, w))),
            [tf.shape(x)[by_axis], -1]), axis=1)
      return tape.per_example_gradient(losses, [w])[0]
    return tf.function(per_example, jit_compile=jit, input_signature=[
        tf.TensorSpec([None, 4, 2], tf.float32)])

  with tf.GradientTape() as tape:
    jac = tape.jacobian(tf.reduce_sum(tf.square(tf.tanh(
        tf.einsum("bti,io->bto", x, w))), axis=[1, 2]), w).numpy()
  got = make(0)(x).numpy()
  np.testing.assert_allclose(got, jac, rtol=0, atol=1e-5 * np.abs(jac).max())
  with pytest.raises(ValueError, match="reshapes"):
    make(1)(x)


def test_batch_of_one_cannot_mix():
  """With one example, ops that drop the batch axis (a squeeze of every
  size-1 axis) are fine: the per-example gradient is the gradient."""
  w = _weights()
  x = _inputs()[:1]
  with tf_pxg.GradientTape() as tape:
    losses = tf.reshape(tf.reduce_sum(tf.squeeze(tf.tanh(tf.matmul(x, w)))),
                        [1])
  got = tape.per_example_gradient(losses, [w])[0].numpy()
  with tf.GradientTape() as ref:
    total = tf.reduce_sum(tf.tanh(tf.matmul(x, w)))
  want = ref.gradient(total, w).numpy()
  np.testing.assert_allclose(got[0], want, rtol=0,
                             atol=1e-6 * np.abs(want).max())
