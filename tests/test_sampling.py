"""`tf_pxg.data`: Poisson batches, masks, fixed shapes, overflow, splitting.

References are closed forms: Binomial(N, q) for the realised batch sizes
(mean, variance and a chi-square goodness-of-fit test over 2000 steps),
Binomial(T, q) for each example's inclusion count, and set identities for
the layout.
"""

import math

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tf_pxg import data as dpd

N, B, STEPS = 1000, 50, 2000


def _sizes_and_counts(sampler, steps):
  sizes = np.zeros(steps, np.int64)
  counts = np.zeros(sampler.num_examples, np.int64)
  for t in range(steps):
    idx = sampler.sample_indices()
    sizes[t] = len(idx)
    counts[idx] += 1
  return sizes, counts


def binomial_chi_square_p(sizes, n, q):
  """p-value of a chi-square test of `sizes` against Binomial(n, q).

  Bins between the 0.5% and 99.5% quantiles, tails pooled, adjacent bins
  merged until each expects >= 5.
  """
  steps = len(sizes)
  edges = np.arange(int(stats.binom.ppf(0.005, n, q)),
                    int(stats.binom.ppf(0.995, n, q)) + 1)
  observed = [np.sum(sizes < edges[0])]
  expected = [stats.binom.cdf(edges[0] - 1, n, q)]
  for k in edges:
    observed.append(np.sum(sizes == k))
    expected.append(stats.binom.pmf(k, n, q))
  observed.append(np.sum(sizes > edges[-1]))
  expected.append(stats.binom.sf(edges[-1], n, q))
  expected = np.array(expected) * steps
  observed = np.array(observed, float)
  obs_m, exp_m, o, e = [], [], 0.0, 0.0
  for oi, ei in zip(observed, expected):
    o, e = o + oi, e + ei
    if e >= 5:
      obs_m.append(o)
      exp_m.append(e)
      o = e = 0.0
  obs_m[-1] += o
  exp_m[-1] += e
  _, p = stats.chisquare(obs_m, np.array(exp_m) * sum(obs_m) / sum(exp_m))
  return p


def check_binomial_sizes(sizes, n, q):
  """Mean and variance within 5% of Binomial(n, q)'s (or 5 standard errors
  of the sample variance, sqrt(2 / (steps - 1)) relative, when fewer steps
  make 5% too tight), chi-square p > 1e-3."""
  mean, var = n * q, n * q * (1 - q)
  var_tol = max(0.05, 5 * math.sqrt(2 / (len(sizes) - 1)))
  assert abs(sizes.mean() / mean - 1) < 0.05, (sizes.mean(), mean)
  assert abs(sizes.var(ddof=1) / var - 1) < var_tol, (sizes.var(ddof=1), var)
  p = binomial_chi_square_p(sizes, n, q)
  assert p > 1e-3, p


def check_inclusion(counts, steps, q):
  """Each example's count over `steps` steps is Binomial(steps, q)."""
  freq = counts / steps
  sd = math.sqrt(q * (1 - q) / steps)
  assert abs(freq.mean() - q) < 4 * sd / math.sqrt(len(counts))
  # Every example: within 5 sd of q (N = 1000 tests, two-sided 5.7e-7 each).
  assert np.all(np.abs(freq - q) < 5 * sd), np.abs(freq - q).max() / sd
  # The counts' spread is Binomial(T, q)'s: within 5 standard errors of the
  # sample variance, sqrt(2 / (N - 1)) relative (0.15 was 3.4 of them at
  # N = 1000: a secure sampler, drawing from OS entropy, failed it once in
  # CI-sized runs, 0.1504).
  var_tol = max(0.15, 5 * math.sqrt(2 / (len(counts) - 1)))
  assert abs(counts.var(ddof=1) / (steps * q * (1 - q)) - 1) < var_tol


def test_realised_batch_sizes_follow_binomial():
  sampler = dpd.PoissonSampler(N, B, seed=0)
  sizes, _ = _sizes_and_counts(sampler, STEPS)
  check_binomial_sizes(sizes, N, sampler.sampling_rate)


def test_fixed_size_batches_fail_the_binomial_check():
  # The statistics above can fail: shuffled fixed batches have variance 0.
  sizes = np.full(STEPS, B)
  q = B / N
  assert abs(sizes.var() / (N * q * (1 - q)) - 1) > 0.05


def test_each_example_included_with_probability_q():
  sampler = dpd.PoissonSampler(N, B, seed=1)
  _, counts = _sizes_and_counts(sampler, STEPS)
  check_inclusion(counts, STEPS, sampler.sampling_rate)


def test_unseeded_samplers_differ_and_seeded_repeat():
  a, b = dpd.PoissonSampler(N, B), dpd.PoissonSampler(N, B)
  assert not np.array_equal(a.sample_indices(), b.sample_indices())
  c, d = dpd.PoissonSampler(N, B, seed=5), dpd.PoissonSampler(N, B, seed=5)
  np.testing.assert_array_equal(c.sample_indices(), d.sample_indices())


