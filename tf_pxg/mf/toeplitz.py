"""Banded Toeplitz strategies for correlated-noise DP training (BandMF).

Notation (Choquette-Choo et al. 2023; McKenna 2024). Over n optimizer steps
the model consumes the prefix sums of the privatised gradients: the workload
is the n×n lower-triangular all-ones matrix A (row i sums steps 0..i). A
matrix mechanism factors A = B·C, releases C·G + z with G the n stacked
clipped gradient sums and z i.i.d. Gaussian, and the model sees

    B·(C·G + z) = A·G + A·C⁻¹·z,

i.e. step i adds the noise x_i = (C⁻¹·z)_i to its gradient sum instead of z_i.

Here C is a lower-triangular banded Toeplitz matrix with b = `num_bands`
bands: C[i, j] = c_{i-j} for 0 <= i - j < b and 0 otherwise. Its inverse is
lower-triangular Toeplitz too (not banded), so the noise can be streamed with
b - 1 buffers:

    x_i = (z_i - sum_{j=1}^{b-1} c_j x_{i-j}) / c_0.

Sensitivity. Column j of C is (c_0, ..., c_{b-1}) placed at rows j..j+b-1,
so every column has L2 norm ||c||_2 except the last b - 1 (truncated, norm
< ||c||_2). The coefficients here are normalised to ||c||_2 = 1, so the
largest column norm is 1 (for n >= b). If every example participates only in
steps at least b apart, its columns touch disjoint rows, and each
participation changes C·G by at most (clip norm) × 1 in L2 norm, exactly as
one DP-SGD step does; that is what the amplified BandMF accounting in
`tf_pxg.accounting` (``min_separation=b``) assumes. So a b-banded strategy
needs b-min-separation participation: `BandedToeplitz.min_separation` is b
(the participation it needs; `num_bands` is the matrix's band count, the
same number).

b = 1 is DP-SGD: c = [1.0] exactly, C = I, x_i = z_i.

Error measure. `mean_error(n)` is the prefix-sum workload's mean squared
error per unit noise variance (McKenna 2024, eq. for the mean-squared loss;
jax-privacy `toeplitz.loss` with `reduction_fn=jnp.mean`):

    mean_error(n) = ||A·C⁻¹||_F² / n × (max column norm of C)²,

the average over the n prefix sums of the variance of their noise when z has
unit variance, times the squared sensitivity (1 for normalised coefficients
and n >= b). With noise multiplier σ and clip norm R the noise in the
prefix sums has mean variance σ² R² · mean_error(n) per coordinate. For
b = 1 it is (n + 1) / 2.

References:
  Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified)
    Banded Matrix Factorization: A unified approach to private training",
    NeurIPS 2023, arXiv:2306.08153.
  Kalinin and Lampert, "Banded Square Root Matrix Factorization for
    Differentially Private Model Training", NeurIPS 2024, arXiv:2405.13763.
  McKenna, "Scaling up the Banded Matrix Factorization Mechanism for
    Differentially Private ML", arXiv:2405.15913, 2024.
  jax-privacy, `jax_privacy/matrix_factorization/toeplitz.py`
    (`optimize_banded_toeplitz`, `loss`, `optimize_coefs_for_amplifications`).
"""

import math
import numbers
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from scipy import linalg
from scipy import optimize
from scipy import signal

__all__ = [
    "BandedToeplitz",
    "NumBandsChoice",
    "METHODS",
    "choose_num_bands",
    "optimize_coefs",
    "sqrt_coefs",
]

# Ways `BandedToeplitz` chooses its coefficients when none are given.
METHODS = ("sqrt", "optimized")

# Candidate band counts of `choose_num_bands` (those fitting N, B and the
# step count are tried).
DEFAULT_NUM_BANDS_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)

# Coefficients whose computed norm is in [1 - this, 1] count as normalised
# and are kept bit for bit, so normalising twice (e.g.
# `from_config(get_config())`) is the identity.
_NORM_TOLERANCE = 8 * np.finfo(np.float64).eps


