"""DP-AdaFEST / DP-FEST (tf_pxg.dp.sparse_selection): closed forms.

The selection against its definition (counts of clipped 0/1 maps; every
row noised and thresholded), the untouched rows' selection against its
Binomial closed form, the capacity against scipy's exact binomial tail,
the noise on the selected rows against sigma C, the accounting against
dp-accounting's composition of the two Gaussians, and the Keras step
(bit-for-bit untouched rows, eager / tf.function / XLA, accumulation).
"""

import math
import textwrap

import _multi_worker as multi_worker
import dp_accounting
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tf_pxg import accounting
from tf_pxg.dp import sparse_selection as ss


def _counts_reference(ids_per_table, vocab, clip, mask):
  """NumPy: per table, the dense `[V]` sum of clipped 0/1 row maps."""
  b = ids_per_table[0].shape[0]
  sets = [[set(t[i].tolist()) for i in range(b)] for t in ids_per_table]
  out = [np.zeros(v) for v in vocab]
  for i in range(b):
    n = sum(len(s[i]) for s in sets)
    w = min(1.0, clip / math.sqrt(n)) * mask[i]
    for k, s in enumerate(sets):
      for r in s[i]:
        out[k][r] += w
  return out


def test_touched_rows_are_the_clipped_maps_summed():
  rng = np.random.default_rng(0)
  vocab = [50, 7]
  ids = [rng.integers(0, 50, size=(6, 5)), rng.integers(0, 7, size=(6, 3))]
  mask = np.array([1, 1, 0, 1, 1, 1], np.float32)
  clip = 1.5
  got = ss.touched_rows([[tf.constant(ids[0][:, :2]),
                          tf.constant(ids[0][:, 2:])],
                         [tf.constant(ids[1])]], vocab, clip, mask)
  want = _counts_reference(ids, vocab, clip, mask)
  for t, w, v, i in zip(got, want, vocab, ids):
    num = int(t.num)
    rows = t.rows.numpy()
    assert num == len(np.unique(i))
    np.testing.assert_array_equal(rows[:num], np.unique(i))
    np.testing.assert_array_equal(rows[num:], v + np.arange(num, rows.size))
    dense = np.zeros(v)
    dense[rows[:num]] = t.counts.numpy()[:num]
    np.testing.assert_allclose(dense, w, rtol=1e-6, atol=1e-7)
    assert np.all(t.counts.numpy()[num:] == 0)


def test_false_positive_rate_closed_form():
  assert ss.false_positive_rate(0.0, 1.0) == 0.5
  assert ss.false_positive_rate(2.0, 1.0) == pytest.approx(
      stats.norm.sf(2.0), rel=1e-12)
  assert ss.false_positive_rate(3.0, 0.5) == pytest.approx(
      stats.norm.sf(6.0), rel=1e-10)
  assert ss.false_positive_rate(0.0, 0.0) == 0.0
  assert ss.false_positive_rate(-1.0, 0.0) == 1.0


@pytest.mark.parametrize("n,p", [(10**5, 1e-3), (10**7, 2e-5), (1000, 0.3),
                                 (10**9, 1e-9)])
def test_capacity_bounds_the_binomial_tail(n, p):
  k = ss.false_positive_capacity(n, p)
  # scipy's exact tail: the Chernoff capacity is conservative...
  assert stats.binom.sf(k, n, p) <= ss.TAIL_PROBABILITY
  # ... and not absurdly so (within the Chernoff slack of the mean).
  assert k <= n * p + 20 * math.sqrt(n * p) + 60
  assert ss.false_positive_capacity(n, 0.0) == 0


