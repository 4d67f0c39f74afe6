"""Cyclic Poisson sampling (`PoissonSampler(num_groups=b)`, for BandMF).

Example i is in group i mod b; global step s samples only group s mod b,
each of its examples independently with probability q = B b / N. The
references are independent of the code under test:

- the law: for every step, its indices are = s (mod b); over the steps of
  its group each example's inclusion count is Binomial(T / b, q) (5
  standard errors per example, the pooled mean and variance as in
  `test_sampling.check_inclusion`), and it is never included at another
  step; the batch sizes of group g's steps are Binomial(|G_g|, q) with
  |G_g| = len(range(g, N, b)) (mean, variance, chi-square); inclusions are
  independent across the group's examples and steps (lag-pair counts of
  `test_sampling_scale`); an example's participations are a multiple of b
  (>= b) steps apart;
- exact draws: each path equals a re-implementation in this file of "a
  Bernoulli(q) process over the group's positions by geometric gaps, mapped
  back to g + b k" from the same uniforms (NumPy's PCG64 keyed
  `[seed, step]`; TensorFlow's stateless Philox keyed by the step key);
  b = 1 gives exactly the draws of a sampler built without the argument
  (and the pre-cyclic algorithm, which the re-implementation is at b = 1);
- resuming: a stream started at `start_step` s0 samples group s0 mod b
  first and equals the whole stream's steps from s0 on;
- the numpy and tf.data paths use different generators (PCG64 and Philox,
  as for plain Poisson sampling), so they agree in law, each against the
  closed forms above and against each other (per-group mean sizes);
- errors: b < 1, non-integers, b > floor(N / B) (naming the maximum).
"""

import math

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tf_pxg import data as dpd
from tf_pxg.data import poisson
from tf_pxg.data import sampling_ops

import test_sampling as base
import test_sampling_scale as scale

# b = 4 does not divide N: groups of 251, 251, 251 and 250 examples.
N, B, G = 1003, 25, 4
Q = B * G / N
STEPS = 1600  # 400 steps per group


def _group(g, n=N, b=G):
  """Group g's examples, counted directly."""
  return np.arange(g, n, b)


def _numpy_inclusions(sampler, steps, start=0):
  inc = np.zeros((steps, sampler.num_examples), bool)
  for t in range(steps):
    inc[t, sampler.indices_for_step(start + t)] = True
  return inc


@pytest.fixture(scope="module")
def numpy_inc():
  return _numpy_inclusions(dpd.PoissonSampler(N, B, seed=21, num_groups=G),
                           STEPS)


@pytest.fixture(scope="module")
def tf_inc():
  return scale._tf_inclusions(
      dpd.PoissonSampler(N, B, seed=22, num_groups=G), STEPS)


def _check_cyclic_law(inc, n=N, b=G, q=Q):
  steps = inc.shape[0]
  step_group = np.arange(steps) % b
  example_group = np.arange(n) % b
  # Only the step's group is ever sampled.
  eligible = step_group[:, None] == example_group[None, :]
  assert not inc[~eligible].any()
  # Each example over its group's steps: Binomial(steps / b, q).
  per_group = steps // b
  counts = np.array([inc[i % b::b, i].sum() for i in range(n)])
  base.check_inclusion(counts, per_group, q)
  for g in range(b):
    sub = inc[g::b][:, _group(g, n, b)]
    base.check_binomial_sizes(sub.sum(1), len(_group(g, n, b)), q)
    scale._check_independent(sub, q)


def test_numpy_path_has_the_cyclic_law(numpy_inc):
  _check_cyclic_law(numpy_inc)


def test_tf_stream_has_the_cyclic_law(tf_inc):
  _check_cyclic_law(tf_inc)


def test_every_index_is_in_the_group_of_its_step():
  sampler = dpd.PoissonSampler(N, B, seed=3, num_groups=G,
                               accumulation_steps=2)
  assert sampler.num_groups == G
  assert sampler.sampling_rate == pytest.approx(B * G / N, rel=1e-15)
  for s in (0, 1, 2, 3, 4, 5, 17, 10 ** 9 + 3):
    assert sampler.group_of_step(s) == s % G
    idx = sampler.indices_for_step(s)
    assert len(idx) > 0 and np.all(idx % G == s % G)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < N
  for g in range(G):
    assert sampler.group_size(g) == len(_group(g))
  # The stateful methods and the layout: every real row of a step's
  # physical batches is in the step's group.
  for s in range(8):
    batches = sampler.logical_step()
    assert batches[-1].step_end and len(batches) >= 2
    rows = np.concatenate([b.indices[b.mask == 1] for b in batches])
    assert np.all(rows % G == s % G)
  # tf.data stream from an offset, k = 2 physical batches per step.
  step, seen = 5, 0
  for idx, mask, end in sampling_ops.index_stream(
      sampler, start_step=5, num_steps=6).as_numpy_iterator():
    assert np.all(idx[mask == 1] % G == step % G)
    seen += int(mask.sum())
    step += bool(end)
  assert step == 11 and seen > 0


