"""BandMF correlated noise in the train step (`tf_pxg.dp.correlated`).

References are independent of the streaming code: the noise is compared
with the dense lower-triangular solve `C^-1 z` (SciPy) of the strategy
matrix that `tf_pxg.mf.BandedToeplitz` builds, where `z` is read from a
DP-SGD run with the same noise seed (same keys, so the same Gaussians);
the covariance with `C^-1 C^-T`; ε with dp_accounting's own events.
"""

import math
import os
import tempfile
import textwrap

import _multi_worker as multi_worker
import dp_accounting
import keras
import numpy as np
import pytest
import scipy.linalg
import tensorflow as tf

from tf_pxg import mf
from tf_pxg.dp import correlated
import tf_pxg.keras as dpk

SIGMA, CLIP, BATCH = 1.0, 1.0, 8


def _zero_gradient_model(units=50, mechanism=None, seed=3, **kw):
  """Zero inputs into a bias-free Dense: every per-example gradient is 0,
  so the step's mean gradient is the noise alone, `x_i / B`."""
  inp = keras.Input((20,))
  out = keras.layers.Dense(units, use_bias=False,
                           kernel_initializer="zeros")(inp)
  model = dpk.DPModel(inp, out, l2_norm_clip=CLIP, noise_multiplier=SIGMA,
                      seed=seed, noise_mechanism=mechanism, **kw)
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                jit_compile=False)
  return model


def _step_noises(model, steps):
  """The `[steps, n]` noisy mean gradients of `steps` plain-batch steps."""
  data = (np.zeros((BATCH, 20), "float32"), np.zeros((BATCH, 50), "float32"),
          None)
  out = []
  for _ in range(steps):
    result = model.dp_gradients(data)
    out.append(np.concatenate([g.numpy().ravel() for g in result.grads]))
    model.dp_apply(result)
  return np.stack(out)


def _dense_strategy(coefs, n):
  c = np.zeros((n, n))
  for j, cj in enumerate(coefs):
    c += np.diag(np.full(n - j, cj), -j)
  return c


@pytest.mark.parametrize("bands", [1, 4, 16])
def test_streamed_noise_equals_dense_inverse_strategy_times_z(bands):
  steps = 50
  z = _step_noises(_zero_gradient_model(), steps)  # DP-SGD: z_i / B
  strategy = mf.BandedToeplitz(bands)
  got = _step_noises(_zero_gradient_model(mechanism=strategy), steps)
  if bands == 1:  # DP-SGD exactly: the same code path, bit for bit.
    np.testing.assert_array_equal(got, z)
    return
  dense = _dense_strategy(strategy.coefs, steps)
  np.testing.assert_allclose(dense, strategy.strategy_matrix(steps),
                             atol=1e-15)
  want = scipy.linalg.solve_triangular(dense, z.astype(np.float64),
                                       lower=True)
  # float32 recurrence against a float64 solve: rounding only.
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=1e-5 * float(np.abs(want).max()))
  # The check can fail: the noise really is correlated, not z.
  assert np.abs(got - z).max() > 0.1 * np.abs(z).max()


def test_streamed_noise_covariance_matches_inverse_strategy_gram():
  bands, steps, n = 16, 50, 100_000
  strategy = mf.BandedToeplitz(bands)
  var = tf.Variable(tf.zeros([n]))
  state = correlated.NoiseBuffers([var], bands)
  gen = tf.random.Generator.from_seed(11)
  std = SIGMA * CLIP
  draws = np.stack([correlated.correlated_noisy_sums(
      [tf.zeros([n])], strategy.coefs, state, tf.constant(i, tf.int64), std,
      gen)[0].numpy() for i in range(steps)]).astype(np.float64)
  inv = strategy.noise_matrix(steps)
  want = std ** 2 * inv @ inv.T
  got = draws @ draws.T / n
  # Sampling std of each entry of a Gaussian sample covariance.
  se = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want ** 2) / n)
  assert np.all(np.abs(got - want) <= 5 * se), np.abs(got - want).max()
  # DP-SGD's identity covariance would fail the same check.
  assert not np.all(np.abs(got - std ** 2 * np.eye(steps)) <= 5 * se)