def test_untouched_selection_matches_the_binomial_and_is_uniform():
  """Noising every untouched row and thresholding selects each with
  probability p = Q(tau / s), independently: the count is Binomial(M, p)
  and the rows are uniform over the untouched ones."""
  vocab, tau, s = 2000, 1.0, 0.8
  ids = tf.constant([[3, 17, 17, 1999], [4, 5, 6, 3]], tf.int64)
  touched = ss.touched_rows([[ids]], [vocab], 1.0)[0]
  p = ss.false_positive_rate(tau, s)
  cap = ss.false_positive_capacity(vocab, p)
  m = vocab - int(touched.num)

  @tf.function
  def draw(seed):
    return ss.sample_untouched_rows(touched, vocab, p, cap, seed)

  trials = 300
  hits = np.zeros(vocab)
  counts = []
  for i in range(trials):
    rows, valid = draw(tf.constant([i, 11], tf.int64))
    rows = rows.numpy()[valid.numpy()]
    assert len(np.unique(rows)) == len(rows)
    counts.append(len(rows))
    hits[rows] += 1
  touched_set = set(ids.numpy().ravel().tolist())
  assert not any(hits[r] for r in touched_set)
  total = sum(counts)
  mean, sd = trials * m * p, math.sqrt(trials * m * p * (1 - p))
  assert abs(total - mean) < 5 * sd, (total, mean, sd)
  # The per-trial count's variance is the Binomial's (not Poisson-like
  # clumping): within 30 % for 300 trials (chi-square, ~5 sd).
  assert np.var(counts) == pytest.approx(m * p * (1 - p), rel=0.3)
  # Uniform over the untouched rows: chi-square on 20 bins of rows.
  free = np.array([r for r in range(vocab) if r not in touched_set])
  binned = np.add.reduceat(hits[free], np.arange(0, free.size, 100))
  expected = np.diff(np.append(np.arange(0, free.size, 100), free.size))
  expected = expected * total / free.size
  assert stats.chisquare(binned, expected).pvalue > 1e-4


def test_selection_equals_noising_every_row():
  """The touched rows' selection rate against Q((tau - count) / s), and
  with tau = 0 and no selection noise exactly the rows with a positive
  count (the real examples' rows)."""
  vocab = 100
  ids = tf.constant([[1, 2, 2], [2, 5, 7], [9, 9, 9]], tf.int64)
  mask = tf.constant([1.0, 1.0, 0.0])
  touched = ss.touched_rows([[ids]], [vocab], 1.0, mask)[0]
  sel = ss.select_rows(touched, vocab, 0.0, 0.0, 0, tf.constant([1, 2]))
  chosen = sel.rows.numpy()[sel.selected.numpy()]
  np.testing.assert_array_equal(chosen, [1, 2, 5, 7])  # not 9: padding
  tau, s = 1.0, 0.5
  counts = touched.counts.numpy()
  picks = np.zeros(int(touched.num))
  trials = 400
  select = tf.function(lambda seed: ss.select_rows(touched, vocab, tau, s, 0,
                                                   seed).selected)
  for i in range(trials):
    picks += select(tf.constant([i, 3], tf.int64)).numpy()[:int(touched.num)]
  want = stats.norm.sf((tau - counts[:int(touched.num)]) / s)
  sd = np.sqrt(want * (1 - want) / trials)
  np.testing.assert_array_less(np.abs(picks / trials - want), 5 * sd + 1e-9)


def _sum_slices(ids, width, seed=0):
  rng = np.random.default_rng(seed)
  flat = np.asarray(ids).reshape(-1)
  values = rng.normal(size=(flat.size, width)).astype(np.float32)
  return tf.IndexedSlices(tf.constant(values), tf.constant(flat),
                          tf.constant([100, width], tf.int64)), values


def test_threshold_zero_no_selection_noise_is_dense_restricted_to_touched():
  ids = np.array([[1, 2, 2], [2, 5, 7]])
  clipped, values = _sum_slices(ids, 4)
  dense = np.zeros((100, 4), np.float32)
  np.add.at(dense, ids.reshape(-1), values)
  touched = ss.touched_rows([[tf.constant(ids, tf.int64)]], [100], 1.0)[0]
  sel = ss.select_rows(touched, 100, 0.0, 0.0, 0, tf.constant([1, 2]))
  for compact in (True, False):
    out = ss.noisy_selected_rows(clipped, sel, 0.0, tf.constant([5, 6]),
                                 scale=0.5, compact=compact)
    got = tf.convert_to_tensor(out).numpy()
    np.testing.assert_allclose(got, 0.5 * dense, rtol=1e-6, atol=1e-6)
  out = ss.noisy_selected_rows(clipped, sel, 0.0, tf.constant([5, 6]))
  assert sorted(out.indices.numpy().tolist()) == [1, 2, 5, 7]


