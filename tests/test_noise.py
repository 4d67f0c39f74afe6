"""Tests for tf_pxg.dp.noise: distribution, seeding, replicas, XLA."""

import math

import numpy as np
import pytest
import tensorflow as tf

from _normality import KS_CRITICAL, N, ks_statistic as _ks_statistic
from tf_pxg import dp


def _noise(grads, noisy):
  return tf.concat([tf.reshape(tf.cast(b - a, tf.float64), [-1])
                    for a, b in zip(grads, noisy) if a is not None], 0)


def _grads():
  # Non-zero gradients of several shapes, 100_000 entries in all.
  return [tf.fill([200, 300], 3.0), None, tf.fill([40_000], -1.0)]


SOURCES = {
    "generator": lambda: dict(generator=dp.make_generator(seed=7)),
    "seed": lambda: dict(seed=tf.constant([11, 12], tf.int64)),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_noise_is_normal_with_stddev(source):
  stddev = 0.7
  grads = _grads()
  noisy = dp.add_gaussian_noise(grads, stddev, **SOURCES[source]())
  noise = _noise(grads, noisy)
  assert int(tf.size(noise)) == N
  assert _ks_statistic(noise, stddev) < KS_CRITICAL
  assert float(np.std(noise)) == pytest.approx(stddev, rel=0.02)
  assert abs(float(tf.reduce_mean(noise))) < 5 * stddev / math.sqrt(N)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_box_muller_pairs_are_independent_normals(dtype):
  # Odd size: the last pair's sine half is dropped. The cosine and sine
  # halves come from the same uniforms; they must still be uncorrelated,
  # and their squared radii chi-square(2): E[z1^2 + z2^2] = 2.
  z = dp.box_muller_normal(dp.make_generator(seed=9), [N + 1], dtype)
  assert z.shape == [N + 1] and z.dtype == dtype
  assert _ks_statistic(z, 1.0) < KS_CRITICAL
  half = (N + 2) // 2
  cos_half, sin_half = z[:half - 1], z[half:]
  corr = np.corrcoef(cos_half.numpy(), sin_half.numpy())[0, 1]
  assert abs(corr) < 5 / math.sqrt(half)
  r2 = cos_half ** 2 + sin_half ** 2
  assert float(tf.reduce_mean(r2)) == pytest.approx(2.0, rel=0.03)


def test_ks_check_has_power():
  # The same check rejects noise whose std is 5% off or mean is 0.05 std off.
  noise = tf.random.stateless_normal([N], seed=[1, 2], dtype=tf.float64)
  assert _ks_statistic(noise, 1.0) < KS_CRITICAL
  assert _ks_statistic(1.05 * noise, 1.0) > KS_CRITICAL
  assert _ks_statistic(noise + 0.05, 1.0) > KS_CRITICAL


def test_none_entries_pass_through_and_dtypes_kept():
  grads = [None, tf.ones([3], tf.float64), None, tf.ones([2, 2], tf.bfloat16)]
  out = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([1, 2]))
  assert out[0] is None and out[2] is None
  assert out[1].dtype == tf.float64 and out[1].shape == (3,)
  assert out[3].dtype == tf.bfloat16 and out[3].shape == (2, 2)
  assert dp.add_gaussian_noise([None], 1.0, seed=tf.constant([1, 2])) == [None]


def test_zero_stddev_is_identity_and_indexed_slices_densify():
  g = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]),
                       tf.constant([4, 3]))
  out, = dp.add_gaussian_noise([g], 0.0, generator=dp.make_generator(seed=1))
  np.testing.assert_array_equal(out, tf.convert_to_tensor(g))


def test_stateless_seed_reproducible():
  grads = _grads()
  a = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([5, 6]))
  b = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([5, 6]))
  c = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([5, 7]))
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[2], b[2])
  assert not np.array_equal(a[0], c[0])
  # A scalar seed s means [0, s] and is just as deterministic.
  d = dp.add_gaussian_noise(grads, 1.0, seed=6)
  e = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([0, 6]))
  np.testing.assert_array_equal(d[0], e[0])
  # int64 seeds use all their bits.
  f = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([2**40, 6], tf.int64))
  g = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([0, 6], tf.int64))
  assert not np.array_equal(f[0], g[0])


def test_tensors_in_one_call_get_independent_noise():
  grads = [tf.zeros([N]), tf.zeros([N])]
  a, b = dp.add_gaussian_noise(grads, 1.0, seed=tf.constant([3, 4]))
  assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 5 / math.sqrt(N)


