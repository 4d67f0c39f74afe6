"""Tests for secure mode (tf_pxg.dp.secure): the same statistical checks as
the default noise (KS against N(0, s^2), independence across tensors,
steps and replicas), the sum-of-four construction against its definition,
OS keys (no seed, no replay), the XLA error, and the Keras plumbing."""

import math
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import _multi_worker as multi_worker
from _normality import KS_CRITICAL, N, ks_statistic as _ks_statistic
from tf_pxg import dp
from tf_pxg.dp import secure
from tf_pxg.dp import threefry


def _grads():
  return [tf.fill([200, 300], 3.0), None, tf.fill([40_000], -1.0)]


def _noise(grads, noisy):
  return tf.concat([tf.reshape(tf.cast(b - a, tf.float64), [-1])
                    for a, b in zip(grads, noisy) if a is not None], 0)


def _secure(grads, stddev, scale=None):
  return dp.add_gaussian_noise(grads, stddev,
                               generator=secure.SecureNoiseSource(),
                               scale=scale)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_secure_noise_is_normal_with_stddev(mode):
  stddev = 0.7
  grads = _grads()
  fn = _secure if mode == "eager" else tf.function(_secure)
  noisy = fn(grads, stddev)
  assert noisy[1] is None
  noise = _noise(grads, noisy)
  assert int(tf.size(noise)) == N
  assert _ks_statistic(noise, stddev) < KS_CRITICAL
  assert float(np.std(noise)) == pytest.approx(stddev, rel=0.02)
  assert abs(float(tf.reduce_mean(noise))) < 5 * stddev / math.sqrt(N)
  # The check has power here too: a sum of four without the 1/2 fails.
  assert _ks_statistic(2 * noise, stddev) > KS_CRITICAL


def test_secure_noise_float64_and_scale():
  # float64 takes TF's stateless kernel (seeded by OS bytes), also summed.
  g = tf.zeros([N], tf.float64)
  out, = _secure([g], 1.5, scale=0.5)
  assert out.dtype == tf.float64
  assert _ks_statistic(out, 0.75) < KS_CRITICAL


def test_secure_noise_low_precision_and_indexed_slices():
  out, = _secure([tf.zeros([1000], tf.bfloat16)], 1.0)
  assert out.dtype == tf.bfloat16 and out.shape == (1000,)
  rows = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]),
                          tf.constant([4, 3]))
  dense, = _secure([rows], 0.0)
  np.testing.assert_array_equal(dense, tf.convert_to_tensor(rows))


def test_sum_of_four_draws_is_the_definition():
  # With the OS keys fixed, the noise equals stddev * (z1 + z2 + z3 + z4)/2
  # for z_j the Threefry normals of key j, computed here one by one.
  keys = tf.constant([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]],
                     tf.uint32)

  class Fixed(secure.SecureNoiseSource):

    def keys(self, count):
      return keys[:count]

  g = tf.fill([1001], 0.25)
  out, = dp.add_gaussian_noise([g], 0.8, generator=Fixed(), scale=2.0)
  z = sum(threefry.normal([1001], keys[j]) for j in range(4)).numpy()
  want = 2.0 * (0.25 + 0.8 * z.astype(np.float64) / 2)
  np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-6)
  assert secure.NUM_SUMMANDS == 4


