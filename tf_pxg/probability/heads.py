"""Distribution heads: a model's last-layer outputs -> a TFP distribution.

A head says how many parameters the last layer outputs per example
(`num_params`) and maps them to a batch of distributions, one per example;
`NegativeLogLikelihood(head)` (`tf_pxg.probability.losses`) trains with
`-log p(y_b | params_b)` per example, which DP-SGD clips example by example.

Contract, for every head:

* `params`: `[B, num_params]` float (the batch on axis 0), any real values;
  positive parameters go through `softplus(.) + min_scale`, so no output of
  the layer gives an invalid distribution.
* `y`: `[B]` or `[B, 1]` (a scalar event per example), except
  `CensoredWeibull`: `[B, 2]` = (time > 0, event indicator: 1 observed,
  0 right-censored).
* `log_likelihood(y, params)`: `[B]`, example b's log-likelihood from row b
  of `params` and of `y` alone (every op is row-wise, which tf_pxg checks).
* `distribution(params)`: the TFP distribution of batch shape `[B]`
  (predictive draws and intervals; for `CensoredWeibull`, of the time).

Heads are Keras-serializable (`get_config`), so a model compiled with
`NegativeLogLikelihood(head)` saves and loads.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_pxg.probability._tfp_import import import_tfp

tfp = import_tfp()
tfd = tfp.distributions

_PACKAGE = "tf_pxg.probability"


def _column(y, i: int = 0):
  """Column i of labels `[B]` (i = 0 only) or `[B, k]`, as `[B]`."""
  y = tf.convert_to_tensor(y)
  if y.shape.rank == 1:
    if i:
      raise ValueError(f"Labels of shape {y.shape} have no column {i}.")
    return y
  return y[:, i]


def _positive(x, min_scale):
  return tf.nn.softplus(x) + tf.cast(min_scale, x.dtype)


class Head:
  """A distribution family with a parameterisation (see the module doc).

  Subclasses set `num_params` and implement `distribution`; the default
  `log_likelihood` is `distribution(params).log_prob(y)`.
  """

  num_params: int = 0

  def __init__(self, min_scale: float = 1e-3):
    self.min_scale = float(min_scale)

  def distribution(self, params) -> "tfd.Distribution":
    raise NotImplementedError

  def log_likelihood(self, y, params):
    """`[B]` log-likelihoods of labels `y` under `params` (`[B, P]`)."""
    params = tf.convert_to_tensor(params)
    y = tf.cast(_column(y), params.dtype)
    return self.distribution(params).log_prob(y)

  def get_config(self) -> dict:
    return {"min_scale": self.min_scale}

  @classmethod
  def from_config(cls, config):
    return cls(**config)

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
    return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Normal(Head):
  """Heteroscedastic regression: params (loc, scale)."""

  num_params = 2

  def distribution(self, params):
    return tfd.Normal(loc=params[:, 0],
                      scale=_positive(params[:, 1], self.min_scale))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class StudentT(Head):
  """Robust regression: params (loc, scale, df); `df = 1 + softplus`
  (or the fixed `df` given, then params (loc, scale))."""

  def __init__(self, df=None, min_scale: float = 1e-3):
    super().__init__(min_scale)
    self.df = None if df is None else float(df)
    self.num_params = 2 if df is not None else 3

  def distribution(self, params):
    df = (1.0 + tf.nn.softplus(params[:, 2]) if self.df is None else
          tf.cast(self.df, params.dtype))
    return tfd.StudentT(df=df, loc=params[:, 0],
                        scale=_positive(params[:, 1], self.min_scale))

  def get_config(self):
    return {**super().get_config(), "df": self.df}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Poisson(Head):
  """Counts: params (log rate,)."""

  num_params = 1

  def distribution(self, params):
    return tfd.Poisson(log_rate=params[:, 0])


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NegativeBinomial(Head):
  """Over-dispersed counts: params (log mean, dispersion); the total count
  r = softplus(dispersion) + min_scale, logits = log mean - log r, so the
  mean is exp(params[:, 0]) and the variance mean + mean^2 / r."""

  num_params = 2

  def distribution(self, params):
    r = _positive(params[:, 1], self.min_scale)
    return tfd.NegativeBinomial(total_count=r,
                                logits=params[:, 0] - tf.math.log(r))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MixtureDensity(Head):
  """A mixture density network's head: K Normal components, params
  (K mixture logits, K locs, K scales), `num_params = 3 K`."""

  def __init__(self, num_components: int = 3, min_scale: float = 1e-3):
    super().__init__(min_scale)
    self.num_components = int(num_components)
    self.num_params = 3 * self.num_components

  def distribution(self, params):
    k = self.num_components
    return tfd.MixtureSameFamily(
        mixture_distribution=tfd.Categorical(logits=params[:, :k]),
        components_distribution=tfd.Normal(
            loc=params[:, k:2 * k],
            scale=_positive(params[:, 2 * k:], self.min_scale)))

  def get_config(self):
    return {**super().get_config(), "num_components": self.num_components}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CensoredWeibull(Head):
  """Survival times with right censoring: params (log concentration, log
  scale) through softplus; labels `[B, 2]` = (time, event). An observed
  event (1) contributes the density `log f(t)`, a censored one (0) the
  survival `log S(t) = -(t / scale)^concentration`."""

  num_params = 2

  def distribution(self, params):
    return tfd.Weibull(
        concentration=_positive(params[:, 0], self.min_scale),
        scale=_positive(params[:, 1], self.min_scale))

  def log_likelihood(self, y, params):
    params = tf.convert_to_tensor(params)
    y = tf.cast(y, params.dtype)
    time, event = _column(y, 0), _column(y, 1)
    dist = self.distribution(params)
    return (event * dist.log_prob(time) +
            (1.0 - event) * dist.log_survival_function(time))


HEADS = {cls.__name__: cls for cls in (Normal, StudentT, Poisson,
                                       NegativeBinomial, MixtureDensity,
                                       CensoredWeibull)}
