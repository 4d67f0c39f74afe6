"""DP-SGD training through `model.fit`, checked against closed forms.

References are written here: a plain `tf.GradientTape` loop over single
examples (clip each, average), Keras' own non-private step, and the
distribution of the noise.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk

LR = 0.1


def _functional(seed=0, dp_cls=None, **dp):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((6, 6, 1))
  h = keras.layers.Conv2D(3, 3, activation="tanh")(inp)
  h = keras.layers.GroupNormalization(groups=1)(h)
  h = keras.layers.Flatten()(h)
  h = keras.layers.Dense(5, activation="relu")(h)
  out = keras.layers.Dense(3)(h)
  if dp_cls is None:
    return keras.Model(inp, out)
  return dp_cls(inp, out, **dp)


def _data(n=8, seed=1):
  rng = np.random.RandomState(seed)
  x = rng.randn(n, 6, 6, 1).astype("float32")
  y = rng.randint(0, 3, size=n).astype("int32")
  return x, y


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _one_step(model, x, y, **fit_kwargs):
  model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0,
            **fit_kwargs)
  return [v.numpy() for v in model.trainable_variables]


def _reference_clipped_mean(model, x, y, clip, loss_fn):
  """mean_b(min(1, C/||g_b||) g_b), one example at a time."""
  grads = None
  for b in range(len(x)):
    with tf.GradientTape() as tape:
      loss = loss_fn(y[b:b + 1], model(x[b:b + 1], training=True))
    g = tape.gradient(loss, model.trainable_variables)
    norm = math.sqrt(sum(float(tf.reduce_sum(t * t)) for t in g))
    factor = min(1.0, clip / norm)
    g = [factor * t.numpy() for t in g]
    grads = g if grads is None else [a + c for a, c in zip(grads, g)]
  return [t / len(x) for t in grads]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_no_noise_infinite_clip_equals_keras_step(jit_compile):
  x, y = _data()
  plain = _functional()
  dp = _functional(dp_cls=dpk.DPModel, l2_norm_clip=float("inf"),
                   noise_multiplier=0.0)
  dp.set_weights(plain.get_weights())
  for m in (plain, dp):
    m.compile(optimizer=keras.optimizers.SGD(LR), loss=_sce(),
              jit_compile=jit_compile)
  weights = np.linspace(0.0, 2.0, len(x)).astype("float32")
  want = _one_step(plain, x, y, sample_weight=weights)
  got = _one_step(dp, x, y, sample_weight=weights)
  for w, g in zip(want, got):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  assert int(dp.optimizer.iterations) == 1


@pytest.mark.parametrize("jit_compile", [False, True])
def test_no_noise_small_clip_sgd_equals_reference(jit_compile):
  x, y = _data()
  model = _functional(dp_cls=dpk.DPModel, l2_norm_clip=0.05,
                      noise_multiplier=0.0)
  before = [v.numpy() for v in model.trainable_variables]
  ref = _reference_clipped_mean(model, x, y, 0.05, _sce())
  model.compile(optimizer=keras.optimizers.SGD(LR), loss=_sce(),
                jit_compile=jit_compile)
  got = _one_step(model, x, y)
  for w0, r, g in zip(before, ref, got):
    np.testing.assert_allclose(g, w0 - LR * r, rtol=1e-4, atol=1e-6)
  # The clip is active (else this test checks nothing beyond the first).
  assert any(np.abs(r).max() > 0 for r in ref)


def test_no_noise_small_clip_dpadam_equals_adam_on_reference():
  x, y = _data()
  model = _functional(dp_cls=dpk.DPModel)
  twin = _functional()
  twin.set_weights(model.get_weights())
  ref = _reference_clipped_mean(twin, x, y, 0.05, _sce())
  adam = keras.optimizers.Adam(0.01)
  adam.apply([tf.constant(r) for r in ref], twin.trainable_variables)
  model.compile(optimizer=dpk.DPAdam(0.05, 0.0, learning_rate=0.01),
                loss=_sce())
  got = _one_step(model, x, y)
  for w, g in zip(twin.trainable_variables, got):
    np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-6)


def test_sequential_make_private_and_subclass_match_reference():
  x, y = _data()
  keras.utils.set_random_seed(3)
  seq = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Flatten(),
                          keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(3)])
  ref = _reference_clipped_mean(seq, x, y, 0.1, _sce())
  before = [v.numpy() for v in seq.trainable_variables]
  dp = dpk.make_private(seq, l2_norm_clip=0.1, noise_multiplier=0.0)
  assert isinstance(dp, dpk.DPSequential)
  dp.compile(optimizer=keras.optimizers.SGD(LR), loss=_sce())
  _one_step(dp, x, y)
  # Shares the layers: the original model's weights moved too.
  for w0, r, v in zip(before, ref, seq.trainable_variables):
    np.testing.assert_allclose(v.numpy(), w0 - LR * r, rtol=1e-4, atol=1e-6)

  class Net(keras.Model):

    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.flat = keras.layers.Flatten()
      self.d1 = keras.layers.Dense(4, activation="tanh")
      self.d2 = keras.layers.Dense(3)

    def call(self, x):
      return self.d2(self.d1(self.flat(x)))

  dp_net_cls = dpk.make_dp_model_class(Net)
  net = dp_net_cls(l2_norm_clip=0.1, noise_multiplier=0.0)
  net(x[:1])
  net.set_weights(seq.get_weights())
  ref = _reference_clipped_mean(net, x, y, 0.1, _sce())
  before = [v.numpy() for v in net.trainable_variables]
  net.compile(optimizer=keras.optimizers.SGD(LR), loss=_sce())
  got = _one_step(net, x, y)
  for w0, r, g in zip(before, ref, got):
    np.testing.assert_allclose(g, w0 - LR * r, rtol=1e-4, atol=1e-6)


def _loss_case_models(loss, loss_weights=None, outputs=1):
  def build(dp_cls):
    keras.utils.set_random_seed(5)
    inp = keras.Input((4, 3))
    h = keras.layers.Dense(5, activation="tanh")(inp)
    outs = [keras.layers.Dense(2, name=f"out{i}")(h) for i in range(outputs)]
    out = outs[0] if outputs == 1 else outs
    if dp_cls is None:
      return keras.Model(inp, out)
    return dp_cls(inp, out, l2_norm_clip=float("inf"), noise_multiplier=0.0)

  plain, dp = build(None), build(dpk.DPModel)
  for m in (plain, dp):
    m.compile(optimizer=keras.optimizers.SGD(LR), loss=loss,
              loss_weights=loss_weights)
  return plain, dp


@pytest.mark.parametrize("case", [
    "mse_string", "loss_object_sample_weight", "user_function",
    "two_outputs_loss_weights"])
def test_loss_forms_match_keras(case):
  """[B, T] losses, sample weights, functions, several outputs."""
  rng = np.random.RandomState(0)
  x = rng.randn(6, 4, 3).astype("float32")
  y = rng.randn(6, 4, 2).astype("float32")
  kwargs = {}
  if case == "mse_string":
    plain, dp = _loss_case_models("mse")
  elif case == "loss_object_sample_weight":
    plain, dp = _loss_case_models(keras.losses.MeanAbsoluteError())
    kwargs["sample_weight"] = rng.rand(6, 4).astype("float32")  # temporal
  elif case == "user_function":
    plain, dp = _loss_case_models(
        lambda yt, yp: tf.reduce_sum(tf.square(yt - yp), axis=-1))
  else:
    plain, dp = _loss_case_models(["mse", "mae"], [0.3, 2.0], outputs=2)
    y = [y, 2 * y]
  want = _one_step(plain, x, y, **kwargs)
  got = _one_step(dp, x, y, **kwargs)
  for w, g in zip(want, got):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_weight_regularizer_added_unclipped():
  rng = np.random.RandomState(0)
  x, y = rng.randn(4, 3).astype("float32"), rng.randn(4, 1).astype("float32")
  keras.utils.set_random_seed(0)
  reg = keras.regularizers.L2(0.5)
  inp = keras.Input((3,))
  out = keras.layers.Dense(1, kernel_regularizer=reg)(inp)
  # Tiny clip: the data gradient is ~0; the regularizer's must pass in full.
  dp = dpk.DPModel(inp, out, l2_norm_clip=1e-9, noise_multiplier=0.0)
  dp.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
  kernel = dp.trainable_variables[0].numpy()
  got = _one_step(dp, x, y)[0]
  np.testing.assert_allclose(got, kernel - LR * 2 * 0.5 * kernel, rtol=1e-5,
                             atol=1e-8)


@pytest.mark.parametrize("sampling", ["plain", "poisson"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_weight_regularizer_with_noise_is_added_once_outside_the_clip(
    sampling, jit_compile):
  """With noise on (it once failed in Keras' all-reduce: "All
  custom_gradient outputs should be from the same graph"), the regularised
  model's step is the plain one's plus -lr * dR/dw exactly: the same
  seed draws the same noise, the regulariser is outside the clip."""
  rng = np.random.RandomState(1)
  n = 8
  x, y = rng.randn(n, 3).astype("float32"), rng.randn(n, 1).astype("float32")
  kernels = []
  for reg in (None, keras.regularizers.L2(0.5)):
    inp = keras.Input((3,))
    out = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.Constant(0.4),
        kernel_regularizer=reg)(inp)
    model = dpk.DPModel(inp, out, l2_norm_clip=0.3, noise_multiplier=1.5,
                        seed=7)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                  jit_compile=jit_compile)
    if sampling == "plain":
      model.train_on_batch(x, y)
    else:  # one logical step: q = 1
      model.fit(x, y, batch_size=n, epochs=1, verbose=0, sampling_seed=2)
    assert int(model.optimizer.iterations) == 1
    kernels.append(model.trainable_variables[0].numpy())
  np.testing.assert_allclose(kernels[1] - kernels[0],
                             -LR * 2 * 0.5 * np.full((3, 1), 0.4),
                             rtol=1e-4, atol=1e-6)


def _zero_grad_model(dp_cls, **dp):
  """Zero inputs and zero-initialised weights with MSE to 0: every
  per-example gradient is exactly 0, so the update is -lr * noise / B."""
  inp = keras.Input((100,))
  out = keras.layers.Dense(50, kernel_initializer="zeros")(inp)
  return dp_cls(inp, out, **dp)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_noise_std_is_sigma_clip_over_batch(jit_compile):
  sigma, clip, batch = 1.3, 0.7, 16
  model = _zero_grad_model(dpk.DPModel, l2_norm_clip=clip,
                           noise_multiplier=sigma, seed=123)
  model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                jit_compile=jit_compile)
  x = np.zeros((batch, 100), "float32")
  y = np.zeros((batch, 50), "float32")
  got = _one_step(model, x, y)
  update = np.concatenate([g.ravel() for g in got]) / -LR
  expected = sigma * clip / batch
  assert abs(update.std() / expected - 1) < 0.05, (update.std(), expected)
  assert abs(update.mean()) < 4 * expected / math.sqrt(update.size)


def test_noise_differs_between_steps_and_unseeded_models():
  x = np.zeros((4, 100), "float32")
  y = np.zeros((4, 50), "float32")
  updates = []
  for _ in range(2):
    model = _zero_grad_model(dpk.DPModel, l2_norm_clip=1.0,
                             noise_multiplier=1.0)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    first = _one_step(model, x, y)[0]
    second = _one_step(model, x, y)[0] - first
    assert np.abs(first - second).max() > 0.1
    updates.append(first)
  assert np.abs(updates[0] - updates[1]).max() > 0.1


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("mode", ["graph", "eager", "jit"])
def test_non_finite_example_is_dropped_and_the_step_applied(bad, mode):
  # The non-finite example gets clip factor 0; the step is never skipped
  # (a skip would depend on one example). Exact values: test_non_finite.py.
  x, y = _data()
  x[3, 0, 0, 0] = bad
  model = _functional(dp_cls=dpk.DPModel, l2_norm_clip=1.0,
                      noise_multiplier=1.0)
  model.compile(optimizer=keras.optimizers.Adam(0.1), loss=_sce(),
                run_eagerly=mode == "eager", jit_compile=mode == "jit")
  before = [v.numpy() for v in model.trainable_variables]
  history = model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
  assert int(model.optimizer.iterations) == 1
  assert "dp_skipped_steps" not in history.history
  for w, v in zip(before, model.trainable_variables):
    assert np.all(np.isfinite(v.numpy())), v.path
    assert np.any(v.numpy() != w), v.path


def test_dp_optimizer_provides_settings_and_trains():
  x, y = _data(n=32)
  model = _functional(dp_cls=dpk.DPModel)
  model.compile(optimizer=dpk.DPSGD(1.0, 0.5, learning_rate=0.1),
                loss=_sce(), metrics=["accuracy"])
  assert model.l2_norm_clip == 1.0 and model.noise_multiplier == 0.5
  history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                      unprotected_training_metrics=True)
  assert set(history.history) >= {"unprotected_loss", "unprotected_accuracy"}
  assert int(model.optimizer.iterations) == 8
  assert np.all(np.isfinite(history.history["unprotected_loss"]))


def test_evaluate_and_predict_behave_as_keras():
  x, y = _data(n=16)
  plain = _functional()
  dp = _functional(dp_cls=dpk.DPModel, l2_norm_clip=1.0, noise_multiplier=1.0)
  dp.set_weights(plain.get_weights())
  for m in (plain, dp):
    m.compile(optimizer="sgd", loss=_sce(), metrics=["accuracy"])
  np.testing.assert_allclose(dp.predict(x, verbose=0),
                             plain.predict(x, verbose=0), rtol=1e-6)
  want = plain.evaluate(x, y, verbose=0, return_dict=True)
  got = dp.evaluate(x, y, verbose=0, return_dict=True)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-6)


def test_example_script_runs_and_prints_summary():
  import os
  import re
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "examples", "dp_digits.py"),
       "--epochs=2", "--target_epsilon=2.0"],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  # train_loss: the NoisyLoss release (noised, inside ε).
  assert re.fullmatch(r"epoch 2: test_accuracy=\S+ epsilon=\S+ "
                      r"train_loss=\S+", lines[-2]), lines[-2]
  match = re.fullmatch(
      r"final: test_accuracy=(\S+) epsilon=(\S+) delta=1e-05", lines[-1])
  assert match, lines[-1]
  assert 0.0 <= float(match.group(1)) <= 1.0
  assert float(match.group(2)) <= 2.0


def test_embedding_and_masked_sequence_match_reference():
  """Sparse (IndexedSlices) embedding gradients; a masked [B, T] loss."""
  rng = np.random.RandomState(0)
  x = rng.randint(1, 20, size=(6, 5)).astype("int32")
  x[:, 3:] = 0  # padding, masked out by mask_zero
  y = rng.randn(6, 5, 2).astype("float32")
  keras.utils.set_random_seed(2)
  inp = keras.Input((5,), dtype="int32")
  h = keras.layers.Embedding(20, 4, mask_zero=True)(inp)
  out = keras.layers.Dense(2)(h)
  model = dpk.DPModel(inp, out, l2_norm_clip=0.05, noise_multiplier=0.0)

  def masked_mse(yt, yp, xb):
    m = tf.cast(xb != 0, tf.float32)
    per_step = tf.reduce_mean(tf.square(yt - yp), axis=-1)
    return tf.reduce_sum(per_step * m) / tf.reduce_sum(m)

  grads = None
  for b in range(len(x)):
    with tf.GradientTape() as tape:
      loss = masked_mse(y[b:b + 1], model(x[b:b + 1]), x[b:b + 1])
    g = [tf.convert_to_tensor(t).numpy()
         for t in tape.gradient(loss, model.trainable_variables)]
    factor = min(1.0, 0.05 / math.sqrt(sum((t * t).sum() for t in g)))
    g = [factor * t for t in g]
    grads = g if grads is None else [a + c for a, c in zip(grads, g)]
  before = [v.numpy() for v in model.trainable_variables]
  model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
  got = _one_step(model, x, y)
  for w0, g, new in zip(before, grads, got):
    np.testing.assert_allclose(new, w0 - LR * g / len(x), rtol=1e-4,
                               atol=1e-7)


def test_steps_per_execution_runs_every_dp_step():
  # Keras loops several train steps inside one tf.function: the tape then
  # records inside the loop body's graph, and every step is counted.
  x, y = _data(n=32)
  model = _functional(dp_cls=dpk.DPModel, l2_norm_clip=1.0,
                      noise_multiplier=0.5)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_sce(),
                steps_per_execution=4)
  before = [v.numpy() for v in model.trainable_variables]
  history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert int(model.optimizer.iterations) == 8
  assert "dp_skipped_steps" not in history.history
  assert all(np.any(v.numpy() != w)
             for w, v in zip(before, model.trainable_variables))


def _per_example_grads(model, x, y, loss_fn):
  """[g_b per variable] for each example, by a batch-of-one tape loop."""
  out = []
  for b in range(len(x)):
    with tf.GradientTape() as tape:
      loss = loss_fn(y[b:b + 1], model(x[b:b + 1], training=True), b)
    out.append([tf.convert_to_tensor(t).numpy()
                for t in tape.gradient(loss, model.trainable_variables)])
  return out


def _clipped_mean(grads, clip):
  norms = np.array([math.sqrt(sum(float((t * t).sum()) for t in g))
                    for g in grads])
  factors = np.minimum(1.0, clip / norms)
  mean = [sum(f * g[i] for f, g in zip(factors, grads)) / len(grads)
          for i in range(len(grads[0]))]
  return mean, norms


@pytest.mark.parametrize("jit_compile", [False, True])
def test_no_noise_mixed_clip_sgd_equals_reference(jit_compile):
  """Some examples clipped, some not (the clip is the median norm)."""
  x, y = _data()
  model = _functional(dp_cls=dpk.DPModel, l2_norm_clip=1.0,
                      noise_multiplier=0.0)
  grads = _per_example_grads(model, x, y, lambda yt, yp, b: _sce()(yt, yp))
  _, norms = _clipped_mean(grads, 1.0)
  clip = float(np.median(norms))
  assert np.sum(norms > clip * 1.01) >= 2 and np.sum(norms < clip * 0.99) >= 2
  ref, _ = _clipped_mean(grads, clip)
  model = _functional(dp_cls=dpk.DPModel, l2_norm_clip=clip,
                      noise_multiplier=0.0)
  before = [v.numpy() for v in model.trainable_variables]
  model.compile(optimizer=keras.optimizers.SGD(LR), loss=_sce(),
                jit_compile=jit_compile)
  got = _one_step(model, x, y)
  for w0, r, g in zip(before, ref, got):
    np.testing.assert_allclose(g, w0 - LR * r, rtol=1e-4, atol=1e-6)


def test_masked_sequence_varied_lengths_match_reference():
  """Each example's loss is the mean over ITS unmasked steps (the counts
  differ, so batch-level mask normalisation would give another update)."""
  rng = np.random.RandomState(4)
  lengths = [5, 1, 3, 2, 4, 2]
  x = rng.randint(1, 20, size=(6, 5)).astype("int32")
  for b, n in enumerate(lengths):
    x[b, n:] = 0
  y = rng.randn(6, 5, 2).astype("float32")

  def build(clip=1.0):
    keras.utils.set_random_seed(6)
    inp = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4, mask_zero=True)(inp)
    out = keras.layers.Dense(2)(h)
    return dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=0.0)

  def per_example_loss(yt, yp, b):
    m = tf.cast(x[b:b + 1] != 0, tf.float32)
    per_step = tf.reduce_mean(tf.square(yt - yp), axis=-1)
    return tf.reduce_sum(per_step * m) / tf.reduce_sum(m)

  model = build()
  grads = _per_example_grads(model, x, y, per_example_loss)
  _, norms = _clipped_mean(grads, 1.0)
  clip = float(np.median(norms))
  ref, _ = _clipped_mean(grads, clip)
  # Batch-level normalisation (each step weighted 1 / all unmasked steps)
  # differs from per-example normalisation by more than the tolerance.
  scale = [n * len(x) / sum(lengths) for n in lengths]
  batch_level, _ = _clipped_mean(
      [[s * t for t in g] for s, g in zip(scale, grads)], clip)
  assert max(np.abs(a - r).max() for a, r in zip(batch_level, ref)) > 1e-3

  model = build(clip)
  before = [v.numpy() for v in model.trainable_variables]
  model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
  got = _one_step(model, x, y)
  for w0, r, g in zip(before, ref, got):
    np.testing.assert_allclose(g, w0 - LR * r, rtol=1e-4, atol=1e-7)


def test_model_seed_makes_noise_reproducible():
  x = np.zeros((4, 100), "float32")
  y = np.zeros((4, 50), "float32")

  def update(seed):
    model = _zero_grad_model(dpk.DPModel, l2_norm_clip=1.0,
                             noise_multiplier=1.0, seed=seed)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    return np.concatenate([w.ravel() for w in _one_step(model, x, y)])

  first, again, other = update(7), update(7), update(8)
  np.testing.assert_array_equal(first, again)
  assert np.abs(first).max() > 0.1
  assert np.abs(first - other).max() > 0.1


@pytest.mark.parametrize("inputs", ["arrays", "dataset", "validation"])
def test_poisson_fit_emits_no_keras_warning(inputs):
  """Quiet by default: nothing our fit does makes Keras warn (e.g.
  "`shuffle=True` was passed, but will be ignored")."""
  import warnings  # pylint: disable=g-import-not-at-top
  x, y = _data(n=32)
  model = _functional(dp_cls=dpk.DPModel, l2_norm_clip=1.0,
                      noise_multiplier=0.5)
  model.compile(optimizer="sgd", loss=_sce(), metrics=["accuracy"])
  kwargs = {"arrays": dict(x=x, y=y), "validation": dict(
      x=x, y=y, validation_data=(x, y)), "dataset": dict(
          x=tf.data.Dataset.from_tensor_slices((x, y)))}[inputs]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(batch_size=8, epochs=1, verbose=0, **kwargs)
  ours = [str(w.message) for w in caught
          if "keras" in w.filename or "tf_pxg" in w.filename]
  assert not ours, ours
