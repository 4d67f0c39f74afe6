"""A mean-field Gaussian variational dense layer for Keras 3, trained by DP-VI.

`DenseVariational` keeps a Gaussian posterior `q(w) = N(mu, sigma^2)` per
weight (`sigma = softplus(rho)`), draws `w = mu + sigma * eps` with
`eps ~ N(0, I)` on every call (the reparameterisation trick; Blundell et
al., "Weight Uncertainty in Neural Networks", ICML 2015), and adds the KL
divergence to the prior `p(w) = N(0, prior_scale^2)` as *weight
regularizers* of `mu` and `rho`. Minimising the model's loss (the mean
per-example negative log-likelihood) plus the regularizers is maximising
the evidence lower bound divided by N:

  ELBO / N = (1/N) sum_i E_q[log p(y_i | x_i, w)] - KL(q || p) / N,

so set `kl_weight = 1 / N` (N the number of training examples).

DP variational inference (Jälkö, Dikmen, Honkela, "Differentially private
variational inference for non-conjugate models", UAI 2017): DP-SGD clips
and noises the per-example gradients of the expected log-likelihood, and
adds the KL term outside the clip. Why that keeps the guarantee:

* The KL of two Gaussians is a function of `(mu, rho)` alone,
  `sum_j log(s / sigma_j) + (sigma_j^2 + mu_j^2) / (2 s^2) - 1/2`: no
  example enters it. Its gradient at the current parameters is a function
  of those parameters, which are themselves the (post-processed) output of
  the earlier noised steps; adding it changes no example's contribution,
  so the sensitivity of the clipped sum, and the noise that covers it, are
  those of the likelihood part alone. This is exactly how tf_pxg's DP step
  treats weight regularizers (added after the noise, unclipped; the
  threat model's "data-independent terms"), which is why the KL is written
  as two regularizers (the KL separates into a term of `mu` and one of
  `rho`): `GaussianKLLoc` and `GaussianKLScale`. Clipping it would only
  bias the posterior towards the data.
* `eps` is drawn from a Keras `SeedGenerator`, independently of the data,
  once per call and shared by the examples of the batch (like a dropout
  mask that does not depend on the data). Example b's loss is a function
  of its own rows and of `eps`, so its gradient is its own and is clipped
  like any other; the generator's state update is a data-independent write
  that tf_pxg's DP step allows, and
  `tf_pxg.testing.check_example_independence` reseeds it identically in
  both of its runs.

Shapes: input `[B, ..., d_in]` -> output `[B, ..., units]`, the batch on
axis 0 (the kernel is shared by the examples, as in `keras.layers.Dense`).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

_PACKAGE = "tf_pxg.probability"


def _softplus_inverse(x: float) -> float:
  return math.log(math.expm1(x))


class _GaussianKL(keras.regularizers.Regularizer):

  def __init__(self, kl_weight: float, prior_scale: float = 1.0):
    self.kl_weight = float(kl_weight)
    self.prior_scale = float(prior_scale)

  def get_config(self):
    return {"kl_weight": self.kl_weight, "prior_scale": self.prior_scale}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GaussianKLLoc(_GaussianKL):
  """The part of `kl_weight * KL(N(mu, sigma^2) || N(0, s^2))` that depends
  on the posterior means: `kl_weight * sum mu^2 / (2 s^2)`."""

  def __call__(self, loc):
    s2 = tf.cast(self.prior_scale ** 2, loc.dtype)
    return self.kl_weight * tf.reduce_sum(tf.square(loc)) / (2.0 * s2)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GaussianKLScale(_GaussianKL):
  """The part that depends on `rho` (`sigma = softplus(rho)`):
  `kl_weight * sum log(s / sigma) + sigma^2 / (2 s^2) - 1/2`."""

  def __call__(self, rho):
    sigma = tf.nn.softplus(rho)
    s = tf.cast(self.prior_scale, rho.dtype)
    return self.kl_weight * tf.reduce_sum(
        tf.math.log(s) - tf.math.log(sigma) +
        tf.square(sigma) / (2.0 * tf.square(s)) - 0.5)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DenseVariational(keras.layers.Layer):
  """A dense layer with a mean-field Gaussian posterior over its weights.

  Args:
    units: output size.
    kl_weight: the KL term's weight, `1 / N` for the ELBO of N examples.
    prior_scale: the prior's standard deviation s (`N(0, s^2)` per weight).
    posterior_scale: the posterior's initial standard deviation.
    activation: as for `keras.layers.Dense`.
    use_bias: whether the layer has a (variational) bias.
    seed: seeds the reparameterisation noise (tests); None draws from
      Keras' global seed.

  Call:
    `inputs`: `[B, ..., d_in]`. `noise`: optional `(kernel_eps, bias_eps)`
    standard normals of the kernel's and the bias' shapes, used instead of
    fresh draws (common random numbers, tests). Returns `[B, ..., units]`.
    Every call draws a new weight sample, in training and in inference:
    average several calls for a predictive distribution.
  """

  def __init__(self, units: int, kl_weight: float, prior_scale: float = 1.0,
               posterior_scale: float = 1e-2, activation=None,
               use_bias: bool = True, seed=None, **kwargs):
    super().__init__(**kwargs)
    self.units = int(units)
    self.kl_weight = float(kl_weight)
    self.prior_scale = float(prior_scale)
    self.posterior_scale = float(posterior_scale)
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.seed = seed
    self.seed_generator = keras.random.SeedGenerator(seed)

  def build(self, input_shape):
    d_in = int(input_shape[-1])
    rho0 = keras.initializers.Constant(
        _softplus_inverse(self.posterior_scale))
    loc_kl = GaussianKLLoc(self.kl_weight, self.prior_scale)
    scale_kl = GaussianKLScale(self.kl_weight, self.prior_scale)

    def pair(name, shape, loc_init):
      loc = self.add_weight(name=f"{name}_loc", shape=shape,
                            initializer=loc_init, regularizer=loc_kl)
      rho = self.add_weight(name=f"{name}_rho", shape=shape,
                            initializer=rho0, regularizer=scale_kl)
      return loc, rho

    self.kernel_loc, self.kernel_rho = pair(
        "kernel", (d_in, self.units), "glorot_uniform")
    if self.use_bias:
      self.bias_loc, self.bias_rho = pair("bias", (self.units,), "zeros")

  def _sample(self, loc, rho, eps):
    if eps is None:
      eps = keras.random.normal(tuple(loc.shape), dtype=self.compute_dtype,
                                seed=self.seed_generator)
    return (keras.ops.cast(loc, self.compute_dtype) +
            keras.ops.cast(keras.ops.softplus(rho), self.compute_dtype) *
            keras.ops.cast(eps, self.compute_dtype))

  def call(self, inputs, noise=None):
    kernel_eps, bias_eps = (None, None) if noise is None else noise
    out = keras.ops.matmul(inputs, self._sample(
        self.kernel_loc, self.kernel_rho, kernel_eps))
    if self.use_bias:
      out = out + self._sample(self.bias_loc, self.bias_rho, bias_eps)
    return self.activation(out) if self.activation is not None else out

  def kl_divergence(self):
    """`KL(q || p)` summed over the layer's weights (without `kl_weight`)."""
    unit = (GaussianKLLoc(1.0, self.prior_scale),
            GaussianKLScale(1.0, self.prior_scale))
    pairs = [(self.kernel_loc, self.kernel_rho)]
    if self.use_bias:
      pairs.append((self.bias_loc, self.bias_rho))
    return tf.add_n([unit[0](tf.convert_to_tensor(loc)) +
                     unit[1](tf.convert_to_tensor(rho))
                     for loc, rho in pairs])

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.units,)

  def get_config(self):
    return {**super().get_config(), "units": self.units,
            "kl_weight": self.kl_weight, "prior_scale": self.prior_scale,
            "posterior_scale": self.posterior_scale,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias, "seed": self.seed}
