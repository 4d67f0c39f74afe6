"""Keras layers shared by several test files (not a test file itself)."""

from __future__ import annotations

import keras


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
