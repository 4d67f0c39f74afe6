"""BLT noise: buffered linear Toeplitz correlated noise, streamed from d buffers.

A matrix mechanism releases `C G + z` for a lower-triangular Toeplitz
strategy C; the model sees the prefix sums `A G + A C^-1 z`, i.e. step t
adds the noise `x_t = (C^-1 z)_t` (see `tf_pxg.mf.toeplitz` for the
notation). BandMF bands C, which costs `b - 1` model-sized buffers. A BLT
(buffered linear Toeplitz, Dvijotham, McMahan, Pillutla, Steinke, Thakurta
2024) is a Toeplitz matrix whose first column is

    d_0 = 1,   d_t = sum_{j<d} omega_j theta_j^(t-1)   (t >= 1),

with d (3-7) "buffers"; the inverse of a BLT is again one,
`C^-1 = BLT(theta', omega')` (theta' the reciprocal zeros of C's rational
series `C(u) = 1 + sum_j omega_j u / (1 - theta_j u)`, omega' from its
partial fractions: `inverse_parameters`). The noise `x = C^-1 z` is
streamed from d states `S_j` (one model-sized buffer each):

    x_t = z_t + sum_j omega'_j S_j,t,     S_j,t+1 = theta'_j S_j,t + z_t,

since `S_j,t = sum_{s<t} theta'_j^(t-1-s) z_s` gives
`x_t = z_t + sum_{s<t} d_{t-s} z_s = (C^-1 z)_t` exactly, with
`d_t = sum_j omega'_j theta'_j^(t-1)` C^-1's first column.

**Parameters (a documented fixed choice, no training-time optimisation).**
`BLT(num_steps=n, num_buffers=d)` fits C to the square root `A^1/2` of the
prefix-sum matrix A (Fichtenberger, Henzinger, Upadhyay 2023; BandMF's
"sqrt" start, Kalinin and Lampert 2024), whose first column is
`r_t = binom(2t, t) / 4^t` (positive, decreasing): the decays are fixed at
`theta_j = 1 - 10^-(k_j)` for d exponents `k_j` evenly spaced in
`[0.25, log10(n) + 0.5]`, and the scales `omega >= 0` are the non-negative
least-squares fit of `r_1..r_n` (`scipy.optimize.nnls`, deterministic;
scales fitted to 0 drop their buffer). Explicit `theta` and `omega` of C
(e.g. from jax-privacy's BLT optimiser) may be given instead. The fit only
matters for utility: privacy is computed for the C it gives.

**Privacy (the participation schema the ε assumes, and no other).**
Each unit participates only at steps `t = g mod b` of its group g, at most
once every `b = min_separation` steps, and the run has at most
`num_steps = n` steps: cyclic sampling with b groups, as BandMF's
(`tf_pxg.data.PoissonSampler(min_separation=b)`; Poisson sampling within the
group is allowed, below). For one unit with participation set P (clipped
contributions `g_i`, `||g_i|| <= C_clip`), C's release changes by
`sum_{i in P} C[:, i] g_i^T`, whose squared Frobenius norm is
`sum_{i,j in P} <C_i, C_j> <g_i, g_j> <= C_clip^2 ||C 1_P||^2` when every
entry of C is >= 0 (all Gram entries are then >= 0; checked at
construction, which raises otherwise). `||C 1_P||` grows with P (entries
>= 0), so its maximum over the schema is over the full sets
`P_g = {g, g + b, ...} ∩ [0, n)`:

    sens = max_g ||C 1_{P_g}||_2,

computed exactly in float64 (`sensitivity`). The release is then the
Gaussian mechanism with noise multiplier `sigma / sens`: the event of the
whole run is `GaussianDpEvent(sigma / sens)` (`dp_event`), composed
with nothing (the participations are already inside `sens`; no
amplification by sampling is claimed, so it is an upper bound for cyclic
Poisson sampling, exact for cyclic fixed batches). `tf_pxg.accounting`
refuses an ε for a run longer than `num_steps`, and
`tf_pxg.data.participation.check` one with another participation schema
(`min_separation` must match the sampler's
groups).

Distribution: each of R replicas draws `z^r ~ N(0, s^2 / R)` and keeps its
own states (`ON_READ`/`SUM`); the recurrence is linear, so the replicas'
`x^r` sum to the `x` of `sum_r z^r`, as BandMF's (`tf_pxg.dp.correlated`).

Added in this one file (plus its tests and docs), through the
`tf_pxg.dp.mechanisms.NoiseMechanism` protocol: `DPOptimizer(...,
noise_mechanism=BLT(...))`; no switch elsewhere.

References:
  Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and
    Near-Optimal Noise Generation for Streaming Differential Privacy",
    FOCS 2024, arXiv:2404.16706.
  McMahan, Xu, Zhang (and others), "Hassle-free Private Training with BLT
    Mechanisms" / jax-privacy `matrix_factorization/buffered_toeplitz.py`,
    arXiv:2408.08868, 2024.
  Fichtenberger, Henzinger, Upadhyay, "Constant Matters: Fine-grained Error
    Bound on Differentially Private Continual Observation", ICML 2023.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import dp_accounting
import numpy as np
from scipy import optimize
from scipy import signal
import tensorflow as tf

from tf_pxg.dp import correlated
from tf_pxg.dp import mechanisms
from tf_pxg.dp import noise as dp_noise

__all__ = ["BLT"]


def _sqrt_coefs(n: int) -> np.ndarray:
  """`r_0..r_n` of `A^1/2`: the series of `(1 - u)^-1/2`."""
  r = np.empty(n + 1)
  r[0] = 1.0
  for t in range(1, n + 1):  # r_t = r_{t-1} (t - 1/2) / t
    r[t] = r[t - 1] * (t - 0.5) / t
  return r


def _fit(num_buffers: int, n: int):
  """The fixed choice of the module docstring: C's theta, omega."""
  exponents = np.linspace(0.25, math.log10(max(n, 2)) + 0.5, num_buffers)
  theta = 1.0 - 10.0 ** (-exponents)
  t = np.arange(1, n + 1, dtype=np.float64)
  basis = theta[None, :] ** (t[:, None] - 1.0)
  omega, _ = optimize.nnls(basis, _sqrt_coefs(n)[1:])
  keep = omega > 0
  return theta[keep], omega[keep]