def test_noise_std_on_selected_rows_is_sigma_c():
  ids = np.arange(400).reshape(20, 20)
  clipped, values = _sum_slices(ids, 64)
  touched = ss.touched_rows([[tf.constant(ids, tf.int64)]], [1000], 1.0)[0]
  sel = ss.select_rows(touched, 1000, 0.0, 0.0, 0, tf.constant([1, 2]))
  stddev = 0.7
  out = ss.noisy_selected_rows(clipped, sel, stddev, tf.constant([8, 9]))
  order = np.argsort(out.indices.numpy())
  noise = out.values.numpy()[order] - values
  n = noise.size
  assert np.mean(noise) == pytest.approx(0.0, abs=5 * stddev / math.sqrt(n))
  # The sample std's sd is about s / sqrt(2n).
  assert np.std(noise) == pytest.approx(stddev,
                                        abs=5 * stddev / math.sqrt(2 * n))


def test_fixed_selection_keeps_only_its_rows():
  ids = np.array([[1, 2, 2], [2, 5, 7]])
  clipped, values = _sum_slices(ids, 3)
  dense = np.zeros((100, 3), np.float32)
  np.add.at(dense, ids.reshape(-1), values)
  fixed = [0, 2, 7, 50]
  sel = ss.fixed_selection(np.array(fixed, np.int64))
  out = ss.noisy_selected_rows(clipped, sel, 0.0, tf.constant([1, 1]))
  np.testing.assert_array_equal(out.indices.numpy(), fixed)
  np.testing.assert_allclose(out.values.numpy(), dense[fixed], rtol=1e-6,
                             atol=1e-6)


def test_eager_function_and_xla_agree():
  """One selection and noise in three execution modes: equal draws in
  eager and tf.function (stateless seeds); XLA's Philox streams differ
  from TF's kernels, so there the noiseless step is compared exactly and
  the noisy one against the closed forms."""
  vocab = 10**5
  ids = tf.constant(np.random.default_rng(1).integers(0, 500, size=(8, 6)),
                    tf.int64)
  clipped, _ = _sum_slices(ids.numpy(), 8)
  clipped = tf.IndexedSlices(clipped.values, clipped.indices,
                             tf.constant([vocab, 8], tf.int64))
  config = ss.DPAdaFEST(threshold=2.0, selection_noise_multiplier=1.0)
  cap = config.capacity(vocab)
  n = ids.shape.num_elements()

  def step(seed, stddev, gradient_stddev):
    touched = ss.touched_rows([[ids]], [vocab], 1.0)[0]
    sel = ss.select_rows(touched, vocab, config.threshold, stddev, cap, seed)
    out = ss.noisy_selected_rows(clipped, sel, gradient_stddev, seed,
                                 compact=False)
    return out.indices, out.values, sel.selected

  seed = tf.constant([4, 2], tf.int64)
  modes = {"function": tf.function(step),
           "xla": tf.function(step, jit_compile=True)}
  for stddev, gstd in ((config.selection_stddev, 0.3), (0.0, 0.0)):
    want = step(seed, stddev, gstd)
    for name, fn in modes.items():
      got = fn(seed, stddev, gstd)
      if name == "xla" and stddev:
        fp = int(np.sum(got[2].numpy()[n:]))
        p = config.false_positive_rate
        assert abs(fp - vocab * p) < 6 * math.sqrt(vocab * p)
        continue
      np.testing.assert_array_equal(got[2].numpy(), want[2].numpy())
      np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
      np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), rtol=1e-6,
                                 atol=1e-6)
  # About V p false positives among the slots (p = Q(2) = 2.3 %).
  want = step(seed, config.selection_stddev, 0.3)
  p = config.false_positive_rate
  fp = int(np.sum(want[2].numpy()[n:]))
  assert abs(fp - vocab * p) < 6 * math.sqrt(vocab * p)


