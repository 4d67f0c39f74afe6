"""The Sampler protocol (issue 29): typed batch info, the sampler table,
fit asking the sampler, and a sampler added in this one file."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import accounting
import tf_pxg.data as dpd
from tf_pxg.data import samplers
from tf_pxg.data.balls_in_bins import BallsInBinsSampler
from tf_pxg.dp import mechanisms
import tf_pxg.keras as dpk

N, SIGMA, DELTA = 16, 1.0, 1e-5


class FullBatchSampler(dpd.PoissonSampler):
  """Full-batch DP-GD: every example in every logical step.

  No subsampling, so no amplification: each example's clipped gradient
  enters every step, and T steps are the T-fold composition of the
  mechanism's per-step event (for independent noise the Gaussian mechanism
  of sensitivity C at noise multiplier sigma, under add/remove adjacency).
  """

  def __init__(self, num_examples, expected_batch_size, **kwargs):
    del expected_batch_size  # the batch is the whole data set
    super().__init__(num_examples, num_examples, **kwargs)

  def step_indices(self, step, key=None):
    del step, key
    return tf.range(self.num_examples, dtype=tf.int64)

  def dp_event(self, mechanism, noise_multiplier, steps):
    return dp_accounting.SelfComposedDpEvent(
        mechanism.dp_event(noise_multiplier), int(steps))


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, 3)).astype("float32"),
          rng.normal(size=(N, 1)).astype("float32"))


def _model():
  model = dpk.DPSequential(
      [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="zeros")],
      l2_norm_clip=1.0, noise_multiplier=SIGMA, seed=0)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  return model


def test_a_sampler_defined_in_a_test_trains_and_is_accounted():
  """Adding a sampler is one class (this file): fit draws its batches and
  PrivacyCallback's ε is its own event, against dp-accounting here."""
  x, y = _data()
  stream = dpd.poisson_dataset(FullBatchSampler(N, 4, seed=1), x, y,
                               start_step=0)
  _, _, info = next(iter(stream))
  info = dpd.BatchInfo.from_element(info)
  assert float(tf.reduce_sum(info.mask)) == N and bool(info.step_end)
  assert float(info.normalizer) == N

  model = _model()
  callback = dpk.PrivacyCallback(N, N, delta=DELTA)
  history = model.fit(x, y, batch_size=N, epochs=2, verbose=0,
                      sampling=FullBatchSampler, sampling_seed=1,
                      callbacks=[callback])
  assert int(model.optimizer.iterations) == 2
  assert isinstance(model.dp_plan.sampler, FullBatchSampler)
  expected = dp_accounting.rdp.RdpAccountant(
      list(accounting.RDP_ORDERS)).compose(dp_accounting.SelfComposedDpEvent(
          dp_accounting.GaussianDpEvent(SIGMA), 2)).get_epsilon(DELTA)
  assert history.history["epsilon"][-1] == pytest.approx(expected,
                                                         rel=1e-12)
  # No amplification: above the Poisson figure at rate 1/2 for 2 steps.
  assert expected > accounting.compute_epsilon(N, N // 2, SIGMA, steps=2,
                                               delta=DELTA)


def test_sampler_table_protocol_and_shuffled_event():
  assert samplers.resolve("poisson") is dpd.PoissonSampler
  assert samplers.resolve("shuffled") is samplers.ShuffledSampler
  assert samplers.resolve(BallsInBinsSampler) is BallsInBinsSampler
  with pytest.raises(ValueError, match="'poisson', 'shuffled'"):
    samplers.resolve("uniform")
  with pytest.raises(ValueError, match="PoissonSampler subclass"):
    samplers.resolve(dict)
  for sampler in (dpd.PoissonSampler(N, 4, seed=0),
                  BallsInBinsSampler(N, 4, seed=0),
                  samplers.ShuffledSampler(batch_size=4)):
    assert isinstance(sampler, samplers.Sampler)
  shuffled = samplers.ShuffledSampler(batch_size=4)
  assert not shuffled.certified
  with pytest.raises(samplers.NotCertifiedError, match="shuffled"):
    shuffled.dp_event(mechanisms.IndependentGaussian(), SIGMA, 3)


def test_privacy_units_state_the_inner_event():
  """Users (and augmult) are units drawn by the inner sampler: the event is
  the inner one's, per unit, equal to the Poisson ε over U users."""
  users, b = 40, 4
  inner = dpd.PoissonSampler(users, b, seed=0)
  units = samplers.PrivacyUnits(inner, "user", examples_per_user=3)
  assert units.privacy_unit == "user" and units.certified
  assert units.num_examples == users and units.sampling_rate == b / users
  event = units.dp_event(mechanisms.IndependentGaussian(), SIGMA, 7)
  assert event == inner.dp_event(mechanisms.IndependentGaussian(), SIGMA, 7)
  assert accounting.event_epsilon(event, DELTA) == pytest.approx(
      accounting.compute_epsilon(users, b, SIGMA, steps=7, delta=DELTA),
      rel=1e-12)
  with pytest.raises(ValueError, match="privacy_unit"):
    samplers.PrivacyUnits(inner, "batch")


def test_batch_info_is_typed_on_both_sides_of_the_wire():
  mask = tf.constant([1.0, 1.0, 0.0])
  info = dpd.BatchInfo(mask, True, 2.5, row_mask=tf.ones([6]))
  wire = info.to_element()
  assert set(wire) == {dpd.MASK, dpd.STEP_END, dpd.NORMALIZER, dpd.ROW_MASK}
  np.testing.assert_array_equal(wire[dpd.STEP_END], [1.0, 1.0, 1.0])
  back = dpd.BatchInfo.from_element(wire)
  np.testing.assert_array_equal(back.mask, mask)
  assert bool(back.step_end) and float(back.normalizer) == 2.5
  assert back.weight is None and back.row_mask.shape == [6]
  # The public builder is the same conversion; a plain weight is no info.
  assert set(dpd.dp_batch_info(mask, False, 2.0)) == {
      dpd.MASK, dpd.STEP_END, dpd.NORMALIZER}
  assert dpd.BatchInfo.from_element(tf.ones([3])) is None


def test_fit_takes_a_sampler_instance():
  """An instance is the sampler fit draws from: with its seed it trains
  exactly as the class with that sampling_seed (same noise seed), another
  seed trains differently; one that does not fit the data raises."""
  x, y = _data()

  def weights(sampling, **kwargs):
    model = _model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, sampling=sampling,
              **kwargs)
    assert int(model.optimizer.iterations) == accounting.steps_for(N, 4, 1)
    return model, np.concatenate([w.ravel() for w in model.get_weights()])

  given = dpd.PoissonSampler(N, 4, seed=5)
  model, by_instance = weights(given)
  assert model.dp_plan.sampler is given
  _, by_class = weights("poisson", sampling_seed=5)
  _, other_seed = weights(dpd.PoissonSampler(N, 4, seed=6))
  np.testing.assert_array_equal(by_instance, by_class)
  assert np.abs(by_instance - other_seed).max() > 1e-6
  with pytest.raises(ValueError, match="num_examples is 17"):
    _model().fit(x, y, verbose=0, sampling=dpd.PoissonSampler(N + 1, 4))
  with pytest.raises(ValueError, match="drop sampling_seed"):
    _model().fit(x, y, verbose=0, sampling_seed=1,
                 sampling=dpd.PoissonSampler(N, 4, seed=1))