def _rational(theta: np.ndarray, omega: np.ndarray):
  """`(num, den)` in powers of u of `1 + sum_j omega_j u / (1 - theta_j u)`."""
  den = np.array([1.0])
  for th in theta:
    den = np.convolve(den, [1.0, -th])
  num = np.concatenate([den, [0.0]])
  for j, w in enumerate(omega):
    rest = np.array([1.0])
    for k, th in enumerate(theta):
      if k != j:
        rest = np.convolve(rest, [1.0, -th])
    num[1:1 + rest.size] += w * rest
  return np.trim_zeros(num, "b"), den


def inverse_parameters(theta, omega):
  """`(theta', omega')` with `BLT(theta', omega') = BLT(theta, omega)^-1`.

  Partial fractions of `den(u) / num(u)` (`scipy.signal.residuez`, whose
  polynomials are in powers of `u = z^-1`): `sum_i r_i / (1 - p_i u) + k`,
  so `d_t = sum_i r_i p_i^t` (t >= 1): theta' = p, omega' = r p.

  Raises:
    ValueError: complex or `|theta'| >= 1` poles (no stable real BLT).
  """
  num, den = _rational(np.asarray(theta, np.float64),
                       np.asarray(omega, np.float64))
  r, p, _ = signal.residuez(den, num)
  if (np.max(np.abs(np.imag(p)), initial=0.0) > 1e-9 or
      np.max(np.abs(p), initial=0.0) >= 1.0):
    raise ValueError(
        f"BLT: C^-1 of theta={list(theta)}, omega={list(omega)} has poles "
        f"{p.tolist()}; a streamed BLT needs real poles inside (-1, 1). Use "
        "the default fit or other parameters.")
  p, r = np.real(p), np.real(r)
  return p, r * p


