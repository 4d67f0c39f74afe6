"""Truncated Poisson sampling (issue 53, item 2): `tf_pxg.data.truncated_poisson`.

- The event: the sampler's `dp_event` is dp-accounting's
  `TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)` composed T times,
  with the same PLD ε, and ε falls toward the untruncated Poisson ε as
  B_max grows.
- The law (the `tf.data` stream, many steps): one physical batch of B_max
  rows per step; `min(Binomial(N, q), B_max)` real rows; uniform inclusion;
  a truncated step keeps a uniform subset of its draw.
- `fit(max_batch_size=...)` end to end; save/load keeps the choice.
- `tf-pxg epsilon/noise --max_batch_size`.
"""

import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

import tf_pxg
from tf_pxg import accounting
from tf_pxg import cli
from tf_pxg.data import sampling_ops
from tf_pxg.data import samplers
from tf_pxg.data.truncated_poisson import TruncatedPoissonSampler
from tf_pxg.dp import mechanisms

DELTA = 1e-5


def _direct_event(n, q, b_max, sigma, steps):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.TruncatedSubsampledGaussianDpEvent(n, q, b_max, sigma),
      steps)


def _direct_pld(event, interval=1e-4):
  accountant = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=interval)
  return accountant.compose(event).get_epsilon(DELTA)


# The event ------------------------------------------------------------------


def test_event_is_dp_accountings_truncated_event_composed():
  n, b, b_max, sigma, steps = 2000, 32, 40, 1.1, 60
  sampler = TruncatedPoissonSampler(n, b, max_batch_size=b_max, seed=0)
  event = sampler.dp_event(mechanisms.IndependentGaussian(), sigma, steps)
  direct = _direct_event(n, b / n, b_max, sigma, steps)
  assert event == direct
  # The same ε, composed directly (one event `steps` times) at one interval.
  by_count = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-4).compose(
          dp_accounting.TruncatedSubsampledGaussianDpEvent(
              n, b / n, b_max, sigma), steps).get_epsilon(DELTA)
  assert _direct_pld(event) == by_count
  # tf_pxg's PLD (refined intervals) on it: the library's ε, equal to
  # itself on the direct event, and within PLD's refinement of it.
  ours = accounting.event_epsilon(event, DELTA, "pld")
  assert ours == accounting.event_epsilon(direct, DELTA, "pld")
  np.testing.assert_allclose(ours, by_count, rtol=0.02)


def test_epsilon_falls_to_poisson_as_max_batch_size_grows():
  n, b, sigma, steps = 2000, 32, 1.0, 100
  poisson_eps = accounting.compute_epsilon(n, b, sigma, steps=steps,
                                           accountant="pld")
  caps = [b, b + 6, b + 12, b + 24, b + 48]
  eps = [accounting.compute_epsilon(n, b, sigma, steps=steps,
                                    accountant="pld", max_batch_size=c)
         for c in caps]
  assert all(x >= y for x, y in zip(eps, eps[1:])), eps
  assert eps[0] > 1.5 * poisson_eps  # truncating at the mean costs a lot
  assert all(e >= poisson_eps * (1 - 0.01) for e in eps), (eps, poisson_eps)
  np.testing.assert_allclose(eps[-1], poisson_eps, rtol=0.01)


def test_rdp_is_answered_by_pld_with_a_warning():
  event = _direct_event(500, 0.02, 12, 1.0, 10)
  with pytest.warns(accounting.TruncationAccountedWithPLD, match="PLD"):
    rdp = accounting.event_epsilon(event, DELTA, "rdp")
  assert rdp == accounting.event_epsilon(event, DELTA, "pld")


def test_refuses_what_it_cannot_account():
  with pytest.raises(ValueError, match="accumulation_steps=2"):
    TruncatedPoissonSampler(100, 10, accumulation_steps=2, seed=0)
  with pytest.raises(ValueError, match="no cyclic groups"):
    TruncatedPoissonSampler(100, 10, min_separation=2, group_seed=1, seed=0)
  with pytest.raises(ValueError, match="differ"):
    TruncatedPoissonSampler(100, 10, physical_batch_size=12,
                            max_batch_size=14, seed=0)
  from tf_pxg import mf  # noqa: PLC0415
  sampler = TruncatedPoissonSampler(100, 10, seed=0)
  with pytest.raises(ValueError, match="TruncatedPoissonSampler"):
    sampler.dp_event(mechanisms.resolve("band_mf")(mf.BandedToeplitz(2)),
                     1.0, 10)
  with pytest.raises(ValueError, match="min_separation=2"):
    accounting.compute_epsilon(100, 10, 1.0, steps=5, max_batch_size=12,
                               min_separation=2)