def test_generator_tensors_share_a_draw_but_get_independent_noise():
  # Static-shape tensors of one dtype are filled from one draw (split and
  # reshaped); tensors of unknown shape or another dtype draw their own.
  # Every tensor's noise must still be N(0, s^2) and independent of the
  # others'. Sizes are odd so the draw has a dropped last element.
  gen = dp.make_generator(seed=13)

  @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
  def noisy(dynamic):
    grads = [tf.zeros([N // 2 + 1]), tf.zeros([N // 4, 2], tf.float64),
             tf.zeros([3, N // 6]), dynamic]
    return dp.add_gaussian_noise(grads, 0.5, generator=gen)

  outs = noisy(tf.zeros([N // 2 + 1]))
  assert [o.shape for o in outs] == [(N // 2 + 1,), (N // 4, 2),
                                     (3, N // 6), (N // 2 + 1,)]
  assert outs[1].dtype == tf.float64
  for o in outs:
    assert _ks_statistic(o, 0.5) < 2 * KS_CRITICAL  # smaller samples
  flat = [tf.reshape(tf.cast(o, tf.float64), [-1]).numpy() for o in outs]
  m = min(len(f) for f in flat)
  corr = np.corrcoef(np.stack([f[:m] for f in flat]))
  assert np.max(np.abs(corr[~np.eye(len(flat), dtype=bool)])) < 5 / math.sqrt(m)


def test_generator_advances():
  gen = dp.make_generator(seed=3)
  a, = dp.add_gaussian_noise([tf.zeros([100])], 1.0, generator=gen)
  b, = dp.add_gaussian_noise([tf.zeros([100])], 1.0, generator=gen)
  assert not np.array_equal(a, b)
  again = dp.make_generator(seed=3)
  c, = dp.add_gaussian_noise([tf.zeros([100])], 1.0, generator=again)
  np.testing.assert_array_equal(a, c)


def test_unseeded_generators_differ():
  a = dp.make_generator().normal([8])
  b = dp.make_generator().normal([8])
  assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------
# Replicas.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_replica_noise_stddev(replicas):
  assert dp.replica_noise_stddev(3.0, replicas) == pytest.approx(
      3.0 / math.sqrt(replicas), rel=1e-15)
  t = dp.replica_noise_stddev(tf.constant(3.0), replicas)
  assert float(t) == pytest.approx(3.0 / math.sqrt(replicas), rel=1e-6)


def test_replica_seeds_independent_and_deterministic():
  seed = tf.constant([21, 22])
  replicas = 4
  seeds = [dp.replica_seed(seed, r, replicas) for r in range(replicas)]
  assert len({tuple(s.numpy()) for s in seeds}) == replicas
  np.testing.assert_array_equal(seeds[2], dp.replica_seed(seed, 2, replicas))
  np.testing.assert_array_equal(
      seeds[1], dp.replica_seed(seed, tf.constant(1), replicas))
  streams = np.stack([
      dp.add_gaussian_noise([tf.zeros([N // 4])], 1.0, seed=s)[0].numpy()
      for s in seeds
  ])
  corr = np.corrcoef(streams)
  off_diagonal = corr[~np.eye(replicas, dtype=bool)]
  assert np.max(np.abs(off_diagonal)) < 5 / math.sqrt(N // 4)


def test_summed_replica_noise_has_the_global_stddev():
  # What an all-reduce SUM does under a strategy: R replicas each add
  # N(0, s^2 / R) with their own seed; the total must be N(0, s^2).
  stddev, replicas = 2.0, 4
  seed = tf.constant([8, 9])
  total = tf.add_n([
      dp.add_gaussian_noise(
          [tf.zeros([N], tf.float64)],
          dp.replica_noise_stddev(stddev, replicas),
          seed=dp.replica_seed(seed, r, replicas))[0]
      for r in range(replicas)
  ])
  assert _ks_statistic(total, stddev) < KS_CRITICAL
  assert float(np.std(total)) == pytest.approx(stddev, rel=0.02)
  # Without the split the sum would have std sqrt(R) * s: the check sees it.
  assert _ks_statistic(total * math.sqrt(replicas), stddev) > KS_CRITICAL


# ---------------------------------------------------------------------------
# tf.function and XLA.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_inside_tf_function(jit):
  gen = dp.make_generator(seed=5)

  @tf.function(jit_compile=jit)
  def step(a, b, seed, replica):
    stddev = dp.replica_noise_stddev(1.5, 4)
    stateless = dp.add_gaussian_noise(
        [a, None, b], stddev, seed=dp.replica_seed(seed, replica, 4))
    stateful = dp.add_gaussian_noise([a, None, b], stddev, generator=gen)
    return stateless, stateful

  a, b = tf.zeros([N // 2]), tf.zeros([N // 2])
  seed = tf.constant([1, 2])
  (s0, none0, s1), (g0, none1, g1) = step(a, b, seed, tf.constant(3))
  assert none0 is None and none1 is None
  (t0, _, _), (h0, _, _) = step(a, b, seed, tf.constant(3))
  np.testing.assert_array_equal(s0, t0)  # stateless: same seed, same noise
  assert not np.array_equal(g0, h0)      # generator: fresh noise every call
  for noise in (tf.concat([s0, s1], 0), tf.concat([g0, g1], 0)):
    assert _ks_statistic(noise, 0.75) < KS_CRITICAL


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def test_needs_exactly_one_source_of_randomness():
  with pytest.raises(ValueError, match="exactly one source of randomness"):
    dp.add_gaussian_noise([tf.zeros([2])], 1.0)
  with pytest.raises(ValueError, match="exactly one source of randomness"):
    dp.add_gaussian_noise([tf.zeros([2])], 1.0,
                          generator=dp.make_generator(seed=1),
                          seed=tf.constant([1, 2]))


@pytest.mark.parametrize("seed,message", [
    (tf.constant([1, 2, 3]), r"seed must be .* shape \[2\].*got shape \(3,\)"),
    (tf.constant([1.0, 2.0]), r"seed must be an integer .*got dtype float32"),
])
def test_bad_seed(seed, message):
  with pytest.raises(ValueError, match=message):
    dp.add_gaussian_noise([tf.zeros([2])], 1.0, seed=seed)
  with pytest.raises(ValueError, match=message):
    dp.replica_seed(seed, 0, 2)


@pytest.mark.parametrize("replicas", [0, -1, 2.0, True, None])
def test_bad_num_replicas(replicas):
  with pytest.raises(ValueError, match=r"num_replicas must be a positive "
                     r"integer .*got " + repr(replicas).replace(".", r"\.")):
    dp.replica_noise_stddev(1.0, replicas)
  with pytest.raises(ValueError, match="num_replicas must be a positive"):
    dp.replica_seed(tf.constant([1, 2]), 0, replicas)


def test_exports():
  assert callable(dp.clip_factors)
  np.testing.assert_allclose(
      dp.clip_factors(tf.constant([0.5, 2.0, 4.0]), 1.0), [1.0, 0.5, 0.25])


# ---------------------------------------------------------------------------
# The fused Threefry kernel (tf_pxg.dp.threefry).
# ---------------------------------------------------------------------------

from tf_pxg.dp import threefry  # noqa: E402


@pytest.mark.parametrize("key, counter, expected", [
    # Known-answer vectors of the Random123 reference (kat_vectors,
    # threefry2x32_20).
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3),
     (0xC4923A9C, 0x483DF7A0)),
])
def test_threefry_known_answers(key, counter, expected):
  u32 = lambda v: tf.constant([v], tf.uint32)  # noqa: E731
  y0, y1 = threefry.threefry2x32(u32(key[0])[0], u32(key[1])[0],
                                 u32(counter[0]), u32(counter[1]))
  assert (int(y0[0]), int(y1[0])) == expected


def test_cos_2pi_reduction_and_polynomial_accuracy():
  # Every quarter turn, both sides of its boundaries (where q changes and
  # the add wraps), and the top of the uint32 range.
  q = np.arange(5, dtype=np.int64) << 30
  edges = np.concatenate([q - 2**29 - 1, q - 2**29, q + 2**29 - 1, q])
  b = np.concatenate([np.linspace(0, 2**32 - 1, 400_001).astype(np.int64),
                      edges[(edges >= 0) & (edges < 2**32)]]).astype(np.uint32)
  got = threefry._cos_2pi(tf.constant(b)).numpy().astype(np.float64)
  want = np.cos(2 * np.pi * b.astype(np.float64) / 2**32)
  assert np.max(np.abs(got - want)) < 2e-7


@pytest.mark.parametrize("jit", [False, True])
def test_threefry_normal_is_standard_normal(jit):
  key = tf.constant([3, 1, 4], tf.uint32)
  z = tf.function(lambda: threefry.normal([N], key), jit_compile=jit)()
  assert z.dtype == tf.float32
  assert _ks_statistic(z, 1.0) < KS_CRITICAL
  # The radius uses 32-bit uniforms: |z| <= sqrt(2 * 33 ln 2).
  assert float(tf.reduce_max(tf.abs(z))) <= math.sqrt(66 * math.log(2))
  other = threefry.normal([N], tf.constant([3, 1, 5], tf.uint32))
  assert abs(np.corrcoef(z.numpy(), other.numpy())[0, 1]) < 5 / math.sqrt(N)


def test_threefry_tensors_take_disjoint_counter_ranges():
  # Tensor j's noise is elements sum(sizes[:j]).. of one draw: the same
  # key gives the same numbers as one flat draw, split.
  key = tf.constant([7, 8, 9], tf.uint32)
  a, b = threefry.add_normal_noise([tf.zeros([3, 5]), tf.zeros([7])], key,
                                   2.0)
  flat = threefry.normal([22], key)
  # Within a few float32 ulps of the largest |2 z| (13.5).
  np.testing.assert_allclose(tf.reshape(a, [-1]), 2.0 * flat[:15], rtol=0,
                             atol=1e-5)
  np.testing.assert_allclose(b, 2.0 * flat[15:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_threefry_low_precision_gets_float32_samples_cast(dtype):
  key = tf.constant([1, 2, 3], tf.uint32)
  (low,) = threefry.add_normal_noise([tf.zeros([N], dtype)], key, 0.5)
  assert low.dtype == dtype
  # float16/bfloat16 take the XLA kernel; compare with its float32 samples
  # (the native op's differ by float rounding, which can flip a cast).
  want = tf.function(lambda: tf.cast(0.5 * threefry.normal([N], key), dtype),
                     jit_compile=True)()
  np.testing.assert_array_equal(low.numpy(), want.numpy())


def test_threefry_errors():
  key = tf.constant([1, 2, 3], tf.uint32)
  with pytest.raises(ValueError, match="float32"):
    threefry.add_normal_noise([tf.zeros([4], tf.float64)], key, 1.0)

  @tf.function(input_signature=[tf.TensorSpec([None])])
  def dynamic(t):
    return threefry.add_normal_noise([t], key, 1.0)

  with pytest.raises(ValueError, match="static shapes"):
    dynamic(tf.zeros([4]))
  with pytest.raises(ValueError, match="at most 4294967295"):
    threefry._normal_flat(key, threefry.MAX_ELEMENTS - 10, 20)


def test_float64_and_dynamic_shapes_use_tf_kernels_in_add_gaussian_noise():
  # float64 tensors keep float64 samples (the fused kernel is float32).
  (noisy,) = dp.add_gaussian_noise([tf.zeros([N], tf.float64)], 1.0,
                                   seed=tf.constant([1, 2]))
  assert noisy.dtype == tf.float64
  assert _ks_statistic(noisy, 1.0) < KS_CRITICAL
  # Some samples are not float32 numbers: they were drawn in float64.
  assert np.any(noisy.numpy() != noisy.numpy().astype(np.float32))


@pytest.mark.parametrize("jit", [False, True])
def test_densify_indexed_slices_adds_repeated_rows(jit):
  values = tf.reshape(tf.range(12, dtype=tf.float32), [4, 3])
  indices = tf.constant([2, 0, 2, 4])
  slices = tf.IndexedSlices(values, indices, tf.constant([6, 3]))
  dense = tf.function(lambda: dp.densify(slices), jit_compile=jit)()
  np.testing.assert_array_equal(dense, tf.convert_to_tensor(slices))
  assert float(dense[2, 0]) == 0.0 + 6.0  # rows 0 and 2 of values add up
  np.testing.assert_array_equal(dp.densify(tf.ones([2])), [1.0, 1.0])


@pytest.mark.parametrize("jit", [False, True])
def test_indexed_slices_rows_are_added_inside_the_fused_noise(jit):
  # The same key gives the same noise whether the rows arrive dense or as
  # IndexedSlices, and the rows (with a repeated index) are added exactly.
  values = tf.reshape(tf.range(12, dtype=tf.float32), [4, 3])

  def rows():
    return tf.IndexedSlices(values, tf.constant([2, 0, 2, 4]),
                            tf.constant([6, 3]))

  key = tf.constant([4, 5, 6], tf.uint32)
  sparse, dense = tf.function(
      lambda: threefry.add_normal_noise([rows(), tf.ones([5])], key, 0.5),
      jit_compile=jit)()
  dense_rows = tf.convert_to_tensor(rows())
  want = threefry.add_normal_noise([tf.ones([5]), dense_rows], key, 0.5)
  # Within a few float32 ulps of the largest value (the rows reach 20).
  np.testing.assert_allclose(dense, want[0], rtol=0, atol=1e-5)
  # Tensor order decides the counter ranges: put the dense one first.
  np.testing.assert_allclose(sparse, want[1], rtol=0, atol=1e-5)
  noise_only = sparse - dense_rows
  assert _ks_statistic(tf.reshape(noise_only, [-1]), 0.5) < 0.6  # 18 values


def test_seed_split_is_tfps():
  """`_split_seed` gives the seeds TFP's `tfp.random.split_seed` gave for
  stateless seeds (values recorded with TFP 0.25), so dropping the TFP
  dependency changed no noise stream."""
  # pylint: disable=protected-access
  split = dp.noise._split_seed
  assert np.stack(split(tf.constant([8, 9]), 3, "add_gaussian_noise")
                  ).tolist() == [[1046045944, -1777047437],
                                 [532777158, 1674330241],
                                 [1756861792, 73258851]]
  assert np.stack(split(tf.constant([8, 9]), 4, "replica_seed")).tolist() == [
      [963361412, 1483262786], [1461464007, 685314809],
      [-557494539, -648102121], [1662123093, 65720529]]
