"""A test of the test: a small one-run audit through `fit` with
`tf_pxg.audit.CanaryCallback` rejects a broken mechanism (no noise) that
claims ε = 1, and does not reject the correct one.

Synthetic data (no download, no scikit-learn): 300 examples around 10
class centres in R^16, and m = 200 out-of-distribution canaries (uniform
on [-4, 4]^16, random labels), each included with probability 1/2.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from tf_pxg import accounting  # noqa: E402
from tf_pxg import audit  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402

CLAIM, DELTA, BATCH, EPOCHS, M = 1.0, 1e-5, 32, 40, 200


def _audit(noise_factor, seed=0):
  rng = np.random.default_rng(seed)
  centres = rng.standard_normal((10, 16)).astype("float32")
  y = rng.integers(0, 10, 300).astype("int32")
  x = centres[y] + 0.3 * rng.standard_normal((300, 16)).astype("float32")
  canaries = audit.CanaryCallback.out_of_distribution(
      M, (16,), 10, low=-4.0, high=4.0, seed=seed)
  x_all, y_all = canaries.insert(x, y)
  n = len(x_all)
  sigma = accounting.noise_multiplier_for_epsilon(CLAIM, n, BATCH,
                                                  epochs=EPOCHS, delta=DELTA)
  keras.utils.set_random_seed(seed)
  model = dpk.DPSequential(
      [keras.Input((16,)), keras.layers.Dense(64, activation="tanh"),
       keras.layers.Dense(10)],
      l2_norm_clip=1.0, noise_multiplier=sigma * noise_factor)
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  # The claim (σ) is accounted apart from the model, whose plan has the
  # broken noise: an unattached PrivacyCallback, whose budget becomes the
  # model's step limit.
  claim = dpk.PrivacyCallback(num_examples=n, batch_size=BATCH,
                              noise_multiplier=sigma, delta=DELTA,
                              target_epsilon=CLAIM)
  model.set_step_limit(claim.max_steps())
  model.fit(x_all, y_all, batch_size=BATCH, epochs=EPOCHS, verbose=0,
            callbacks=[canaries])
  auditor = canaries.auditor
  assert auditor.m == M
  assert len(auditor.in_scores) == canaries.num_included
  bound = max(auditor.epsilon_one_run(0.05, DELTA),
              auditor.epsilon_one_run(0.05, DELTA, one_sided=False))
  return claim.epsilon(int(model.optimizer.iterations.numpy())), bound, auditor


def test_audit_rejects_a_run_without_noise():
  claimed, bound, auditor = _audit(noise_factor=0.0)
  assert claimed <= CLAIM
  assert bound > claimed, (bound, claimed, auditor.summary(delta=DELTA))


def test_audit_does_not_reject_the_correct_mechanism():
  claimed, bound, auditor = _audit(noise_factor=1.0)
  assert bound <= claimed, (bound, claimed, auditor.summary(delta=DELTA))


def test_canary_callback_inclusion_and_errors():
  c = audit.CanaryCallback(np.zeros((1000, 2)), np.zeros(1000), seed=1)
  # Binomial(1000, 1/2): within 5 std of 500.
  assert abs(c.num_included - 500) < 5 * np.sqrt(250)
  x, y = c.insert(np.ones((3, 2)), np.ones(3))
  assert len(x) == 3 + c.num_included == len(y)
  with pytest.raises(ValueError, match="at least 2 canaries"):
    audit.CanaryCallback(np.zeros((1, 2)), np.zeros(1))
  with pytest.raises(ValueError, match="score must be one of"):
    audit.CanaryCallback(np.zeros((4, 2)), np.zeros(4), score="auc")