def test_sigma_split_matches_dp_accounting_composition():
  """The pair (selection, gradient) accounted as one Gaussian with
  sigma^-2 = sigma_g^-2 + sigma_sel^-2 equals dp-accounting's composition
  of the two Gaussians (RDP curves, unsampled); the reported epsilon is
  dp-accounting's for the Poisson-sampled pair. Composing two
  independently sampled Gaussians instead would under-count (both see the
  same batch): it gives less, and each part alone less still."""
  sigma, sigma_sel = 1.1, 4.0
  config = ss.DPAdaFEST(threshold=3.0, selection_noise_multiplier=sigma_sel)
  sigma_g = config.gradient_noise_multiplier(sigma, sigma_sel)
  assert sigma_g**-2 + sigma_sel**-2 == pytest.approx(sigma**-2, rel=1e-12)
  orders = list(accounting.RDP_ORDERS)
  pair = dp_accounting.rdp.RdpAccountant(orders).compose(
      dp_accounting.ComposedDpEvent([
          dp_accounting.GaussianDpEvent(sigma_g),
          dp_accounting.GaussianDpEvent(sigma_sel)]))
  single = dp_accounting.rdp.RdpAccountant(orders).compose(
      dp_accounting.GaussianDpEvent(sigma))
  assert pair.get_epsilon(1e-5) == pytest.approx(single.get_epsilon(1e-5),
                                                 rel=1e-9)
  n, b, steps, delta = 60000, 256, 2000, 1e-5
  q = b / n
  ours = accounting.compute_epsilon(n, b, sigma, steps=steps, delta=delta,
                                    accountant="rdp")
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), steps)
  assert ours == pytest.approx(
      dp_accounting.rdp.RdpAccountant(orders).compose(event).get_epsilon(
          delta), rel=1e-9)
  separate = dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma_g)),
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma_sel))]), steps)
  separate_epsilon = dp_accounting.rdp.RdpAccountant(orders).compose(
      separate).get_epsilon(delta)
  assert ours > separate_epsilon
  alone = dp_accounting.rdp.RdpAccountant(orders).compose(
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma_g)), steps)).get_epsilon(delta)
  assert alone < separate_epsilon


def test_sigma_split_refuses_a_selection_that_uses_the_budget():
  config = ss.DPAdaFEST(threshold=3.0, selection_noise_multiplier=1.0)
  with pytest.raises(ValueError, match="selection_noise_multiplier"):
    config.gradient_noise_multiplier(1.0, 1.0)


@pytest.mark.parametrize("kwargs", [
    {"threshold": float("nan"), "selection_noise_multiplier": 1.0},
    {"threshold": 1.0, "selection_noise_multiplier": -1.0},
    {"threshold": 1.0, "selection_noise_multiplier": 1.0,
     "selection_l2_norm_clip": 0.0},
])
def test_bad_settings_raise(kwargs):
  with pytest.raises(ValueError):
    ss.DPAdaFEST(**kwargs)


def test_fixed_rows_must_be_integers():
  with pytest.raises(ValueError, match="integer row ids"):
    ss.DPFEST({"t": [0.5, 1.5]})
  with pytest.raises(ValueError, match="non-empty"):
    ss.DPFEST({"t": []})


# ---------------------------------------------------------------------------
# The Keras step (noise_mechanism=DPAdaFEST / DPFEST).
# ---------------------------------------------------------------------------

_VOCAB, _WIDTH, _B, _L = 400, 8, 8, 5


def _model(noise_mechanism, noise_multiplier=1.0, jit_compile=False, lr=0.5,
           seed=3):
  import keras  # pylint: disable=g-import-not-at-top
  import tf_pxg  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = tf_pxg.keras.DPSequential(
      [keras.Input((_L,), dtype="int32"),
       keras.layers.Embedding(_VOCAB, _WIDTH, name="table"),
       keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)],
      l2_norm_clip=1.0, noise_multiplier=noise_multiplier, seed=seed,
      noise_mechanism=noise_mechanism)
  model.compile(optimizer=keras.optimizers.SGD(lr), jit_compile=jit_compile,
                loss=keras.losses.MeanSquaredError(reduction=None))
  return model


def _batch():
  rng = np.random.default_rng(5)
  x = rng.integers(0, 40, size=(_B, _L)).astype(np.int32)  # rows < 40
  return x, rng.normal(size=(_B, 1)).astype(np.float32)


def _table(model):
  return model.layers[0].embeddings.numpy().copy()