def test_noise_buffers_are_one_slot_ring_of_last_b_minus_1_noises():
  bands = 4
  strategy = mf.BandedToeplitz(bands)
  model = _zero_gradient_model(mechanism=strategy)
  noises = _step_noises(model, 7) * BATCH  # x_i
  buf = model.optimizer.dp_state.noise.buffers[0].numpy()  # [3, 20, 50]
  for t in range(4, 7):  # x_t lives in slot t mod 3
    np.testing.assert_allclose(buf[t % 3].ravel(), noises[t], rtol=1e-6,
                               atol=1e-6)
  assert model.optimizer.noise_buffer_bytes == 3 * 20 * 50 * 4
  assert correlated.memory_report(model.optimizer.dp_state.noise) == {
      "num_buffers": 3, "buffer_bytes": 3 * 20 * 50 * 4}


def _fit_model(mechanism, jit=False, spe=1, seed=5):
  keras.utils.set_random_seed(0)
  model = dpk.DPSequential(
      [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)],
      l2_norm_clip=0.5, noise_multiplier=0.8, seed=seed,
      noise_mechanism=mechanism)
  model.compile(optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                jit_compile=jit, steps_per_execution=spe)
  state = getattr(model.optimizer, "dp_state", None)  # None: plain SGD
  if state is not None and state.group_seed is not None:
    # The run's secret group assignment (OS entropy by default), fixed so
    # that two runs sample the same batches.
    state.group_seed.assign(1234)
  return model


def _data(n=64):
  rng = np.random.default_rng(0)
  return (rng.standard_normal((n, 5)).astype("float32"),
          rng.integers(0, 3, n).astype("int32"))


def test_band_one_fit_is_bit_for_bit_dp_sgd():
  x, y = _data()
  runs = []
  for mechanism in (None, mf.BandedToeplitz(1)):
    model = _fit_model(mechanism)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, sampling_seed=4)
    runs.append([v.numpy() for v in model.trainable_variables])
  for a, b in zip(*runs):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("jit,spe", [(True, 4), (False, 4), (True, 1)])
def test_fit_under_xla_and_steps_per_execution_matches_eager_steps(jit, spe):
  x, y = _data()
  strategy = mf.BandedToeplitz(4)
  ref = _fit_model(strategy)
  ref.fit(x, y, batch_size=8, epochs=2, verbose=0, sampling_seed=4)
  model = _fit_model(strategy, jit=jit, spe=spe)
  model.fit(x, y, batch_size=8, epochs=2, verbose=0, sampling_seed=4)
  assert int(model.optimizer.iterations) == int(ref.optimizer.iterations)
  for a, b in zip(model.trainable_variables, ref.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-4)
  for a, b in zip(model.optimizer.dp_state.noise.buffers,
                  ref.optimizer.dp_state.noise.buffers):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-4)


