"""Gradient canaries through `fit`: the one-run audit catches each broken
mechanism (no noise, noise / 10, no clipping) that claims ε = 1, and does
not flag the correct one.

Synthetic data (no download): 300 examples around 10 class centres in
R^16, a 16-32-10 MLP (874 parameters) trained with plain SGD on Poisson
batches (q = 32 / 300) for 15 epochs (141 logical steps). m = 800 Dirac
gradient canaries of norm 100 C (`tf_pxg.audit.CanaryCallback.gradient`),
each "in" with probability 1/2 and Poisson-sampled into steps at q, scored
by the likelihood ratio of their released projections. The verdict uses the
Gaussian f-DP one-run bound at significance 0.01 with two rules, each
asserted: `MultiSplit`, and the example's pre-declared rule
(`examples/audit_digits.py`: "in" for the top 2 % of the scores and "out"
for the bottom 2 %, `TopFraction(0.02, two_sided=True)`).

Not flaky, by construction and by the theorem:
* every random choice is seeded (data, weights, the sampler, the noise
  generator, the canaries' inclusion, directions and sampling coins), so
  each test is one fixed draw;
* correct run: each f-DP bound exceeds the claim with probability at most
  the significance, 0.01, over those draws, because the accountant's
  privacy profile implies the Gaussian claim the bound tests (asserted:
  `gdp_covers`); the draw here gives bounds far below 1;
* broken runs: the bounds measured here (`MultiSplit` / the example's rule:
  no noise 5.98 / 2.45, noise / 10 4.37 / 2.45, no clip 6.05 / 2.45,
  against the claim 1; the correct run 0.28 / 0.30) leave a wide margin:
  the canaries' per-step signal is 10× (noise / 10) or 100× (no clip, norm
  100 C) the claimed one, and infinite without noise. (The example's rule
  makes 32 guesses at m = 800; all 32 right give 2.45.)
Four fits of 12-21 s each here on 2 shared cores (57 s for the four tests). The exactness tests (no noise, every
real example weighted 0) check each canary's contribution through the real
clip, accumulation, BandMF, SGD and a MirroredStrategy of 2 replicas.
"""

import os
import textwrap

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from tf_pxg import accounting  # noqa: E402
from tf_pxg import audit  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402

CLAIM, DELTA, N, BATCH, EPOCHS, M = 1.0, 1e-5, 300, 32, 15, 800
SIGNIFICANCE = 0.01
STRATEGIES = (audit.MultiSplit(num_samples=11, seed=0),
              audit.TopFraction(0.02, two_sided=True))


def _audit(break_mode, seed=0):
  rng = np.random.default_rng(seed)
  centres = rng.standard_normal((10, 16)).astype("float32")
  y = rng.integers(0, 10, N).astype("int32")
  x = centres[y] + 0.3 * rng.standard_normal((N, 16)).astype("float32")
  sigma = accounting.noise_multiplier_for_epsilon(CLAIM, N, BATCH,
                                                  epochs=EPOCHS, delta=DELTA)
  clip, noise = 1.0, sigma
  if break_mode == "no_noise":
    noise = 0.0
  elif break_mode == "noise_div_10":
    noise = sigma / 10
  elif break_mode == "no_clip":
    clip, noise = 1e9, sigma / 1e9      # noise std stays sigma * 1.0
  keras.utils.set_random_seed(seed)
  model = dpk.DPSequential(
      [keras.Input((16,)), keras.layers.Dense(32, activation="tanh"),
       keras.layers.Dense(10)],
      l2_norm_clip=clip, noise_multiplier=noise, seed=seed)
  model.compile(optimizer=keras.optimizers.SGD(0.5),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  canaries = audit.CanaryCallback.gradient(
      M, 100.0, accounting.sampling_probability(N, BATCH), seed=seed + 1,
      score="likelihood", noise_multiplier=sigma)
  # The claim (σ) is accounted apart from the model, whose plan has the
  # broken noise: an unattached PrivacyCallback, whose budget becomes the
  # model's step limit.
  claim = dpk.PrivacyCallback(num_examples=N, batch_size=BATCH,
                              noise_multiplier=sigma, delta=DELTA,
                              target_epsilon=CLAIM)
  model.set_step_limit(claim.max_steps())
  model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
            sampling_seed=seed, callbacks=[canaries])
  assert canaries.projections.shape == (
      int(model.optimizer.iterations.numpy()), M)
  bounds = [canaries.auditor.epsilon_one_run_fdp(
      SIGNIFICANCE, DELTA, threshold_strategy=rule) for rule in STRATEGIES]
  return (claim.epsilon(int(model.optimizer.iterations.numpy())), bounds,
          canaries)


@pytest.mark.parametrize("break_mode", ["no_noise", "noise_div_10",
                                        "no_clip"])
def test_gradient_canaries_catch_a_broken_mechanism(break_mode):
  claimed, bounds, canaries = _audit(break_mode)
  assert claimed <= CLAIM
  assert min(bounds) > claimed, (break_mode, bounds, canaries.auditor)


def test_gradient_canaries_do_not_flag_the_correct_mechanism():
  claimed, bounds, canaries = _audit("none")
  event = accounting.dp_event(N, BATCH, canaries.noise_multiplier,
                              epochs=EPOCHS)
  assert audit.gdp_covers(event, claimed, DELTA)
  assert max(bounds) <= claimed, (bounds, canaries.auditor)
  # The hook is gone after fit: a later fit adds no canaries.
  state = canaries.model.optimizer.step_state
  assert state.audit is None and state.clipped_sum_hook is None


