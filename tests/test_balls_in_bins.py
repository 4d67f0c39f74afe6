"""Tests for balls-in-bins sampling (tf_pxg.data.balls_in_bins): each
example in exactly one step per epoch, bins uniform and independent across
epochs, the stated upper bound against an independent closed form (the
analytic Gaussian mechanism), the Monte-Carlo accountant against closed
forms (two bins: a one-dimensional integral of Black-Scholes terms; one
bin: the Gaussian mechanism, Poisson at q = 1) and against Poisson's ε
where theory says they meet (large sigma), a fit whose PrivacyCallback
composes the sampler's event, and that nothing outside its two files names
it in code."""

import ast
import functools
import math
import pathlib

import keras
import numpy as np
import pytest
import dp_accounting
from scipy import integrate
from scipy import optimize
from scipy import stats
import tensorflow as tf

import tf_pxg
from tf_pxg import accounting
from tf_pxg.data import balls_in_bins
from tf_pxg.data import balls_in_bins_accounting as bba
from tf_pxg.data import sampling_ops
from tf_pxg.dp import mechanisms

BallsInBinsSampler = balls_in_bins.BallsInBinsSampler


def test_every_example_in_exactly_one_step_per_epoch():
  sampler = BallsInBinsSampler(50, 10, seed=4)
  assert sampler.num_bins == 5 and sampler.expected_batch_size == 10.0
  for epoch in range(3):
    steps = [sampler.indices_for_step(epoch * 5 + j) for j in range(5)]
    joined = np.concatenate(steps)
    np.testing.assert_array_equal(np.sort(joined), np.arange(50))
  # Another epoch, another assignment.
  assert not all(np.array_equal(sampler.indices_for_step(j),
                                sampler.indices_for_step(5 + j))
                 for j in range(5))


def test_stream_is_the_masked_layout_of_the_same_bins():
  sampler = BallsInBinsSampler(40, 8, physical_batch_size=16, seed=2)
  stream = sampling_ops.index_stream(sampler, start_step=5, num_steps=5)
  seen = []
  for idx, mask, _ in stream.as_numpy_iterator():
    seen.extend(idx[mask > 0].tolist())
  np.testing.assert_array_equal(np.sort(seen), np.arange(40))
  want = np.concatenate([sampler.indices_for_step(s) for s in range(5, 10)])
  np.testing.assert_array_equal(np.sort(seen), np.sort(want))


