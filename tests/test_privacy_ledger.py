"""The privacy ledger: ε covers the model's whole history (issue 40).

Each test is an attack on the reported ε: a history that the last
optimizer's counter does not describe (two fits with other batch sizes, a
recompile with another σ, a budget run across a recompile, saving and
resuming by every path). The expected ε is dp-accounting's, computed here
directly from the sequence of events that really ran (the step counts
read from the optimizers, the rates from the batch sizes), never from
tf_pxg's accounting.
"""

import math
import re

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import mf
from tf_pxg.dp import ledger as ledger_lib

N, DELTA = 64, 1e-5


def _data():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((N, 3)).astype("float32"),
          rng.integers(0, 2, N).astype("int32"))


def _model(sigma=1.0, optimizer=None, **dp):
  """A DP model; with `sigma=None` its settings come from `optimizer` (a
  DPOptimizer) alone."""
  keras.utils.set_random_seed(0)
  if sigma is not None:
    dp.update(l2_norm_clip=1.0, noise_multiplier=sigma)
  model = dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(2)], **dp)
  model.compile(optimizer or keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _poisson(q, sigma, steps):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _rdp(*events):
  acc = dp_accounting.rdp.RdpAccountant()
  for e in events:
    acc.compose(e)
  return acc.get_epsilon(DELTA)


def _steps(model):
  return int(model.optimizer.iterations.numpy())


def _fit(model, batch_size, epochs=1, **kwargs):
  x, y = _data()
  before = _steps(model)
  cb = dpk.PrivacyCallback(num_examples=N, batch_size=batch_size,
                           delta=DELTA)
  history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                      callbacks=[cb], **kwargs)
  return _steps(model) - before, history.history["epsilon"][-1]


def test_two_fits_with_other_batch_sizes_compose():
  model = _model()
  t1, _ = _fit(model, 16)
  t2, logged = _fit(model, 4)
  assert (t1, t2) == (4, 16)
  want = _rdp(_poisson(16 / N, 1.0, t1), _poisson(4 / N, 1.0, t2))
  # Before the ledger: every step at the last fit's rate.
  stale = _rdp(_poisson(4 / N, 1.0, t1 + t2))
  assert want > 1.5 * stale
  assert logged == pytest.approx(want, rel=1e-9)
  assert model.privacy_ledger.epsilon(DELTA) == pytest.approx(
      want, rel=1e-9)
  assert len(model.privacy_ledger.runs(_steps(model))) == 2


def test_same_batch_size_twice_is_one_run():
  model = _model()
  t1, _ = _fit(model, 8)
  t2, logged = _fit(model, 8)
  assert logged == pytest.approx(_rdp(_poisson(8 / N, 1.0, t1 + t2)),
                                 rel=1e-9)
  assert len(model.privacy_ledger.runs(_steps(model))) == 1


def test_recompile_with_another_sigma_keeps_the_history():
  model = _model(None, dpk.DPSGD(1.0, 1.0, learning_rate=0.1))
  t1, _ = _fit(model, 8)
  model.compile(dpk.DPSGD(1.0, 4.0, learning_rate=0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  assert _steps(model) == 0  # the new optimizer's counter restarted
  t2, logged = _fit(model, 8)
  want = _rdp(_poisson(8 / N, 1.0, t1), _poisson(8 / N, 4.0, t2))
  assert logged == pytest.approx(want, rel=1e-9)
  assert logged > 3 * _rdp(_poisson(8 / N, 4.0, t2))  # the stale figure


def test_recompile_with_a_plain_optimizer_keeps_the_history():
  model = _model()
  t1, _ = _fit(model, 8)
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  t2, logged = _fit(model, 8)
  assert logged == pytest.approx(
      _rdp(_poisson(8 / N, 1.0, t1), _poisson(8 / N, 1.0, t2)), rel=1e-9)


def test_budget_counts_the_history_across_a_recompile():
  # The budget of 6 steps at q = 1/8 is spent by the first fit; after a
  # recompile the second fit may take no more steps than keep the
  # composition within it.
  x, y = _data()
  target = _rdp(_poisson(8 / N, 1.0, 10))
  model = _model()
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
      dpk.PrivacyCallback(N, 8, delta=DELTA, target_epsilon=target)])
  t1 = _steps(model)
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
      dpk.PrivacyCallback(N, 8, delta=DELTA, target_epsilon=target)])
  t2 = _steps(model)
  assert t1 + t2 == 10  # not t1 + 10
  assert _rdp(_poisson(8 / N, 1.0, t1),
              _poisson(8 / N, 1.0, t2)) <= target * (1 + 1e-9)
  with pytest.raises(ValueError, match="would be exceeded by the next step"):
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[
        dpk.PrivacyCallback(N, 8, delta=DELTA, target_epsilon=target)])


