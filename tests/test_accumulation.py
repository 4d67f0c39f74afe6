"""Poisson `fit`: masked padding, logical steps over k physical batches, noise.

References: the same step without padding rows; one step on the
concatenated batch; a plain `tf.GradientTape` loop over single examples;
the closed-form noise std `sigma C / (q N)` of one logical step.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import accounting
from tf_pxg import data as dpd
import tf_pxg.keras as dpk


CLIP = 2.5  # between the smallest and largest per-example norm (checked)


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(clip=None, noise=0.0, seed=0, optimizer=None, jit_compile=False,
           metrics=None, kind="dense", unprotected_training_metrics=False):
  """A small DPModel; `kind="embedding"` reads 5 token ids (its table's
  clipped sum is `IndexedSlices` of the used rows)."""
  clip = CLIP if clip is None else clip
  keras.utils.set_random_seed(seed)
  if kind == "embedding":
    inp = keras.Input((5,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(inp))
  else:
    inp = keras.Input((5,))
    h = keras.layers.Dense(7, activation="tanh")(inp)
  out = keras.layers.Dense(3)(h)
  model = dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=noise,
                      seed=seed,
                      unprotected_training_metrics=unprotected_training_metrics)
  model.compile(optimizer=optimizer or keras.optimizers.Adam(0.05),
                loss=_sce(), jit_compile=jit_compile, metrics=metrics)
  return model


VOCAB = 13


def _data(n, seed=1, kind="dense"):
  rng = np.random.RandomState(seed)
  x = (rng.randint(0, VOCAB, (n, 5)).astype("int32") if kind == "embedding"
       else rng.randn(n, 5).astype("float32") * 2)
  return x, rng.randint(0, 3, n).astype("int32")


def _weights(model):
  return [v.numpy() for v in model.trainable_variables]


def _assert_close(got, want, rel=1e-6):
  scale = max(np.abs(w).max() for w in want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=rel * scale)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_padding_rows_change_nothing(jit_compile):
  x, y = _data(6)
  rng = np.random.RandomState(9)
  pad_x = np.concatenate([x[:2], rng.randn(5, 5).astype("float32") * 50,
                          x[2:]])
  pad_y = np.concatenate([y[:2], rng.randint(0, 3, 5), y[2:]])
  mask = np.array([1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1], "float32")
  results = []
  for xb, yb, m in ((x, y, np.ones(6, "float32")), (pad_x, pad_y, mask)):
    model = _model(jit_compile=jit_compile, metrics=["accuracy"],
                   unprotected_training_metrics=True)
    info = dpd.dp_batch_info(m, step_end=True, normalizer=5.0)
    logs = model.train_on_batch(xb, yb, sample_weight=info, return_dict=True)
    results.append((_weights(model), logs))
  (w_plain, logs_plain), (w_pad, logs_pad) = results
  assert any(np.abs(a).max() > 0 for a in w_plain)
  _assert_close(w_pad, w_plain, rel=1e-6)
  for key in ("unprotected_loss", "unprotected_accuracy"):
    assert logs_pad[key] == pytest.approx(logs_plain[key], rel=1e-6)


@pytest.mark.parametrize("kind", ["dense", "embedding"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_logical_step_over_four_physical_batches_equals_one_step(
    jit_compile, kind):
  x, y = _data(32, kind=kind)
  # Between the smallest and largest per-example norm (checked below).
  clip = {"dense": CLIP, "embedding": 1.4}[kind]
  one = _model(clip=clip, jit_compile=jit_compile, kind=kind)
  one.train_on_batch(x, y, sample_weight=dpd.dp_batch_info(
      np.ones(32), step_end=True, normalizer=32.0))
  want = _weights(one)

  acc = _model(clip=clip, jit_compile=jit_compile, kind=kind)
  before = _weights(acc)
  for i in range(4):
    sl = slice(8 * i, 8 * i + 8)
    acc.train_on_batch(x[sl], y[sl], sample_weight=dpd.dp_batch_info(
        np.ones(8), step_end=(i == 3), normalizer=32.0))
    if i < 3:  # nothing applied, nothing counted until the step ends
      _assert_close(_weights(acc), before, rel=0)
      assert int(acc.optimizer.iterations) == 0
  assert int(acc.optimizer.iterations) == int(one.optimizer.iterations) == 1
  _assert_close(_weights(acc), want, rel=1e-5)
  # The clip was active for some examples and not for others.
  norms = _per_example_norms(_model(kind=kind), x, y)
  assert norms.min() < clip < norms.max()


def _per_example_norms(model, x, y):
  out = []
  for b in range(len(y)):
    with tf.GradientTape() as tape:
      loss = _sce()(y[b:b + 1], model(x[b:b + 1]))
    g = tape.gradient(loss, model.trainable_variables)
    out.append(math.sqrt(sum(float(tf.reduce_sum(tf.square(tf.convert_to_tensor(t))))
                             for t in g)))
  return np.array(out)


def _reference_update(model, x, y, clip, divisor):
  total = None
  for b in range(len(y)):
    with tf.GradientTape() as tape:
      loss = _sce()(y[b:b + 1], model(x[b:b + 1], training=True))
    g = tape.gradient(loss, model.trainable_variables)
    norm = math.sqrt(sum(float(tf.reduce_sum(t * t)) for t in g))
    c = min(1.0, clip / norm)
    total = ([c * t.numpy() for t in g] if total is None else
             [a + c * t.numpy() for a, t in zip(total, g)])
  return [-t / divisor for t in total]


@pytest.mark.parametrize("k, physical", [(4, None), (2, 4)])
def test_fit_logical_step_matches_per_example_reference(k, physical):
  # q = 1: every example is in the one logical step; (2, 4) makes the draw
  # of 24 overflow k * P = 8 rows, so it is carried into 6 physical batches.
  x, y = _data(24)
  model = _model(optimizer=keras.optimizers.SGD(1.0))
  before = _weights(model)
  want = _reference_update(model, x, y, CLIP, divisor=24)
  model.fit(x, y, batch_size=24, epochs=1, verbose=0, accumulation_steps=k,
            physical_batch_size=physical, sampling_seed=0)
  assert int(model.optimizer.iterations) == 1
  _assert_close([w - b for w, b in zip(_weights(model), before)], want,
                rel=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_noise_std_per_logical_step_is_sigma_clip_over_qn(jit_compile):
  sigma, clip, n, b, lr = 1.3, 0.7, 64, 16, 0.5
  inp = keras.Input((200,))
  out = keras.layers.Dense(50, kernel_initializer="zeros")(inp)
  model = dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=sigma,
                      seed=11)
  model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse",
                jit_compile=jit_compile)
  x = np.zeros((n, 200), "float32")
  y = np.zeros((n, 50), "float32")
  # One logical step over k = 4 physical batches: noise must be drawn once
  # (4 draws would give twice the std), divided by qN = B, not the realised
  # batch size.
  model.fit(x, y, batch_size=b, epochs=1, steps_per_epoch=1, verbose=0,
            accumulation_steps=4, sampling_seed=3)
  assert int(model.optimizer.iterations) == 1
  update = np.concatenate([v.numpy().ravel()
                           for v in model.trainable_variables]) / -lr
  expected = sigma * clip / b
  assert abs(update.std() / expected - 1) < 0.03, (update.std(), expected)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_embedding_noise_covers_every_row_once_per_logical_step(jit_compile):
  # The table's clipped sums are IndexedSlices of the used rows; over a
  # logical step of 4 physical batches they go through the accumulator's
  # later/carry branches and the skipped draws. Zero data gradient: the
  # update is the noise alone, on every row (used or not), drawn once.
  sigma, clip, n, b, lr, vocab = 1.3, 0.7, 64, 16, 0.5, 400
  inp = keras.Input((3,), dtype="int32")
  emb = keras.layers.Embedding(vocab, 50, embeddings_initializer="zeros")
  out = keras.layers.GlobalAveragePooling1D()(emb(inp))
  model = dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=sigma,
                      seed=5)
  model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse",
                jit_compile=jit_compile)
  x = np.random.RandomState(0).randint(0, 20, (n, 3)).astype("int32")
  model.fit(x, np.zeros((n, 50), "float32"), batch_size=b, epochs=1,
            steps_per_epoch=1, verbose=0, accumulation_steps=4,
            sampling_seed=3)
  assert int(model.optimizer.iterations) == 1
  update = emb.embeddings.numpy() / -lr
  assert np.all(np.abs(update).sum(axis=1) > 0)  # rows 20.. were unused
  expected = sigma * clip / b
  assert abs(update.std() / expected - 1) < 0.03, (update.std(), expected)


def test_fit_counts_logical_steps_and_reports_poisson_epsilon():
  x, y = _data(40)
  model = _model(noise=1.0)
  cb = dpk.PrivacyCallback(num_examples=40, batch_size=8)
  history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                      accumulation_steps=2, callbacks=[cb], sampling_seed=1)
  # ceil(40 / 8) = 5 logical steps per epoch (no overflow for this seed).
  assert int(model.optimizer.iterations) == 10
  assert history.history["epsilon"][-1] == pytest.approx(cb.epsilon(10))


def test_fit_runs_the_accounted_number_of_steps():
  # N = 20, B = 8: 3 epochs are ceil(3 * 20 / 8) = 8 steps for the
  # accountant, not 3 * ceil(20 / 8) = 9.
  x, y = _data(20)
  model = _model(noise=1.0)
  history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                      accumulation_steps=2)
  assert accounting.steps_for(20, 8, 3) == 8
  assert int(model.optimizer.iterations) == 8
  assert len(history.history["learning_rate"]) == 3
  # An explicit steps_per_epoch is taken as given.
  model.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=3, verbose=0)
  assert int(model.optimizer.iterations) == 8 + 9


def test_privacy_callback_refuses_or_labels_shuffled_batches():
  x, y = _data(16)
  model = _model(noise=1.0)
  with pytest.raises(ValueError, match="sampling='shuffled'"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffled",
              callbacks=[dpk.PrivacyCallback(16, 8)])
  with pytest.warns(UserWarning, match="not a guarantee"):
    history = model.fit(
        x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffled",
        callbacks=[dpk.PrivacyCallback(16, 8, allow_shuffled=True)])
  assert "epsilon" not in history.history
  assert history.history["epsilon_if_poisson"][0] > 0
  with pytest.raises(ValueError, match="sampling rate"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[dpk.PrivacyCallback(16, 4)])


def test_batched_dataset_needs_an_explicit_choice():
  x, y = _data(16)
  model = _model()
  batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
  with pytest.raises(ValueError, match="batched tf.data.Dataset"):
    model.fit(batched, epochs=1, verbose=0)
  model.fit(batched, epochs=1, verbose=0, sampling="shuffled")
  assert int(model.optimizer.iterations) == 4
  # An unbatched finite dataset is Poisson-sampled.
  unbatched = tf.data.Dataset.from_tensor_slices((x, y))
  model.fit(unbatched, batch_size=4, epochs=1, verbose=0)
  assert int(model.optimizer.iterations) == 8
  with pytest.raises(ValueError, match="'poisson'.*'shuffled'"):
    model.fit(x, y, sampling="uniform", verbose=0)


def test_keras_gradient_accumulation_steps_rejected():
  model = _model()
  for opt in (keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
              dpk.DPOptimizer(keras.optimizers.Adam(
                  gradient_accumulation_steps=4), CLIP, 0.0)):
    with pytest.raises(ValueError, match="accumulation_steps=k"):
      model.compile(optimizer=opt, loss=_sce())


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_noisy_mean_divides_inside_the_noise_pass(dtype):
  # (sums + N(0, (sigma C)^2)) / normalizer: the same draw as
  # add_gaussian_noise from an equal generator, divided; sigma = 0 divides.
  from tf_pxg import dp  # pylint: disable=g-import-not-at-top
  sums = [tf.fill([300, 7], tf.constant(3.0, dtype)), None,
          tf.IndexedSlices(tf.ones([2, 4], dtype), tf.constant([1, 1]),
                           tf.constant([5, 4]))]
  mean = dp.noisy_mean(sums, 2.0, 1.5, 4.0, dp.make_generator(seed=9))
  noisy = dp.add_gaussian_noise(sums, 3.0, generator=dp.make_generator(9))
  assert mean[1] is None
  for m, n in zip([mean[0], mean[2]], [noisy[0], noisy[2]]):
    assert m.dtype == dtype
    # |noisy| <= 3 + 6.76 * 3: a few float32 ulps of that, / 4.
    np.testing.assert_allclose(m, n / 4.0, rtol=0, atol=1e-5)
  plain = dp.noisy_mean(sums[:1], 2.0, 0.0, 4.0, dp.make_generator(seed=9))
  np.testing.assert_array_equal(plain[0], sums[0] / 4.0)
