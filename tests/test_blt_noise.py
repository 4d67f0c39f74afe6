"""Tests for BLT noise (tf_pxg.dp.blt): the streamed noise against the
dense C^-1 z it implies (closed form) and its covariance, the inverse
pair, the sensitivity against a brute-force maximum over participation
patterns, the event, a Keras fit with saved buffers; in the train step under
XLA against the dense C^-1 z, a checkpoint round trip of the buffers, and
MirroredStrategy's replica shares against the covariance. That it was added
in one file: tests/test_balls_in_bins.py::test_added_in_one_file."""

import itertools
import textwrap

import _multi_worker as multi_worker
import dp_accounting
import keras
import numpy as np
import pytest
from scipy import linalg
import tensorflow as tf

import tf_pxg
from tf_pxg.dp import blt
from tf_pxg.dp import mechanisms


def _stream(mech, steps, shape, seed, noise_multiplier=1.0):
  """`steps` draws of `mech.add` on zero sums, and the z they used."""
  var = tf.Variable(tf.zeros(shape))
  state = mech.init_state([var])
  gen = tf.random.Generator.from_seed(seed)
  xs = []
  for i in range(steps):
    noisy, state = mech.add([tf.zeros(shape)], state, tf.constant(i),
                            noise_multiplier=noise_multiplier,
                            l2_norm_clip=1.0, num_replicas=1, source=gen)
    xs.append(noisy[0].numpy())
  gen = tf.random.Generator.from_seed(seed)
  zs = [mechanisms.IndependentGaussian().add(
      [tf.zeros(shape)], None, None, noise_multiplier=noise_multiplier,
      l2_norm_clip=1.0, num_replicas=1, source=gen)[0][0].numpy()
        for _ in range(steps)]
  return np.stack(xs), np.stack(zs)


@pytest.mark.parametrize("buffers", [3, 4])
def test_streamed_noise_is_the_dense_inverse_strategy_times_z(buffers):
  mech = blt.BLT(num_steps=40, min_separation=4, num_buffers=buffers)
  steps = 12
  x, z = _stream(mech, steps, [7], seed=3)
  want = mech.noise_matrix(steps) @ z.astype(np.float64)
  np.testing.assert_allclose(x, want, rtol=1e-4,
                             atol=1e-5 * np.abs(want).max())


def test_inverse_pair_multiplies_to_identity():
  """C (the fitted BLT) times the streamed C^-1: the identity, in float64."""
  mech = blt.BLT(num_steps=500, min_separation=5, num_buffers=4)
  n = 80
  c = linalg.toeplitz(mech.strategy_coefs(n), np.zeros(n))
  np.testing.assert_allclose(c @ mech.noise_matrix(n), np.eye(n), atol=1e-9)
  assert np.all(c >= 0)


def test_noise_covariance_is_inverse_strategy_gram():
  mech = blt.BLT(num_steps=20, min_separation=2, num_buffers=3)
  steps, width = 5, 40_000
  x, _ = _stream(mech, steps, [width], seed=5)
  cov = np.cov(x)
  inv = mech.noise_matrix(steps)
  want = inv @ inv.T
  np.testing.assert_allclose(cov, want, atol=6 * np.abs(want).max() /
                             np.sqrt(width))


def test_sensitivity_is_the_max_over_all_participation_patterns():
  """Brute force: every set of steps b apart within n (any subset of a
  group's steps, any group), ||C 1_P|| maximal at a full group."""
  n, b = 9, 3
  mech = blt.BLT(num_steps=n, min_separation=b, num_buffers=3)
  c = linalg.toeplitz(mech.strategy_coefs(n), np.zeros(n))
  best = 0.0
  for size in range(1, n + 1):
    for p in itertools.combinations(range(n), size):
      if all(q - r >= b for r, q in zip(p, p[1:])):
        best = max(best, float(np.linalg.norm(c[:, list(p)].sum(1))))
  np.testing.assert_allclose(mech.sensitivity(), best, rtol=1e-12)


