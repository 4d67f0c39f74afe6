"""Automatic and quantile-adaptive clipping (`tf_pxg.clipping`).

References: per-example gradients from a plain `tf.GradientTape` loop over
single examples, scaled by the policy's closed form; the adaptive clip's
target is the known quantile of a designed norm distribution; ε from
dp_accounting's composition of the two Gaussian releases.
"""

import math

from _keras_models import reference_grads_by_example as _reference_grads
import _multi_worker as multi_worker
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import accounting
import tf_pxg.keras as dpk

clipping = tf_pxg.clipping


def _dense_and_conv(dtype):
  keras.utils.set_random_seed(1)
  dense = keras.Sequential([keras.Input((6,), dtype=dtype),
                            keras.layers.Dense(4, activation="tanh",
                                               dtype=dtype),
                            keras.layers.Dense(3, dtype=dtype)])
  conv = keras.Sequential([keras.Input((6, 6, 2), dtype=dtype),
                           keras.layers.Conv2D(3, 3, activation="relu",
                                               dtype=dtype),
                           keras.layers.Flatten(dtype=dtype),
                           keras.layers.Dense(3, dtype=dtype)])
  return {"dense": (dense, (6,)), "conv": (conv, (6, 6, 2))}


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("arch", ["dense", "conv"])
def test_automatic_clipped_sum_equals_closed_form(mode, dtype, batch, arch):
  model, shape = _dense_and_conv(dtype)[arch]
  rng = np.random.default_rng(batch)
  x = rng.standard_normal((batch,) + shape).astype(dtype)
  y = rng.standard_normal((batch, 3)).astype(dtype)
  loss_fn = lambda t, p: tf.reduce_sum(tf.square(p - t), axis=-1)  # noqa
  policy = clipping.Automatic(stability=0.05)
  r = 0.7

  def run(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = loss_fn(y, model(x))
    return tape.clipped_gradient_sum(losses, model.trainable_variables, r,
                                     clipping=policy)

  fn = {"eager": run, "function": tf.function(run),
        "xla": tf.function(run, jit_compile=True)}[mode]
  sums, norms = fn(tf.constant(x), tf.constant(y))
  ref = _reference_grads(model, x, y, lambda t, p: tf.reduce_sum(
      loss_fn(t, p)))
  ref_norms = np.array([math.sqrt(sum((g * g).sum() for g in gs))
                        for gs in ref])
  want = [sum(r / (n + 0.05) * gs[i] for gs, n in zip(ref, ref_norms))
          for i in range(len(ref[0]))]
  # Norms (and so the factors) are float32 in both dtypes.
  tol = 1e-4 if dtype == "float32" else 1e-6
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=tol)
  for got, w in zip(sums, want):
    scale = max(float(np.abs(w).max()), 1e-30)
    np.testing.assert_allclose(got.numpy(), w, rtol=0, atol=tol * scale)
  # Every scaled example has norm < R (the sensitivity).
  assert np.all(r * ref_norms / (ref_norms + 0.05) < r)


def test_automatic_keras_step_is_normalised_mean_and_noise_is_sigma_r():
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 5)).astype("float32")
  y = rng.standard_normal((16, 2)).astype("float32")
  model = dpk.DPSequential([keras.Input((5,)), keras.layers.Dense(2)],
                           l2_norm_clip=2.0, noise_multiplier=0.0,
                           clipping=clipping.Automatic(0.01))
  model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
  before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  ref = _reference_grads(model, x, y, lambda t, p: tf.reduce_mean(
      tf.square(p - t)))
  model.train_on_batch(x, y)
  assert isinstance(model.optimizer, dpk.DPOptimizer)  # compile wrapped it
  for i, v in enumerate(model.trainable_variables):
    mean = sum(2.0 / (math.sqrt(sum((t * t).sum() for t in gs)) + 0.01) *
               gs[i] for gs in ref) / 16
    np.testing.assert_allclose(v.numpy(), before[i] - 0.5 * mean, rtol=0,
                               atol=1e-5)


@keras.saving.register_keras_serializable(package="test_clipping")
def linear_loss(y_true, y_pred):
  del y_true
  return tf.reduce_sum(y_pred, axis=-1)