# ---------------------------------------------------------------------------
# Checks.
# ---------------------------------------------------------------------------


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_num_bands(num_bands) -> int:
  if not _is_int(num_bands) or num_bands < 1:
    raise ValueError(
        f"num_bands must be a positive integer (1 = DP-SGD); got "
        f"{num_bands!r}.")
  return int(num_bands)


def _check_steps(steps, name: str = "steps") -> int:
  if not _is_int(steps) or steps < 1:
    raise ValueError(f"{name} must be a positive integer; got {steps!r}.")
  return int(steps)


def _normalise(coefs: np.ndarray) -> np.ndarray:
  """c / ||c||_2 with computed norm in [1 - 8 eps, 1] (never above 1).

  Returns c itself if its norm is already in that range. Rounding can put
  c / ||c|| a few ulps above 1; it is then shrunk by (1 - eps) steps until
  `np.linalg.norm` gives <= 1, so the sensitivity bound holds in float64.
  """
  with np.errstate(over="ignore", under="ignore"):
    norm = float(np.linalg.norm(coefs))
  if 1.0 - _NORM_TOLERANCE <= norm <= 1.0:
    return coefs
  if not 1e-150 < norm < 1e150:  # avoid overflow/underflow in the norm
    coefs = coefs / np.max(np.abs(coefs))
    norm = float(np.linalg.norm(coefs))
  coefs = coefs / norm
  while float(np.linalg.norm(coefs)) > 1.0:
    coefs = coefs * (1.0 - np.finfo(np.float64).eps)
  return coefs