def test_event_is_gaussian_at_sigma_over_sensitivity_and_refuses_longer():
  mech = blt.BLT(num_steps=30, min_separation=3)
  event = mech.dp_event(2.0)
  assert event == dp_accounting.GaussianDpEvent(2.0 / mech.sensitivity())
  assert mech.participation_groups == 3 and mech.whole_run_event
  with pytest.raises(ValueError, match="omega must be >= 0"):
    blt.BLT(num_steps=5, theta=[0.5], omega=[-0.1])


def test_config_round_trip():
  mech = blt.BLT(num_steps=50, min_separation=5)
  back = mechanisms.deserialize(mechanisms.serialize(mech))
  assert back == mech
  np.testing.assert_array_equal(back.inverse_theta, mech.inverse_theta)


def test_fit_and_keras_save_keep_the_buffers(tmp_path):
  keras.utils.set_random_seed(0)
  mech = blt.BLT(num_steps=64, min_separation=2, num_buffers=3)
  model = tf_pxg.keras.DPSequential(
      [keras.Input([3]), keras.layers.Dense(2)], seed=1)
  model.compile(tf_pxg.keras.DPSGD(1.0, 1.0, noise_mechanism=mech,
                                   learning_rate=0.1), loss="mse")
  x = np.random.RandomState(0).randn(32, 3).astype(np.float32)
  y = np.random.RandomState(1).randn(32, 2).astype(np.float32)
  callback = tf_pxg.keras.PrivacyCallback(num_examples=32, batch_size=8)
  history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                      sampling_seed=3, callbacks=[callback])
  # The whole run's event, sigma / sens (no amplification, module doc);
  # none past num_steps.
  want = tf_pxg.accounting.event_epsilon(
      dp_accounting.GaussianDpEvent(1.0 / mech.sensitivity()), 1e-5)
  np.testing.assert_allclose(history.history["epsilon"][-1], want,
                             rtol=1e-12)
  assert callback.epsilon(64) == want and callback.epsilon(65) == np.inf
  state = model.optimizer.dp_state.noise
  assert len(state) == 2 and state[0].shape == (3, 3, 2)
  assert np.abs(state[0].numpy()).max() > 0
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.noise_mechanism == mech
  for a, b in zip(loaded.optimizer.dp_state.noise, state):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def _zero_gradient_model(mechanism, jit=False, seed=3):
  """Zero inputs into a bias-free Dense: the per-example gradients are 0,
  so with SGD(1) the update of a batch of 8 is exactly `-x_t / 8`."""
  inp = keras.Input((4,))
  out = keras.layers.Dense(6, use_bias=False,
                           kernel_initializer="zeros")(inp)
  model = tf_pxg.keras.DPModel(inp, out, l2_norm_clip=1.0,
                               noise_multiplier=1.0, seed=seed,
                               noise_mechanism=mechanism)
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                jit_compile=jit)
  return model


_ZEROS = (np.zeros((8, 4), "float32"), np.zeros((8, 6), "float32"))


def _noises(model, steps):
  """`[steps, 24]`: each step's noise x_t, read from the update."""
  out = []
  for _ in range(steps):
    before = model.trainable_variables[0].numpy().copy()
    model.train_on_batch(*_ZEROS)
    out.append(8.0 * (before - model.trainable_variables[0].numpy()).ravel())
  return np.stack(out)


def test_xla_train_step_noise_is_the_dense_inverse_strategy_times_z():
  """Under jit_compile=True the train step's noise is C^-1 z, z read from
  a DP-SGD run with the same noise seed (the same Gaussians)."""
  mech = blt.BLT(num_steps=20, min_separation=2, num_buffers=3)
  steps = 4
  z = _noises(_zero_gradient_model(None), steps)
  x = _noises(_zero_gradient_model(mech, jit=True), steps)
  want = mech.noise_matrix(steps) @ z.astype(np.float64)
  np.testing.assert_allclose(x, want, rtol=0,
                             atol=1e-5 * np.abs(want).max())
  assert np.abs(x - z).max() > 0.1  # the correlation is there


