"""Tests for the `NoiseMechanism` protocol (tf_pxg.dp.mechanisms): each
implementation against its closed form, the settings it is built from, its
saved config, and that the train step runs a mechanism it has never seen
(a user-defined one) with no switch elsewhere."""

import ast
import pathlib

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import mf
from tf_pxg.dp import correlated
from tf_pxg.dp import mechanisms
from tf_pxg.dp import secure

ROOT = pathlib.Path(tf_pxg.__file__).parent


def _sums():
  return [tf.reshape(tf.range(12, dtype=tf.float32), [3, 4]),
          tf.constant([5.0, -2.0])]


def _add(mech, sums, state=None, step=0, **kwargs):
  args = dict(noise_multiplier=0.0, l2_norm_clip=1.0, num_replicas=1,
              source=tf.random.Generator.from_seed(1))
  args.update(kwargs)
  return mech.add(sums, state, tf.constant(step, tf.int64), **args)


def test_zero_noise_is_the_clipped_sum_divided_by_the_normalizer():
  sums = _sums()
  noisy, state = _add(mechanisms.IndependentGaussian(), sums, normalizer=4.0)
  assert state is None
  for g, n in zip(sums, noisy):
    np.testing.assert_array_equal(n.numpy(), g.numpy() / 4.0)


def test_independent_noise_has_std_sigma_c_over_sqrt_replicas():
  sums = [tf.zeros([200_000])]
  noisy, _ = _add(mechanisms.IndependentGaussian(), sums,
                  noise_multiplier=1.5, l2_norm_clip=2.0, num_replicas=4,
                  normalizer=2.0)
  want = 1.5 * 2.0 / 2.0 / 2.0  # sigma C / sqrt(R) / normalizer
  got = float(np.std(noisy[0].numpy()))
  assert abs(got - want) < 5 * want / np.sqrt(2 * 200_000)


def test_bandmf_add_streams_the_dense_inverse_strategy():
  """T steps of `BandMF.add` with zero sums are C^-1 z for the same z."""
  strategy = mf.BandedToeplitz(num_bands=3)
  mech = mechanisms.BandMF(strategy)
  var = tf.Variable(tf.zeros([5]))
  state = mech.init_state([var])
  assert mech.state_variables(state) == list(state.buffers)
  steps, gen_seed = 6, 7
  gen = tf.random.Generator.from_seed(gen_seed)
  got = np.stack([_add(mech, [tf.zeros([5])], state, i, noise_multiplier=1.0,
                       source=gen)[0][0].numpy() for i in range(steps)])
  # The same z: IndependentGaussian from the same generator, c_0 scaled.
  gen = tf.random.Generator.from_seed(gen_seed)
  z = np.stack([_add(mechanisms.IndependentGaussian(), [tf.zeros([5])],
                     noise_multiplier=1.0, source=gen)[0][0].numpy()
                for _ in range(steps)])
  want = correlated.dense_noise(strategy.coefs, z)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(
      want).max())


def test_unwritten_step_leaves_the_state():
  mech = mechanisms.BandMF(mf.BandedToeplitz(num_bands=2))
  var = tf.Variable(tf.zeros([3]))
  state = mech.init_state([var])
  _add(mech, [tf.zeros([3])], state, 0, noise_multiplier=1.0,
       write=tf.constant(False))
  np.testing.assert_array_equal(state.buffers[0].numpy(), np.zeros([1, 3]))
  _add(mech, [tf.zeros([3])], state, 0, noise_multiplier=1.0,
       write=tf.constant(True))
  assert np.abs(state.buffers[0].numpy()).max() > 0


def test_secure_wraps_any_mechanism_and_takes_os_keys():
  inner = mechanisms.BandMF(mf.BandedToeplitz(num_bands=2))
  mech = mechanisms.from_setting(mf.BandedToeplitz(num_bands=2),
                                 secure_mode=True)
  assert isinstance(mech, mechanisms.SecureGaussian) and mech.inner == inner
  assert isinstance(mech.noise_source(None), secure.SecureNoiseSource)
  assert mech.participation_groups == 2 and mech.stateful
  assert not mech.supports_xla
  noisy, _ = _add(mechanisms.SecureGaussian(mechanisms.IndependentGaussian()),
                  [tf.zeros([50_000])], noise_multiplier=1.0,
                  source=None)  # the given source is not used
  assert abs(float(np.std(noisy[0].numpy())) - 1.0) < 0.03


def test_settings_map_to_mechanisms_and_events():
  assert mechanisms.from_setting(None) == mechanisms.IndependentGaussian()
  assert mechanisms.from_setting(
      mf.BandedToeplitz(num_bands=1)) == mechanisms.IndependentGaussian()
  band = mechanisms.from_setting(mf.BandedToeplitz(num_bands=4))
  assert isinstance(band, mechanisms.BandMF)
  assert band.participation_groups == 4
  assert band.dp_event(1.3) == dp_accounting.GaussianDpEvent(1.3)
  with pytest.raises(TypeError, match="NoiseMechanism"):
    mechanisms.from_setting("bandmf")


def test_serialize_round_trips_and_loads_only_tf_pxg_modules():
  for setting in [None, mf.BandedToeplitz(num_bands=3),
                  mechanisms.IndependentGaussian(),
                  mechanisms.SecureGaussian(mechanisms.BandMF(
                      mf.BandedToeplitz(num_bands=2)))]:
    config = mechanisms.serialize(setting)
    back = mechanisms.deserialize(config)
    assert mechanisms.serialize(back) == config
  with pytest.raises(ValueError, match="only tf_pxg modules"):
    mechanisms.deserialize({"module": "os", "class_name": "system",
                            "config": {}})


def test_noise_does_not_import_secure():
  """The noise <-> secure cycle is gone: noise.py imports no `secure`."""
  tree = ast.parse((ROOT / "dp" / "noise.py").read_text())
  names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
           for a in n.names]
  assert "secure" not in names


class _Doubled(mechanisms.NoiseMechanism):
  """A test mechanism: independent noise of twice the std (so its event is
  Gaussian with sigma / 2). Defined here only: nothing else names it."""

  def add(self, clipped_sum, state, step, **kwargs):
    kwargs["noise_multiplier"] = 2.0 * kwargs["noise_multiplier"]
    return mechanisms.IndependentGaussian().add(clipped_sum, state, step,
                                                **kwargs)

  def dp_event(self, noise_multiplier):
    return dp_accounting.GaussianDpEvent(noise_multiplier / 2.0)


def test_train_step_runs_a_new_mechanism_without_a_switch():
  """A zero-gradient model: each step's update is the mechanism's noise
  over the batch size, so its std tells which mechanism ran."""
  keras.utils.set_random_seed(0)
  width, batch = 4000, 8
  model = tf_pxg.keras.DPSequential(
      [keras.Input([1]), keras.layers.Dense(width, use_bias=False,
                                            kernel_initializer="zeros")],
      seed=3)
  model.compile(tf_pxg.keras.DPOptimizer(
      keras.optimizers.SGD(1.0), l2_norm_clip=1.0, noise_multiplier=0.5,
      noise_mechanism=_Doubled()), loss="mse")
  x = np.zeros([batch, 1], np.float32)
  y = np.zeros([batch, width], np.float32)
  model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
  step = -model.trainable_variables[0].numpy().ravel()
  want = 2.0 * 0.5 * 1.0 / batch
  assert abs(float(np.std(step)) - want) < 0.1 * want