def _check_coefs(coefs, num_bands: int) -> np.ndarray:
  try:
    array = np.array(coefs, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(
        f"coefs must be a sequence of {num_bands} real numbers "
        f"(num_bands); got {coefs!r}.") from None
  if array.shape != (num_bands,):
    raise ValueError(
        f"coefs must have length num_bands = {num_bands} (one coefficient "
        f"per band, c_0 first); got shape {array.shape}. Pass num_bands="
        f"{array.size if array.ndim == 1 else '...'} or {num_bands} "
        "coefficients.")
  if not np.all(np.isfinite(array)):
    raise ValueError(f"coefs must all be finite; got {array.tolist()}.")
  if not array[0] > 0:
    raise ValueError(
        f"coefs[0] (the diagonal c_0) must be > 0 so that C is invertible "
        f"and the noise x_i = (z_i - ...) / c_0 is defined; got "
        f"{array[0]!r}. Negate all coefficients if c_0 < 0.")
  return array


# ---------------------------------------------------------------------------
# Toeplitz arithmetic on coefficient vectors (O(n b) or O(n log n)).
# ---------------------------------------------------------------------------


def _inverse_coefs(coefs: np.ndarray, n: int) -> np.ndarray:
  """First column d of C⁻¹ (length n) for the n×n banded Toeplitz C.

  d is the impulse response of the all-pole filter 1 / c(z):
  d_0 = 1 / c_0, d_k = -(sum_{j=1}^{min(k, b-1)} c_j d_{k-j}) / c_0.
  """
  impulse = np.zeros(n)
  impulse[0] = 1.0
  return signal.lfilter([1.0], coefs, impulse)


def _weighted_prefix_error(coefs: np.ndarray,
                           n: int) -> Tuple[float, np.ndarray, np.ndarray]:
  """E = ||A C⁻¹||_F² / n, and the pieces its gradient needs.

  A·C⁻¹ is lower-triangular Toeplitz with first column s = cumsum(d), and
  its entry s_k appears n - k times, so E = sum_k (n - k) s_k² / n.
  """
  d = _inverse_coefs(coefs, n)
  s = np.cumsum(d)
  weights = (n - np.arange(n)) / n
  return float(np.dot(weights, s * s)), d, weights * s


def _loss_and_grad(coefs: np.ndarray, n: int) -> Tuple[float, np.ndarray]:
  """L(c) = ||c||² · ||A C⁻¹||_F² / n and dL/dc (c unnormalised, len b <= n).

  L is invariant to scaling c, so its minimiser's direction is what counts.
  Gradient: with C d = e_0, dd/dc_j = -C⁻¹ S^j d = -S^j (C⁻¹ d) (S the down
  shift; lower-triangular Toeplitz matrices commute), so
  dE/dc_j = -sum_{m >= j} g_m e_{m-j} with e = C⁻¹ d and
  g_m = dE/dd_m = 2 sum_{k >= m} w_k s_k.
  """
  with np.errstate(over="ignore", invalid="ignore"):
    error, d, weighted_s = _weighted_prefix_error(coefs, n)
    if not math.isfinite(error):
      return math.inf, np.zeros_like(coefs)
    g = 2.0 * np.cumsum(weighted_s[::-1])[::-1]
    e = signal.lfilter([1.0], coefs, d)
    grad_error = np.array(
        [-np.dot(g[j:], e[:n - j]) for j in range(coefs.size)])
    norm2 = float(np.dot(coefs, coefs))
    loss = norm2 * error
    grad = 2.0 * coefs * error + norm2 * grad_error
  if not (math.isfinite(loss) and np.all(np.isfinite(grad))):
    return math.inf, np.zeros_like(coefs)
  return loss, grad


# What log L(c) is taken to be where L is not finite: far above any finite
# value L-BFGS-B compares it with, so its line search backs off. (An inf
# makes SciPy's line search stop at its first trial step.)
_UNSTABLE_LOG_LOSS = 1e6


def _log_loss_and_grad(coefs: np.ndarray, n: int) -> Tuple[float, np.ndarray]:
  """log L(c) and its gradient: the same minimiser, better scaled.

  Where L overflows (1 / c(z) unstable, so C⁻¹'s coefficients grow
  exponentially in n) returns a large finite value and a zero gradient.
  """
  loss, grad = _loss_and_grad(coefs, n)
  if not (math.isfinite(loss) and loss > 0):
    return _UNSTABLE_LOG_LOSS, np.zeros_like(coefs)
  return math.log(loss), grad / loss


# ---------------------------------------------------------------------------
# Coefficient choices.
# ---------------------------------------------------------------------------


def sqrt_coefs(num_bands: int) -> np.ndarray:
  """The banded square root of the prefix-sum matrix, normalised.

  The lower-triangular square root of A (all ones) is Toeplitz with
  coefficients r_k = |binom(-1/2, k)| = binom(2k, k) / 4^k = 1, 1/2, 3/8,
  5/16, ... (the Taylor coefficients of (1 - z)^{-1/2}; Fichtenberger,
  Henzinger and Upadhyay 2023; Kalinin and Lampert 2024). The banded square
  root keeps r_0..r_{b-1} and, here, divides by their L2 norm so that the
  largest column norm of C is 1.

  Args:
    num_bands: b >= 1.

  Returns:
    float64 array [b], positive and decreasing, norm 1; [1.0] for b = 1.
  """
  num_bands = _check_num_bands(num_bands)
  k = np.arange(1, num_bands)
  r = np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])
  return _normalise(r)


def optimize_coefs(num_bands: int,
                   steps: int,
                   max_iterations: int = 500) -> np.ndarray:
  """Banded Toeplitz coefficients minimising the prefix sums' mean error.

  Minimises L(c) = ||A C⁻¹||_F² / n × ||c||² (n = `steps`; the mean squared
  error of all n prefix sums per unit noise variance, times the squared
  sensitivity ||c||² of one participation) over the b coefficients with
  SciPy's L-BFGS-B on log L and the analytic gradient, starting from
  `sqrt_coefs(b)` (as jax-privacy's `optimize_banded_toeplitz` starts from
  the square root). Each evaluation is O(n b); n = 10^4, b = 16 takes well
  under a second. The result is never worse than the start and its noise
  recursion is stable (C⁻¹'s coefficients decay): otherwise the square root,
  which has both properties, is returned.

  Args:
    num_bands: b >= 1; b = 1 returns [1.0] (DP-SGD) without optimising.
    steps: n, the number of steps the strategy is used for, an integer
      >= num_bands.
    max_iterations: L-BFGS-B iteration limit.

  Returns:
    float64 array [b] with L2 norm 1 and c_0 > 0.

  Raises:
    ValueError: If num_bands < 1, steps is not an integer >= num_bands, or
      the optimiser produced non-finite coefficients.
  """
  num_bands = _check_num_bands(num_bands)
  steps = _check_steps(steps)
  if steps < num_bands:
    raise ValueError(
        f"steps={steps} must be >= num_bands={num_bands}: a {num_bands}-band "
        f"strategy for {steps} steps has unused bands. Use num_bands <= "
        f"{steps}.")
  start = sqrt_coefs(num_bands)
  if num_bands == 1:
    return start
  result = optimize.minimize(
      _log_loss_and_grad, start, args=(steps,), jac=True, method="L-BFGS-B",
      options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10})
  coefs = np.asarray(result.x, dtype=np.float64)
  if not np.all(np.isfinite(coefs)) or coefs[0] == 0:
    raise ValueError(
        f"optimize_coefs(num_bands={num_bands}, steps={steps}) failed: "
        f"{result.message}. Use method='sqrt'.")
  coefs = coefs * np.sign(coefs[0])  # L(c) = L(-c); keep c_0 > 0.
  coefs = _normalise(coefs)
  if not (_loss_and_grad(coefs, steps)[0] <= _loss_and_grad(start, steps)[0]
          and _is_stable(coefs)):
    return start
  return coefs


