"""A TFP draw seeded from the data is refused (issue 49): whatever the data
touches is data, a seed included. Runs in CI's [probability] stage."""

import numpy as np
import pytest
import tensorflow as tf

import tf_pxg

tfp = pytest.importorskip("tensorflow_probability")
tfd = tfp.distributions

B, D = 4, 3


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_a_tfp_sample_seeded_from_token_ids_is_refused(mode):
  x = tf.constant(np.random.default_rng(0).normal(size=(B, D)), tf.float32)
  ids = tf.constant(np.random.default_rng(1).integers(0, 9, size=(B, D)),
                    tf.int32)
  w = tf.Variable(tf.ones([D, 2]) * 0.1)

  def step(x, ids):
    with tf_pxg.GradientTape() as tape:
      seed = tf.stack([tf.reduce_max(ids), 0])  # a batch statistic
      noise = tfd.Normal(0.0, 1.0).sample([B, 2], seed=seed)
      losses = tf.reduce_sum(tf.square(x @ w + noise), 1)
    return tape.clipped_gradient_sum(losses, [w], 1.0)

  if mode != "eager":
    step = tf.function(step, jit_compile=mode == "jit")
  with pytest.raises(ValueError, match="op '"):
    step(x, ids)


def test_a_tfp_sample_with_a_constant_seed_trains():
  x = tf.constant(np.random.default_rng(0).normal(size=(B, D)), tf.float32)
  w = tf.Variable(tf.ones([D, 2]) * 0.1)
  noise = tfd.Normal(0.0, 1.0).sample([2], seed=[1, 2])
  with tf_pxg.GradientTape() as tape:
    losses = tf.reduce_sum(tf.square(x @ w + noise), 1)
  got = tape.per_example_gradient(losses, [w])[0]
  resid = x.numpy() @ w.numpy() + noise.numpy()
  want = np.einsum("bd,bk->bdk", x.numpy(), 2.0 * resid)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
