"""Correlated (matrix-factorization) noise, streamed: BandMF's noise in TF.

A lower-triangular banded Toeplitz strategy `C` with coefficients
`c_0..c_{b-1}` (`tf_pxg.mf.BandedToeplitz`; `||c||_2 = 1`, `c_0 > 0`)
turns DP-SGD's independent per-step noise `z_1..z_T`
(`z_i ~ N(0, (sigma C_clip)^2)` per coordinate) into the correlated noise
`x = C^-1 z` (DP-FTRL / BandMF): the model learns the prefix sums
`A (G + C^-1 z)`, whose error is `A C^-1 z`, smaller than DP-SGD's `A z`
for a good `C`. Since `C x = z`,

  x_i = (z_i - sum_{j=1}^{b-1} c_j x_{i-j}) / c_0,

so step i needs only the last `b - 1` noises: `NoiseBuffers` keeps them,
one `[b-1, *shape]` variable per trainable variable, as a ring (`x_t` in
slot `t mod (b-1)`, one slot written per step). With `b = 1`, `x_i = z_i`:
DP-SGD (the train step then does not use this module at all).

Distribution. Each of R replicas draws its share `z_i^r ~ N(0, s^2 / R)`
(`tf_pxg.dp.noise.replica_noise_stddev`) and keeps its own buffers (`ON_READ`
variables, no communication): the recurrence is linear, so the replicas'
`x_i^r` sum to the `x_i` of `sum_r z_i^r ~ N(0, s^2)`. Restoring a
checkpoint under R replicas assigns each replica `x / R` of the saved sum
`x` (`SUM` aggregation), which by the same linearity continues the same
global sequence.

Privacy (why the step index matters). The sensitivity of `C G` to one
example is `C_clip` times the norm of the sum of the columns of `C` at the
steps where the example participates; with participations `>= b` steps
apart those columns do not overlap and each has norm `||c|| = 1`, so one
participation costs what a DP-SGD step does (Choquette-Choo et al. 2023).
The train step uses `optimizer.iterations` (logical steps applied) as `i`,
the same counter cyclic Poisson sampling (`tf_pxg.data`) uses to pick the
group of step i (i mod b), so the separation holds across `fit` calls and
resumed runs. A step past the step limit (`set_step_limit`) writes no
buffer, as it applies no update.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg.dp import noise as dp_noise


def buffer_dtype(dtype: tf.DType) -> tf.DType:
  """float32 for half-precision variables, else theirs."""
  return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class NoiseBuffers:
  """The last `b - 1` noise vectors of a BandMF run, per trainable variable.

  Create it in the strategy scope (as the model's variables). Its variables
  are `ON_READ`/`SUM`: each replica holds its share (see the module doc).

  Args:
    variables: the trainable variables the noise is for.
    num_bands: b > 1.

  Attributes:
    buffers: one `[b-1, *v.shape]` variable per variable (zeros at start:
      `x_t = 0` for `t < 0`).
  """

  def __init__(self, variables: Sequence[tf.Variable], num_bands: int):
    if num_bands < 2:
      raise ValueError(f"NoiseBuffers needs num_bands >= 2; got {num_bands}.")
    self.num_bands = int(num_bands)
    self._keys = [id(v) for v in variables]
    self.buffers = [
        tf.Variable(tf.zeros([num_bands - 1] + list(v.shape),
                             buffer_dtype(v.dtype)),
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name="dp_noise_buffer")
        for v in variables]

  def matches(self, variables: Sequence[tf.Variable]) -> bool:
    return self._keys == [id(v) for v in variables]

  @property
  def nbytes(self) -> int:
    """Bytes the buffers hold (per replica)."""
    return sum(int(np.prod(b.shape)) * b.dtype.size for b in self.buffers)


def slot_weights(coefs: np.ndarray, step) -> tf.Tensor:
  """`[b-1]` weights `w_k = c_j / c_0` of ring slot k at step `step`.

  Slot k holds `x_t` for `t = k mod (b-1)`; at step i it holds `x_{i-j}` with
  `j = ((i - k - 1) mod (b-1)) + 1`, in `1..b-1`.
  """
  coefs = np.asarray(coefs, np.float64)
  m = len(coefs) - 1
  ratios = tf.constant(coefs[1:] / coefs[0], tf.float64)
  k = tf.range(m, dtype=tf.int64)
  j = tf.math.floormod(tf.cast(step, tf.int64) - k - 1, m) + 1
  return tf.gather(ratios, j - 1)


def correlated_noisy_sums(sums: Sequence[tf.Tensor], coefs: np.ndarray,
                          state: NoiseBuffers, step, stddev, generator,
                          scale=None, write=None) -> List[tf.Tensor]:
  """`(sums + x_i) * scale`, with `x_i` streamed from `state`.

  Draws `z_i ~ N(0, stddev^2)` per coordinate (the fused noise kernel, one
  key for all tensors, or the secure source), computes
  `x_i = (z_i - sum_{j>=1} c_j x_{i-j}) / c_0` from the buffers, and writes
  `x_i` into slot `step mod (b-1)` when `write` (a scalar bool; None:
  always) — otherwise the buffers are unchanged (a step that is not
  applied).

  Args:
    sums: one replica's clipped-gradient sums, dense, one per variable of
      `state` (cast to the buffers' dtype).
    coefs: the strategy's `[b]` coefficients, `c_0 > 0`.
    state: the `NoiseBuffers`.
    step: scalar integer tensor, the global step index i
      (`optimizer.iterations` before this step's update).
    stddev: this replica's noise std for z (`sigma C / sqrt(R)`).
    generator: the noise source (`tf.random.Generator` or secure source).
    scale: optional factor for the result (`1 / normalizer`).
    write: optional scalar bool gate for the buffer write.

  Returns:
    The noisy sums, in the buffers' dtypes.
  """
  coefs = np.asarray(coefs, np.float64)
  m = len(coefs) - 1
  weights = slot_weights(coefs, step)
  past = [-tf.tensordot(tf.cast(weights, buf.dtype), buf.read_value(), 1)
          for buf in state.buffers]
  x = dp_noise.add_gaussian_noise(past, stddev / float(coefs[0]),
                                  generator=generator)
  slot = tf.reshape(tf.math.floormod(tf.cast(step, tf.int64), m), [1, 1])
  for buf, x_i in zip(state.buffers, x):
    new = x_i if write is None else tf.where(
        write, x_i, tf.gather_nd(buf.read_value(), slot)[0])
    if isinstance(buf, tf.distribute.DistributedValues):
      # A replica's ON_READ share has no scatter in replica context.
      buf.assign(tf.tensor_scatter_nd_update(buf.read_value(), slot,
                                             new[tf.newaxis]))
    else:
      buf.scatter_nd_update(slot, new[tf.newaxis])
  out = []
  for g, x_i in zip(sums, x):
    noisy = tf.cast(g, x_i.dtype) + x_i
    out.append(noisy if scale is None else noisy * tf.cast(scale, x_i.dtype))
  return out


def dense_noise(coefs: np.ndarray, z: np.ndarray) -> np.ndarray:
  """`C^-1 z` for `[T, ...]` z, by the dense lower-triangular solve (tests).

  The reference for `correlated_noisy_sums`: C is the `[T, T]` banded
  Toeplitz matrix of `coefs`.
  """
  coefs = np.asarray(coefs, np.float64)
  t = z.shape[0]
  c = np.zeros((t, t))
  for j, cj in enumerate(coefs):
    c += np.diag(np.full(t - j, cj), -j) if j < t else 0
  flat = z.reshape(t, -1).astype(np.float64)
  import scipy.linalg  # noqa: PLC0415  (dp-accounting depends on SciPy)
  return scipy.linalg.solve_triangular(c, flat, lower=True).reshape(z.shape)


def memory_report(state: Optional[NoiseBuffers]) -> dict:
  """`{"num_buffers": b-1, "buffer_bytes": ...}` for logs and benchmarks."""
  if state is None:
    return {"num_buffers": 0, "buffer_bytes": 0}
  return {"num_buffers": state.num_bands - 1, "buffer_bytes": state.nbytes}