def _is_stable(coefs: np.ndarray) -> bool:
  """Whether C⁻¹'s coefficients decay: all roots of c_0 w^{b-1} + c_1
  w^{b-2} + ... + c_{b-1} (the poles of 1 / c(z)) lie inside the unit
  circle, so the streamed noise recursion does not amplify rounding."""
  return coefs.size == 1 or bool(np.max(np.abs(np.roots(coefs))) < 1.0)


# ---------------------------------------------------------------------------
# The strategy.
# ---------------------------------------------------------------------------


class BandedToeplitz:
  """Lower-triangular banded Toeplitz strategy C with normalised columns.

  C[i, j] = c_{i-j} for 0 <= i - j < b, else 0, with ||c||_2 = 1 (computed
  in float64: in [1 - 8 eps, 1], never above 1) and c_0 > 0. The noise of step i is x_i = (C⁻¹ z)_i, streamed
  as x_i = (z_i - sum_{j=1}^{b-1} c_j x_{i-j}) / c_0 with b - 1 buffers
  (`num_buffers`). See the module docstring for the sensitivity argument
  and `tf_pxg.accounting` (``min_separation=strategy.min_separation``)
  for the ε.

  Args:
    num_bands: b >= 1. b = 1 is DP-SGD (coefs == [1.0] exactly).
    coefs: Optional explicit c_0..c_{b-1}: b finite numbers with c_0 > 0;
      they are divided by their L2 norm. If given, `method` and `steps`
      are ignored.
    method: How to choose the coefficients when `coefs` is None:
      "sqrt" (default): the banded square root of the prefix-sum matrix
      (`sqrt_coefs`, Kalinin and Lampert 2024), needs no optimisation and
      no step count; "optimized": minimise the mean error for `steps`
      steps (`optimize_coefs`).
    steps: The run's number of optimizer steps; required for "optimized".

  Raises:
    ValueError: For num_bands < 1, bad coefs, an unknown method, or
      method="optimized" without steps. The message names the argument.
  """

  def __init__(self,
               num_bands: int,
               coefs: Optional[Sequence[float]] = None,
               method: str = "sqrt",
               steps: Optional[int] = None):
    num_bands = _check_num_bands(num_bands)
    if coefs is not None:
      coefs = _normalise(_check_coefs(coefs, num_bands))
    elif method == "sqrt":
      coefs = sqrt_coefs(num_bands)
    elif method == "optimized":
      if steps is None:
        raise ValueError(
            "method='optimized' needs steps=n, the number of optimizer "
            "steps the strategy is optimised for (e.g. "
            "tf_pxg.accounting.steps_for(num_examples, batch_size, epochs)); "
            "or use method='sqrt', which needs none.")
      coefs = optimize_coefs(num_bands, steps)
    else:
      raise ValueError(
          f"method must be one of {', '.join(repr(m) for m in METHODS)}; got "
          f"{method!r}. Or pass coefs= explicitly.")
    coefs = np.array(coefs, dtype=np.float64)
    coefs.setflags(write=False)
    self._num_bands = num_bands
    self._coefs = coefs

  @property
  def num_bands(self) -> int:
    """b, the number of bands (nonzero diagonals) of C."""
    return self._num_bands

  @property
  def min_separation(self) -> int:
    """b of the b-min-separation participation this strategy's ε needs
    (participations at least b steps apart, on a fixed cycle): its band
    count."""
    return self._num_bands

  @property
  def coefs(self) -> np.ndarray:
    """c_0..c_{b-1}, float64 [b], read-only, L2 norm 1 (<= 1), c_0 > 0."""
    return self._coefs

  @property
  def num_buffers(self) -> int:
    """b - 1: past noise vectors x_{i-1}..x_{i-b+1} the stream keeps."""
    return self._num_bands - 1

  def inverse_coefs(self, n: int) -> np.ndarray:
    """First column of C⁻¹ for n steps, float64 [n].

    d_0 = 1 / c_0, d_k = -(sum_{j=1}^{min(k, b-1)} c_j d_{k-j}) / c_0; C⁻¹
    is the lower-triangular Toeplitz matrix with first column d.
    """
    n = _check_steps(n, "n")
    return _inverse_coefs(self._coefs[:n], n)

  def strategy_matrix(self, n: int) -> np.ndarray:
    """Dense C, float64 [n, n] (lower triangular, b bands)."""
    n = _check_steps(n, "n")
    column = np.zeros(n)
    m = min(n, self._num_bands)
    column[:m] = self._coefs[:m]
    return linalg.toeplitz(column, np.zeros(n))

  def noise_matrix(self, n: int) -> np.ndarray:
    """Dense C⁻¹, float64 [n, n]: step i's noise is row i times z."""
    column = self.inverse_coefs(n)
    return linalg.toeplitz(column, np.zeros(column.size))

  def mean_error(self, n: int) -> float:
    """||A C⁻¹||_F² / n × (max column norm of C)² for n steps.

    The mean over the n prefix sums of their noise variance per unit
    variance of z, times the squared sensitivity of one participation
    (1 when n >= b, ||c_0..c_{n-1}||² otherwise). (n + 1) / 2 for b = 1.
    """
    n = _check_steps(n, "n")
    coefs = self._coefs[:n]
    with np.errstate(over="ignore", invalid="ignore"):
      error, _, _ = _weighted_prefix_error(coefs, n)
    return error * float(np.dot(coefs, coefs))

  def get_config(self) -> Dict[str, Any]:
    """JSON-able dict: {"num_bands": int, "coefs": [float, ...]}."""
    return {"num_bands": self._num_bands,
            "coefs": [float(c) for c in self._coefs]}

  @classmethod
  def from_config(cls, config: Dict[str, Any]) -> "BandedToeplitz":
    """Inverse of `get_config`; the coefficients come back bit for bit."""
    return cls(config["num_bands"], coefs=config["coefs"])

  def __eq__(self, other) -> bool:
    if not isinstance(other, BandedToeplitz):
      return NotImplemented
    return (self._num_bands == other._num_bands and
            np.array_equal(self._coefs, other._coefs))

  def __hash__(self) -> int:
    return hash((self._num_bands, tuple(self._coefs.tolist())))

  def __repr__(self) -> str:
    coefs = ", ".join(repr(float(c)) for c in self._coefs)
    return f"BandedToeplitz(num_bands={self._num_bands}, coefs=[{coefs}])"


