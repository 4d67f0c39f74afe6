"""Tests for tf_pxg.mf (banded Toeplitz strategies, BandMF) against dense
NumPy/SciPy computations written out here."""

import json
import math
import os
import subprocess
import sys
import time

import dp_accounting
import numpy as np
import pytest
from scipy import linalg

from tf_pxg import accounting
from tf_pxg import mf
from tf_pxg.mf import toeplitz

BANDS = [1, 2, 4, 16]


def _prefix_matrix(n):
  return np.tril(np.ones((n, n)))


def _dense_c(coefs, n):
  """C[i, j] = coefs[i - j] for 0 <= i - j < len(coefs), written as loops."""
  c = np.zeros((n, n))
  for i in range(n):
    for j in range(max(0, i - len(coefs) + 1), i + 1):
      c[i, j] = coefs[i - j]
  return c


def _dense_mean_error(coefs, n):
  c = _dense_c(coefs, n)
  workload = _prefix_matrix(n) @ np.linalg.inv(c)
  max_col_norm = np.linalg.norm(c, axis=0).max()
  return np.sum(workload**2) / n * max_col_norm**2


def _strategies(b, n=200):
  out = [mf.BandedToeplitz(b), mf.BandedToeplitz(b, method="optimized",
                                                  steps=n)]
  rng = np.random.default_rng(b)
  coefs = np.concatenate([[1.0], 0.3 * rng.standard_normal(b - 1)])
  out.append(mf.BandedToeplitz(b, coefs=coefs))
  return out


# ---------------------------------------------------------------------------
# Dense identities.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("b", BANDS)
def test_strategy_times_noise_matrix_is_identity(b):
  n = 40
  for s in _strategies(b):
    c, c_inv = s.strategy_matrix(n), s.noise_matrix(n)
    np.testing.assert_array_equal(c, _dense_c(s.coefs, n))
    np.testing.assert_allclose(c @ c_inv, np.eye(n), atol=1e-12)
    np.testing.assert_allclose(c_inv, np.linalg.inv(c), atol=1e-12)
    np.testing.assert_allclose(s.inverse_coefs(n), np.linalg.inv(c)[:, 0],
                               atol=1e-12)
    # Lower-triangular Toeplitz: every diagonal is constant.
    np.testing.assert_array_equal(np.triu(c_inv, 1), 0)