def test_checkpoint_and_resume_continue_the_noise_sequence():
  strategy = mf.BandedToeplitz(4)
  data = (np.zeros((BATCH, 20), "float32"), np.zeros((BATCH, 50), "float32"))
  a = _zero_gradient_model(mechanism=strategy)
  for _ in range(5):
    a.train_on_batch(*data)
  ckpt_dir = tempfile.mkdtemp()
  path = tf.train.Checkpoint(model=a, optimizer=a.optimizer).save(
      os.path.join(ckpt_dir, "ckpt"))
  gen_state = a.optimizer.step_state.generator.state.numpy()
  for _ in range(3):
    a.train_on_batch(*data)

  def resumed(restore_buffers=True):
    b = _zero_gradient_model(mechanism=strategy, seed=99)
    b.optimizer.build(b.trainable_variables)
    tf.train.Checkpoint(model=b, optimizer=b.optimizer).restore(
        path).assert_existing_objects_matched()
    if not restore_buffers:
      for buf in b.optimizer.dp_state.noise.buffers:
        buf.assign(tf.zeros_like(buf))
    b.optimizer.step_state.generator.reset(gen_state)  # the same z from here on
    for _ in range(3):
      b.train_on_batch(*data)
    return b

  b = resumed()
  assert int(b.optimizer.iterations) == 8
  np.testing.assert_allclose(b.trainable_variables[0].numpy(),
                             a.trainable_variables[0].numpy(), rtol=0,
                             atol=1e-6)
  # Without the buffers the sequence would restart: the check can fail.
  c = resumed(restore_buffers=False)
  assert np.abs(c.trainable_variables[0].numpy() -
                a.trainable_variables[0].numpy()).max() > 1e-3


def test_keras_save_and_load_keep_buffers_and_mechanism():
  strategy = mf.BandedToeplitz(4)
  model = _zero_gradient_model(mechanism=strategy)
  model.train_on_batch(np.zeros((BATCH, 20), "float32"),
                       np.zeros((BATCH, 50), "float32"))
  path = os.path.join(tempfile.mkdtemp(), "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.noise_mechanism == strategy
  assert loaded.optimizer.noise_mechanism == strategy
  # The run's cyclic group assignment survives with it.
  assert int(loaded.optimizer.dp_state.group_seed.numpy()) == int(
      model.optimizer.dp_state.group_seed.numpy())
  for a, b in zip(loaded.optimizer.dp_state.noise.buffers,
                  model.optimizer.dp_state.noise.buffers):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert np.abs(model.optimizer.dp_state.noise.buffers[0].numpy()).max() > 0


def test_epsilon_logged_is_dp_accountings_amplified_bandmf_composition():
  x, y = _data(256)
  bands, batch, sigma = 4, 8, 1.5
  keras.utils.set_random_seed(0)
  model = dpk.DPSequential([keras.layers.Dense(3)], l2_norm_clip=1.0,
                           noise_multiplier=sigma, seed=1,
                           noise_mechanism=mf.BandedToeplitz(bands))
  model.compile(optimizer="sgd", loss=keras.losses.
                SparseCategoricalCrossentropy(from_logits=True))
  cb = dpk.PrivacyCallback(num_examples=256, batch_size=batch, delta=1e-5)
  hist = model.fit(x, y, batch_size=batch, epochs=1, verbose=0,
                   callbacks=[cb], sampling_seed=2)
  steps = int(model.optimizer.iterations)
  assert steps == 32 and model.dp_plan.sampler.num_groups == bands
  q = batch * bands / 256
  assert model.dp_plan.sampler.sampling_rate == pytest.approx(q)
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / bands))
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(event)
  assert hist.history["epsilon"][-1] == pytest.approx(
      acc.get_epsilon(1e-5), rel=1e-9)


def test_budget_stops_bandmf_and_unapplied_steps_write_no_buffer():
  strategy = mf.BandedToeplitz(4)
  model = _zero_gradient_model(mechanism=strategy)
  data = (np.zeros((BATCH, 20), "float32"), np.zeros((BATCH, 50), "float32"))
  for _ in range(3):
    model.train_on_batch(*data)
  model.set_step_limit(3)
  before = [b.numpy() for b in model.optimizer.dp_state.noise.buffers]
  weights = model.trainable_variables[0].numpy()
  for _ in range(2):
    model.train_on_batch(*data)
  assert int(model.optimizer.iterations) == 3
  for a, b in zip(before, model.optimizer.dp_state.noise.buffers):
    np.testing.assert_array_equal(a, b.numpy())
  np.testing.assert_array_equal(weights, model.trainable_variables[0].numpy())


