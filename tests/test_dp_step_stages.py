"""The framework-free stages of a DP step (`tf_pxg.dp.step`): a custom loop
with the tape runs the same clip -> accumulate -> privatize as `fit`.

A custom loop over a plain Keras model, with `tf_pxg.GradientTape`, the
plan and the stages, must take exactly the step the DP model's
`train_on_batch` takes: the same clipped sum and, from the same noise seed,
the same noise.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg.data import BatchInfo
from tf_pxg.dp import noise as dp_noise
from tf_pxg.dp import plan as dp_plan
from tf_pxg.dp import step as dp_step
from tf_pxg.dp import step_state

B, D, LR, SEED = 6, 4, 0.5, 11


def _data():
  rng = np.random.default_rng(3)
  return (rng.normal(size=(B, D)).astype("float32"),
          rng.normal(size=(B, 2)).astype("float32"))


def _layers():
  return [keras.Input((D,)), keras.layers.Dense(
      2, kernel_initializer=keras.initializers.Constant(0.2),
      bias_initializer=keras.initializers.Constant(-0.1))]


def _keras_step(clip, sigma):
  x, y = _data()
  model = dpk.DPSequential(_layers(), l2_norm_clip=clip,
                           noise_multiplier=sigma, seed=SEED)
  model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
  model.train_on_batch(x, y)
  return [v.numpy() for v in model.trainable_variables]


def _custom_loop_step(clip, sigma):
  """One step of a custom loop: the tape, the plan, the three stages."""
  x, y = _data()
  model = keras.Sequential(_layers())
  variables = model.trainable_variables
  plan = dp_plan.DPPlan.validated("custom loop", clip, sigma, required=True)
  parts = dp_step.StepParts.stateless(plan)
  generator = dp_noise.make_generator(SEED)
  with tf_pxg.GradientTape() as tape:
    losses = tf.reduce_mean(tf.square(model(x) - y), axis=-1)  # [B]
  info = BatchInfo.plain(B)
  clipped = dp_step.clip(tape, losses, losses, variables, info, parts)
  totals = dp_step.accumulate(clipped, info, variables, parts)
  noisy, divisor, released = dp_step.privatize(parts, totals, info,
                                               generator)
  assert released == ()
  for v, g in zip(variables, noisy):
    g = g if divisor is None else g / divisor
    v.assign_sub(LR * g)
  return [v.numpy() for v in variables], clipped


@pytest.mark.parametrize("clip", [0.05, 1.0, float("inf")])
def test_custom_loop_without_noise_takes_the_keras_step(clip):
  got, clipped = _custom_loop_step(clip, 0.0)
  for a, b in zip(got, _keras_step(clip, 0.0)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert clipped.norms.shape == (B,)
  if np.isfinite(clip):  # each clipped contribution within the clip
    assert float(tf.norm(tf.concat([tf.reshape(s, [-1])
                                    for s in clipped.sums], 0))) <= B * clip


def test_custom_loop_with_noise_draws_the_keras_steps_noise():
  got, _ = _custom_loop_step(0.7, 1.3)
  want = _keras_step(0.7, 1.3)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  no_noise, _ = _custom_loop_step(0.7, 0.0)
  assert not np.allclose(got[0], no_noise[0])  # the noise was added


def test_stateless_parts_refuse_a_plan_with_state():
  plan = dp_plan.DPPlan.validated(
      "custom loop", 1.0, 1.0, required=True,
      clipping=tf_pxg.clipping.QuantileAdaptive(count_stddev=5.0))
  with pytest.raises(ValueError, match="keeps state.*DPOptimizer"):
    dp_step.StepParts.stateless(plan)


def test_poisson_batches_need_a_step_state():
  plan = dp_plan.DPPlan.validated("custom loop", 1.0, 0.0, required=True)
  parts = dp_step.StepParts.stateless(plan)
  info = BatchInfo(mask=tf.ones([B]), step_end=tf.constant(True),
                   normalizer=tf.constant(float(B)))
  variables = [tf.Variable(tf.zeros([2]))]
  clipped = dp_step.Clipped([tf.ones([2])], tf.ones([B]),
                            tf.ones([B], tf.bool))
  with pytest.raises(ValueError, match="StepState"):
    dp_step.accumulate(clipped, info, variables, parts)
  parts = parts._replace(step_state=step_state.StepState())
  totals = dp_step.accumulate(clipped, info, variables, parts)
  np.testing.assert_array_equal(totals[0].numpy(), [1.0, 1.0])