@pytest.mark.parametrize("b", BANDS)
def test_inverse_coefs_follow_the_recurrence(b):
  n = 60
  for s in _strategies(b):
    c = s.coefs
    d = np.zeros(n)
    for k in range(n):
      acc = 1.0 if k == 0 else 0.0
      for j in range(1, min(k, b - 1) + 1):
        acc -= c[j] * d[k - j]
      d[k] = acc / c[0]
    np.testing.assert_allclose(s.inverse_coefs(n), d, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("b", BANDS)
def test_streamed_noise_equals_dense_noise(b):
  """x_i = (z_i - sum_{j>=1} c_j x_{i-j}) / c_0 with b - 1 buffers = C^-1 z."""
  n, dim = 50, 3
  rng = np.random.default_rng(0)
  z = rng.standard_normal((n, dim))
  for s in _strategies(b):
    c = s.coefs
    buffers = [np.zeros(dim) for _ in range(s.num_buffers)]  # x_{i-1}, ...
    streamed = []
    for i in range(n):
      x = z[i].copy()
      for j in range(1, b):
        x -= c[j] * buffers[j - 1]
      x /= c[0]
      buffers = [x] + buffers[:-1] if buffers else []
      streamed.append(x)
    np.testing.assert_allclose(np.array(streamed), s.noise_matrix(n) @ z,
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("b", BANDS)
def test_column_norms_at_most_one_max_one(b):
  for s in _strategies(b):
    assert s.num_bands == b and s.num_buffers == b - 1
    assert s.coefs.dtype == np.float64 and s.coefs.shape == (b,)
    assert s.coefs[0] > 0
    assert np.linalg.norm(s.coefs) <= 1.0
    norms = np.linalg.norm(s.strategy_matrix(3 * b), axis=0)
    # (A column's norm summed in another order may differ by an ulp.)
    assert np.all(norms <= 1 + 4 * np.finfo(float).eps)
    assert norms.max() == pytest.approx(1.0, abs=1e-14)


def test_one_band_is_the_identity_exactly():
  for s in [mf.BandedToeplitz(1), mf.BandedToeplitz(1, coefs=[3.0]),
            mf.BandedToeplitz(1, method="optimized", steps=100),
            mf.BandedToeplitz(1, coefs=[0.1])]:
    assert s.coefs.tolist() == [1.0]
    assert s.num_buffers == 0
    np.testing.assert_array_equal(s.strategy_matrix(7), np.eye(7))
    np.testing.assert_array_equal(s.noise_matrix(7), np.eye(7))
  assert mf.sqrt_coefs(1).tolist() == [1.0]
  assert mf.optimize_coefs(1, 10).tolist() == [1.0]


def test_explicit_coefs_are_normalised():
  raw = np.array([2.0, 1.0, -0.5])
  s = mf.BandedToeplitz(3, coefs=raw)
  np.testing.assert_allclose(s.coefs, raw / np.sqrt(5.25), rtol=1e-15)
  with pytest.raises(ValueError):
    s.coefs[0] = 1.0  # read-only
  for scale in (1e-300, 1e300):
    np.testing.assert_allclose(
        mf.BandedToeplitz(3, coefs=raw * scale).coefs, s.coefs, rtol=1e-15)


# ---------------------------------------------------------------------------
# Coefficient choices.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 2, 5, 16])
def test_sqrt_coefs_are_the_truncated_matrix_square_root(b):
  n = 32
  root = np.real(linalg.sqrtm(_prefix_matrix(n)))
  np.testing.assert_allclose(root @ root, _prefix_matrix(n), atol=1e-12)
  expected = root[:b, 0] / np.linalg.norm(root[:b, 0])
  np.testing.assert_allclose(mf.sqrt_coefs(b), expected, rtol=1e-12)
  np.testing.assert_array_equal(mf.BandedToeplitz(b).coefs, mf.sqrt_coefs(b))


@pytest.mark.parametrize("b", [1, 3, 16])
@pytest.mark.parametrize("n", [1, 5, 50])
def test_mean_error_equals_dense(b, n):
  for s in _strategies(b, n=max(n, b)):
    assert s.mean_error(n) == pytest.approx(
        _dense_mean_error(s.coefs, n), rel=1e-10)


def test_mean_error_of_dp_sgd():
  for n in (1, 10, 1000):
    assert mf.BandedToeplitz(1).mean_error(n) == pytest.approx((n + 1) / 2,
                                                               rel=1e-14)


@pytest.mark.parametrize("b", [4, 16])
def test_optimized_beats_sqrt_and_dp_sgd(b):
  n = 1000
  opt = mf.BandedToeplitz(b, method="optimized", steps=n)
  sqrt_error = mf.BandedToeplitz(b).mean_error(n)
  dp_sgd_error = mf.BandedToeplitz(1).mean_error(n)
  assert opt.mean_error(n) <= sqrt_error
  assert opt.mean_error(n) <= dp_sgd_error
  # Strictly better here (the sqrt is not optimal for the mean error).
  assert opt.mean_error(n) < 0.95 * sqrt_error
  # A local minimum: no small random perturbation is better.
  rng = np.random.default_rng(b)
  for _ in range(20):
    coefs = opt.coefs + 1e-3 * rng.standard_normal(b)
    other = mf.BandedToeplitz(b, coefs=coefs)
    assert other.mean_error(n) >= opt.mean_error(n) * (1 - 1e-9)
  # Its noise recursion is stable: C^-1's coefficients decay.
  assert np.max(np.abs(np.roots(opt.coefs))) < 1
  assert 1 - 1e-14 <= np.linalg.norm(opt.coefs) <= 1.0


def test_optimize_ten_thousand_steps_sixteen_bands_is_fast():
  start = time.perf_counter()
  coefs = mf.optimize_coefs(16, 10_000)
  elapsed = time.perf_counter() - start
  assert elapsed < 15, elapsed
  n = 10_000
  assert (mf.BandedToeplitz(16, coefs=coefs).mean_error(n) <
          mf.BandedToeplitz(16).mean_error(n))


# ---------------------------------------------------------------------------
# Config, equality, repr.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("b", BANDS)
def test_config_round_trip_is_exact(b):
  for s in _strategies(b):
    config = json.loads(json.dumps(s.get_config()))
    assert config == {"num_bands": b, "coefs": s.coefs.tolist()}
    back = mf.BandedToeplitz.from_config(config)
    assert back == s and hash(back) == hash(s)
    np.testing.assert_array_equal(back.coefs, s.coefs)
    rebuilt = eval(repr(s), {"BandedToeplitz": mf.BandedToeplitz})  # pylint: disable=eval-used
    np.testing.assert_array_equal(rebuilt.coefs, s.coefs)


def test_equality():
  assert mf.BandedToeplitz(4) == mf.BandedToeplitz(4, coefs=mf.sqrt_coefs(4))
  assert mf.BandedToeplitz(4) != mf.BandedToeplitz(2)
  assert mf.BandedToeplitz(2) != mf.BandedToeplitz(2, coefs=[1.0, 0.1])
  assert mf.BandedToeplitz(1) != "BandedToeplitz(1)"


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------

BAD = [
    (dict(num_bands=0), "num_bands"),
    (dict(num_bands=-2), "num_bands"),
    (dict(num_bands=2.0), "num_bands"),
    (dict(num_bands=True), "num_bands"),
    (dict(num_bands=3, coefs=[1.0, 0.5]), "length num_bands = 3"),
    (dict(num_bands=2, coefs=[[1.0, 0.5]]), "length num_bands"),
    (dict(num_bands=2, coefs=[1.0, math.nan]), "finite"),
    (dict(num_bands=2, coefs=[1.0, math.inf]), "finite"),
    (dict(num_bands=2, coefs=[0.0, 1.0]), "coefs[0]"),
    (dict(num_bands=2, coefs=[-1.0, 0.5]), "coefs[0]"),
    (dict(num_bands=2, coefs=["a", "b"]), "coefs"),
    (dict(num_bands=4, method="optimized"), "steps"),
    (dict(num_bands=4, method="lbfgs"), "method"),
    (dict(num_bands=4, method="optimized", steps=2), "num_bands <= 2"),
    (dict(num_bands=4, method="optimized", steps=0), "steps"),
]


@pytest.mark.parametrize("kwargs,text", BAD)
def test_constructor_errors(kwargs, text):
  with pytest.raises(ValueError) as info:
    mf.BandedToeplitz(**kwargs)
  assert text in str(info.value)


def test_function_errors():
  with pytest.raises(ValueError, match="num_bands"):
    mf.sqrt_coefs(0)
  with pytest.raises(ValueError, match="steps"):
    mf.optimize_coefs(4, 0)
  with pytest.raises(ValueError, match="n must be a positive integer"):
    mf.BandedToeplitz(2).noise_matrix(0)


# ---------------------------------------------------------------------------
# choose_num_bands.
# ---------------------------------------------------------------------------

def _event(q, sigma, rounds):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), rounds)