def _history(model):
  t1, _ = _fit(model, 16)
  t2, _ = _fit(model, 4)
  return _rdp(_poisson(16 / N, 1.0, t1), _poisson(4 / N, 1.0, t2))


@pytest.mark.parametrize("path", ["keras", "weights", "checkpoint"])
def test_ledger_survives_saving_and_resuming(tmp_path, path):
  model = _model()
  want = _history(model)
  steps = _steps(model)
  fresh = _model()
  x, y = _data()
  if path == "keras":
    model.save(tmp_path / "m.keras")
    fresh = keras.models.load_model(tmp_path / "m.keras")
  elif path == "weights":  # ModelCheckpoint / BackupAndRestore's format
    model.save_weights(tmp_path / "m.weights.h5")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(tmp_path / "m.weights.h5")
  else:
    tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh).restore(
        tf.train.latest_checkpoint(str(tmp_path))).expect_partial()
  assert _steps(fresh) == steps
  ledger = fresh.privacy_ledger
  assert ledger.epsilon(DELTA) == pytest.approx(want, rel=1e-9)
  # Resuming with the last fit's settings continues its run (t3 counts the
  # steps `fit` completes after Keras' loop, when a logical step straddled
  # its end; the logged ε is read at the last epoch's end, before them).
  t3, logged = _fit(fresh, 4)
  want = _rdp(_poisson(16 / N, 1.0, 4), _poisson(4 / N, 1.0, 16 + t3))
  assert fresh.epsilon(DELTA) == pytest.approx(want, rel=1e-9)
  assert logged <= want * (1 + 1e-9)


def test_backup_and_restore_resume_counts_every_step(tmp_path):
  x, y = _data()

  class Interrupt(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      if epoch == 1:
        raise RuntimeError("interrupted")

  backup = str(tmp_path / "backup")
  model = _model()
  _fit(model, 16)  # a first run at another rate
  with pytest.raises(RuntimeError, match="interrupted"):
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup), Interrupt()])
  resumed = _model()
  cb = dpk.PrivacyCallback(N, 8, delta=DELTA)
  resumed.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[
      keras.callbacks.BackupAndRestore(backup), cb])
  total = _steps(resumed)
  assert total > 4 + 2 * 8  # restored after 2 epochs, then trained on
  assert cb.epsilon() == pytest.approx(
      _rdp(_poisson(16 / N, 1.0, 4), _poisson(8 / N, 1.0, total - 4)),
      rel=1e-9)


def test_correlated_noise_refuses_another_run_on_its_stream():
  model = _model(noise_mechanism=mf.BandedToeplitz(2))
  x, y = _data()
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  with pytest.raises(ledger_lib.ComposeError, match="correlated"):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  # A new DP optimizer (a fresh noise state) composes.
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert len(model.privacy_ledger.runs(_steps(model))) == 2


def test_ledger_is_inspectable_and_round_trips_its_events():
  model = _model()
  _history(model)
  text = model.privacy_ledger.summary(_steps(model))
  assert "run 0: 4 steps" in text and "run 1 (open): 16 steps" in text
  assert "expected_batch_size=16" in text and "expected_batch_size=4" in text
  event = model.privacy_ledger.event()
  assert ledger_lib.event_from_json(
      ledger_lib.event_to_json(event)) == event
  assert math.isfinite(model.privacy_ledger.epsilon(DELTA))