# ---------------------------------------------------------------------------
# Choosing b.
# ---------------------------------------------------------------------------


class NumBandsChoice(NamedTuple):
  """Result of `choose_num_bands`.

  Attributes:
    num_bands: The chosen b.
    strategy: Its `BandedToeplitz`.
    noise_multiplier: σ reaching the target ε with that b (amplified BandMF
      accounting, `tf_pxg.accounting.noise_multiplier_for_epsilon`).
    expected_error: σ² × strategy.mean_error(steps), the criterion.
    candidates: One dict per candidate tried, in order, with keys
      "num_bands", "noise_multiplier", "mean_error", "expected_error".
  """
  num_bands: int
  strategy: BandedToeplitz
  noise_multiplier: float
  expected_error: float
  candidates: Tuple[Dict[str, Any], ...]


def choose_num_bands(num_examples: int,
                     batch_size: int,
                     epochs: float,
                     target_epsilon: float,
                     delta: float,
                     candidates: Optional[Sequence[int]] = None,
                     method: str = "optimized",
                     accountant: str = "rdp") -> NumBandsChoice:
  """Picks b for a run like jax-privacy's `optimize_coefs_for_amplifications`.

  Fewer bands mean more amplification (each example is sampled from a
  group of N / b at rate q = B b / N and participates in ceil(T / b)
  rounds); more bands mean more noise cancellation. For each candidate b
  this computes σ_b, the smallest noise multiplier whose amplified BandMF
  run (`tf_pxg.accounting.noise_multiplier_for_epsilon(...,
  min_separation=b)`)
  is (target_epsilon, delta)-DP, builds the strategy for T steps, and
  scores it by

      expected_error(b) = σ_b² × mean_error_b(T),

  the mean over the T prefix sums of the injected noise's variance per
  coordinate, in units of (clip norm)², i.e. the mean squared error that
  the noise adds to the sum of the model's updates (the expected batch
  size B is the same for every b, so dividing by B², as jax-privacy does
  for the average gradient, would not change the ranking). The b with the
  smallest expected_error wins (ties: the smaller b).

  Args:
    num_examples: N.
    batch_size: Expected batch size B.
    epochs: Epochs; T = tf_pxg.accounting.steps_for(N, B, epochs) >= 1.
    target_epsilon: ε to reach.
    delta: δ.
    candidates: b values to try. Default: those of 1, 2, 4, 8, 16, 32, 64
      with b <= N / B and b <= T. Explicit values must satisfy both.
    method: How each candidate's coefficients are chosen: "optimized"
      (default, as jax-privacy; `optimize_coefs` for T steps, well under a
      second per candidate for T ~ 10^4) or "sqrt".
    accountant: "rdp" or "pld", as in `tf_pxg.accounting`.

  Returns:
    A `NumBandsChoice` (num_bands, strategy, noise_multiplier,
    expected_error, candidates).

  Raises:
    ValueError: For invalid run arguments (see `tf_pxg.accounting`), zero
      steps, an unknown method, or a candidate that is not a positive int,
      exceeds N // B (sampling rate B b / N > 1) or exceeds T.
  """
  from tf_pxg import accounting  # pylint: disable=import-outside-toplevel

  steps = accounting.steps_for(num_examples, batch_size, epochs)
  if steps < 1:
    raise ValueError(
        f"epochs={epochs!r} gives 0 steps; there is no strategy to choose.")
  if method not in METHODS:
    raise ValueError(
        f"method must be one of {', '.join(repr(m) for m in METHODS)}; got "
        f"{method!r}.")
  max_bands = min(num_examples // batch_size, steps)
  if candidates is None:
    candidates = [b for b in DEFAULT_NUM_BANDS_CANDIDATES if b <= max_bands]
  else:
    candidates = list(candidates)
    if not candidates:
      raise ValueError("candidates must be a non-empty sequence of ints.")
    for b in candidates:
      _check_num_bands(b)
      if b > max_bands:
        raise ValueError(
            f"candidate num_bands={b} is too large: it must be <= "
            f"num_examples // batch_size = {num_examples // batch_size} "
            f"(sampling rate B*b/N <= 1) and <= steps = {steps}; the "
            f"largest allowed is {max_bands}.")
  rows: List[Dict[str, Any]] = []
  best = None
  for b in candidates:
    sigma = accounting.noise_multiplier_for_epsilon(
        target_epsilon, num_examples, batch_size, steps=steps, delta=delta,
        accountant=accountant, min_separation=b)
    strategy = BandedToeplitz(b, method=method, steps=steps)
    error = strategy.mean_error(steps)
    expected = sigma * sigma * error
    rows.append({"num_bands": b, "noise_multiplier": sigma,
                 "mean_error": error, "expected_error": expected})
    if best is None or expected < best[3]:
      best = (b, strategy, sigma, expected)
  return NumBandsChoice(best[0], best[1], best[2], best[3], tuple(rows))
