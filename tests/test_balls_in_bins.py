"""Tests for balls-in-bins sampling (tf_pxg.data.balls_in_bins): each
example in exactly one step per epoch, bins uniform and independent across
epochs, the stated upper bound against an independent closed form (the
analytic Gaussian mechanism), a fit whose PrivacyCallback composes the
sampler's event, and that nothing outside its file names it in code."""

import ast
import math
import pathlib

import keras
import numpy as np
import pytest
from scipy import optimize
from scipy import stats
import tensorflow as tf

import tf_pxg
from tf_pxg import accounting
from tf_pxg.data import balls_in_bins
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
                      sampling=BallsInBinsSampler, sampling_seed=3,
                      callbacks=[callback])
  assert int(model.optimizer.iterations.numpy()) == 8
  want = accounting.event_epsilon(
      BallsInBinsSampler(64, 16, seed=0).dp_event(
          mechanisms.IndependentGaussian(), 1.0, 8), 1e-5)
  np.testing.assert_allclose(history.history["epsilon"][-1], want,
                             rtol=1e-12)


def _code_names(path: pathlib.Path) -> set:
  """Imported module names and identifiers used in code (not strings)."""
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
  return names


@pytest.mark.parametrize("module,names", [
    ("data/balls_in_bins.py", {"balls_in_bins", "BallsInBinsSampler"}),
    ("dp/blt.py", {"blt", "BLT"}),
])
def test_added_in_one_file(module, names):
  """No other tf_pxg module imports or names it in code: no switch."""
  root = pathlib.Path(tf_pxg.__file__).parent
  users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                 if str(p.relative_to(root)) != module and
                 any(n in m for m in _code_names(p) for n in names))
  assert users == [], users