def test_participations_are_a_multiple_of_b_steps_apart(numpy_inc, tf_inc):
  for inc in (numpy_inc, tf_inc):
    gaps = []
    for i in range(N):
      steps = np.flatnonzero(inc[:, i])
      d = np.diff(steps)
      assert np.all(d % G == 0) and np.all(d >= G)
      gaps.append(d)
    # The bound is attained: some example joins two consecutive steps of
    # its group (expected about N (T / b - 1) q^2 = 3980 such pairs; how
    # many is the lag-1 pair count checked in the law tests).
    assert any(np.any(d == G) for d in gaps)


def test_numpy_and_tf_paths_agree_in_law(numpy_inc, tf_inc):
  # Different generators (PCG64 vs Philox): compare per-group mean sizes
  # two-sample (5 standard errors of the difference), and the size
  # distributions with a two-sample chi-square over pooled bins.
  for g in range(G):
    a = numpy_inc[g::G].sum(1)
    b = tf_inc[g::G].sum(1)
    var = len(_group(g)) * Q * (1 - Q)
    assert abs(a.mean() - b.mean()) < 5 * math.sqrt(2 * var / len(a))
  a, b = numpy_inc.sum(1), tf_inc.sum(1)
  edges = np.quantile(np.concatenate([a, b]), np.linspace(0, 1, 9)[1:-1])
  table = np.array([np.bincount(np.searchsorted(edges, x, side="right"),
                                minlength=len(edges) + 1) for x in (a, b)])
  table = table[:, table.sum(0) > 0]
  assert stats.chi2_contingency(table)[1] > 1e-3


# Exact draws against re-implementations ------------------------------------


def _reference_skips(uniform_rounds, size, q):
  """A Bernoulli(q) sample of range(size) from gap uniforms on (0, 1].

  `uniform_rounds(r)` gives round r's uniforms; gap G = floor(log U /
  log(1 - q)) >= 0 failures before the next success.
  """
  out, pos, r = [], -1, 0
  while True:
    for u in uniform_rounds(r):
      pos += int(min(math.floor(math.log(u) / math.log1p(-q)), size)) + 1
      if pos >= size:
        return np.array(out, np.int64)
      out.append(pos)
    r += 1


def _chunk(size, q):
  mean = size * q
  return int(min(size + 1, math.ceil(mean + 6 * math.sqrt(mean) + 16)))


@pytest.mark.parametrize("b", [1, 3, 4])
def test_numpy_draws_equal_the_reference(b):
  n, bsz, seed = 1001, 20, 8
  q = bsz * b / n
  sampler = dpd.PoissonSampler(n, bsz, seed=seed, num_groups=b)
  for s in range(12):
    g = s % b
    size = len(_group(g, n, b))
    rng = np.random.default_rng([seed, s])
    chunk = _chunk(size, q)
    ref = _reference_skips(lambda r: 1.0 - rng.random(chunk), size, q)
    np.testing.assert_array_equal(sampler.indices_for_step(s), g + b * ref)


