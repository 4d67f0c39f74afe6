"""The DP-step helpers of `tf_pxg.testing` against hand-computed steps.

`expected_dp_sgd_weights` and `assert_dp_step_matches_reference` are the
oracle of several DP `fit` tests, so they are checked here on numbers worked
out by hand, and the assertion must reject a wrong step.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import testing as pxg_testing

# Two examples, two variables. Example 0: g = ([3], [4]) (norm 5);
# example 1: g = ([0], [1]) (norm 1).
_GRADS = [np.array([[3.0], [0.0]]), np.array([[4.0], [1.0]])]
_WEIGHTS = [np.array([1.0]), np.array([2.0])]


def test_norms_are_flat_over_variables():
  np.testing.assert_array_equal(
      pxg_testing.per_example_global_norms(_GRADS), [5.0, 1.0])


def test_expected_weights_clip_only_examples_above_the_clip():
  # C = 2: example 0 scaled by 2/5 -> (1.2, 1.6); example 1 kept (0, 1).
  # Mean over B = 2: (0.6, 1.3); lr 1.
  got = pxg_testing.expected_dp_sgd_weights(_WEIGHTS, _GRADS, 2.0)
  np.testing.assert_allclose(got[0], [1.0 - 0.6], rtol=1e-15)
  np.testing.assert_allclose(got[1], [2.0 - 1.3], rtol=1e-15)
  # Divisor 4 (an expected batch size) and learning rate 0.5.
  got = pxg_testing.expected_dp_sgd_weights(
      [tf.constant(w) for w in _WEIGHTS], [tf.constant(g) for g in _GRADS],
      2.0, batch_size=4, learning_rate=0.5)
  np.testing.assert_allclose(got[1], [2.0 - 0.5 * 2.6 / 4], rtol=1e-15)


def test_assertion_passes_within_and_fails_beyond_the_tolerance():
  initial = _WEIGHTS
  expected = pxg_testing.expected_dp_sgd_weights(initial, _GRADS, 2.0)
  # Update sizes 0.6 and 1.3: rtol 1e-4 allows 6e-5 and 1.3e-4 (+ 1e-7).
  close = [expected[0] + 5e-5, expected[1] - 1.2e-4]
  assert pxg_testing.assert_dp_step_matches_reference(
      close, initial, expected) <= 1.0
  with pytest.raises(AssertionError, match=r"weight 0: off by 7e-05"):
    pxg_testing.assert_dp_step_matches_reference(
        [expected[0] + 7e-5, expected[1]], initial, expected)
  with pytest.raises(AssertionError, match="kernel"):
    pxg_testing.assert_dp_step_matches_reference(
        [expected[0], expected[1] + np.nan], initial, expected,
        names=["bias", "kernel"])
  # Unclipped steps (a clip no example reaches) are a different update.
  unclipped = pxg_testing.expected_dp_sgd_weights(initial, _GRADS, 1e9)
  with pytest.raises(AssertionError):
    pxg_testing.assert_dp_step_matches_reference(unclipped, initial, expected)


def test_mismatched_lists_raise_value_error():
  with pytest.raises(ValueError, match="2 weights but 1"):
    pxg_testing.expected_dp_sgd_weights(_WEIGHTS, _GRADS[:1], 1.0)
  with pytest.raises(ValueError, match=r"per_example_grads\[0\] has shape"):
    pxg_testing.expected_dp_sgd_weights(_WEIGHTS, [g[:, :, None]
                                                   for g in _GRADS], 1.0)
  with pytest.raises(ValueError, match="1 actual, 2 initial"):
    pxg_testing.assert_dp_step_matches_reference(
        _WEIGHTS[:1], _WEIGHTS, _WEIGHTS)