def test_checkpoint_round_trip_continues_the_noise_sequence(tmp_path):
  mech = blt.BLT(num_steps=20, min_separation=2, num_buffers=3)
  a = _zero_gradient_model(mech)
  _noises(a, 3)
  path = tf.train.Checkpoint(model=a, optimizer=a.optimizer).save(
      str(tmp_path / "ckpt"))
  gen_state = a.optimizer.step_state.generator.state.numpy()
  want = _noises(a, 2)

  def resumed(restore_buffers):
    b = _zero_gradient_model(mech, seed=99)
    b.optimizer.build(b.trainable_variables)
    tf.train.Checkpoint(model=b, optimizer=b.optimizer).restore(
        path).assert_existing_objects_matched()
    if not restore_buffers:
      for buf in b.optimizer.dp_state.noise:
        buf.assign(tf.zeros_like(buf))
    b.optimizer.step_state.generator.reset(gen_state)  # the same z from here on
    return _noises(b, 2)

  np.testing.assert_allclose(resumed(True), want, rtol=0, atol=1e-6)
  # Without the buffers the sequence restarts: the check can fail.
  assert np.abs(resumed(False) - want).max() > 1e-2


# Run by tests/_multi_worker.py's shared MirroredStrategy process (2
# logical CPUs, `strategy`; see `mirrored_results`).
MIRRORED_CASES = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_pxg.keras as dpk
    from tf_pxg.dp import blt

    def sequence():
      SIGMA, CLIP, B, LR = 1.3, 0.7, 16, 1.0
      mech = blt.BLT(num_steps=20, min_separation=2, num_buffers=3)
      with strategy.scope():
        inp = keras.Input((100,))
        out = keras.layers.Dense(300, use_bias=False,
                                 kernel_initializer="zeros")(inp)
        model = dpk.DPModel(inp, out, l2_norm_clip=CLIP,
                            noise_multiplier=SIGMA, seed=7,
                            noise_mechanism=mech)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                      jit_compile=False)
        model.optimizer.build(model.trainable_variables)
      ds = tf.data.Dataset.from_tensor_slices(
          (np.zeros((B, 100), "float32"), np.zeros((B, 300), "float32")))
      # Without autograph, as Keras traces fit's step: autograph would
      # convert tf_pxg's whole train step first (~20 s of CPU per process).
      @tf.function(autograph=False)
      def step(batch):
        strategy.run(model.train_step, args=(batch,))
      prev = model.trainable_variables[0].numpy().copy()
      steps = []
      for batch in strategy.experimental_distribute_dataset(
          ds.batch(B).repeat(3)):
        step(batch)
        w = model.trainable_variables[0].numpy().copy()
        steps.append(((prev - w) / LR).ravel())
        prev = w
      return dict(
          cov=np.cov(np.stack(steps)).tolist(),
          replicas=strategy.num_replicas_in_sync,
          iterations=int(model.optimizer.iterations.numpy()))

    scenarios(sequence=sequence)
    """)


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


def test_mirrored_strategy_replica_shares_give_one_global_blt_sequence(
    mirrored):
  """Two replicas each stream their share z^r ~ N(0, s^2 / 2): the global
  noise's covariance over steps is s^2 C^-1 C^-T (not 2x, not 1/2x)."""
  result = multi_worker.scenario(mirrored, "sequence")
  assert result["replicas"] == 2 and result["iterations"] == 3
  mech = blt.BLT(num_steps=20, min_separation=2, num_buffers=3)
  inv = mech.noise_matrix(3)
  want = (1.3 * 0.7 / 16) ** 2 * inv @ inv.T
  # 30000 coordinates: each entry's standard error <= ~1.2% of the diagonal.
  np.testing.assert_allclose(np.array(result["cov"]), want, rtol=0,
                             atol=0.05 * want.diagonal().max())
