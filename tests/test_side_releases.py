"""Private side releases (`tf_pxg.dp.releases`) and the two parts added
through the plug points alone: a new side release
(`tf_pxg.dp.norm_release.ClippedNormMean`) and a stateful clipping policy
(`tf_pxg.dp.norm_tracking.NormTracking`).

Each is checked against closed forms computed from a plain
`tf.GradientTape` loop over single examples: the released statistic, its
noise, the gradient's share of σ, the clip's path; and as a whole run:
the ε is the plan's σ's, the state is saved and restored.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg.dp import norm_release
from tf_pxg.dp import norm_tracking
from tf_pxg.dp import releases

N, D = 8, 3


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, D)).astype("float32")
  y = rng.normal(size=(N, 1)).astype("float32")
  return x, y


def _model(lr=0.1, seed=1, **dp):
  inp = keras.Input((D,))
  out = keras.layers.Dense(
      1, kernel_initializer=keras.initializers.Constant(0.3),
      bias_initializer=keras.initializers.Constant(-0.2))(inp)
  model = dpk.DPModel(inp, out, seed=seed, **dp)
  model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
  return model


def _norms(model, x, y) -> np.ndarray:
  """Per-example gradient norms, one plain `tf.GradientTape` per example."""
  out = []
  for b in range(len(x)):
    with tf.GradientTape() as tape:
      pred = model(x[b:b + 1])
      loss = tf.reduce_mean(tf.square(pred - y[b:b + 1]))
    grads = tape.gradient(loss, model.trainable_variables)
    out.append(np.sqrt(sum(float(tf.reduce_sum(g**2)) for g in grads)))
  return np.array(out)


# ClippedNormMean: a new side release in one file -----------------------------


@pytest.mark.parametrize("clip", [0.05, 0.5, 100.0])
def test_clipped_norm_mean_is_the_mean_of_the_clipped_norms(clip):
  x, y = _data()
  model = _model(l2_norm_clip=clip, noise_multiplier=0.0,
                 side_releases=[norm_release.ClippedNormMean(3.0)])
  want = np.mean(np.minimum(_norms(model, x, y), clip))
  logs = model.train_on_batch(x, y, return_dict=True)
  assert logs["clipped_norm_mean"] == pytest.approx(want, rel=1e-5)
  # Its state (the last released value) is the DPOptimizer's, saved there.
  assert float(model.optimizer.dp_state.releases[
      "clipped_norm_mean"].numpy()) == pytest.approx(want, rel=1e-5)


def test_clipped_norm_mean_noise_and_the_sigma_split_match_closed_forms():
  # No gradient (zero weights and targets) and learning rate 0: every step
  # releases pure noise N(0, (m C)^2) / n with n = N (a plain batch).
  x = np.ones((N, D), "float32")
  y = np.zeros((N, 1), "float32")
  sigma, m, clip, steps = 1.0, 4.0, 0.5, 300
  inp = keras.Input((D,))
  out = keras.layers.Dense(1, kernel_initializer="zeros",
                           bias_initializer="zeros")(inp)
  model = dpk.DPModel(inp, out, seed=3, l2_norm_clip=clip,
                      noise_multiplier=sigma,
                      side_releases=[norm_release.ClippedNormMean(m)])
  model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
  values = [model.train_on_batch(x, y, return_dict=True)["clipped_norm_mean"]
            for _ in range(steps)]
  want = m * clip / N
  # The sample std of 300 normals is within 15 % of the truth (3.7 of its
  # standard errors, 1/sqrt(2 * 300)); the mean within 4 standard errors.
  assert np.std(values) == pytest.approx(want, rel=0.15)
  assert abs(np.mean(values)) < 4 * want / np.sqrt(steps)
  # The gradient keeps the rest of sigma: sigma_g^-2 = sigma^-2 - m^-2.
  assert model.dp_plan.step_noise(None).gradient == pytest.approx(
      (sigma**-2 - m**-2)**-0.5, rel=1e-12)


def test_a_side_release_leaves_the_epsilon_of_the_plans_sigma():
  x, y = _data()
  x = np.tile(x, (8, 1))
  y = np.tile(y, (8, 1))
  eps = []
  for extra in ([], [norm_release.ClippedNormMean(10.0)]):
    model = _model(l2_norm_clip=1.0, noise_multiplier=1.2,
                   side_releases=extra)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, sampling_seed=1)
    eps.append(model.epsilon(1e-5))
  assert eps[1] == pytest.approx(eps[0], rel=1e-12)


def test_side_releases_are_refused_where_they_would_leak_or_overspend():
  with pytest.raises(ValueError, match="ClippedNormMean.*whole privacy"):
    dpk.DPSGD(1.0, 1.0, side_releases=[norm_release.ClippedNormMean(0.9)])
  with pytest.raises(ValueError, match="finite number > 0"):
    norm_release.ClippedNormMean(0.0)
  with pytest.raises(ValueError, match="distinct names"):
    dpk.DPSGD(1.0, 1.0, side_releases=[norm_release.ClippedNormMean(5.0),
                                       norm_release.ClippedNormMean(6.0)])
  # The noisy loss is the one stateless release (Keras' loss tracker); in
  # side_releases it would log a physical batch's partial sum.
  with pytest.raises(TypeError, match="stateful"):
    dpk.DPSGD(1.0, 1.0, side_releases=[dpk.NoisyLoss(1.0, 5.0)])
  # The model's and the optimizer's settings must agree.
  model = _model(l2_norm_clip=1.0, noise_multiplier=1.0,
                 side_releases=[norm_release.ClippedNormMean(5.0)])
  with pytest.raises(ValueError, match="side_releases"):
    model.compile(dpk.DPSGD(1.0, 1.0, side_releases=[
        norm_release.ClippedNormMean(6.0)]), loss="mse")


def test_side_release_state_is_saved_and_restored(tmp_path):
  x, y = _data()
  inp = keras.Input((D,))
  model = dpk.DPModel(inp, keras.layers.Dense(1)(inp), seed=1)
  model.compile(optimizer=dpk.DPSGD(1.0, 0.0, side_releases=[
      norm_release.ClippedNormMean(5.0)], learning_rate=0.1), loss="mse")
  model.train_on_batch(x, y)
  state = float(model.optimizer.dp_state.releases[
      "clipped_norm_mean"].numpy())
  path = os.path.join(str(tmp_path), "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.dp_plan.side_releases == (norm_release.ClippedNormMean(5.0),)
  assert float(loaded.optimizer.dp_state.releases[
      "clipped_norm_mean"].numpy()) == pytest.approx(state, rel=1e-7)


# NormTracking: a stateful clipping policy in one file ------------------------


def test_norm_tracking_step_is_the_closed_form():
  x, y = _data()
  c0, k, rate = 0.4, 1.5, 0.3
  policy = norm_tracking.NormTracking(target_ratio=k, rate=rate,
                                      noise_multiplier=10.0)
  model = _model(l2_norm_clip=c0, noise_multiplier=0.0, clipping=policy)
  mean = np.mean(np.minimum(_norms(model, x, y), c0))
  logs = model.train_on_batch(x, y, return_dict=True)
  want = (1 - rate) * c0 + rate * k * mean
  assert model.optimizer.current_l2_norm_clip == pytest.approx(want,
                                                               rel=1e-5)
  assert logs["l2_norm_clip"] == pytest.approx(want, rel=1e-5)


def test_norm_tracking_settles_at_target_ratio_times_the_norm():
  # Every example's gradient has norm r (learning rate 0: fixed weights),
  # so from above, C_t -> k r geometrically: C_t - k r = (1 - rate)^t (C_0 -
  # k r).
  r, k, rate, c0 = 0.7, 2.0, 0.25, 5.0
  x = np.zeros((N, D), "float32")
  y = np.full((N, 1), -r / 2, "float32")  # d/db (b - y)^2 = 2 (0 - y) = r
  inp = keras.Input((D,))
  out = keras.layers.Dense(1, kernel_initializer="zeros",
                           bias_initializer="zeros")(inp)
  model = dpk.DPModel(inp, out, seed=1, l2_norm_clip=c0, noise_multiplier=0.0,
                      clipping=norm_tracking.NormTracking(k, rate))
  model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
  np.testing.assert_allclose(_norms(model, x, y), r, rtol=1e-6)
  for _ in range(40):
    model.train_on_batch(x, y)
  want = k * r + (1 - rate)**40 * (c0 - k * r)
  assert model.optimizer.current_l2_norm_clip == pytest.approx(want,
                                                               rel=1e-4)


def test_norm_tracking_by_name_saves_splits_sigma_and_keeps_epsilon(tmp_path):
  x, y = _data()
  x, y = np.tile(x, (8, 1)), np.tile(y, (8, 1))
  model = _model(l2_norm_clip=1.0, noise_multiplier=1.1,
                 clipping="norm_tracking")
  assert model.dp_plan.clipping == norm_tracking.NormTracking()
  assert model.dp_plan.step_noise(None).gradient == pytest.approx(
      (1.1**-2 - 10.0**-2)**-0.5, rel=1e-12)
  model.fit(x, y, batch_size=8, epochs=2, verbose=0, sampling_seed=2)
  flat = _model(l2_norm_clip=1.0, noise_multiplier=1.1)
  flat.fit(x, y, batch_size=8, epochs=2, verbose=0, sampling_seed=2)
  assert model.epsilon(1e-5) == pytest.approx(flat.epsilon(1e-5), rel=1e-12)
  clip = model.optimizer.current_l2_norm_clip
  assert clip != 1.0  # it moved
  path = os.path.join(str(tmp_path), "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.dp_plan.clipping == norm_tracking.NormTracking()
  assert loaded.optimizer.current_l2_norm_clip == pytest.approx(clip,
                                                                rel=1e-7)


def test_norm_tracking_errors_name_the_argument():
  with pytest.raises(ValueError, match="rate"):
    norm_tracking.NormTracking(rate=1.5)
  model = _model(l2_norm_clip=1.0, noise_multiplier=1.0,
                 clipping=norm_tracking.NormTracking(noise_multiplier=0.5))
  with pytest.raises(ValueError, match="whole privacy budget"):
    model.train_on_batch(*_data())


def test_gradient_noise_multiplier_composes_back_to_sigma():
  sigma = 0.9
  parts = [norm_release.ClippedNormMean(4.0), dpk.NoisyLoss(1.0, 6.0)]
  sigma_g = releases.gradient_noise_multiplier(sigma, parts)
  assert (sigma_g**-2 + 4.0**-2 + 6.0**-2)**-0.5 == pytest.approx(sigma,
                                                                  rel=1e-12)
  assert releases.gradient_noise_multiplier(0.0, parts) == 0.0