def _norm_model(lr=0.0, **kw):
  """Loss = w . x_b with w of shape [D, 1]: example b's gradient is x_b,
  its norm ||x_b||, whatever the weights."""
  model = dpk.DPSequential(
      [keras.Input((3,)), keras.layers.Dense(1, use_bias=False)], **kw)
  model.compile(optimizer=keras.optimizers.SGD(lr),
                loss=linear_loss)
  return model


@pytest.mark.parametrize("quantile", [0.5, 0.9])
@pytest.mark.parametrize("start", [0.1, 10.0])
def test_quantile_clip_tracks_true_quantile_without_count_noise(quantile,
                                                                start):
  rng = np.random.default_rng(0)
  n = 4000
  radius = rng.uniform(0.0, 4.0, n)  # norms ~ U(0, 4): quantile p is 4p
  direction = rng.standard_normal((n, 3))
  direction /= np.linalg.norm(direction, axis=1, keepdims=True)
  x = (radius[:, None] * direction).astype("float32")
  y = np.zeros((n, 1), "float32")
  model = _norm_model(
      l2_norm_clip=start, noise_multiplier=0.0,
      clipping=clipping.QuantileAdaptive(quantile, learning_rate=0.2,
                                         count_stddev=0.0))
  clips = []
  cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: (
      clips.append(model.optimizer.current_l2_norm_clip)))
  hist = model.fit(x, y, batch_size=200, epochs=15, verbose=0,
                   callbacks=[cb], sampling_seed=3)
  true = float(np.quantile(radius, quantile))
  assert abs(np.mean(clips[-100:]) / true - 1) < 0.05, (true, clips[-5:])
  assert abs(clips[-1] / true - 1) < 0.15
  assert hist.history["l2_norm_clip"][-1] == pytest.approx(clips[-1])
  assert abs(clips[0] - start) < abs(true - start)  # it moved from start


def _zero_gradient(units, **kw):
  inp = keras.Input((10,))
  out = keras.layers.Dense(units, use_bias=False,
                           kernel_initializer="zeros")(inp)
  model = dpk.DPModel(inp, out, seed=4, **kw)
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                jit_compile=False)
  return model


def test_adaptive_gradient_noise_is_the_theorem_1_split():
  sigma, count_std, clip, batch = 1.0, 0.6, 0.5, 16
  model = _zero_gradient(10_000, l2_norm_clip=clip, noise_multiplier=sigma,
                         clipping=clipping.QuantileAdaptive(
                             count_stddev=count_std))
  model.train_on_batch(np.zeros((batch, 10), "float32"),
                       np.zeros((batch, 10_000), "float32"))
  std = float(np.std(model.trainable_variables[0].numpy())) * batch
  sigma_g = (sigma ** -2 - (2 * count_std) ** -2) ** -0.5
  assert std == pytest.approx(sigma_g * clip, rel=0.02)
  assert not std == pytest.approx(sigma * clip, rel=0.1)
  # The accounted sigma is exactly the composition of the two releases
  # (RDP of Gaussians adds in 1 / sigma^2; Poisson sampling then acts on
  # the one Gaussian of the stacked query).
  pair = dp_accounting.rdp.RdpAccountant()
  pair.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(sigma_g),
      dp_accounting.GaussianDpEvent(2 * count_std)]))
  one = dp_accounting.rdp.RdpAccountant()
  one.compose(dp_accounting.GaussianDpEvent(sigma))
  assert pair.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5),
                                                 rel=1e-9)
  assert accounting.split_noise_multipliers(sigma, count_std) == (
      pytest.approx(sigma_g, rel=1e-12))


def test_adaptive_epsilon_in_callback_is_the_accounted_sigma():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((500, 3)).astype("float32")
  y = np.zeros((500, 1), "float32")
  model = _norm_model(l2_norm_clip=1.0, noise_multiplier=1.2,
                      clipping=clipping.QuantileAdaptive())
  cb = dpk.PrivacyCallback(num_examples=500, batch_size=50)
  hist = model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[cb])
  steps = int(model.optimizer.iterations)
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          0.1, dp_accounting.GaussianDpEvent(1.2)), steps))
  assert hist.history["epsilon"][-1] == pytest.approx(acc.get_epsilon(1e-5),
                                                      rel=1e-9)
  # Default count_stddev B/20 = 2.5 > sigma/2: the split is well defined.
  assert math.isfinite(hist.history["l2_norm_clip"][-1])