def test_independent_across_tensors_and_steps():
  # Steps: the same traced function called twice reads new OS bytes.
  step = tf.function(lambda g: _secure(g, 1.0))
  grads = [tf.zeros([N // 2]), tf.zeros([N // 2])]
  a0, a1 = step(grads)
  b0, b1 = step(grads)
  streams = np.stack([t.numpy() for t in (a0, a1, b0, b1)])
  corr = np.corrcoef(streams)
  assert np.max(np.abs(corr[~np.eye(4, dtype=bool)])) < 5 / math.sqrt(N // 2)
  # No TF seed makes it repeat.
  tf.random.set_seed(0)
  c0 = _secure([tf.zeros([64])], 1.0)[0]
  tf.random.set_seed(0)
  d0 = _secure([tf.zeros([64])], 1.0)[0]
  assert not np.array_equal(c0, d0)


def test_keys_are_fresh_os_bytes():
  source = secure.SecureNoiseSource()
  k1, k2 = source.keys(4), source.keys(4)
  assert k1.shape == (4, 3) and k1.dtype == tf.uint32
  assert not np.array_equal(k1, k2)
  traced = tf.function(lambda: source.keys(2))
  assert not np.array_equal(traced(), traced())
  # The bytes look uniform: 4096 words' mean is 2^31 within 5 std.
  words = secure.os_random_uint32([4096]).numpy().astype(np.float64)
  assert abs(words.mean() - 2**31) < 5 * 2**32 / math.sqrt(12 * 4096)


def test_xla_raises_and_says_what_to_do():

  @tf.function(jit_compile=True)
  def step(g):
    return _secure([g], 1.0)[0]

  with pytest.raises(ValueError, match=r"XLA cannot compile.*jit_compile="
                     r"False"):
    step(tf.zeros([4]))


def test_make_noise_source():
  assert isinstance(secure.make_noise_source(secure_mode=True),
                    secure.SecureNoiseSource)
  assert isinstance(secure.make_noise_source(seed=1), tf.random.Generator)
  with pytest.raises(ValueError, match="cannot be reproducible.*Drop the"):
    secure.make_noise_source(seed=1, secure_mode=True)


# Replicas: a MirroredStrategy over 2 logical CPUs, in a subprocess -----------


_REPLICAS = textwrap.dedent("""
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import sys
    sys.path.insert(0, "tests")
    from _normality import ks_statistic
    from tf_pxg import dp
    from tf_pxg.dp import secure

    n = 50_000
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    source = secure.SecureNoiseSource()

    @tf.function
    def step():
      def replica():
        s = dp.replica_noise_stddev(2.0, 2)
        return dp.add_gaussian_noise([tf.zeros([n])], s,
                                     generator=source)[0]
      return strategy.run(replica)

    per = strategy.experimental_local_results(step())
    again = strategy.experimental_local_results(step())
    a, b = per[0].numpy(), per[1].numpy()
    total = a + b
    print("RESULT " + json.dumps(dict(
        corr=float(np.corrcoef(a, b)[0, 1]),
        corr_steps=float(np.corrcoef(a, again[0].numpy())[0, 1]),
        ks_replica=ks_statistic(a, 2.0 / np.sqrt(2)),
        ks_total=ks_statistic(total, 2.0),
        std_total=float(total.std()), n=n)))
""")


def test_replicas_get_independent_noise_summing_to_sigma_c():
  r = multi_worker.run_script(_REPLICAS, timeout=240)
  crit = 1.95 / math.sqrt(r["n"])
  assert abs(r["corr"]) < 5 / math.sqrt(r["n"])
  assert abs(r["corr_steps"]) < 5 / math.sqrt(r["n"])
  assert r["ks_replica"] < crit
  assert r["ks_total"] < crit
  assert r["std_total"] == pytest.approx(2.0, rel=0.03)


# Keras plumbing ----------------------------------------------------------------


def _model(**kwargs):
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  return dpk.DPSequential([keras.Input((4,)), keras.layers.Dense(
      3, kernel_initializer="zeros", bias_initializer="zeros")], **kwargs)


def test_model_secure_mode_with_seed_raises():
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  with pytest.raises(ValueError, match="cannot be reproducible.*Drop the "
                     "seed"):
    _model(l2_norm_clip=1.0, noise_multiplier=1.0, seed=3, secure_mode=True)
  with pytest.raises(ValueError, match="cannot be reproducible"):
    dpk.make_private(keras.Sequential([keras.Input((2,)),
                                       keras.layers.Dense(1)]),
                     1.0, 1.0, seed=1, secure_mode=True)
  # A seeded model compiled with a secure DPOptimizer.
  model = _model(seed=3)
  with pytest.raises(ValueError, match="noise seed.*secure_mode=True"):
    model.compile(optimizer=dpk.DPSGD(1.0, 1.0, secure_mode=True),
                  loss="mse")
  with pytest.raises(TypeError, match="secure_mode must be True or False"):
    _model(l2_norm_clip=1.0, noise_multiplier=1.0, secure_mode="yes")


def test_model_contract_attribute_config_and_xla():
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  model = _model(l2_norm_clip=1.0, noise_multiplier=1.0, secure_mode=True)
  assert model._dp_secure_mode is True and model.secure_mode
  assert model.get_config()["secure_mode"] is True
  clone = dpk.DPSequential.from_config(model.get_config())
  assert clone._dp_secure_mode is True
  assert _model(l2_norm_clip=1.0, noise_multiplier=1.0)._dp_secure_mode is \
      False
  with pytest.raises(ValueError, match="XLA cannot compile"):
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
  model.compile(optimizer="sgd", loss="mse")  # "auto": no XLA
  assert model.jit_compile is False
  # The optimizer's flag turns the model's on, and is saved.
  plain = _model()
  opt = dpk.DPAdam(1.0, 1.0, secure_mode=True)
  assert opt.get_config()["secure_mode"] is True
  assert dpk.DPOptimizer.from_config(opt.get_config()).secure_mode is True
  plain.compile(optimizer=opt, loss="mse")
  assert plain._dp_secure_mode is True
  del keras


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_fit_step_noise_has_the_claimed_std(run_eagerly):
  # sigma C = 10 with C = 1e-3: a step's clipped sum (at most B C = 0.016)
  # is 1.6e-3 of the noise std, so with SGD(1) each logical step moves
  # every weight by -noise / (qN) = N(0, (sigma C / B)^2) to that accuracy.
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  sigma, clip, n, batch = 1e4, 1e-3, 64, 16
  model = dpk.DPSequential([keras.Input((4,)), keras.layers.Dense(500)],
                           l2_norm_clip=clip, noise_multiplier=sigma,
                           secure_mode=True)
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                run_eagerly=run_eagerly)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, 4)).astype("float32")
  y = rng.standard_normal((n, 500)).astype("float32")
  updates = []

  def flat():
    return np.concatenate([v.numpy().ravel()
                           for v in model.trainable_variables])

  class Record(keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
      self.w = flat()

    def on_train_batch_end(self, batch, logs=None):
      w = flat()
      if np.any(w != self.w):     # an overflow batch moves nothing
        updates.append(w - self.w)
      self.w = w

  steps = 8 if run_eagerly else 40
  model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps,
            verbose=0, callbacks=[Record()])
  assert len(updates) >= steps - 1
  # Steps are independent: consecutive updates uncorrelated.
  corr = np.corrcoef(updates[0], updates[1])[0, 1]
  assert abs(corr) < 5 / math.sqrt(updates[0].size)
  updates = np.concatenate(updates)
  want = sigma * clip / batch
  assert _ks_statistic(updates, want) < 1.95 / math.sqrt(updates.size)
  assert updates.std() == pytest.approx(want, rel=0.03)