def test_errors_name_the_fix():
  x, y = _data()
  model = _fit_model(mf.BandedToeplitz(4))
  with pytest.raises(ValueError, match="cyclic Poisson"):
    model.fit(x, y, batch_size=8, verbose=0, sampling="shuffled")
  with pytest.raises(ValueError, match="num_bands"):
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[
        dpk.PrivacyCallback(num_examples=64, batch_size=8, num_bands=2)])
  with pytest.raises(TypeError, match="BandedToeplitz"):
    dpk.DPOptimizer(keras.optimizers.SGD(), 1.0, 1.0, noise_mechanism=4)
  model = _fit_model(mf.BandedToeplitz(4))
  with pytest.raises(ValueError, match="one place"):
    model.compile(optimizer=dpk.DPSGD(0.5, 0.8,
                                      noise_mechanism=mf.BandedToeplitz(2)),
                  loss="mse")


def test_optimizer_config_round_trip_keeps_mechanism():
  opt = dpk.DPSGD(1.0, 1.1, noise_mechanism=mf.BandedToeplitz(8),
                  learning_rate=0.5)
  again = dpk.DPOptimizer.from_config(opt.get_config())
  assert again.noise_mechanism == mf.BandedToeplitz(8)
  np.testing.assert_array_equal(again.noise_mechanism.coefs,
                                mf.BandedToeplitz(8).coefs)


# Run by tests/_multi_worker.py's shared MirroredStrategy process (2
# logical CPUs, `strategy`; see `mirrored_results`).
MIRRORED_CASES = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_pxg.keras as dpk
    from tf_pxg import mf

    def sequence():
      SIGMA, CLIP, B, LR = 1.3, 0.7, 16, 1.0
      band = mf.BandedToeplitz(2)
      with strategy.scope():
        inp = keras.Input((100,))
        out = keras.layers.Dense(500, use_bias=False,
                                 kernel_initializer="zeros")(inp)
        model = dpk.DPModel(inp, out, l2_norm_clip=CLIP,
                            noise_multiplier=SIGMA, seed=7,
                            noise_mechanism=band)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                      jit_compile=False)
      x = np.zeros((B, 100), "float32")
      y = np.zeros((B, 500), "float32")
      ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
      w0 = model.trainable_variables[0].numpy().copy()
      steps = []
      # Without autograph, as Keras traces fit's step: autograph would
      # convert tf_pxg's whole train step first (~20 s of CPU per process).
      @tf.function(autograph=False)
      def step(batch):
        strategy.run(model.train_step, args=(batch,))
      with strategy.scope():
        model.optimizer.build(model.trainable_variables)
      prev = w0
      for batch in strategy.experimental_distribute_dataset(ds.repeat(2)):
        step(batch)
        w = model.trainable_variables[0].numpy().copy()
        steps.append(((prev - w) / LR).ravel().tolist())
        prev = w
      return dict(
          stds=[float(np.std(s)) for s in steps],
          corr=float(np.corrcoef(steps[0], steps[1])[0, 1]),
          coefs=band.coefs.tolist(),
          replicas=strategy.num_replicas_in_sync,
          iterations=int(model.optimizer.iterations.numpy()))

    scenarios(sequence=sequence)
    """)


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


def test_mirrored_strategy_replica_shares_sum_to_one_global_sequence(
    mirrored):
  result = multi_worker.scenario(mirrored, "sequence")
  assert result["replicas"] == 2 and result["iterations"] == 2
  c0, c1 = result["coefs"]
  s = 1.3 * 0.7 / 16
  # x_0 = z_0 / c_0; x_1 = (z_1 - c_1 x_0) / c_0 (global sums of shares).
  assert result["stds"][0] == pytest.approx(s / c0, rel=0.05)
  assert result["stds"][1] == pytest.approx(
      s * math.sqrt(1 + (c1 / c0) ** 2) / c0, rel=0.05)
  want_corr = -(c1 / c0) / math.sqrt(1 + (c1 / c0) ** 2)
  assert result["corr"] == pytest.approx(want_corr, abs=0.03)
