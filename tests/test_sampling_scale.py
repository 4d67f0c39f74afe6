"""O(B) Poisson sampling (geometric skips): same law, independence, cost.

References are closed forms: Binomial(N, q) for batch sizes and
Binomial(T, q) for inclusion counts (the checks of `test_sampling.py`),
and, for independence of the inclusions I[t, i] across steps and across
examples, the count of included pairs at a lag d in a Bernoulli(q)
sequence of length L: mean (L - d) q^2 and variance
(L - d)(q^2 - q^4) + 2 (L - 2d)(q^3 - q^4) (overlapping pairs share one
indicator). Each is checked within 5 standard deviations (two-sided
5.7e-7); a shuffled-epoch sampler fails the same check (negative control).
Secure mode: no seed, OS randomness at every step.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import data as dpd
from tf_pxg.data import poisson
from tf_pxg.data import sampling_ops

import test_sampling as base

N, B, STEPS = 1000, 50, 2000
Q = B / N


def _numpy_inclusions(sampler, steps):
  inc = np.zeros((steps, sampler.num_examples), bool)
  for t in range(steps):
    inc[t, sampler.sample_indices()] = True
  return inc


def _tf_inclusions(sampler, steps, start_step=0):
  """Inclusion matrix of `steps` steps of the tf.data index stream."""
  inc = np.zeros((steps, sampler.num_examples), bool)
  t = 0
  for idx, mask, end in sampling_ops.index_stream(
      sampler, start_step=start_step, num_steps=steps).as_numpy_iterator():
    inc[t, idx[mask == 1]] = True
    t += bool(end)
  assert t == steps
  return inc


def _lag_pair_z(inc, axis, lag, q):
  """z-score of the count of included pairs `lag` apart along `axis`."""
  a = np.moveaxis(inc, axis, -1).astype(np.int64)
  rows, length = a.shape
  count = float(np.sum(a[:, :-lag] * a[:, lag:]))
  mean = rows * (length - lag) * q * q
  var = rows * ((length - lag) * (q ** 2 - q ** 4) +
                2 * max(length - 2 * lag, 0) * (q ** 3 - q ** 4))
  return (count - mean) / math.sqrt(var)


def _check_independent(inc, q):
  zs = {("steps", 1): _lag_pair_z(inc, 0, 1, q),
        ("steps", 7): _lag_pair_z(inc, 0, 7, q)}
  for lag in (1, 2, 3, 50):
    zs[("examples", lag)] = _lag_pair_z(inc, 1, lag, q)
  assert all(abs(z) < 5 for z in zs.values()), zs


def _check_law(inc, q):
  base.check_binomial_sizes(inc.sum(1), inc.shape[1], q)
  base.check_inclusion(inc.sum(0), inc.shape[0], q)


@pytest.fixture(scope="module")
def numpy_inc():
  return _numpy_inclusions(dpd.PoissonSampler(N, B, seed=11), STEPS)


@pytest.fixture(scope="module")
def tf_inc():
  # k = 2 physical batches per step, so steps are re-assembled from masks.
  return _tf_inclusions(
      dpd.PoissonSampler(N, B, accumulation_steps=2, seed=12), STEPS)


def test_numpy_sampler_law(numpy_inc):
  _check_law(numpy_inc, Q)


def test_numpy_sampler_independent_across_examples_and_steps(numpy_inc):
  _check_independent(numpy_inc, Q)


def test_tf_stream_law(tf_inc):
  _check_law(tf_inc, Q)


def test_tf_stream_independent_across_examples_and_steps(tf_inc):
  _check_independent(tf_inc, Q)


def test_independence_check_fails_for_shuffled_epochs():
  # Shuffle once per epoch, cut fixed batches of B: an example is never in
  # two steps of one epoch, so the step-lag pair count is far too small.
  rng = np.random.default_rng(0)
  inc = np.zeros((STEPS, N), bool)
  per_epoch = N // B
  for e in range(STEPS // per_epoch):
    perm = rng.permutation(N)
    for s in range(per_epoch):
      inc[e * per_epoch + s, perm[s * B:(s + 1) * B]] = True
  with pytest.raises(AssertionError):
    _check_independent(inc, Q)


@pytest.mark.parametrize("n", [10 ** 5, 10 ** 7, 10 ** 9])
def test_work_per_step_is_o_of_b(n):
  # Uniforms drawn per step: one round of Nq + 6 sqrt(Nq) + 16 gaps,
  # whatever N (the N-uniform sampler drew N).
  b, drawn = 1024, []

  def counting(size):
    drawn.append(size)
    return 1.0 - rng.random(size)

  rng = np.random.default_rng(0)
  sizes = []
  for _ in range(50):
    drawn.clear()
    sizes.append(len(poisson.geometric_skip_indices(counting, n, b / n)))
    assert sum(drawn) <= 2 * poisson.gap_chunk_size(n, b / n) < 2.5 * b
  assert abs(np.mean(sizes) / b - 1) < 5 / math.sqrt(50 * b)


def test_large_n_indices_valid_and_rate_right():
  sampler = dpd.PoissonSampler(10 ** 9, 1024, seed=3)
  sizes = []
  for _ in range(200):
    idx = sampler.sample_indices()
    assert np.all(np.diff(idx) > 0) and idx[0] >= 0 and idx[-1] < 10 ** 9
    sizes.append(len(idx))
  # Binomial(1e9, 1.024e-6): mean 1024, sd 32; the mean of 200 within 5 se.
  assert abs(np.mean(sizes) - 1024) < 5 * 32 / math.sqrt(200)
  tf_idx = sampling_ops.step_indices(sampling_ops.step_key(3, 0), 10 ** 9,
                                     1024 / 10 ** 9).numpy()
  assert np.all(np.diff(tf_idx) > 0) and tf_idx[-1] < 10 ** 9
  assert abs(len(tf_idx) - 1024) < 6 * 32


def test_q_one_takes_everything():
  assert len(dpd.PoissonSampler(7, 7, seed=0).sample_indices()) == 7
  np.testing.assert_array_equal(
      sampling_ops.step_indices(tf.constant([1, 2], tf.int64), 7, 1.0), range(7))


def test_seeded_stream_is_a_function_of_seed_and_step():
  a = dpd.PoissonSampler(N, B, seed=5)
  first = [a.sample_indices() for _ in range(4)]
  resumed = dpd.PoissonSampler(N, B, seed=5, start_step=2)
  np.testing.assert_array_equal(resumed.sample_indices(), first[2])
  np.testing.assert_array_equal(a.indices_for_step(1), first[1])
  other = dpd.PoissonSampler(N, B, seed=6)
  assert not np.array_equal(other.sample_indices(), first[0])
  # The tf.data stream: starting at step 2 continues the stream from 0.
  s = dpd.PoissonSampler(N, B, seed=5)
  whole = _tf_inclusions(s, 5)
  np.testing.assert_array_equal(_tf_inclusions(s, 3, start_step=2), whole[2:])
  assert not np.array_equal(whole[0], whole[2])


def test_public_dataset_reiteration_draws_fresh_steps_reproducibly():
  x = np.arange(N, dtype=np.int64)
  mk = lambda: dpd.poisson_dataset(  # noqa: E731
      dpd.PoissonSampler(N, B, seed=9, steps_per_epoch=3), x, x)
  ds = mk()
  first = [e[0] for e in ds.as_numpy_iterator()]
  second = [e[0] for e in ds.as_numpy_iterator()]
  assert not any(np.array_equal(a, b) for a, b in zip(first, second))
  again = [e[0] for e in mk().as_numpy_iterator()]
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)


# Secure mode ------------------------------------------------------------------


def test_secure_mode_with_a_seed_raises():
  with pytest.raises(ValueError, match="secure_mode=True"):
    dpd.PoissonSampler(N, B, seed=1, secure_mode=True)


def test_secure_numpy_sampler_never_repeats_and_has_the_law():
  a = dpd.PoissonSampler(N, B, secure_mode=True)
  b = dpd.PoissonSampler(N, B, secure_mode=True)
  assert a.seed is None
  # The same step index twice gives fresh draws: nothing is expanded from
  # a seed.
  assert not np.array_equal(a.indices_for_step(0), a.indices_for_step(0))
  seen = {tuple(s.sample_indices()) for s in (a, b) for _ in range(50)}
  assert len(seen) == 100
  _check_law(_numpy_inclusions(a, STEPS), Q)


def test_secure_tf_stream_never_repeats_and_has_the_law():
  sampler = dpd.PoissonSampler(N, B, secure_mode=True)
  one = _tf_inclusions(sampler, 50)
  two = _tf_inclusions(sampler, 50)  # same start_step: fresh keys anyway
  rows = {r.tobytes() for r in np.concatenate([one, two])}
  assert len(rows) == 100
  inc = _tf_inclusions(sampler, STEPS)
  _check_law(inc, Q)
  _check_independent(inc, Q)


def test_urandom_keys_are_fresh_and_not_constant():
  keys = np.stack(list(sampling_ops.urandom_keys().take(64)
                       .as_numpy_iterator()))
  assert keys.shape == (64, 2) and len({tuple(k) for k in keys}) == 64
  # Byte values look uniform: mean of the 1024 key bytes near 127.5
  # (sd of the mean ~2.3).
  raw = keys.view(np.uint8)
  assert abs(raw.mean() - 127.5) < 12