@pytest.mark.parametrize("jit_compile", [False, True])
def test_keras_rows_not_selected_are_bit_for_bit_untouched(jit_compile):
  """tau huge: no row is selected and the table is bit-for-bit unchanged,
  while the dense layer gets its dense noise; tau = -1e9 (every row
  selected): every row moves, the untouched ones by noise alone."""
  x, y = _batch()
  for tau, moved in ((1e9, 0), (-1e9, _VOCAB)):
    model = _model(ss.DPAdaFEST(threshold=tau, selection_noise_multiplier=3.0),
                   jit_compile=jit_compile)
    model.build((None, _L))
    before = _table(model)
    dense_before = model.layers[-1].kernel.numpy().copy()
    model.train_on_batch(x, y)
    after = _table(model)
    assert int(np.sum(np.any(after != before, axis=1))) == moved
    assert np.all(model.layers[-1].kernel.numpy() != dense_before)


def test_keras_threshold_zero_without_noise_is_dense_dp_sgd():
  """sigma = 0, sigma_sel = 0, tau = 0: the selected rows are the touched
  ones and the step equals dense DP-SGD's (no noise) exactly there; the
  other rows are untouched (their gradient is 0 in both)."""
  x, y = _batch()
  sparse = _model(ss.DPAdaFEST(threshold=0.0, selection_noise_multiplier=0.0),
                  noise_multiplier=0.0)
  dense = _model(None, noise_multiplier=0.0)
  for m in (sparse, dense):
    m.build((None, _L))
  dense.set_weights(sparse.get_weights())
  before = _table(sparse)
  sparse.train_on_batch(x, y)
  dense.train_on_batch(x, y)
  np.testing.assert_allclose(_table(sparse), _table(dense), rtol=1e-6,
                             atol=1e-7)
  touched = np.unique(x)
  untouched = np.setdiff1d(np.arange(_VOCAB), touched)
  assert np.array_equal(_table(sparse)[untouched], before[untouched])
  assert np.all(np.any(_table(sparse)[touched] != before[touched], axis=1))


def test_keras_noise_std_on_selected_rows_and_sigma_split():
  """Every row selected (tau = -1e9): an untouched row's update is
  -lr * N(0, (sigma_g C)^2) / B with sigma_g = (sigma^-2 - sigma_sel^-2)^-1/2."""
  x, y = _batch()
  sigma, sigma_sel, lr = 1.0, 2.0, 0.5
  model = _model(ss.DPAdaFEST(threshold=-1e9,
                              selection_noise_multiplier=sigma_sel),
                 noise_multiplier=sigma, lr=lr)
  model.build((None, _L))
  before = _table(model)
  model.train_on_batch(x, y)
  untouched = np.setdiff1d(np.arange(_VOCAB), np.unique(x))
  step = (_table(model) - before)[untouched].ravel()
  sigma_g = (sigma**-2 - sigma_sel**-2)**-0.5
  want = lr * sigma_g * 1.0 / _B
  n = step.size
  assert np.std(step) == pytest.approx(want, abs=5 * want / math.sqrt(2 * n))
  assert np.mean(step) == pytest.approx(0.0, abs=5 * want / math.sqrt(n))


def test_keras_fixed_rows_dp_fest():
  x, y = _batch()
  fixed = [0, 3, 7, 39, 200]
  model = _model(ss.DPFEST({"table/embeddings": fixed}))
  model.build((None, _L))
  before = _table(model)
  model.train_on_batch(x, y)
  moved = np.flatnonzero(np.any(_table(model) != before, axis=1))
  np.testing.assert_array_equal(moved, fixed)


def test_keras_poisson_fit_with_accumulation():
  """Logical steps of 2 physical batches (dense counts path): tau huge
  leaves the table bit-for-bit unchanged; tau = -1e9 moves every row."""
  rng = np.random.default_rng(2)
  x = rng.integers(0, 40, size=(64, _L)).astype(np.int32)
  y = rng.normal(size=(64, 1)).astype(np.float32)
  for tau, moved in ((1e9, 0), (-1e9, _VOCAB)):
    model = _model(ss.DPAdaFEST(threshold=tau, selection_noise_multiplier=3.0))
    model.build((None, _L))
    before = _table(model)
    model.fit(x, y, batch_size=16, epochs=1, accumulation_steps=2,
              verbose=0)
    assert int(np.sum(np.any(_table(model) != before, axis=1))) == moved


