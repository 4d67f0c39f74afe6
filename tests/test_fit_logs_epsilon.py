"""A DP model's `fit` logs ε with no callback; `PrivacyCallback` needs N
and the batch size only outside `fit`.

`fit` adds a `PrivacyCallback` unless one is given
(`tf_pxg.keras.callbacks.with_privacy_log`): N, the batch size and the
privacy unit come from the run's sampler, ε from the model's privacy
ledger. Checked against dp-accounting directly: after epoch e of a
Poisson run (q = B / N, σ, ceil(N / B) logical steps an epoch) the logged
`epsilon` is the RDP ε of the Poisson-subsampled Gaussian composed over
the steps taken, at δ = 1e-5 by default or `fit(delta=...)`. User-level
runs log `epsilon_user_level` (U users at rate B / U); shuffled batches,
for which no ε holds, log none. Two places for one setting are refused.
"""

import math

import dp_accounting
import keras
import numpy as np
import pytest

from tf_pxg import accounting
import tf_pxg.keras as dpk

N, BATCH, SIGMA = 40, 8, 1.3


def _model():
  keras.utils.set_random_seed(0)
  inp = keras.Input((3,))
  model = dpk.DPModel(inp, keras.layers.Dense(2)(inp), l2_norm_clip=1.0,
                      noise_multiplier=SIGMA, seed=0)
  model.compile(optimizer="sgd", loss=keras.losses.
                SparseCategoricalCrossentropy(from_logits=True))
  return model


def _data(n=N):
  rng = np.random.default_rng(0)
  return (rng.standard_normal((n, 3)).astype("float32"),
          rng.integers(0, 2, n).astype("int32"))


def _poisson_epsilon(rate, steps, delta):
  """dp-accounting's RDP ε of `steps` Poisson-subsampled Gaussians."""
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS))
  acc.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          rate, dp_accounting.GaussianDpEvent(SIGMA)), steps))
  return acc.get_epsilon(delta)


class _Steps(keras.callbacks.Callback):
  """`optimizer.iterations` at each epoch end."""

  def __init__(self):
    super().__init__()
    self.steps = []

  def on_epoch_end(self, epoch, logs=None):
    self.steps.append(int(self.model.optimizer.iterations.numpy()))


@pytest.mark.parametrize("delta", [None, 1e-6])
def test_fit_logs_epsilon_with_no_callback(delta):
  x, y = _data()
  model, steps = _model(), _Steps()
  history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0,
                      sampling_seed=1, callbacks=[steps],
                      **({} if delta is None else {"delta": delta}))
  assert steps.steps == [5, 10, 15]
  want = [_poisson_epsilon(BATCH / N, t, delta or 1e-5) for t in steps.steps]
  np.testing.assert_allclose(history.history["epsilon"], want, rtol=1e-9)
  assert history.history["epsilon"][-1] == pytest.approx(
      model.epsilon(delta or 1e-5), rel=1e-12)


def test_progress_bar_shows_epsilon(capsys):
  x, y = _data()
  _model().fit(x, y, batch_size=BATCH, epochs=1, verbose=2, sampling_seed=1)
  out = capsys.readouterr().out
  want = _poisson_epsilon(BATCH / N, 5, 1e-5)
  assert f"epsilon: {want:.4f}" in out, out


def test_callback_without_n_or_b_reads_the_sampler():
  """`PrivacyCallback()` logs what one given N and B logs; and a second
  callback is not added."""
  x, y = _data()
  logged = []
  for callback in (dpk.PrivacyCallback(), dpk.PrivacyCallback(N, BATCH)):
    history = _model().fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                           sampling_seed=1, callbacks=[callback])
    logged.append(history.history["epsilon"])
    assert callback.num_examples == N and callback.batch_size == BATCH
  assert logged[0] == logged[1]
  assert logged[0][-1] == pytest.approx(
      _poisson_epsilon(BATCH / N, 10, 1e-5), rel=1e-9)


def test_user_level_runs_log_user_level_epsilon():
  """fit(user_ids=...) samples U users at rate B / U: logged under
  `epsilon_user_level`, with dp-accounting's ε at q = B / U."""
  users = 20
  x, y = _data()
  user_ids = np.arange(N) % users
  model, steps = _model(), _Steps()
  history = model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                      sampling_seed=1, user_ids=user_ids,
                      examples_per_user=2, callbacks=[steps])
  assert "epsilon" not in history.history
  assert history.history["epsilon_user_level"][-1] == pytest.approx(
      _poisson_epsilon(4 / users, steps.steps[-1], 1e-5), rel=1e-9)


def test_shuffled_batches_log_no_epsilon():
  x, y = _data()
  history = _model().fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                         sampling="shuffled")
  assert not any(k.startswith("epsilon") for k in history.history)
  with pytest.raises(ValueError, match="sampling='shuffled'"):
    _model().fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                 sampling="shuffled", target_epsilon=5.0)


def test_one_place_for_each_setting():
  x, y = _data()
  model = _model()
  before = [v.numpy() for v in model.weights]
  for kwargs in (dict(delta=1e-6), dict(target_epsilon=3.0)):
    with pytest.raises(ValueError, match="give them to it instead"):
      model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                callbacks=[dpk.PrivacyCallback()], **kwargs)
  assert int(model.optimizer.iterations.numpy()) == 0
  for b, v in zip(before, model.weights):
    np.testing.assert_array_equal(b, v.numpy())
  for kwargs in (dict(batch_size=8), dict(num_examples=8),
                 dict(num_examples=8, num_users=8, batch_size=2)):
    with pytest.raises(ValueError, match="PrivacyCallback"):
      dpk.PrivacyCallback(**kwargs)


def test_without_a_sampler_n_and_b_are_asked_for():
  """Outside a DP model's fit (a plain Keras model: no plan, no ledger,
  no sampler) the callback cannot know N: the error says to pass it."""
  inp = keras.Input((3,))
  plain = keras.Model(inp, keras.layers.Dense(2)(inp))
  plain.compile(optimizer="sgd", loss="mse")
  callback = dpk.PrivacyCallback(noise_multiplier=SIGMA)
  callback.set_model(plain)
  with pytest.raises(ValueError, match="pass num_examples= and batch_size="):
    callback.epsilon(3)
  assert math.isfinite(dpk.PrivacyCallback(
      N, BATCH, noise_multiplier=SIGMA).epsilon(3))