@pytest.mark.parametrize("k, replicas", [(1, 1), (4, 1), (2, 2), (3, 4)])
def test_layout_fixed_shapes_masks_and_balanced_replicas(k, replicas):
  sampler = dpd.PoissonSampler(N, B, accumulation_steps=k,
                               num_replicas=replicas, seed=2)
  p = sampler.physical_batch_size
  assert p == dpd.default_physical_batch_size(B, k, replicas)
  assert p % replicas == 0 and p * k >= B + 4 * math.sqrt(B)
  rows = p // replicas
  for _ in range(50):
    idx = sampler.sample_indices()
    batches = sampler.layout(idx)
    assert len(batches) == k  # no overflow at these sizes with this seed
    assert [b.step_end for b in batches] == [False] * (k - 1) + [True]
    got = []
    for b in batches:
      assert b.indices.shape == (p,) and b.mask.shape == (p,)
      assert set(np.unique(b.mask)) <= {0.0, 1.0}
      np.testing.assert_array_equal(b.indices[b.mask == 0], 0)
      got.extend(b.indices[b.mask == 1].tolist())
      per_replica = b.mask.reshape(replicas, rows).sum(1)
      assert per_replica.max() - per_replica.min() <= 1
    assert sorted(got) == sorted(idx.tolist())


def test_overflow_is_carried_into_extra_physical_batches():
  sampler = dpd.PoissonSampler(100, 60, physical_batch_size=8,
                               accumulation_steps=2, seed=3)
  for _ in range(20):
    idx = sampler.sample_indices()
    batches = sampler.layout(idx)
    assert len(batches) == max(2, math.ceil(len(idx) / 8)) > 2
    assert [b.step_end for b in batches][-1] and not any(
        b.step_end for b in batches[:-1])
    got = np.concatenate([b.indices[b.mask == 1] for b in batches])
    assert sorted(got.tolist()) == sorted(idx.tolist())  # nothing dropped


def test_empty_draw_gives_k_all_padding_batches():
  sampler = dpd.PoissonSampler(10, 1, accumulation_steps=3, seed=0)
  batches = sampler.layout(np.zeros(0, np.int64))
  assert len(batches) == 3 and all(b.mask.sum() == 0 for b in batches)
  assert batches[-1].step_end


def test_dataset_elements_gather_rows_with_static_shapes():
  rng = np.random.RandomState(0)
  x = {"a": rng.randn(40, 3).astype("float32"),
       "b": np.arange(40, dtype="int32")}
  y = rng.randint(0, 5, 40)
  w = rng.rand(40).astype("float32")
  sampler = dpd.PoissonSampler(40, 8, accumulation_steps=2, seed=4,
                               steps_per_epoch=3)
  ds = dpd.poisson_dataset(sampler, x, y, sample_weight=w)
  p = sampler.physical_batch_size
  assert ds.element_spec[0]["a"].shape == (p, 3)
  assert ds.element_spec[2][dpd.MASK].shape == (p,)
  elements = list(ds.as_numpy_iterator())
  ends = [e[2][dpd.STEP_END][0] for e in elements]
  assert sum(ends) == 3 and ends[-1] == 1
  for xb, yb, info in elements:
    idx = xb["b"]  # the example index itself
    np.testing.assert_array_equal(xb["a"], x["a"][idx])
    np.testing.assert_array_equal(yb, y[idx])
    np.testing.assert_array_equal(info[dpd.WEIGHT], w[idx])
    np.testing.assert_array_equal(info[dpd.NORMALIZER], np.full(p, 8.0))
    assert len(set(info[dpd.STEP_END])) == 1
  # Re-iterating draws fresh steps.
  again = [e[0]["b"] for e in ds.as_numpy_iterator()]
  assert any(not np.array_equal(a, e[0]["b"])
             for a, e in zip(again, elements))


def test_shard_batch_slices_replica_rows():
  batch = (tf.reshape(tf.range(12), [6, 2]), {"m": tf.range(6)})
  got = dpd.shard_batch(batch, 3, 1)
  np.testing.assert_array_equal(got[0].numpy(), [[4, 5], [6, 7]])
  np.testing.assert_array_equal(got[1]["m"].numpy(), [2, 3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_examples=10, expected_batch_size=11), "q = B / N"),
    (dict(num_examples=10, expected_batch_size=0), "expected_batch_size"),
    (dict(num_examples=0, expected_batch_size=1), "num_examples"),
    (dict(num_examples=10, expected_batch_size=2, num_replicas=2,
          physical_batch_size=5), "multiple of num_replicas"),
    (dict(num_examples=10, expected_batch_size=2, accumulation_steps=0),
     "accumulation_steps"),
])
def test_invalid_sampler_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dpd.PoissonSampler(**kwargs)


def test_dataset_size_mismatch_rejected():
  sampler = dpd.PoissonSampler(10, 2)
  with pytest.raises(ValueError, match="same number of examples"):
    dpd.poisson_dataset(sampler, np.zeros((10, 2)), np.zeros(9))
  with pytest.raises(ValueError, match="sampler is for 10"):
    dpd.poisson_dataset(sampler, np.zeros((11, 2)), np.zeros(11))