def test_attack_a_row_reveals_only_its_selection():
  """Neighbouring batches: D' adds one example that alone touches row r.
  Over many runs, whenever r is not selected its value is bit-for-bit its
  initial value in both worlds (nothing else to see), and the attack
  'guess D' iff r moved' has the rates of the selection's Gaussian
  mechanism, Q(tau/s) and Q((tau - w)/s), which meet mu-GDP with
  mu = 1/sigma_sel."""
  vocab, tau, sigma_sel = 200, 1.0, 1.0
  base = np.array([[1, 2, 3], [2, 4, 5]])
  extra = np.array([[150, 151, 152]])  # only the added example touches 150
  row = 150
  rng = np.random.default_rng(0)
  table = rng.normal(size=(vocab, 4)).astype(np.float32)
  moved = {}
  trials = 300
  var = tf.Variable(table)
  cap = ss.false_positive_capacity(vocab, ss.false_positive_rate(tau,
                                                                 sigma_sel))
  for world, ids in (("D", base), ("D'", np.concatenate([base, extra]))):

    @tf.function
    def trial(i, ids=tf.constant(ids, tf.int64)):
      """One step's release and the SGD update, on the table reset."""
      var.assign(table)
      touched = ss.touched_rows([[ids]], [vocab], 1.0)[0]
      sel = ss.select_rows(touched, vocab, tau, sigma_sel, cap,
                           tf.stack([i, tf.constant(1, tf.int64)]))
      values = tf.ones([tf.size(ids), 4])
      update = ss.noisy_selected_rows(
          tf.IndexedSlices(values, tf.reshape(ids, [-1]),
                           tf.constant([vocab, 4], tf.int64)),
          sel, 0.5, tf.stack([i, tf.constant(2, tf.int64)]))
      var.scatter_sub(tf.IndexedSlices(0.1 * update.values,
                                       update.indices))
      return var.read_value()[row], tf.reduce_any(
          tf.equal(update.indices, row))

    hits = 0
    for i in range(trials):
      value, in_selection = trial(tf.constant(i, tf.int64))
      changed = not np.array_equal(value.numpy(), table[row])
      assert changed == bool(in_selection)
      hits += changed
    moved[world] = hits / trials
  w = 1.0 / math.sqrt(3)  # the added example's clipped weight (3 rows)
  want = {"D": stats.norm.sf(tau / sigma_sel),
          "D'": stats.norm.sf((tau - w) / sigma_sel)}
  for k in want:
    sd = math.sqrt(want[k] * (1 - want[k]) / trials)
    assert abs(moved[k] - want[k]) < 5 * sd, (k, moved[k], want[k])
  # mu-GDP (Dong et al.): TPR <= Phi(Phi^-1(FPR) + mu) at the true rates.
  mu = w / sigma_sel
  assert want["D'"] <= stats.norm.cdf(stats.norm.ppf(want["D"]) + mu) + 1e-12