def test_model_epsilon_and_summary_read_the_ledger():
  model = _model()
  want = _history(model)
  assert model.epsilon(DELTA) == pytest.approx(want, rel=1e-9)
  assert model.epsilon(DELTA, accountant="pld") <= want * 1.01
  summary = model.privacy_summary().splitlines()
  assert [line.split(":")[0] for line in summary] == [
      "run 0", "run 1 (open)", "risk"]  # two runs, then their risk
  # A model that released nothing (not even compiled) has ε = 0.
  fresh = dpk.DPSequential([keras.layers.Dense(2)])
  assert fresh.epsilon() == 0.0
  assert "no noised release yet" in fresh.privacy_summary()


def test_fits_with_other_samplings_compose():
  # Poisson, then balls-in-bins (its certified bound: one Gaussian per
  # epoch begun, tf_pxg.data.balls_in_bins), then Poisson again.
  import tf_pxg.data.balls_in_bins  # noqa: F401  (registers the sampling)
  model = _model()
  t1, _ = _fit(model, 16)
  x, y = _data()
  before = _steps(model)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0,
            sampling="balls_in_bins")
  t2, bins = _steps(model) - before, model.dp_plan.sampler.num_bins
  t3, logged = _fit(model, 16)
  want = _rdp(_poisson(16 / N, 1.0, t1),
              dp_accounting.SelfComposedDpEvent(
                  dp_accounting.GaussianDpEvent(1.0), math.ceil(t2 / bins)),
              _poisson(16 / N, 1.0, t3))
  assert t2 > 0 and logged == pytest.approx(want, rel=1e-9)
  assert len(model.privacy_ledger.runs(_steps(model))) == 3


def test_callback_given_the_plans_sigma_warns_and_reads_the_ledger():
  # A callback told σ explicitly (TF Privacy's habit) with the model's own
  # σ: redundant (a DeprecationWarning), and it reports the whole history.
  model = _model()
  _fit(model, 16)
  x, y = _data()
  same = dpk.PrivacyCallback(N, 4, noise_multiplier=1.0, delta=DELTA)
  with pytest.warns(DeprecationWarning, match="noise_multiplier=1.0 .*"
                    "redundant"):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[same])
  assert same.epsilon() == pytest.approx(
      _rdp(_poisson(16 / N, 1.0, 4), _poisson(4 / N, 1.0, 16)), rel=1e-9)


@pytest.mark.parametrize("given, named, planned", [
    ({"noise_multiplier": 2.0}, "noise_multiplier=2.0", "noise_multiplier=1.0"),
    ({"accountant": "pld"}, "accountant='pld'", "accountant='rdp'"),
    ({"min_separation": 2}, "min_separation=2", "min_separation=1"),
])
def test_callback_with_other_settings_than_the_plan_raises_before_a_step(
    given, named, planned):
  # Attack: a callback given its own σ (or accountant, or b) would report
  # an ε for noise the model does not add. The model's DPOptimizer plan
  # (DP-SGD, σ = 1, RDP, b = 1) is the one owner: the callback refuses,
  # naming the argument and both values, before any step.
  model = _model()
  _fit(model, 16)
  x, y = _data()
  steps, epsilon = _steps(model), model.epsilon(DELTA)
  weights = [v.numpy() for v in model.trainable_variables]
  cb = dpk.PrivacyCallback(N, 8, delta=DELTA, target_epsilon=10.0, **given)
  cb.set_model(model)
  for read in (cb.epsilon, cb.max_steps):
    with pytest.raises(ValueError, match=re.escape(named)) as raised:
      read()
    assert planned in str(raised.value)
    assert "has no settings of its own" in str(raised.value)
  with pytest.raises(ValueError, match=re.escape(named)):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        dpk.PrivacyCallback(N, 8, delta=DELTA, **given)])
  assert _steps(model) == steps
  assert model.epsilon(DELTA) == epsilon
  for v, w in zip(model.trainable_variables, weights):
    np.testing.assert_array_equal(v.numpy(), w)
