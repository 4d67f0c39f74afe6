"""A Kolmogorov-Smirnov check that samples are N(0, stddev^2)."""

import math

import tensorflow as tf

N = 100_000


def ks_critical(n: int) -> float:
  """The two-sided KS statistic's critical value at alpha = 1e-3 for `n`
  samples (asymptotic: 1.95 / sqrt(n))."""
  return 1.95 / math.sqrt(n)


KS_CRITICAL = ks_critical(N)


def ks_statistic(samples, stddev) -> float:
  """sup_x |F_n(x) - F(x)| for F the N(0, stddev^2) CDF."""
  x = tf.sort(tf.reshape(tf.cast(samples, tf.float64), [-1]))
  n = tf.cast(tf.size(x), tf.float64)
  model_cdf = 0.5 * tf.math.erfc(-x / (stddev * math.sqrt(2.0)))
  i = tf.range(1, tf.size(x) + 1, dtype=tf.float64)
  return float(tf.maximum(tf.reduce_max(i / n - model_cdf),
                          tf.reduce_max(model_cdf - (i - 1) / n)))
