"""Cyclic Poisson sampling (`PoissonSampler(num_groups=b, group_seed=s)`).

Every example is assigned a group once, `g_i`, by the documented PRF

    np.random.default_rng([s, int.from_bytes(b"tf_pxg/groups", "big")])
        .integers(0, b, size=N)

and global step t samples only the members of group t mod b, each
independently with probability q = B b / N. The references here are
independent of the code under test (the assignment is recomputed from that
formula, the draws from re-implemented geometric skips):

- the assignment: the sampler's groups, member lists and sizes are exactly
  the formula's (also when drawn in small chunks), whatever the sampling
  seed, `start_step` or secure mode (same group seed => same groups); the
  numpy and tf.data paths sample from exactly the same groups (each
  index of a step is in the step's group, and over 400 steps of a group at
  q ~ 0.1 both paths draw every member of it);
- why it is valid under add/remove adjacency. Positional keying under a
  secret random seed is an i.i.d. assignment: with the seed uniform and
  unknown, `g_0, g_1, ...` are (modelling the generator as a random
  function of its key) i.i.d. uniform on range(b), and `g_i` depends on
  (seed, i) only, not on N nor on which record sits at position i. So a
  data set with record j removed (the later rows shifted up) gives its
  N - 1 records the groups `g_0, ..., g_{N-2}`: again i.i.d. uniform, the
  law the full data set gives the same records. The tests check the pure
  function of (seed, position) (a prefix of the sequence for a shorter
  data set), and, over 2000 seeds, that the records left after a removal
  have uniform marginals (including a fixed record that moved down one
  position), Binomial(N - 1, 1/b) group sizes and pairwise-independent
  groups (P(same group) = 1/b), as the full data set's records do;
- the law of the sampling: never an index outside the step's group; each
  example's inclusion frequency over its group's steps is q (5 standard
  errors per example and pooled) and its count Binomial(T / b, q); the
  batch sizes of group g's steps Binomial(|G_g|, q) (mean, variance,
  chi-square); inclusions independent across the group's members and
  steps (lag-pair counts of `test_sampling_scale`); two participations of
  an example a multiple of b (>= b) steps apart, the bound attained;
- exact draws: each path equals a re-implementation in this file of "a
  Bernoulli(q) process over the positions in the group's member list by
  geometric gaps, mapped back to the members" from the same uniforms
  (NumPy's PCG64 keyed `[seed, step]`; TensorFlow's stateless Philox keyed
  by the step key); b = 1 gives exactly the draws of a sampler built
  without the argument (with or without a group seed);
- resuming: a sampler or stream started at `start_step` s0 samples group
  s0 mod b first and equals the whole stream's steps from s0 on;
- errors: no group seed for b > 1 (the message says it must be fixed for
  the run and that a DP model's fit passes it), invalid group seeds,
  b < 1, non-integers, b > floor(N / B) (naming the maximum), a stream
  without `start_step` that is not whole cycles; Beam's config too.
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

# b = 4, N = 1003: group sizes Binomial(1003, 1/4).
N, B, G = 1003, 25, 4
Q = B * G / N
GS = 20240521  # the group seed of most tests
STEPS = 1600  # 400 steps per group
SALT = int.from_bytes(b"tf_pxg/groups", "big")


def _assignment(n, b, group_seed):
  """The documented PRF, computed here."""
  return np.random.default_rng([group_seed, SALT]).integers(0, b, size=n)


REF = _assignment(N, G, GS)


def _members(g, ref=REF):
  return np.flatnonzero(ref == g)


def _sampler(**kwargs):
  kwargs.setdefault("num_groups", G)
  kwargs.setdefault("group_seed", GS)
  return dpd.PoissonSampler(N, B, **kwargs)


def _numpy_inclusions(sampler, steps, start=0):
  inc = np.zeros((steps, sampler.num_examples), bool)
  for t in range(steps):
    inc[t, sampler.indices_for_step(start + t)] = True
  return inc


@pytest.fixture(scope="module")
def numpy_inc():
  return _numpy_inclusions(_sampler(seed=21), STEPS)


@pytest.fixture(scope="module")
def tf_inc():
  return scale._tf_inclusions(_sampler(seed=22), STEPS)


# The assignment ------------------------------------------------------------


def test_assignment_is_the_documented_prf(monkeypatch):
  assert poisson.GROUP_SALT == SALT > 2 ** 64
  sampler = _sampler(seed=3)
  assert sampler.group_seed == GS and sampler.num_groups == G
  np.testing.assert_array_equal(sampler.example_groups(), REF)
  np.testing.assert_array_equal(dpd.group_assignment(N, G, GS), REF)
  sizes = np.bincount(REF, minlength=G)
  assert len(set(sizes)) > 1  # not an equal split
  for g in range(G):
    np.testing.assert_array_equal(sampler.group_members(g), _members(g))
    assert sampler.group_size(g) == sizes[g]
  assert sampler.group_index.max_size == sizes.max()
  # Drawn in chunks of one generator: the same values as one call.
  monkeypatch.setattr(poisson, "_GROUP_CHUNK", 7)
  np.testing.assert_array_equal(dpd.group_assignment(N, G, GS), REF)
  np.testing.assert_array_equal(_sampler().example_groups(), REF)
  # Other b and seeds (b = 300 > 256 takes 16-bit keys in the sort).
  for n, b, s in ((5000, 300, 1), (1000, 7, 2 ** 64 - 1), (40, 2, 0)):
    ref = _assignment(n, b, s)
    sampler = dpd.PoissonSampler(n, 1, num_groups=b, group_seed=s)
    np.testing.assert_array_equal(sampler.example_groups(), ref)
    for g in (0, b - 1):
      np.testing.assert_array_equal(sampler.group_members(g),
                                    np.flatnonzero(ref == g))


def test_same_group_seed_same_groups_across_samplers():
  """Sampling seed, start step and secure mode leave the groups alone."""
  variants = [_sampler(seed=1), _sampler(seed=2, start_step=17),
              _sampler(start_step=10 ** 6), _sampler(secure_mode=True),
              _sampler(seed=5, accumulation_steps=3, num_replicas=2,
                       physical_batch_size=40)]
  for sampler in variants:
    np.testing.assert_array_equal(sampler.example_groups(), REF)
    for s in (0, 5, 17, 10 ** 6 + 3):
      idx = sampler.indices_for_step(s)
      assert np.all(REF[idx] == s % G)
  # Another group seed: another assignment (P(equal) = 4^-1003).
  assert not np.array_equal(_sampler(group_seed=GS + 1).example_groups(),
                            REF)


def test_every_index_is_in_the_group_of_its_step():
  sampler = _sampler(seed=3, accumulation_steps=2)
  assert sampler.sampling_rate == pytest.approx(B * G / N, rel=1e-15)
  for s in (0, 1, 2, 3, 4, 5, 17, 10 ** 9 + 3):
    assert sampler.group_of_step(s) == s % G
    idx = sampler.indices_for_step(s)
    assert len(idx) > 0 and idx.dtype == np.int64
    assert np.all(REF[idx] == s % G)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < N
  # The stateful methods and the layout: every real row of a step's
  # physical batches is in the step's group.
  for s in range(8):
    batches = sampler.logical_step()
    assert batches[-1].step_end and len(batches) >= 2
    rows = np.concatenate([b.indices[b.mask == 1] for b in batches])
    assert np.all(REF[rows] == s % G)
  # tf.data stream from an offset, k = 2 physical batches per step.
  step, seen = 5, 0
  for idx, mask, end in sampling_ops.index_stream(
      sampler, start_step=5, num_steps=6).as_numpy_iterator():
    assert np.all(REF[idx[mask == 1]] == step % G)
    seen += int(mask.sum())
    step += bool(end)
  assert step == 11 and seen > 0


def test_numpy_and_tf_paths_sample_exactly_the_same_groups(numpy_inc,
                                                           tf_inc):
  # Over a group's 400 steps at q ~ 0.1 every member is drawn (a given
  # member is missed with probability 0.9^400 ~ 5e-19) and no one else:
  # the examples each path draws at group g's steps are exactly its
  # members under the seed's assignment.
  for inc in (numpy_inc, tf_inc):
    for g in range(G):
      np.testing.assert_array_equal(np.flatnonzero(inc[g::G].any(0)),
                                    _members(g))


# Add/remove adjacency: the law of the assignment ----------------------------

SEEDS = 2000
NR, BR, JR = 200, 4, 57  # data set size, groups, removed position


def test_assignment_is_a_pure_function_of_seed_and_position():
  # A shorter data set's assignment is a prefix of a longer one's: g_i
  # depends on (seed, i) only, never on N or on the records.
  for s in (0, 9, GS):
    full = dpd.group_assignment(NR, BR, s)
    for n in (1, NR - 1, 3 * NR):
      got = dpd.group_assignment(n, BR, s)
      k = min(n, NR)
      np.testing.assert_array_equal(got[:k], full[:k])
    np.testing.assert_array_equal(full, _assignment(NR, BR, s))


def _removal_groups():
  """Over SEEDS seeds: the groups of the full data set's records, and of
  the same records after record JR is removed (rows after it shift up)."""
  full = np.stack([dpd.group_assignment(NR, BR, s) for s in range(SEEDS)])
  # Record i of the full set sits at position i (i < JR) or i - 1 (i > JR)
  # of the smaller one, whose assignment is that of N - 1 positions.
  smaller = np.stack([dpd.group_assignment(NR - 1, BR, s)
                      for s in range(SEEDS)])
  kept = np.delete(np.arange(NR), JR)
  return full[:, kept], smaller


def _check_iid_uniform(groups, b):
  """`[seeds, n]` groups: i.i.d. uniform on range(b) across positions."""
  seeds, n = groups.shape
  # Marginals: per position, counts of each group over the seeds.
  counts = np.stack([np.bincount(groups[:, i], minlength=b)
                     for i in range(n)])
  p_values = stats.chisquare(counts, axis=1).pvalue
  # n tests: the smallest p-value of n uniforms is below 1e-3 / n ... rarely.
  assert p_values.min() > 1e-3 / n
  assert stats.kstest(p_values, "uniform").pvalue > 1e-3
  # Pooled marginal: each group has frequency 1 / b (5 standard errors).
  freq = np.bincount(groups.ravel(), minlength=b) / groups.size
  assert np.all(np.abs(freq - 1 / b) <
                5 * math.sqrt((1 / b) * (1 - 1 / b) / groups.size))
  # Group sizes: Binomial(n, 1/b) across seeds (mean, variance,
  # chi-square), per group.
  for g in range(b):
    sizes = (groups == g).sum(1)
    base.check_binomial_sizes(sizes, n, 1 / b)
  # Pairwise independence: P(g_i = g_k) = 1/b for pairs at lags 1, 2, 50.
  for lag in (1, 2, 50):
    same = groups[:, :-lag] == groups[:, lag:]
    se = math.sqrt((1 / b) * (1 - 1 / b) / same.size)
    # Pairs overlap along a seed's row; the lag-pair indicators are
    # pairwise uncorrelated under i.i.d. uniform groups, so se is exact.
    assert abs(same.mean() - 1 / b) < 5 * se, (lag, same.mean())


def test_removing_an_example_leaves_the_others_groups_iid_uniform():
  kept_full, smaller = _removal_groups()
  # Both are i.i.d. uniform: the full set's records (restricted to the
  # kept ones) and the same records after the removal.
  _check_iid_uniform(kept_full, BR)
  _check_iid_uniform(smaller, BR)
  # A fixed record after the removed one moves from position i to i - 1:
  # its group changes for a given seed (as for i mod b, the assignment is
  # positional) but its law over the seed does not: uniform both times,
  # and the two laws agree (two-sample chi-square).
  i = JR + 10
  before = np.bincount(kept_full[:, i - 1], minlength=BR)
  after = np.bincount(smaller[:, i - 1], minlength=BR)
  assert np.mean(kept_full[:, i - 1] != smaller[:, i - 1]) > 0.5
  assert stats.chi2_contingency(np.stack([before, after]))[1] > 1e-3
  # Pairs straddling the removal (records JR - 1 and JR + 1, now
  # neighbours): same group with probability 1/b, as in the full set.
  for groups in (kept_full, smaller):
    same = (groups[:, JR - 1] == groups[:, JR]).mean()
    assert abs(same - 1 / BR) < 5 * math.sqrt(
        (1 / BR) * (1 - 1 / BR) / SEEDS)


def test_positional_residues_fail_the_iid_check():
  """Guard: the check above rejects the positional partition i mod b."""
  residues = np.tile(np.arange(NR) % BR, (SEEDS, 1))
  with pytest.raises(AssertionError):
    _check_iid_uniform(residues, BR)


# The law of the sampling ---------------------------------------------------


def _check_cyclic_law(inc, ref=REF, b=G, q=Q):
  steps = inc.shape[0]
  step_group = np.arange(steps) % b
  eligible = step_group[:, None] == ref[None, :]
  # Only the step's group is ever sampled.
  assert not inc[~eligible].any()
  # Inclusion frequency at the group's steps: q (pooled, 5 standard
  # errors), each example's count Binomial(steps / b, q).
  per_group = steps // b
  assert steps % b == 0
  pooled = inc[eligible].mean()
  assert abs(pooled - q) < 5 * math.sqrt(q * (1 - q) / eligible.sum())
  counts = np.array([inc[ref[i]::b, i].sum() for i in range(inc.shape[1])])
  base.check_inclusion(counts, per_group, q)
  for g in range(b):
    members = np.flatnonzero(ref == g)
    sub = inc[g::b][:, members]
    base.check_binomial_sizes(sub.sum(1), len(members), q)
    scale._check_independent(sub, q)


def test_numpy_path_has_the_cyclic_law(numpy_inc):
  _check_cyclic_law(numpy_inc)


def test_tf_stream_has_the_cyclic_law(tf_inc):
  _check_cyclic_law(tf_inc)


def test_participations_are_a_multiple_of_b_steps_apart(numpy_inc, tf_inc):
  for inc in (numpy_inc, tf_inc):
    gaps = []
    for i in range(N):
      steps = np.flatnonzero(inc[:, i])
      d = np.diff(steps)
      assert np.all(d % G == 0) and np.all(d >= G)
      gaps.append(d)
    # The bound is attained: some example joins two consecutive steps of
    # its group (expected about N (T / b - 1) q^2 = 3980 such pairs).
    assert any(np.any(d == G) for d in gaps)


def test_numpy_and_tf_paths_agree_in_law(numpy_inc, tf_inc):
  # Different generators (PCG64 vs Philox) draw within the same groups:
  # compare per-group mean sizes two-sample (5 standard errors of the
  # difference), and the size distributions with a two-sample chi-square
  # over pooled bins.
  for g in range(G):
    a = numpy_inc[g::G].sum(1)
    b = tf_inc[g::G].sum(1)
    var = len(_members(g)) * Q * (1 - Q)
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


def _ref_members(n, b, s, g):
  return (np.arange(n, dtype=np.int64) if b == 1 else
          np.flatnonzero(_assignment(n, b, s) == g))


@pytest.mark.parametrize("b", [1, 3, 4])
def test_numpy_draws_equal_the_reference(b):
  n, bsz, seed, gs = 1001, 20, 8, 77
  q = bsz * b / n
  sampler = dpd.PoissonSampler(n, bsz, seed=seed, num_groups=b,
                               group_seed=gs)
  for s in range(12):
    members = _ref_members(n, b, gs, s % b)
    rng = np.random.default_rng([seed, s])
    chunk = _chunk(len(members), q)
    ref = _reference_skips(lambda r: 1.0 - rng.random(chunk),
                           len(members), q)
    np.testing.assert_array_equal(sampler.indices_for_step(s), members[ref])


@pytest.mark.parametrize("b", [1, 3, 4])
def test_tf_draws_equal_the_reference(b):
  n, bsz, seed, gs = 1001, 20, 8, 77
  q = bsz * b / n
  sampler = dpd.PoissonSampler(n, bsz, seed=seed, num_groups=b,
                               group_seed=gs)
  stream = [(i[m == 1], e) for i, m, e in sampling_ops.index_stream(
      sampler, start_step=2, num_steps=8).as_numpy_iterator()]
  assert all(e for _, e in stream) and len(stream) == 8
  largest = max(len(_ref_members(n, b, gs, g)) for g in range(b))
  for t, (got, _) in enumerate(stream):
    s = 2 + t
    members = _ref_members(n, b, gs, s % b)
    key = sampling_ops.step_key(seed, s)
    # Rounds are sized for the largest group.
    chunk = _chunk(largest, q)

    def rounds(r, key=key, chunk=chunk):
      sub = tf.random.experimental.stateless_fold_in(
          key, tf.constant(r, tf.int64), alg="philox")
      return 1.0 - tf.random.stateless_uniform(
          [chunk], sub, dtype=tf.float64, alg="philox").numpy()

    # The layout permutes rows; the sample is the set.
    np.testing.assert_array_equal(
        np.sort(got), members[_reference_skips(rounds, len(members), q)])


def test_one_group_is_bit_for_bit_plain_poisson_sampling():
  x = np.arange(N, dtype=np.int64)
  for seed in (0, 7):
    plain = dpd.PoissonSampler(N, B, seed=seed, accumulation_steps=2)
    ones = [dpd.PoissonSampler(N, B, seed=seed, accumulation_steps=2,
                               num_groups=1),
            # A group seed is accepted and changes nothing with one group.
            dpd.PoissonSampler(N, B, seed=seed, accumulation_steps=2,
                               num_groups=1, group_seed=GS)]
    for one in ones:
      assert one.sampling_rate == plain.sampling_rate == B / N
      assert one.steps_per_epoch == plain.steps_per_epoch == math.ceil(
          N / B)
      assert one.physical_batch_size == plain.physical_batch_size
      assert one.group_index is None and one.group_size(0) == N
      for s in range(30):
        np.testing.assert_array_equal(one.indices_for_step(s),
                                      plain.indices_for_step(s))
  assert plain.group_seed is None
  np.testing.assert_array_equal(plain.example_groups(), np.zeros(N))
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
  whole = _sampler(seed=4)
  first = [whole.sample_indices() for _ in range(12)]
  for s0 in (1, 6, 7):
    resumed = _sampler(seed=4, start_step=s0)
    for s in range(s0, 12):
      got = resumed.sample_indices()
      assert np.all(REF[got] == s % G)
      np.testing.assert_array_equal(got, first[s])
  # The stateful epochs continue the cycle even when an epoch is not a
  # whole number of cycles.
  odd = _sampler(seed=4, steps_per_epoch=3)
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
  sampler = _sampler(seed=4)
  full = scale._tf_inclusions(sampler, 11)
  for s0 in (3, 6):
    part = scale._tf_inclusions(_sampler(seed=4, start_step=s0), 11 - s0,
                                start_step=s0)
    np.testing.assert_array_equal(part, full[s0:])
    assert np.all(REF[np.flatnonzero(part[0])] == s0 % G)


def test_secure_mode_keeps_the_cycle_and_the_groups():
  sampler = _sampler(secure_mode=True)
  assert sampler.seed is None and sampler.group_seed == GS
  for s in (2, 7, 9):
    assert np.all(REF[sampler.indices_for_step(s)] == s % G)
  # Steps 4, 5, ...: row t is step 4 + t, of group t mod b.
  _check_cyclic_law(_numpy_inclusions(sampler, STEPS, start=4))
  seen = 0
  step = 5
  for idx, mask, end in sampling_ops.index_stream(
      sampler, start_step=5, num_steps=8).as_numpy_iterator():
    assert np.all(REF[idx[mask == 1]] == step % G)
    seen += int(mask.sum())
    step += bool(end)
  assert seen > 0 and step == 13
  assert not np.array_equal(sampler.indices_for_step(0),
                            sampler.indices_for_step(0))


# Rate, normaliser, sizes ---------------------------------------------------


def test_largest_b_takes_whole_groups_and_normaliser_is_b():
  # b = N / B: q = 1, every step is its whole group.
  sampler = dpd.PoissonSampler(100, 5, seed=1, num_groups=20, group_seed=3)
  ref = _assignment(100, 20, 3)
  assert sampler.sampling_rate == 1.0
  for s in range(25):
    np.testing.assert_array_equal(sampler.indices_for_step(s),
                                  np.flatnonzero(ref == s % 20))
  stream = list(sampling_ops.index_stream(
      sampler, start_step=7, num_steps=2).as_numpy_iterator())
  np.testing.assert_array_equal(np.sort(stream[0][0][stream[0][1] == 1]),
                                np.flatnonzero(ref == 7))
  # The noisy sum's normaliser is the data-independent B = q N / b.
  x = np.arange(N, dtype=np.float32)
  s = _sampler(seed=2)
  for _, _, info in dpd.poisson_dataset(s, x, x).take(6).as_numpy_iterator():
    np.testing.assert_allclose(info[dpd.NORMALIZER], Q * N / G, rtol=1e-6)
    np.testing.assert_allclose(info[dpd.NORMALIZER], B, rtol=0)


def test_empty_group_draws_empty_steps():
  # N = 3, b = 3: some seed leaves a group empty; its steps are empty
  # (k all-padding physical batches) on both paths.
  seed = next(s for s in range(100)
              if len(set(_assignment(3, 3, s))) < 3)
  ref = _assignment(3, 3, seed)
  empty = next(g for g in range(3) if not np.any(ref == g))
  sampler = dpd.PoissonSampler(3, 1, seed=0, num_groups=3, group_seed=seed)
  assert sampler.group_size(empty) == 0
  assert len(sampler.indices_for_step(empty)) == 0
  out = list(sampling_ops.index_stream(sampler, start_step=empty,
                                       num_steps=1).as_numpy_iterator())
  assert len(out) == 1 and out[0][1].sum() == 0 and out[0][2]


def test_default_epoch_is_whole_cycles_and_dataset_rows_in_group():
  s = _sampler(seed=2)
  # ceil(N / (B b)) cycles of b steps.
  assert s.steps_per_epoch == G * math.ceil(N / (B * G)) == 44
  x = np.arange(N, dtype=np.int64)
  ds = dpd.poisson_dataset(s, x, -x)
  step = 0
  for xs, ys, info in ds.as_numpy_iterator():
    real = info[dpd.MASK] == 1
    np.testing.assert_array_equal(ys[real], -xs[real])
    assert np.all(REF[xs[real]] == step % G)
    step += bool(info[dpd.STEP_END][0])
  assert step == 44
  # A second iteration (fresh steps) starts again at group 0: allowed
  # because an epoch is whole cycles.
  first = next(ds.as_numpy_iterator())
  assert np.all(REF[first[0][first[2][dpd.MASK] == 1]] == 0)


def test_user_level_cyclic_sampling_groups_users():
  users = np.repeat(np.arange(40), 2)  # 40 users of 2 examples
  x = np.arange(80, dtype=np.int64)
  s = dpd.PoissonSampler(40, 4, seed=1, num_groups=5, group_seed=6)
  ref = _assignment(40, 5, 6)  # over the users
  step = 0
  for xs, _, info in dpd.poisson_dataset(
      s, x, x, user_ids=users, examples_per_user=2, repeat=True).take(
          20).as_numpy_iterator():
    chosen = xs[info[dpd.ROW_MASK] == 1]
    assert np.all(ref[users[chosen]] == step % 5)
    step += bool(info[dpd.STEP_END][0])
  assert step == 20


# Errors --------------------------------------------------------------------


def test_missing_group_seed_says_where_it_comes_from():
  for kwargs in ({}, {"seed": 3}, {"secure_mode": True}):
    with pytest.raises(ValueError, match=(
        r"num_groups=4 \(cyclic Poisson sampling\) needs group_seed.*"
        r"whole training run.*resumed fit.*DP model's fit passes it.*"
        r"optimizer.*secrets\.randbits")):
      dpd.PoissonSampler(N, B, num_groups=G, **kwargs)
  with pytest.raises(ValueError, match="needs group_seed"):
    dpd.group_assignment(N, G, None)


@pytest.mark.parametrize("group_seed", [-1, 2 ** 64, 1.5, True, "3",
                                        np.float64(2)])
def test_invalid_group_seed(group_seed):
  with pytest.raises(ValueError, match=r"group_seed.*\[0, 2\^64\)"):
    dpd.PoissonSampler(N, B, num_groups=G, group_seed=group_seed)


@pytest.mark.parametrize("n, bsz", [(1003, 25), (1000, 50), (10, 2.5),
                                    (7, 7), (100, 0.5), (1000, 3.3)])
def test_max_num_groups_is_the_largest_b_with_q_at_most_one(n, bsz):
  brute = max(b for b in range(1, n + 1) if bsz * b <= n)
  assert dpd.max_num_groups(n, bsz) == brute
  assert dpd.PoissonSampler(n, bsz, num_groups=brute, group_seed=1,
                            seed=0).sampling_rate <= 1.0
  with pytest.raises(ValueError, match=f"largest num_groups is {brute} "):
    dpd.PoissonSampler(n, bsz, num_groups=brute + 1, group_seed=1)


@pytest.mark.parametrize("groups", [0, -1, 1.5, True, "2", None])
def test_invalid_num_groups(groups):
  with pytest.raises(ValueError, match="num_groups"):
    dpd.PoissonSampler(N, B, num_groups=groups, group_seed=1)


def test_too_many_groups_names_the_maximum():
  with pytest.raises(ValueError, match=(
      r"num_groups=41 .* q = B \* num_groups / N = 1\.02.* "
      r"largest num_groups is 40 \(floor\(N / B\)")):
    dpd.PoissonSampler(N, B, num_groups=41, group_seed=1)


def test_stream_without_start_step_needs_whole_cycles():
  s = _sampler(seed=1, steps_per_epoch=6)
  x = np.arange(N)
  with pytest.raises(ValueError, match="multiple of 4"):
    dpd.poisson_dataset(s, x, x)
  with pytest.raises(ValueError, match="multiple of 4"):
    sampling_ops.index_stream(s, num_steps=6)
  # Fine: endless, or keyed by the global step, or whole cycles.
  dpd.poisson_dataset(s, x, x, repeat=True)
  dpd.poisson_dataset(s, x, x, start_step=0)
  sampling_ops.index_stream(s, num_steps=8)


def test_group_accessors_check_the_group():
  s = _sampler(seed=1)
  for bad in (-1, G, 1.0, True):
    with pytest.raises(ValueError, match=r"group must be an integer in "
                       r"\[0, 4\)"):
      s.group_members(bad)
    with pytest.raises(ValueError, match="group must be"):
      s.group_size(bad)


def test_beam_config_needs_a_group_seed():
  dp_beam = pytest.importorskip("tf_pxg.data.beam")
  with pytest.raises(ValueError, match="needs group_seed"):
    dp_beam.PoissonConfig(5, num_groups=3, seed=1)
  with pytest.raises(ValueError, match="needs group_seed"):
    dp_beam.example_group(b"x" * 16, 3, None)
  assert dp_beam.PoissonConfig(5, seed=1).group_seed is None
  assert dp_beam.PoissonConfig(5, num_groups=3, group_seed=4).group_seed == 4