def _rdp_epsilon(event, delta):
  orders = ([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) +
            [128, 256, 512, 1024])
  return dp_accounting.rdp.RdpAccountant(orders).compose(event).get_epsilon(
      delta)


RUN = dict(num_examples=20000, batch_size=100, epochs=1, target_epsilon=2.0,
           delta=1e-5)
RUN_STEPS = 200  # ceil(1 * 20000 / 100)


def test_choose_num_bands_minimises_sigma_squared_times_mean_error():
  choice = mf.choose_num_bands(**RUN, candidates=[1, 4, 16], method="sqrt")
  steps = RUN_STEPS
  rows = {row["num_bands"]: row for row in choice.candidates}
  assert sorted(rows) == [1, 4, 16]
  for b, row in rows.items():
    sigma = row["noise_multiplier"]
    # sigma reaches the target with the amplified BandMF accounting, checked
    # on dp_accounting directly: ceil(T / b) rounds at q = B b / N.
    event = _event(100 * b / 20000, sigma, math.ceil(steps / b))
    assert _rdp_epsilon(event, 1e-5) <= 2.0
    assert _rdp_epsilon(
        _event(100 * b / 20000, sigma - 2e-4, math.ceil(steps / b)),
        1e-5) > 2.0
    assert row["mean_error"] == pytest.approx(
        _dense_mean_error(mf.sqrt_coefs(b), steps), rel=1e-10)
    assert row["expected_error"] == pytest.approx(
        sigma**2 * row["mean_error"], rel=1e-12)
  best = min(rows, key=lambda b: rows[b]["expected_error"])
  assert choice.num_bands == best
  assert choice.strategy == mf.BandedToeplitz(best)
  assert choice.noise_multiplier == rows[best]["noise_multiplier"]
  assert choice.expected_error == rows[best]["expected_error"]
  # Correlated noise wins over DP-SGD here.
  assert best > 1