def test_default_max_batch_size_is_the_padded_poisson_shape():
  sampler = samplers.resolve("truncated_poisson")(1000, 64, seed=0)
  assert sampler.max_batch_size == sampler.physical_batch_size == 96
  assert sampler.accumulation_steps == 1


# The law ----------------------------------------------------------------------

N, B, B_MAX, T = 60, 12, 12, 4000  # q = 0.2: about 46% of steps truncate


def _stream(sampler, steps):
  ds = sampling_ops.index_stream(sampler, start_step=0, num_steps=steps)
  rows = list(ds.batch(steps).take(1))[0]
  return [r.numpy() for r in rows]


@pytest.fixture(scope="module", params=[False, True], ids=["seeded",
                                                            "secure"])
def stream(request):
  secure = request.param
  sampler = TruncatedPoissonSampler(
      N, B, max_batch_size=B_MAX, secure_mode=secure,
      seed=None if secure else 7)
  return sampler, _stream(sampler, T)


def test_every_step_is_one_physical_batch_of_max_batch_size_rows(stream):
  sampler, (idx, mask, end) = stream
  assert idx.shape == mask.shape == (T, B_MAX)
  assert end.all()  # each physical batch ends its logical step
  assert sampler.accumulation_steps == 1
  real = [np.sort(i[m > 0]) for i, m in zip(idx, mask)]
  assert all(len(set(r)) == len(r) for r in real)
  assert (idx[mask == 0] == 0).all()


def test_real_rows_are_min_of_binomial_and_max_batch_size(stream):
  _, (_, mask, _) = stream
  sizes = mask.sum(axis=1)
  k = np.arange(N + 1)
  pmf = stats.binom.pmf(k, N, B / N)
  mean = float(np.sum(np.minimum(k, B_MAX) * pmf))
  var = float(np.sum(np.minimum(k, B_MAX) ** 2 * pmf)) - mean ** 2
  assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / T)
  # The whole law: chi-square over the values 0..B_MAX (low ones pooled).
  counts = np.bincount(sizes.astype(int), minlength=B_MAX + 1)
  law = np.append(pmf[:B_MAX], pmf[B_MAX:].sum())
  low = law * T < 5
  observed = np.append(counts[~low], counts[low].sum())
  expected = np.append(law[~low], law[low].sum()) * T
  assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_inclusion_is_uniform_across_examples(stream):
  _, (idx, mask, _) = stream
  hits = np.bincount(idx[mask > 0], minlength=N)
  k = np.arange(N + 1)
  p = float(np.sum(np.minimum(k, B_MAX) * stats.binom.pmf(k, N, B / N))) / N
  se = math.sqrt(T * p * (1 - p))
  assert np.abs(hits - T * p).max() < 5 * se, (hits, T * p)


def test_a_truncated_step_keeps_a_uniform_subset_of_its_draw():
  sampler = TruncatedPoissonSampler(N, B, max_batch_size=B_MAX, seed=11)

  @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
  def draw_and_keep(step):
    key = sampling_ops.step_key(sampler.seed, step)
    return (sampling_ops.step_indices(key, N, sampler.sampling_rate),
            sampler.step_indices(step, key))

  by_example = np.zeros((2, N))  # kept, expected
  by_place = np.zeros((2, 4))  # by rank in the draw (quarters)
  variance_example, variance_place = np.zeros(N), np.zeros(4)
  truncated = 0
  for step in range(2500):
    drawn, kept = (a.numpy() for a in draw_and_keep(tf.constant(step,
                                                                tf.int64)))
    assert set(kept) <= set(drawn) and len(kept) == min(len(drawn), B_MAX)
    if len(drawn) <= B_MAX:
      assert (kept == drawn).all()
      continue
    truncated += 1
    p = B_MAX / len(drawn)
    is_kept = np.isin(drawn, kept)
    place = (4 * np.arange(len(drawn))) // len(drawn)
    np.add.at(by_example[0], drawn, is_kept)
    np.add.at(by_example[1], drawn, p)
    variance_example[drawn] += p * (1 - p)
    np.add.at(by_place[0], place, is_kept)
    np.add.at(by_place[1], place, p)
    np.add.at(variance_place, place, p * (1 - p))
  assert truncated > 800
  z_example = (by_example[0] - by_example[1]) / np.sqrt(variance_example)
  z_place = (by_place[0] - by_place[1]) / np.sqrt(variance_place)
  assert np.abs(z_example).max() < 5, z_example
  assert np.abs(z_place).max() < 5, z_place