@mechanisms.register("blt")
class BLT(mechanisms.NoiseMechanism):
  """BLT correlated noise: C and `C^-1` d-buffer BLTs (module docstring).

  Args:
    num_steps: n, the most steps the run takes (the ε covers at most n).
    min_separation: b >= 1, the cyclic participation: each unit joins only
      steps `g mod b` of its group (`fit` then samples cyclic Poisson with
      b groups, as for BandMF).
    num_buffers: d, the buffers of the fixed choice (3-7 typical).
    theta, omega: optional explicit BLT parameters of C (d each,
      `0 <= theta_j < 1`, `omega_j >= 0`); then `num_buffers` is their
      length.

  Raises:
    ValueError: bad sizes or parameters: a negative omega (the sensitivity
      argument needs C >= 0), or a C whose inverse is no stable real BLT.
  """

  stateful = True

  def __init__(self, num_steps: int, min_separation: int = 1,
               num_buffers: int = 4, theta: Optional[Sequence[float]] = None,
               omega: Optional[Sequence[float]] = None):
    for name, value in (("num_steps", num_steps),
                        ("min_separation", min_separation),
                        ("num_buffers", num_buffers)):
      if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"BLT: {name} must be a positive integer; got "
                         f"{value!r}.")
    self.num_steps, self.min_separation = int(num_steps), int(min_separation)
    if (theta is None) != (omega is None):
      raise ValueError("BLT: give both theta and omega, or neither.")
    if theta is None:
      theta, omega = _fit(int(num_buffers), self.num_steps)
    theta = np.asarray(theta, np.float64)
    omega = np.asarray(omega, np.float64)
    if (theta.ndim != 1 or theta.shape != omega.shape or not theta.size or
        not np.all(np.isfinite(theta)) or not np.all(np.isfinite(omega)) or
        np.any(theta < 0) or np.any(theta >= 1)):
      raise ValueError(
          "BLT: theta and omega must be equally long, finite, with "
          f"0 <= theta < 1; got theta={theta.tolist()}, "
          f"omega={omega.tolist()}.")
    self.theta, self.omega = theta, omega
    if np.any(omega < 0):
      raise ValueError(
          f"BLT: omega must be >= 0 (then every entry of C is >= 0, which "
          f"the sensitivity bound needs); got {omega.tolist()}.")
    self.inverse_theta, self.inverse_omega = inverse_parameters(theta, omega)
    self._sensitivity = None

  @property
  def num_buffers(self) -> int:
    return int(self.inverse_theta.size)

  # Matrices (float64, NumPy) ---------------------------------------------

  @staticmethod
  def _column(theta, omega, n: int) -> np.ndarray:
    t = np.arange(1, n, dtype=np.float64)
    col = np.ones(n)
    col[1:] = (omega[None, :] * theta[None, :] ** (t[:, None] - 1.0)).sum(1)
    return col

  def strategy_coefs(self, n: int) -> np.ndarray:
    """`c_0..c_{n-1}`: the first column of C (all >= 0)."""
    return self._column(self.theta, self.omega, n)

  def inverse_coefs(self, n: int) -> np.ndarray:
    """`d_0..d_{n-1}`: the first column of `C^-1` (the streamed BLT)."""
    return self._column(self.inverse_theta, self.inverse_omega, n)

  def noise_matrix(self, n: int) -> np.ndarray:
    """Dense `C^-1`, `[n, n]` lower-triangular Toeplitz."""
    from scipy import linalg  # noqa: PLC0415
    return linalg.toeplitz(self.inverse_coefs(n), np.zeros(n))

  def sensitivity(self) -> float:
    """`max_g ||C 1_{P_g}||` over the cyclic schema (module docstring)."""
    if self._sensitivity is None:
      n, b = self.num_steps, self.min_separation
      c = self.strategy_coefs(n)
      best = 0.0
      for g in range(min(b, n)):
        u = np.zeros(n)
        u[g::b] = 1.0
        best = max(best, float(np.linalg.norm(np.convolve(c, u)[:n])))
      self._sensitivity = best
    return self._sensitivity

  def mean_error(self, n: Optional[int] = None) -> float:
    """`||A C^-1||_F^2 / n * sens^2` (`tf_pxg.mf` BandMF's measure)."""
    n = self.num_steps if n is None else n
    prefix = np.cumsum(self.inverse_coefs(n))  # first column of A C^-1
    # Column j of the Toeplitz A C^-1 is prefix[:n-j]: sum of squares.
    sq = np.cumsum(prefix ** 2)
    return float(sq.sum() / n * self.sensitivity() ** 2)

  # The NoiseMechanism protocol ---------------------------------------------

  def init_state(self, variables):
    """One `[d, *v.shape]` `ON_READ`/`SUM` variable of states per variable."""
    return [tf.Variable(
        tf.zeros([self.num_buffers] + list(v.shape),
                 correlated.buffer_dtype(v.dtype)),
        trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM, name="dp_blt_buffer")
            for v in variables]

  def state_variables(self, state) -> List[tf.Variable]:
    return list(state or [])

  def noise_dtype(self, dtype):
    return correlated.buffer_dtype(dtype)

  def add(self, clipped_sum, state, step, *, noise_multiplier, l2_norm_clip,
          num_replicas, source, normalizer=None, write=None):
    """`(g + x_t) / normalizer` per variable, and the states advanced.

    z_t is drawn as DP-SGD draws it (`tf_pxg.dp.noise.add_gaussian_noise`,
    onto zeros: the same Gaussians for the same generator state); then one
    XLA-compiled function over all variables (fused loops; `jit_compile`
    also inside a non-XLA train step) reads each state once:
    `x_t = z_t + sum_j omega'_j S_j`, `S_j <- theta'_j S_j + z_t`, and the
    output. A step that is not applied (`write` false) keeps the states:
    the gate is on the [d] coefficients (theta' -> 1, z -> 0), not a
    select over the buffers.
    """
    del step  # the states carry the past; the recurrence is step-free
    stddev = dp_noise.replica_noise_stddev(
        noise_multiplier * tf.cast(l2_norm_clip, tf.float64), num_replicas)
    state = list(state)
    z = dp_noise.add_gaussian_noise(
        [tf.zeros(buf.shape[1:], buf.dtype) for buf in state], stddev,
        generator=source)
    scale = (tf.constant(1.0, tf.float64) if normalizer is None else
             1.0 / tf.cast(normalizer, tf.float64))
    out = self._advance(state)(
        z, [dp_noise.densify(g) for g in clipped_sum],
        tf.constant(True) if write is None else tf.convert_to_tensor(write),
        scale)
    return list(out), state

  def _advance(self, state):
    """`add`'s XLA function for these state variables (the last state's
    kept, so eager steps do not recompile)."""
    last = self.__dict__.get("_advance_last")
    if last is not None and len(last[0]) == len(state) and all(
        a is b for a, b in zip(last[0], state)):
      return last[1]
    omega, theta = self.inverse_omega, self.inverse_theta

    @tf.function(jit_compile=True)
    def advance(zs, sums, write, scale):
      out = []
      for buf, z_t, g in zip(state, zs, sums):
        value = buf.read_value()
        # d contiguous rows summed in the loop (not a [d]-long dot).
        x_t = z_t + tf.add_n([float(w) * value[j]
                              for j, w in enumerate(omega)])
        w = tf.cast(write, buf.dtype)
        shape = [-1] + [1] * (buf.shape.rank - 1)
        decay = tf.reshape(w * tf.constant(theta, buf.dtype) + (1 - w), shape)
        buf.assign(decay * value + (w * z_t)[tf.newaxis])
        out.append((tf.cast(g, x_t.dtype) + x_t) * tf.cast(scale, x_t.dtype))
      return out

    self._advance_last = (list(state), advance)
    return advance

  def dp_event(self, noise_multiplier):
    """`GaussianDpEvent(sigma / sens)`: the whole run's event (at most
    `num_steps` steps, cyclic participation with `min_separation` groups;
    not to be composed over steps or amplified)."""
    return dp_accounting.GaussianDpEvent(noise_multiplier /
                                         self.sensitivity())

  #: `dp_event` is the event of the whole run, not of one participation.
  whole_run_event = True

  def get_config(self):
    return {"num_steps": self.num_steps,
            "min_separation": self.min_separation,
            "theta": [float(v) for v in self.theta],
            "omega": [float(v) for v in self.omega]}