def test_no_canaries_no_change():
  """Without canaries the hook returns the very same sums."""
  from tf_pxg.audit import gradient_canaries  # noqa: PLC0415
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  sums = [object(), object()]
  out = gradient_canaries.add_gradient_canaries(
      model, sums, model.trainable_variables, None, 1.0)
  assert out is sums


def test_gradient_canary_errors():
  with pytest.raises(ValueError, match="at least 2"):
    audit.CanaryCallback.gradient(1, 10.0, 0.1)
  with pytest.raises(ValueError, match="sampling_probability"):
    audit.CanaryCallback.gradient(10, 10.0, 0.0)
  with pytest.raises(ValueError, match="direction"):
    audit.CanaryCallback.gradient(10, 10.0, 0.1, direction="sideways")
  with pytest.raises(ValueError, match="noise_multiplier"):
    audit.CanaryCallback.gradient(10, 10.0, 0.1, score="likelihood")
  c = audit.CanaryCallback.gradient(10, 10.0, 0.1, seed=0)
  with pytest.raises(ValueError, match="nothing to insert"):
    c.insert(np.zeros((2, 3)), np.zeros(2))
  with pytest.raises(ValueError, match="none has ended"):
    c.audit()
  with pytest.raises(ValueError, match="distinct"):
    c.gradient_canaries.directions(5)


def _exact_contributions(num_bands, clip, strategy=None, accumulation=1):
  """max |projection - expected| of a run where the canaries are the only
  gradient (module's exactness test), and the number of canary additions."""
  import contextlib  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  from tf_pxg import mf  # noqa: PLC0415
  n, batch, lr, norm = 64, 8, 0.1, 10.0
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, 5)).astype("float32")
  y = rng.integers(0, 4, n).astype("int32")
  extra = {} if num_bands == 1 else {"noise_mechanism":
                                     mf.BandedToeplitz(num_bands)}
  with (strategy.scope() if strategy else contextlib.nullcontext()):
    model = dpk.DPSequential([keras.Input((5,)), keras.layers.Dense(4)],
                             l2_norm_clip=clip, noise_multiplier=0.0,
                             seed=0, **extra)
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  q = accounting.sampling_probability(n, batch, num_bands)
  canaries = audit.CanaryCallback.gradient(20, norm, q, num_bands=num_bands,
                                           seed=3)
  model.fit(x, y, sample_weight=np.zeros(n, "float32"), batch_size=batch,
            epochs=2, verbose=0, sampling_seed=0, callbacks=[canaries],
            accumulation_steps=accumulation)
  g = canaries.gradient_canaries
  steps = canaries.projections.shape[0]
  assert steps == int(model.optimizer.iterations.numpy()) > 0
  want = np.zeros((steps, g.m))
  for t in range(steps):
    coins = tf.random.stateless_uniform(
        [g.m], seed=tf.constant([g.sampling_seed, t], tf.int64)).numpy()
    take = (coins < q) & g.included
    if num_bands > 1:
      take &= g.groups == t % num_bands
    want[t] = take * min(norm, clip)
  # -Δw = lr * (sum) / (q N / b): the projections are in weight units.
  got = canaries.projections * (q * n / num_bands) / lr
  return float(np.abs(got - want).max()), float(want.sum())


@pytest.mark.parametrize("num_bands,clip,accumulation", [
    (1, 1.0, 1), (2, 1.0, 1), (1, 1e9, 1), (1, 1.0, 3)])
def test_canary_contributions_are_exact(num_bands, clip, accumulation):
  """With every real example weighted 0 and no noise, the released update
  is the canaries' alone: each projection must be, exactly, the canary's
  clipped norm at the steps where its coins (replayed here) put it in —
  through the real clip (1e9: no clipping, the full norm), the Poisson
  accumulation (3 physical batches per logical step: added once, at the
  last), BandMF's correlated-noise path (b = 2: cyclic groups) and SGD —
  and 0 elsewhere."""
  err, total = _exact_contributions(num_bands, clip,
                                    accumulation=accumulation)
  assert err < 1e-4 and total > 0


_MIRRORED = """
import json, sys
import tensorflow as tf
{mirrored}
sys.path.insert(0, {tests!r})
import test_audit_gradient as t
err, total = t._exact_contributions(1, 1.0, strategy)
print("RESULT", json.dumps(dict(err=err, total=total,
                                replicas=strategy.num_replicas_in_sync)))
"""


def test_canary_contributions_are_exact_under_mirrored_strategy():
  """Two replicas: each sampled canary is added once (by replica 0), not
  once per replica, and the all-reduced update carries it exactly."""
  import _multi_worker  # noqa: PLC0415  (tests/ is on sys.path)
  code = textwrap.dedent(_MIRRORED).format(
      mirrored=_multi_worker.MIRRORED_TWO_CPUS,
      tests=os.path.dirname(os.path.abspath(__file__)))
  result = _multi_worker.run_script(code, timeout=240)
  assert result["replicas"] == 2
  assert result["err"] < 1e-4 and result["total"] > 0, result