def test_numpy_path_is_the_streams_step():
  sampler = TruncatedPoissonSampler(N, B, max_batch_size=B_MAX, seed=5)
  idx, mask, _ = _stream(sampler, 20)
  for step in range(20):
    np.testing.assert_array_equal(
        sampler.indices_for_step(step), np.sort(idx[step][mask[step] > 0]))


# fit -------------------------------------------------------------------------


def _model(**kwargs):
  return tf_pxg.keras.DPSequential(
      [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)],
      l2_norm_clip=1.0, noise_multiplier=1.1, seed=1, **kwargs)


class _CountBatches(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.batches = 0

  def on_train_batch_end(self, batch, logs=None):
    self.batches += 1


def test_fit_one_fixed_batch_per_step_and_the_ledgers_epsilon():
  x = np.random.RandomState(0).randn(200, 4).astype(np.float32)
  y = np.random.RandomState(1).randn(200, 1).astype(np.float32)
  model = _model()
  model.compile(optimizer="sgd", loss="mse")
  counter = _CountBatches()
  model.fit(x, y, batch_size=16, epochs=2, verbose=0, max_batch_size=18,
            sampling_seed=3, callbacks=[counter])
  sampler = model.dp_plan.sampler
  assert isinstance(sampler, TruncatedPoissonSampler)
  assert (sampler.physical_batch_size, sampler.accumulation_steps) == (18, 1)
  steps = int(model.optimizer.iterations.numpy())
  assert steps == accounting.steps_for(200, 16, 2) == counter.batches
  direct = _direct_event(200, 16 / 200, 18, 1.1, steps)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", accounting.TruncationAccountedWithPLD)
    assert model.epsilon(DELTA) == accounting.event_epsilon(direct, DELTA,
                                                            "pld")
    assert model.privacy_ledger.event() == direct
    summary = model.privacy_summary(DELTA)
  assert "TruncatedSubsampledGaussianDpEvent" in summary
  assert "max_batch_size=18" in summary


def test_fit_refuses_max_batch_size_with_a_sampling_that_does_not_truncate():
  x = np.zeros((40, 4), np.float32)
  y = np.zeros((40, 1), np.float32)
  model = _model()
  model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(ValueError, match="does not truncate"):
    model.fit(x, y, batch_size=8, max_batch_size=10, sampling="poisson",
              verbose=0)
  with pytest.raises(ValueError, match="physical_batch_size=12 differ"):
    model.fit(x, y, batch_size=8, max_batch_size=10, physical_batch_size=12,
              verbose=0)


def test_save_and_load_keep_the_sampling(tmp_path):
  x = np.random.RandomState(0).randn(64, 4).astype(np.float32)
  y = np.random.RandomState(1).randn(64, 1).astype(np.float32)
  model = _model(sampling="truncated_poisson")
  model.compile(optimizer="adam", loss="mse")
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, max_batch_size=10,
            sampling_seed=0)
  path = str(tmp_path / "truncated.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.dp_plan.sampling is TruncatedPoissonSampler
  loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, max_batch_size=10,
             sampling_seed=1)
  assert isinstance(loaded.dp_plan.sampler, TruncatedPoissonSampler)
  assert loaded.dp_plan.sampler.physical_batch_size == 10


# CLI -------------------------------------------------------------------------

RUN = ["--num_examples=6000", "--batch_size=64", "--epochs=1",
       "--max_batch_size=80", "--accountant=pld"]


def test_cli_epsilon_is_dp_accounting_directly(capsys):
  code = cli.main(["tf-pxg", "epsilon", *RUN, "--noise_multiplier=1.0"])
  out = capsys.readouterr().out
  assert code == 0
  steps = accounting.steps_for(6000, 64, 1)
  direct = _direct_event(6000, 64 / 6000, 80, 1.0, steps)
  assert float(out) == accounting.event_epsilon(direct, DELTA, "pld")


def test_cli_noise_reaches_the_target_on_the_direct_event(capsys):
  code = cli.main(["tf-pxg", "noise", *RUN, "--target_epsilon=2",
                   "--tolerance=1e-2"])
  sigma = float(capsys.readouterr().out)
  assert code == 0
  steps = accounting.steps_for(6000, 64, 1)

  def eps(s):
    return accounting.event_epsilon(
        _direct_event(6000, 64 / 6000, 80, s, steps), DELTA, "pld")

  assert eps(sigma) <= 2 < eps(sigma - 1e-2)