@pytest.mark.parametrize("policy", ["automatic", "quantile"])
@pytest.mark.parametrize("jit", [False, True])
def test_accumulation_and_xla_give_the_one_batch_step(policy, jit):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((96, 3)).astype("float32")
  y = rng.standard_normal((96, 2)).astype("float32")

  def run(k, jit):
    keras.utils.set_random_seed(2)
    pol = (clipping.Automatic() if policy == "automatic" else
           clipping.QuantileAdaptive(0.5, 0.3, count_stddev=0.0))
    model = dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(2)],
                             l2_norm_clip=0.3, noise_multiplier=0.0,
                             clipping=pol)
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse",
                  jit_compile=jit)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, sampling_seed=9,
              accumulation_steps=k, physical_batch_size=48 // k)
    return model

  ref, got = run(1, False), run(2, jit)
  assert int(got.optimizer.iterations) == int(ref.optimizer.iterations)
  for a, b in zip(got.trainable_variables, ref.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-5)
  if policy == "quantile":
    assert got.optimizer.current_l2_norm_clip == pytest.approx(
        ref.optimizer.current_l2_norm_clip, rel=1e-5)
    assert ref.optimizer.current_l2_norm_clip != pytest.approx(0.3)


def test_adaptive_clip_is_saved_with_the_optimizer(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 3)).astype("float32")
  model = _norm_model(l2_norm_clip=1.0, noise_multiplier=0.0,
                      clipping=clipping.QuantileAdaptive(count_stddev=0.0))
  model.fit(x, np.zeros((64, 1), "float32"), batch_size=16, verbose=0)
  clip = model.optimizer.current_l2_norm_clip
  assert clip != 1.0
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.current_l2_norm_clip == pytest.approx(clip)
  assert loaded.clipping == clipping.QuantileAdaptive(count_stddev=0.0)


def test_policy_errors_name_the_fix():
  with pytest.raises(ValueError, match="finite l2_norm_clip"):
    dpk.DPSGD(float("inf"), 1.0, clipping=clipping.Automatic())
  with pytest.raises(ValueError, match="Unknown clipping policy"):
    dpk.DPSGD(1.0, 1.0, clipping="median")
  with pytest.raises(ValueError, match="target_quantile"):
    clipping.QuantileAdaptive(1.5)
  with pytest.raises(ValueError, match="stability"):
    clipping.Automatic(0.0)
  # Outside a Poisson fit the expected batch size is unknown.
  model = _norm_model(l2_norm_clip=1.0, noise_multiplier=1.0,
                      clipping=clipping.QuantileAdaptive())
  with pytest.raises(ValueError, match="count_stddev"):
    model.train_on_batch(np.ones((4, 3), "float32"),
                         np.zeros((4, 1), "float32"))
  # A count noise too small for sigma: the count would use the budget.
  model = _norm_model(l2_norm_clip=1.0, noise_multiplier=1.0,
                      clipping=clipping.QuantileAdaptive(count_stddev=0.4))
  with pytest.raises(ValueError, match="count"):
    model.train_on_batch(np.ones((4, 3), "float32"),
                         np.zeros((4, 1), "float32"))
  assert clipping.get("automatic") == clipping.Automatic()
  assert clipping.get(clipping.serialize(
      clipping.QuantileAdaptive(0.7, 0.1, 3.0))) == clipping.QuantileAdaptive(
          0.7, 0.1, 3.0)


_MIRRORED = multi_worker.one_vs_mirrored_fit(
    "dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(2)], "
    "l2_norm_clip=0.05, noise_multiplier=0.0, "
    "clipping=tf_pxg.clipping.QuantileAdaptive(0.5, 0.5, count_stddev=0.0))")


def test_adaptive_clip_under_mirrored_strategy_equals_one_device():
  result = multi_worker.run_script(_MIRRORED, timeout=240)
  (clips1, w1), (clips2, w2) = result["one"], result["two"]
  assert len(clips1) == len(clips2) == 8
  np.testing.assert_allclose(clips2, clips1, rtol=1e-5)
  assert clips1[-1] > 2 * clips1[0]  # C = 0.05 is far below the median
  for a, b in zip(w1, w2):
    np.testing.assert_allclose(np.array(b), np.array(a), rtol=0, atol=1e-5)
