"""DP training under Keras' mixed precision policies.

`mixed_float16`: Keras wraps the compiled optimizer in a
`LossScaleOptimizer`; the DP step backpropagates the losses times its scale,
takes norms and clip factors of the unscaled losses, unscales in the
weighted sums and adds the noise in float32 (`tf_pxg.keras._train_step.
dp_gradients`). `mixed_bfloat16` needs no scaling. Both are checked against
the float32 model's noiseless DP step computed by a plain `tf.GradientTape`
loop over single examples, within the compute dtype's precision.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing

MODES = {"eager": dict(run_eagerly=True), "function": {},
         "xla": dict(jit_compile=True)}
B, D, K = 8, 6, 3
# Relative precision of the compute dtype (float16: 2^-11, bfloat16: 2^-8)
# times a few roundings per op: the tolerance on each variable's update.
RTOL = {"mixed_float16": 1e-2, "mixed_bfloat16": 5e-2}


def _sce(reduction="sum_over_batch_size"):
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=reduction)


T = 6


def _data(seed=0, arch="flat"):
  rng = np.random.RandomState(seed)
  shape = (B, D) if arch == "flat" else (B, T, D)
  return rng.randn(*shape).astype("float32"), rng.randint(0, K, B)


def _layers(arch="flat"):
  # The output layer in float32, as Keras' mixed precision guide advises.
  if arch == "flat":
    return [keras.Input((D,)), keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(K, dtype="float32")]
  # Dense over T rows per example (ghost norms of scaled float16 output
  # gradients) and a LayerNormalization.
  return [keras.Input((T, D)), keras.layers.Dense(32, activation="tanh"),
          keras.layers.LayerNormalization(), keras.layers.Dense(32),
          keras.layers.GlobalAveragePooling1D(),
          keras.layers.Dense(K, dtype="float32")]


def _build(policy, arch="flat", compile_kwargs=None, **dp):
  keras.config.set_dtype_policy(policy)
  try:
    keras.utils.set_random_seed(0)
    model = dpk.DPSequential(_layers(arch), **dp)
    model.compile(keras.optimizers.SGD(1.0), _sce(), **(compile_kwargs or {}))
  finally:
    keras.config.set_dtype_policy("float32")
  return model


@pytest.mark.parametrize("arch", ["flat", "sequence"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("policy", list(RTOL))
def test_mixed_policy_dp_step_matches_float32(policy, mode, arch):
  x, y = _data(arch=arch)
  reference = _build("float32", arch, l2_norm_clip=1.0, noise_multiplier=0.0)
  ref = pxg_testing.reference_per_example_gradients(
      _sce(None), reference, reference.trainable_variables, tf.constant(x),
      tf.constant(y))
  clip = float(np.median(pxg_testing.per_example_global_norms(ref)))
  before = [v.numpy() for v in reference.trainable_variables]
  expected = pxg_testing.expected_dp_sgd_weights(before, ref, clip)
  model = _build(policy, arch, MODES[mode], l2_norm_clip=clip,
                 noise_multiplier=0.0)
  scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
  assert scaled == (policy == "mixed_float16")
  model.set_weights(reference.get_weights())
  model.train_on_batch(x, y)
  largest = max(float(np.max(np.abs(e - b)))
                for e, b in zip(expected, before))
  pxg_testing.assert_dp_step_matches_reference(
      model.trainable_variables, before, expected, rtol=RTOL[policy],
      atol=RTOL[policy] * largest)
  if scaled:  # read, never updated: data-independent
    assert float(model.optimizer.scale_loss(1.0)) == 2.0**15
    assert int(model.optimizer.iterations) == 1


def test_float16_overflowing_example_gets_factor_zero_and_scale_stays():
  # Example 0's activations overflow float16 (inf logits): its clip factor
  # is 0, the step is applied with the others' clipped gradients, and the
  # loss scale is neither halved nor is the step skipped (that decision
  # would come from one example).
  x, y = _data()
  x[0] = 1e6
  reference = _build("float32", l2_norm_clip=0.5, noise_multiplier=0.0)
  ref = pxg_testing.reference_per_example_gradients(
      _sce(None), reference, reference.trainable_variables,
      tf.constant(x[1:]), tf.constant(y[1:]))
  before = [v.numpy() for v in reference.trainable_variables]
  expected = pxg_testing.expected_dp_sgd_weights(before, ref, 0.5,
                                                 batch_size=B)
  model = _build("mixed_float16", l2_norm_clip=0.5, noise_multiplier=0.0)
  model.set_weights(reference.get_weights())
  model.train_on_batch(x, y)
  assert int(model.optimizer.iterations) == 1
  assert float(model.optimizer.scale_loss(1.0)) == 2.0**15
  pxg_testing.assert_dp_step_matches_reference(
      model.trainable_variables, before, expected, rtol=1e-2,
      atol=1e-2 * max(float(np.max(np.abs(e - b)))
                      for e, b in zip(expected, before)))


def test_float16_noise_is_float32_sigma_clip_over_batch():
  # Zero gradients (zero inputs and weights, loss to zero): the update is
  # the noise over B, drawn in float32 at std sigma C / B (within 5% over
  # 16 * 64 + 64 coordinates, a float16 draw or a scaled noise would not).
  keras.config.set_dtype_policy("mixed_float16")
  try:
    model = dpk.DPSequential(
        [keras.Input((16,)), keras.layers.Dense(64, kernel_initializer="zeros",
                                                 dtype="float32")],
        l2_norm_clip=0.5, noise_multiplier=2.0)
    model.compile(keras.optimizers.SGD(1.0), "mse")
  finally:
    keras.config.set_dtype_policy("float32")
  model.train_on_batch(np.zeros((B, 16), "float32"),
                       np.zeros((B, 64), "float32"))
  update = np.concatenate([v.numpy().ravel()
                           for v in model.trainable_variables])
  assert update.std() / (2.0 * 0.5 / B) == pytest.approx(1.0, abs=0.07)


def test_mixed_float16_fit_with_dp_optimizer_and_privacy_callback():
  x, y = _data()
  x = np.concatenate([x] * 4)
  y = np.concatenate([y] * 4)
  keras.config.set_dtype_policy("mixed_float16")
  try:
    model = dpk.DPSequential(_layers())
    model.compile(dpk.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            learning_rate=0.1), _sce())
  finally:
    keras.config.set_dtype_policy("float32")
  assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
  cb = dpk.PrivacyCallback(num_examples=len(x), batch_size=8)
  hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
  assert int(model.optimizer.iterations) == 8
  assert hist.history["epsilon"][-1] == pytest.approx(cb.epsilon(8))
  assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


def test_loss_scale_optimizer_around_a_plain_optimizer_with_state_raises():
  model = dpk.DPSequential(_layers(), l2_norm_clip=1.0, noise_multiplier=1.0,
                           clipping=__import__("tf_pxg").clipping.Automatic())
  with pytest.raises(ValueError, match="inside the LossScaleOptimizer"):
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD()), _sce())