@pytest.mark.parametrize("b", [1, 3, 4])
def test_tf_draws_equal_the_reference(b):
  n, bsz, seed = 1001, 20, 8
  q = bsz * b / n
  sampler = dpd.PoissonSampler(n, bsz, seed=seed, num_groups=b)
  stream = [(i[m == 1], e) for i, m, e in sampling_ops.index_stream(
      sampler, start_step=2, num_steps=8).as_numpy_iterator()]
  assert all(e for _, e in stream) and len(stream) == 8
  for t, (got, _) in enumerate(stream):
    s = 2 + t
    g = s % b
    size = len(_group(g, n, b))
    key = sampling_ops.step_key(seed, s)
    # Rounds are sized for the largest group, ceil(N / b).
    chunk = _chunk(-(-n // b), q)

    def rounds(r, key=key, chunk=chunk):
      sub = tf.random.experimental.stateless_fold_in(
          key, tf.constant(r, tf.int64), alg="philox")
      return 1.0 - tf.random.stateless_uniform(
          [chunk], sub, dtype=tf.float64, alg="philox").numpy()

    # The layout permutes rows; the sample is the set.
    np.testing.assert_array_equal(np.sort(got),
                                  g + b * _reference_skips(rounds, size, q))


def test_one_group_is_bit_for_bit_plain_poisson_sampling():
  x = np.arange(N, dtype=np.int64)
  for seed in (0, 7):
    plain = dpd.PoissonSampler(N, B, seed=seed, accumulation_steps=2)
    one = dpd.PoissonSampler(N, B, seed=seed, accumulation_steps=2,
                             num_groups=1)
    assert one.sampling_rate == plain.sampling_rate == B / N
    assert one.steps_per_epoch == plain.steps_per_epoch == math.ceil(N / B)
    assert one.physical_batch_size == plain.physical_batch_size
    for s in range(30):
      np.testing.assert_array_equal(one.indices_for_step(s),
                                    plain.indices_for_step(s))
  # The tf.data stream, keyed by step and by per-iteration nonce.
  plain = dpd.PoissonSampler(N, B, seed=7, accumulation_steps=2,
                             steps_per_epoch=4)
  one = dpd.PoissonSampler(N, B, seed=7, accumulation_steps=2,
                           steps_per_epoch=4, num_groups=1)
  for start in (None, 3):
    a = list(sampling_ops.index_stream(plain, start_step=start,
                                       num_steps=4).as_numpy_iterator())
    b = list(sampling_ops.index_stream(one, start_step=start,
                                       num_steps=4).as_numpy_iterator())
    assert len(a) == len(b) >= 8
    for u, v in zip(a, b):
      for p, r in zip(u, v):
        np.testing.assert_array_equal(p, r)
  a = list(dpd.poisson_dataset(plain, x, x).as_numpy_iterator())
  b = list(dpd.poisson_dataset(one, x, x).as_numpy_iterator())
  assert len(a) == len(b) >= 8
  for u, v in zip(a, b):
    np.testing.assert_array_equal(u[0], v[0])
    np.testing.assert_array_equal(u[2][dpd.MASK], v[2][dpd.MASK])


# Resuming -----------------------------------------------------------------


def test_start_step_continues_the_cycle():
  whole = dpd.PoissonSampler(N, B, seed=4, num_groups=G)
  first = [whole.sample_indices() for _ in range(12)]
  for s0 in (1, 6, 7):
    resumed = dpd.PoissonSampler(N, B, seed=4, num_groups=G, start_step=s0)
    for s in range(s0, 12):
      got = resumed.sample_indices()
      assert np.all(got % G == s % G)
      np.testing.assert_array_equal(got, first[s])
  # The stateful epochs continue the cycle even when an epoch is not a
  # whole number of cycles.
  odd = dpd.PoissonSampler(N, B, seed=4, num_groups=G, steps_per_epoch=3)
  rows = []
  for _ in range(3):
    step = []
    for batch in odd.epoch():
      step.append(batch.indices[batch.mask == 1])
      if batch.step_end:
        rows.append(np.concatenate(step))
        step = []
  for s, r in enumerate(rows):
    np.testing.assert_array_equal(np.sort(r), first[s])
  # tf.data: a stream started at s0 is the whole stream's steps from s0.
  sampler = dpd.PoissonSampler(N, B, seed=4, num_groups=G)
  full = scale._tf_inclusions(sampler, 11)
  for s0 in (3, 6):
    part = scale._tf_inclusions(sampler, 11 - s0, start_step=s0)
    np.testing.assert_array_equal(part, full[s0:])
    assert np.all(np.flatnonzero(part[0]) % G == s0 % G)


def test_secure_mode_keeps_the_cycle():
  sampler = dpd.PoissonSampler(N, B, secure_mode=True, num_groups=G)
  for s in (2, 7, 9):
    assert np.all(sampler.indices_for_step(s) % G == s % G)
  # Steps 4, 5, ...: row t is step 4 + t, of group t mod b.
  _check_cyclic_law(_numpy_inclusions(sampler, STEPS, start=4))
  seen = 0
  step = 5
  for idx, mask, end in sampling_ops.index_stream(
      sampler, start_step=5, num_steps=8).as_numpy_iterator():
    assert np.all(idx[mask == 1] % G == step % G)
    seen += int(mask.sum())
    step += bool(end)
  assert seen > 0 and step == 13
  assert not np.array_equal(sampler.indices_for_step(0),
                            sampler.indices_for_step(0))


# Rate, normaliser, sizes ---------------------------------------------------


def test_largest_b_takes_whole_groups_and_normaliser_is_b():
  # b = N / B: q = 1, every step is its whole group.
  sampler = dpd.PoissonSampler(100, 5, seed=1, num_groups=20)
  assert sampler.sampling_rate == 1.0
  for s in range(25):
    np.testing.assert_array_equal(sampler.indices_for_step(s),
                                  _group(s % 20, 100, 20))
  stream = list(sampling_ops.index_stream(
      sampler, start_step=7, num_steps=2).as_numpy_iterator())
  np.testing.assert_array_equal(np.sort(stream[0][0][stream[0][1] == 1]),
                                _group(7, 100, 20))
  # The noisy sum's normaliser is the data-independent B = q N / b.
  x = np.arange(N, dtype=np.float32)
  s = dpd.PoissonSampler(N, B, seed=2, num_groups=G)
  for _, _, info in dpd.poisson_dataset(s, x, x).take(6).as_numpy_iterator():
    np.testing.assert_allclose(info[dpd.NORMALIZER], Q * N / G, rtol=1e-6)
    np.testing.assert_allclose(info[dpd.NORMALIZER], B, rtol=0)


def test_default_epoch_is_whole_cycles_and_dataset_rows_in_group():
  s = dpd.PoissonSampler(N, B, seed=2, num_groups=G)
  # ceil(N / (B b)) cycles of b steps.
  assert s.steps_per_epoch == G * math.ceil(N / (B * G)) == 44
  x = np.arange(N, dtype=np.int64)
  ds = dpd.poisson_dataset(s, x, -x)
  step, steps = 0, []
  for xs, ys, info in ds.as_numpy_iterator():
    real = info[dpd.MASK] == 1
    np.testing.assert_array_equal(ys[real], -xs[real])
    assert np.all(xs[real] % G == step % G)
    step += bool(info[dpd.STEP_END][0])
  assert step == 44
  # A second iteration (fresh steps) starts again at group 0: allowed
  # because an epoch is whole cycles.
  first = next(ds.as_numpy_iterator())
  assert np.all(first[0][first[2][dpd.MASK] == 1] % G == 0)


def test_user_level_cyclic_sampling_groups_users():
  users = np.repeat(np.arange(40), 2)  # 40 users of 2 examples
  x = np.arange(80, dtype=np.int64)
  s = dpd.PoissonSampler(40, 4, seed=1, num_groups=5)
  step = 0
  for xs, _, info in dpd.poisson_dataset(
      s, x, x, user_ids=users, examples_per_user=2, repeat=True).take(
          20).as_numpy_iterator():
    chosen = xs[info[dpd.ROW_MASK] == 1]
    assert np.all(users[chosen] % 5 == step % 5)
    step += bool(info[dpd.STEP_END][0])
  assert step == 20


@pytest.mark.parametrize("n, bsz", [(1003, 25), (1000, 50), (10, 2.5),
                                    (7, 7), (100, 0.5), (1000, 3.3)])
def test_max_num_groups_is_the_largest_b_with_q_at_most_one(n, bsz):
  brute = max(b for b in range(1, n + 1) if bsz * b <= n)
  assert dpd.max_num_groups(n, bsz) == brute
  assert dpd.PoissonSampler(n, bsz, num_groups=brute,
                            seed=0).sampling_rate <= 1.0
  with pytest.raises(ValueError, match=f"largest num_groups is {brute} "):
    dpd.PoissonSampler(n, bsz, num_groups=brute + 1)


@pytest.mark.parametrize("groups", [0, -1, 1.5, True, "2", None])
def test_invalid_num_groups(groups):
  with pytest.raises(ValueError, match="num_groups"):
    dpd.PoissonSampler(N, B, num_groups=groups)


def test_too_many_groups_names_the_maximum():
  with pytest.raises(ValueError, match=(
      r"num_groups=41 .* q = B \* num_groups / N = 1\.02.* "
      r"largest num_groups is 40 \(floor\(N / B\)")):
    dpd.PoissonSampler(N, B, num_groups=41)


def test_stream_without_start_step_needs_whole_cycles():
  s = dpd.PoissonSampler(N, B, seed=1, num_groups=G, steps_per_epoch=6)
  x = np.arange(N)
  with pytest.raises(ValueError, match="multiple of 4"):
    dpd.poisson_dataset(s, x, x)
  with pytest.raises(ValueError, match="multiple of 4"):
    sampling_ops.index_stream(s, num_steps=6)
  # Fine: endless, or keyed by the global step, or whole cycles.
  dpd.poisson_dataset(s, x, x, repeat=True)
  dpd.poisson_dataset(s, x, x, start_step=0)
  sampling_ops.index_stream(s, num_steps=8)


def test_group_step_indices_with_one_group_is_step_indices():
  key = tf.constant([3, 4], tf.int64)
  np.testing.assert_array_equal(
      sampling_ops.group_step_indices(key, tf.constant(5), N, 1, B / N),
      sampling_ops.step_indices(key, N, B / N))
  with pytest.raises(ValueError, match="max_examples"):
    sampling_ops.step_indices(key, tf.constant(10, tf.int64), 0.1)
  # The poisson module's helpers agree with direct counts.
  for g in range(G):
    assert poisson.group_size(N, G, g) == len(_group(g))