def test_bins_are_uniform_and_independent_across_epochs():
  n, k, epochs = 400, 4, 30
  sampler = BallsInBinsSampler(n, n // k, seed=7)
  bins = np.empty([epochs, n], np.int64)
  for e in range(epochs):
    for j in range(k):
      bins[e, sampler.indices_for_step(e * k + j)] = j
  counts = np.bincount(bins.ravel(), minlength=k)
  assert stats.chisquare(counts).pvalue > 1e-4
  same = (bins[1:] == bins[:-1]).mean()  # 1/k if independent
  assert abs(same - 1 / k) < 4 * math.sqrt((1 / k) * (1 - 1 / k) /
                                           ((epochs - 1) * n))


def _analytic_gaussian_epsilon(mu: float, delta: float) -> float:
  """ε of the Gaussian mechanism with mu = sensitivity / std (Balle and
  Wang 2018, Theorem 8): delta(eps) = Phi(-eps/mu + mu/2) -
  e^eps Phi(-eps/mu - mu/2)."""
  def gap(eps):
    return (stats.norm.cdf(-eps / mu + mu / 2) -
            math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta)
  return optimize.brentq(gap, 0.0, 500.0)


def test_event_is_one_gaussian_per_epoch_against_the_closed_form():
  sampler = BallsInBinsSampler(1000, 100, seed=1)
  sigma, steps, delta = 1.2, 35, 1e-5  # 4 epochs begun
  event = sampler.dp_event(mechanisms.IndependentGaussian(), sigma, steps)
  # E Gaussians of sensitivity 1, std sigma: one of mu = sqrt(E) / sigma.
  want = _analytic_gaussian_epsilon(math.sqrt(4) / sigma, delta)
  got = accounting.event_epsilon(event, delta, "pld")
  assert want <= got <= 1.02 * want
  # The bound is above Poisson's ε at the same rate (no amplification).
  poisson = accounting.compute_epsilon(1000, 100, sigma, steps=steps,
                                       delta=delta)
  assert got > poisson
  with pytest.raises(ValueError, match="per-step mechanism"):
    from tf_pxg import mf  # noqa: PLC0415
    sampler.dp_event(mechanisms.BandMF(mf.BandedToeplitz(2)), sigma, steps)
  with pytest.raises(ValueError, match="secure mode"):
    BallsInBinsSampler(10, 2, secure_mode=True)


def _two_bin_deltas(sigma: float, eps: float):
  """Exact (remove, add) δ(ε) of one epoch with k = 2 bins.

  With u = (x1 + x2) / √2 and v = (x1 - x2) / √2 (independent N(0, σ²)
  under Q), P/Q = A(u) B(v), A = exp((u / √2 - 1/2) / σ²) lognormal
  (log-mean -1/(2σ²), log-variance 1/(2σ²)), B = cosh(v / (√2 σ²)): the
  u-integral is a Black-Scholes call/put, the v-integral is quadrature.
  remove: E_Q[max(0, AB - e^ε)]; add: E_Q[max(0, 1 - e^ε AB)].
  """
  m, s = -0.5 / sigma**2, math.sqrt(0.5) / sigma
  mean_a = math.exp(m + s * s / 2)
  phi = stats.norm.cdf

  def call(c, strike):  # E[max(0, c A - strike)]
    k = math.log(strike / c)
    return c * mean_a * phi((m + s * s - k) / s) - strike * phi((m - k) / s)

  def put(c, strike):  # E[max(0, strike - c A)]
    k = math.log(strike / c)
    return strike * phi((k - m) / s) - c * mean_a * phi((k - m - s * s) / s)

  b = lambda v: math.cosh(v / (math.sqrt(2) * sigma**2))  # noqa: E731
  w = lambda v: stats.norm.pdf(v, scale=sigma)  # noqa: E731
  lim = 12 * sigma
  remove = integrate.quad(lambda v: w(v) * call(b(v), math.exp(eps)),
                          -lim, lim, epsabs=1e-12)[0]
  add = integrate.quad(lambda v: w(v) * put(math.exp(eps) * b(v), 1.0),
                       -lim, lim, epsabs=1e-12)[0]
  return remove, add


def test_monte_carlo_losses_match_the_two_bin_closed_form():
  sigma, eps, n = 0.7, 0.4, 100_000
  exact = _two_bin_deltas(sigma, eps)
  for remove, want in zip((True, False), exact):
    loss = bba.privacy_loss_samples(sigma, 2, 1, n, seed=5, remove=remove)
    f = np.maximum(0.0, -np.expm1(eps - loss))
    se = f.std() / math.sqrt(n)
    assert abs(f.mean() - want) <= 5 * se, (remove, f.mean(), want, se)
    # The 0.999 upper confidence bound is above the truth for this draw.
    assert bba.delta_upper_bound(f.mean(), n, 1e-3) >= want


def _gaussian_pld_epsilon(event, delta):
  accountant = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-4)
  return accountant.compose(event).get_epsilon(delta)


def test_one_bin_is_the_gaussian_mechanism_and_poisson_at_rate_one():
  """k = 1: every example in every step, E Gaussians, i.e. one of
  mu = sqrt(E) / sigma (closed form), and Poisson at q = 1."""
  sigma, epochs, delta = 1.5, 3, 1e-3
  got = bba.monte_carlo_epsilon(sigma, 1, epochs, delta, num_samples=100_000,
                                seed=2)
  want = _analytic_gaussian_epsilon(math.sqrt(epochs) / sigma, delta)
  poisson = _gaussian_pld_epsilon(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          1.0, dp_accounting.GaussianDpEvent(sigma)), epochs), delta)
  np.testing.assert_allclose(poisson, want, rtol=2e-3)
  np.testing.assert_allclose(got.estimate, want, rtol=0.03)
  assert got.estimate <= got.epsilon and want <= got.epsilon <= 1.1 * want
  assert (got.confidence, got.num_samples, got.num_epochs) == (0.99, 100_000,
                                                               3)


def test_monte_carlo_meets_poisson_as_sigma_grows():
  """Both pairs tend to the same Gaussian as sigma grows (their privacy
  losses' variances are E (e^(1/σ²) - 1) / k to first order: Chua et al.,
  and the Poisson CLT of Dong, Roth, Su 2022), so the ratio of the
  balls-in-bins ε to Poisson's at q = 1/k tends to 1 (it is below 1 at
  small sigma: Chua et al.'s 'similar-or-better')."""
  k, delta = 10, 1e-2
  ratio = {}
  for sigma in (2.0, 8.0):
    got = bba.monte_carlo_epsilon(sigma, k, 1, delta, num_samples=100_000,
                                  seed=3)
    poisson = _gaussian_pld_epsilon(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            1 / k, dp_accounting.GaussianDpEvent(sigma)), k), delta)
    ratio[sigma] = got.estimate / poisson
  assert 0.8 < ratio[2.0] < 0.97, ratio
  assert abs(ratio[8.0] - 1) < 0.03 and abs(ratio[8.0] - 1) < abs(
      ratio[2.0] - 1), ratio