def test_choose_num_bands_default_candidates_respect_n_over_b_and_steps(
    monkeypatch):
  tried = []

  def fake_noise_multiplier(*args, min_separation, **kwargs):
    del args, kwargs
    tried.append(min_separation)
    return 1.0 / min_separation  # makes the largest b win

  monkeypatch.setattr(accounting, "noise_multiplier_for_epsilon",
                      fake_noise_multiplier)
  # N // B = 5: b in {1, 2, 4}.
  choice = mf.choose_num_bands(num_examples=500, batch_size=100, epochs=2,
                               target_epsilon=4.0, delta=1e-4, method="sqrt")
  assert tried == [1, 2, 4]
  assert [r["num_bands"] for r in choice.candidates] == [1, 2, 4]
  assert choice.num_bands == 4 and choice.noise_multiplier == 0.25
  # 3 steps: b in {1, 2}.
  tried.clear()
  choice = mf.choose_num_bands(num_examples=10_000, batch_size=100,
                               epochs=0.03, target_epsilon=4.0, delta=1e-4,
                               method="sqrt")
  assert tried == [1, 2]
  # Large N / B and many steps: all seven.
  tried.clear()
  mf.choose_num_bands(num_examples=100_000, batch_size=100, epochs=1,
                      target_epsilon=4.0, delta=1e-6, method="sqrt")
  assert tried == [1, 2, 4, 8, 16, 32, 64]


def test_choose_num_bands_optimized():
  choice = mf.choose_num_bands(**RUN, candidates=[8])
  assert choice.strategy == mf.BandedToeplitz(8, method="optimized",
                                              steps=RUN_STEPS)


@pytest.mark.parametrize("candidates,text", [
    ([201], "<= num_examples // batch_size = 200"),
    ([0], "num_bands"),
    ([], "non-empty"),
])
def test_choose_num_bands_errors(candidates, text):
  with pytest.raises(ValueError) as info:
    mf.choose_num_bands(**RUN, candidates=candidates, method="sqrt")
  assert text in str(info.value)


def test_choose_num_bands_candidate_above_steps():
  with pytest.raises(ValueError, match="<= steps = 10; the largest allowed "
                     "is 10"):
    mf.choose_num_bands(**dict(RUN, epochs=0.05), candidates=[16])


def test_choose_num_bands_other_errors():
  with pytest.raises(ValueError, match="method"):
    mf.choose_num_bands(**RUN, method="best")
  with pytest.raises(ValueError, match="0 steps"):
    mf.choose_num_bands(**dict(RUN, epochs=0))


def test_module_needs_no_tensorflow():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import sys, tf_pxg.mf; s = tf_pxg.mf.BandedToeplitz(4); "
          "s.mean_error(10); print('tensorflow' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], check=True,
                       capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=repo)).stdout
  assert out.strip() == "False"


def test_exports():
  assert set(mf.__all__) >= {"BandedToeplitz", "choose_num_bands",
                             "optimize_coefs", "sqrt_coefs"}
  assert toeplitz.BandedToeplitz is mf.BandedToeplitz
  assert accounting.max_num_bands(20000, 100) == 200
