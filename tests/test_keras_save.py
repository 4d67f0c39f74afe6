"""Saving, loading, resuming, and the privacy callback's ε."""

import math

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.data as dpd
import tf_pxg.keras as dpk
from tf_pxg import accounting
from tf_pxg import mf

N, BATCH, SIGMA = 64, 16, 1.1


def _data(n=N):
  rng = np.random.RandomState(0)
  return rng.randn(n, 5).astype("float32"), rng.randint(0, 3, n)


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _functional(**dp):
  inp = keras.Input((5,))
  h = keras.layers.Dense(4, activation="relu")(inp)
  h = keras.layers.LayerNormalization()(h)
  return dpk.DPModel(inp, keras.layers.Dense(3)(h), **dp)


def _sequential(**dp):
  return dpk.DPSequential([keras.Input((5,)), keras.layers.Dense(4),
                           keras.layers.Dense(3)], **dp)


class _Net(keras.Model):

  def __init__(self, units=4, **kwargs):
    super().__init__(**kwargs)
    self.units = units
    self.d1 = keras.layers.Dense(units, activation="tanh")
    self.d2 = keras.layers.Dense(3)

  def call(self, x):
    return self.d2(self.d1(x))

  def get_config(self):
    return {**super().get_config(), "units": self.units}


def _subclassed(**dp):
  model = dpk.make_dp_model_class(_Net)(units=4, **dp)
  model(np.zeros((1, 5), "float32"))
  return model


@pytest.mark.parametrize("build", [_functional, _sequential, _subclassed],
                         ids=["functional", "sequential", "subclassed"])
@pytest.mark.parametrize("dp_on", ["model", "optimizer"])
def test_keras_file_round_trip_keeps_dp_config(tmp_path, build, dp_on):
  x, y = _data()
  if dp_on == "model":
    model = build(l2_norm_clip=0.8, noise_multiplier=SIGMA)
    optimizer = keras.optimizers.Adam(0.01)
  else:
    model = build()
    optimizer = dpk.DPAdam(0.8, SIGMA, learning_rate=0.01)
  model.compile(optimizer=optimizer, loss=_sce(), metrics=["accuracy"])
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert type(loaded) is type(model)
  assert loaded.l2_norm_clip == 0.8 and loaded.noise_multiplier == SIGMA
  assert type(loaded.optimizer) is type(model.optimizer)
  assert int(loaded.optimizer.iterations) == N // BATCH
  for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(loaded.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-6)
  want = model.evaluate(x, y, verbose=0, return_dict=True)
  got = loaded.evaluate(x, y, verbose=0, return_dict=True)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
  # The loaded model keeps training privately.
  loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  assert int(loaded.optimizer.iterations) == 2 * N // BATCH


def test_dp_optimizer_config_round_trip():
  opt = dpk.DPSGD(0.5, 2.0, learning_rate=0.3, momentum=0.9)
  clone = dpk.DPOptimizer.from_config(opt.get_config())
  assert (clone.l2_norm_clip, clone.noise_multiplier) == (0.5, 2.0)
  assert isinstance(clone.inner_optimizer, keras.optimizers.SGD)
  assert clone.inner_optimizer.momentum == 0.9
  assert float(clone.learning_rate) == pytest.approx(0.3)


def _direct_epsilon(steps, delta=1e-5):
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          BATCH / N, dp_accounting.GaussianDpEvent(SIGMA)), steps)
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS))
  return acc.compose(event).get_epsilon(delta)


def test_privacy_callback_epsilon_matches_accounting_and_dp_accounting():
  x, y = _data()
  model = _functional(l2_norm_clip=1.0, noise_multiplier=SIGMA)
  model.compile(optimizer="sgd", loss=_sce())
  cb = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH)
  history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                      callbacks=[cb])
  eps = history.history["epsilon"]
  steps_per_epoch = N // BATCH
  for epoch, e in enumerate(eps, start=1):
    steps = epoch * steps_per_epoch
    assert e == pytest.approx(accounting.compute_epsilon(
        N, BATCH, SIGMA, steps=steps, delta=1e-5), rel=1e-12)
    assert e == pytest.approx(_direct_epsilon(steps), rel=1e-9)
  assert eps[0] < eps[1]