def test_sampler_monte_carlo_epsilon_monotone_reproducible_under_bound():
  mech = mechanisms.IndependentGaussian()
  options = dict(accounting="monte_carlo", num_samples=50_000,
                 accounting_seed=7)
  sampler = BallsInBinsSampler(1000, 100, seed=1, **options)
  steps, delta = 15, 1e-3  # 2 epochs begun
  eps = {s: sampler.monte_carlo_epsilon(mech, s, steps, delta)
         for s in (1.0, 1.5)}
  assert eps[1.0].num_epochs == 2 and eps[1.0].num_bins == 10
  assert eps[1.0].epsilon > eps[1.5].epsilon
  certified = {s: accounting.event_epsilon(
      sampler.dp_event(mech, s, steps), delta, "pld") for s in eps}
  for s, mc in eps.items():
    assert mc.estimate <= mc.epsilon < certified[s]
    assert sampler.epsilon(mech, s, steps, delta) == mc.epsilon
  # Same seed, same ε (a new sampler, no cache); another seed differs.
  again = BallsInBinsSampler(1000, 100, **options)
  assert again.monte_carlo_epsilon(mech, 1.0, steps, delta) == eps[1.0]
  other = bba.monte_carlo_epsilon(1.0, 10, 2, delta, num_samples=50_000,
                                  seed=8)
  assert other.epsilon != eps[1.0].epsilon
  # The default states the certified bound; configured() reaches fit.
  assert BallsInBinsSampler(1000, 100).epsilon(
      mech, 1.0, steps, delta) == certified[1.0]
  cls = BallsInBinsSampler.configured(accounting="monte_carlo",
                                      confidence=0.9)
  made = cls(1000, 100)
  assert isinstance(made, BallsInBinsSampler) and issubclass(
      cls, tf_pxg.data.PoissonSampler)
  assert (made.accounting, made.confidence) == ("monte_carlo", 0.9)
  with pytest.raises(ValueError, match="accounting must be one of"):
    BallsInBinsSampler(10, 2, accounting="exact")
  with pytest.raises(ValueError, match="confidence must be in"):
    BallsInBinsSampler(10, 2, confidence=1.0)


def test_fit_uses_the_sampler_and_the_callback_composes_its_event():
  keras.utils.set_random_seed(0)
  x = np.random.RandomState(0).randn(64, 3).astype(np.float32)
  y = np.random.RandomState(1).randn(64, 1).astype(np.float32)
  model = tf_pxg.keras.DPSequential(
      [keras.Input([3]), keras.layers.Dense(1)], l2_norm_clip=1.0,
      noise_multiplier=1.0, seed=1)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  callback = tf_pxg.keras.PrivacyCallback(num_examples=64, batch_size=16)
  history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                      sampling=BallsInBinsSampler.configured(
                          accounting="monte_carlo", num_samples=1000),
                      sampling_seed=3, callbacks=[callback])
  assert int(model.optimizer.iterations.numpy()) == 8
  sampler = model.dp_plan.sampler
  assert isinstance(sampler, BallsInBinsSampler) and (
      sampler.accounting, sampler.num_samples) == ("monte_carlo", 1000)
  # The callback composes events: it logs the certified bound.
  want = accounting.event_epsilon(
      BallsInBinsSampler(64, 16, seed=0).dp_event(
          mechanisms.IndependentGaussian(), 1.0, 8), 1e-5)
  np.testing.assert_allclose(history.history["epsilon"][-1], want,
                             rtol=1e-12)


@functools.lru_cache(maxsize=None)
def _code_names(path: pathlib.Path) -> frozenset:
  """Imported module names and identifiers used in code (not strings).
  Memoised: both cases of `test_added_in_one_file` read the same files
  (the library's ~1.4 MB of source, parsed once instead of twice)."""
  tree = ast.parse(path.read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      names.add(node.module or "")
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.Name):
      names.add(node.id)
    elif isinstance(node, ast.Attribute):
      names.add(node.attr)
  return frozenset(names)


@pytest.mark.parametrize("modules,names", [
    (("data/balls_in_bins.py", "data/balls_in_bins_accounting.py"),
     {"balls_in_bins", "BallsInBinsSampler"}),
    (("dp/blt.py",), {"blt", "BLT"}),
])
def test_added_in_one_file(modules, names):
  """No other tf_pxg module imports or names it in code: no switch (the
  sampler and its Monte-Carlo accountant are balls-in-bins' two files)."""
  root = pathlib.Path(tf_pxg.__file__).parent
  users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                 if str(p.relative_to(root)) not in modules and
                 any(n in m for m in _code_names(p) for n in names))
  assert users == [], users