# Run by tests/_multi_worker.py's shared MirroredStrategy process (2
# logical CPUs, `strategy`; see `mirrored_results`).
MIRRORED_CASES = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_pxg.keras as dpk
    from tf_pxg.dp import sparse_selection as ss

    V, D, B, L, LR = 4000, 8, 16, 5, 1.0
    rng = np.random.default_rng(5)
    x = rng.integers(0, 40, size=(B, L)).astype(np.int32)
    y = rng.normal(size=(B, 1)).astype(np.float32)

    def build(mech, sigma, strategy=None):
      def make():
        keras.utils.set_random_seed(0)
        m = dpk.DPSequential(
            [keras.Input((L,), dtype="int32"),
             keras.layers.Embedding(V, D, name="table"),
             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)],
            l2_norm_clip=1.0, noise_multiplier=sigma, seed=3,
            noise_mechanism=mech)
        m.compile(optimizer=keras.optimizers.SGD(LR), jit_compile=False,
                  loss=keras.losses.MeanSquaredError(reduction=None))
        m.optimizer.build(m.trainable_variables)
        return m
      if strategy is None:
        return make()
      with strategy.scope():
        return make()

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)

    def mirrored_step(model):
      # Without autograph, as Keras traces fit's step: autograph would
      # convert tf_pxg's whole train step first (~20 s of CPU per process).
      @tf.function(autograph=False)
      def step(batch):
        strategy.run(model.train_step, args=(batch,))
      before = model.layers[0].embeddings.numpy().copy()
      for batch in strategy.experimental_distribute_dataset(ds):
        step(batch)
      return before, model.layers[0].embeddings.numpy().copy()

    def selection():
      out = {}
      # A: no noise, tau = 0: equals one replica's dense DP-SGD step.
      exact = build(ss.DPAdaFEST(threshold=0.0,
                                 selection_noise_multiplier=0.0), 0.0,
                    strategy)
      before, after = mirrored_step(exact)
      dense = build(None, 0.0)
      dense.train_on_batch(x, y)
      want = dense.layers[0].embeddings.numpy()
      out["max_abs_err"] = float(np.max(np.abs(after - want)))
      out["scale"] = float(np.max(np.abs(want - before)))
      untouched = np.setdiff1d(np.arange(V), np.unique(x))
      out["untouched_unchanged"] = bool(np.array_equal(after[untouched],
                                                       before[untouched]))
      # B: tau = 0, sigma_sel = 3: each untouched row selected w.p. 1/2, once
      # for the global batch; its update is the noise, std lr sigma_g C / B.
      sigma, sigma_sel = 1.0, 3.0
      noisy = build(ss.DPAdaFEST(threshold=0.0,
                                 selection_noise_multiplier=sigma_sel), sigma,
                    strategy)
      before, after = mirrored_step(noisy)
      delta = (after - before)[untouched]
      moved = np.any(delta != 0, axis=1)
      out["moved_fraction"] = float(moved.mean())
      out["untouched"] = int(untouched.size)
      out["noise_std"] = float(np.std(delta[moved]))
      out["noise_n"] = int(delta[moved].size)
      out["replicas"] = strategy.num_replicas_in_sync
      return out

    scenarios(selection=selection)
    """)


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


def test_mirrored_strategy_selects_once_for_the_global_batch(mirrored):
  """Two replicas (MirroredStrategy on 2 logical CPUs), one global batch
  of 16 split 8 + 8: with no noise and tau = 0 the table equals one
  replica's dense DP-SGD step (tf_pxg's clipped sum, the sparse path
  off) and untouched rows are bit-for-bit unchanged; with tau = 0 and
  sigma_sel = 3 each untouched row is selected with probability
  Q(0) = 1/2 once (two independent per-replica selections, unioned,
  would select 3/4) and moves by the noise alone, whose std is
  lr sigma_g C / B with sigma_g = (1 - 1/9)^-1/2 (not sqrt(2) or
  1/sqrt(2) times it: the replicas' shares add up to one draw)."""
  r = multi_worker.scenario(mirrored, "selection")
  assert r["replicas"] == 2
  assert r["untouched_unchanged"]
  assert r["max_abs_err"] <= 1e-5 * r["scale"] + 1e-8, r
  n = r["untouched"]
  assert abs(r["moved_fraction"] - 0.5) < 5 * math.sqrt(0.25 / n), r
  want = 1.0 * (1.0 - 1.0 / 9.0)**-0.5 * 1.0 / 16
  # The sample std's sd is about want / sqrt(2 n).
  assert abs(r["noise_std"] - want) < 5 * want / math.sqrt(2 * r["noise_n"]), r


def test_merge_touched_rows_sums_the_parts():
  """Two batches' TouchedRows merged = the TouchedRows of their union
  (each example's clip weight is its own, so the counts add)."""
  rng = np.random.default_rng(4)
  vocab = 60
  a, b = rng.integers(0, vocab, (4, 5)), rng.integers(0, vocab, (3, 5))
  parts = [ss.touched_rows([[tf.constant(i, tf.int64)]], [vocab], 1.0)[0]
           for i in (a, b)]
  cat = ss.TouchedRows(*[tf.concat([p[k] for p in parts], 0)
                         for k in range(3)], parts[0].num + parts[1].num)
  got = ss.merge_touched_rows(cat, vocab)
  want = ss.touched_rows([[tf.constant(np.concatenate([a, b]), tf.int64)]],
                         [vocab], 1.0)[0]
  num = int(want.num)
  assert int(got.num) == num
  np.testing.assert_array_equal(got.rows.numpy()[:num], want.rows.numpy()[:num])
  np.testing.assert_allclose(got.counts.numpy(), np.pad(
      want.counts.numpy(), (0, got.counts.shape[0] - want.counts.shape[0])),
                             rtol=1e-6, atol=1e-7)
  assert np.all(got.rows.numpy()[num:] >= vocab)