@pytest.mark.parametrize("how", ["keras_file", "checkpoint"])
def test_privacy_callback_resumes_from_restored_iterations(tmp_path, how):
  x, y = _data()
  model = _functional(l2_norm_clip=1.0, noise_multiplier=SIGMA)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_sce())
  model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
  if how == "keras_file":
    path = str(tmp_path / "m.keras")
    model.save(path)
    resumed = keras.models.load_model(path)
  else:
    ckpt_dir = str(tmp_path / "ckpt")
    path = tf.train.Checkpoint(model=model,
                               optimizer=model.optimizer).save(ckpt_dir)
    resumed = _functional(l2_norm_clip=1.0, noise_multiplier=SIGMA)
    resumed.compile(optimizer=keras.optimizers.SGD(0.1), loss=_sce())
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed,
                        optimizer=resumed.optimizer).restore(
                            path).assert_existing_objects_matched()
  assert int(resumed.optimizer.iterations) == 2 * N // BATCH
  cb = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH)
  history = resumed.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                        callbacks=[cb])
  assert history.history["epsilon"][0] == pytest.approx(
      _direct_epsilon(3 * N // BATCH), rel=1e-9)


def test_target_epsilon_stops_before_budget():
  x, y = _data()
  allowed = 6  # steps whose ε stays within the target
  target = (_direct_epsilon(allowed) + _direct_epsilon(allowed + 1)) / 2
  model = _functional(l2_norm_clip=1.0, noise_multiplier=SIGMA)
  model.compile(optimizer="sgd", loss=_sce())
  cb = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH,
                           target_epsilon=target)
  history = model.fit(x, y, batch_size=BATCH, epochs=5, verbose=0,
                      callbacks=[cb])
  assert int(model.optimizer.iterations) == allowed
  assert history.history["epsilon"][-1] <= target
  # Already at the budget: refuses to take another step.
  with pytest.raises(ValueError, match="target_epsilon"):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[cb])
  assert int(model.optimizer.iterations) == allowed


def test_epsilon_without_noise_is_infinite():
  x, y = _data()
  model = _functional(l2_norm_clip=1.0, noise_multiplier=0.0)
  model.compile(optimizer="sgd", loss=_sce())
  cb = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH)
  history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      callbacks=[cb])
  assert math.isinf(history.history["epsilon"][0])


def test_plan_sampling_and_accountant_survive_keras_file(tmp_path):
  """A plan with BandMF (b = 2, so cyclic Poisson sampling), a chosen
  sampling and the PLD accountant round-trips through a `.keras` file; the
  resumed fit samples by it and the callback's ε is dp-accounting's PLD ε
  of that event, built here from its closed form."""
  x, y = _data()
  bands = 2
  model = _functional()
  model.compile(optimizer=dpk.DPSGD(
      1.0, SIGMA, noise_mechanism=mf.BandedToeplitz(num_bands=bands),
      sampling="poisson", accountant="pld", learning_rate=0.1), loss=_sce())
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  path = str(tmp_path / "plan.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.plan.conflicts(model.optimizer.plan) == []
  assert loaded.dp_plan.accountant == "pld"
  cb = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH)
  history = loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                       callbacks=[cb])
  sampler = loaded.dp_plan.sampler
  assert type(sampler) is dpd.PoissonSampler
  assert sampler.num_groups == bands
  assert sampler.sampling_rate == pytest.approx(bands * BATCH / N)
  steps = int(loaded.optimizer.iterations)
  assert steps == 2 * N // BATCH and cb.accountant == "pld"
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          bands * BATCH / N, dp_accounting.GaussianDpEvent(SIGMA)),
      math.ceil(steps / bands))
  pld = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-4).compose(event).get_epsilon(1e-5)
  rdp = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS)).compose(
      event).get_epsilon(1e-5)
  # The library refines PLD's grid until ε moves by < 1% (a pessimistic
  # bound at each grid), so it sits within 2% above the fine-grid figure;
  # RDP is far enough away that the test tells the two apart.
  assert history.history["epsilon"][0] == pytest.approx(pld, rel=2e-2)
  assert abs(rdp - pld) > 0.05 * pld
  # The callback has no accountant of its own: another than the plan's is
  # refused (issue 42); the model's ledger still answers for RDP.
  own = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH,
                            accountant="rdp")
  own.set_model(loaded)
  with pytest.raises(ValueError, match="accountant='rdp'.*'pld'"):
    own.epsilon()
  assert loaded.epsilon(1e-5, accountant="rdp") == pytest.approx(
      rdp, rel=1e-9)
