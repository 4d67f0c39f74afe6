"""Keras layers and checks shared by several test files (not a test file)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing


class MinimalRNNCell(keras.layers.Layer):
  """A custom cell for `keras.layers.RNN`, as keras.io "Working with RNNs"
  writes one (`add_weight` in `build`, `call(inputs, states)`).

  `h_t = activation(x_t @ kernel + h_{t-1} @ recurrent_kernel)`; the output
  is `h_t` and the state `[h_t]`, both `[batch, units]`.

  Args:
    units: the state size.
    activation: applied to the pre-activation; None (keras.io's cell) keeps
      it linear.
    kernel_initializer: initializer of `kernel` `[input_dim, units]`.
    recurrent_initializer: initializer of `recurrent_kernel`
      `[units, units]`.
  """

  def __init__(self, units, activation=None, kernel_initializer="uniform",
               recurrent_initializer="uniform", **kwargs):
    super().__init__(**kwargs)
    self.units = units
    self.state_size = units
    self.activation = keras.activations.get(activation)
    self.kernel_initializer = kernel_initializer
    self.recurrent_initializer = recurrent_initializer

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1], self.units),
                                  initializer=self.kernel_initializer,
                                  name="kernel")
    self.recurrent_kernel = self.add_weight(
        shape=(self.units, self.units),
        initializer=self.recurrent_initializer, name="recurrent_kernel")

  def call(self, inputs, states):
    h = (keras.ops.matmul(inputs, self.kernel) +
         keras.ops.matmul(states[0], self.recurrent_kernel))
    h = self.activation(h)
    return h, [h]


def check_one_dp_fit_step(make_layers, x, y, *, reference_x=None,
                          build_shape=None):
  """One DP `fit` step equals the noiseless DP-SGD step of the reference.

  A plain `keras.Sequential(make_layers())` (seed 0) gives the per-example
  gradients of the sparse categorical cross-entropy (from logits) by
  `tf_pxg.testing.reference_per_example_gradients`; the clip is their
  median global norm, so some examples are clipped and some not. A
  `DPSequential(make_layers())` with the same weights, `noise_multiplier=0`
  and `SGD(1)` then takes one `fit` step over the whole batch, which must
  give `tf_pxg.testing.expected_dp_sgd_weights` to 1e-4 of each variable's
  update (`assert_dp_step_matches_reference`).

  Args:
    make_layers: returns a fresh list of layers (an `Input` first, or give
      `build_shape`).
    x: the `[B, ...]` numpy inputs given to `fit`.
    y: the `[B]` integer labels.
    reference_x: the inputs of the reference loop; `tf.constant(x)` by
      default.
    build_shape: if given, both models are built with it first.
  """
  keras.utils.set_random_seed(0)
  plain = keras.Sequential(make_layers())
  if build_shape is not None:
    plain.build(build_shape)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None)
  ref = pxg_testing.reference_per_example_gradients(
      loss, plain, plain.trainable_variables,
      tf.constant(x) if reference_x is None else reference_x,
      labels=tf.constant(y))
  clip = float(np.median(pxg_testing.per_example_global_norms(ref)))
  model = dpk.DPSequential(make_layers(), l2_norm_clip=clip,
                           noise_multiplier=0.0)
  if build_shape is not None:
    model.build(build_shape)
  model.set_weights(plain.get_weights())
  model.compile(optimizer=keras.optimizers.SGD(1.0),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, shuffle=False)
  pxg_testing.assert_dp_step_matches_reference(
      model.trainable_variables, before,
      pxg_testing.expected_dp_sgd_weights(before, ref, clip),
      names=[v.path for v in model.trainable_variables])


def reference_grads_by_example(model, x, y, loss_fn):
  """`[B]` lists of per-example gradients (float64, one per trainable
  variable) by the single-example loop of `tf_pxg.testing.reference`;
  `loss_fn(labels, outputs)` reduces one example's outputs to a scalar."""
  from tf_pxg.testing import reference  # noqa: PLC0415
  grads = reference.reference_per_example_gradients(
      lambda t, p: tf.reshape(loss_fn(t, p), [1]), model,
      model.trainable_variables, x, y)
  return [[g[b].numpy().astype(np.float64) for g in grads]
          for b in range(len(x))]
