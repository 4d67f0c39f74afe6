"""Privacy accounting for DP-SGD on `dp_accounting`: ε of a run, σ for an ε.

The mechanism accounted for is DP-SGD with Poisson sampling (Abadi et al.,
2016). At every optimizer step each of the `num_examples` training examples
joins the batch independently with probability

    q = batch_size / num_examples,

so `batch_size` is the *expected* batch size. The clipped per-example gradients
of the batch are summed and Gaussian noise with standard deviation
`noise_multiplier * l2_norm_clip` is added once. With sensitivity
`l2_norm_clip` that one step is the Poisson-subsampled Gaussian mechanism with
noise multiplier σ = `noise_multiplier`,

    PoissonSampledDpEvent(q, GaussianDpEvent(σ)),

and a run of `steps` optimizer steps is its `steps`-fold adaptive composition,

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps).

One epoch is one expected pass over the data, `num_examples / batch_size`
steps, so `epochs` epochs are `steps = ceil(epochs * num_examples /
batch_size)` steps (rounded up: a partial step still releases a noisy
gradient). Neighbouring datasets differ by adding or removing one example
(`NeighboringRelation.ADD_OR_REMOVE_ONE`), the relation under which Poisson
sampling is analysed.

Two accountants turn that event into (ε, δ):

- ``"rdp"``: Rényi DP (Mironov, 2017) of the sampled Gaussian mechanism
  (Mironov, Talwar and Zhang, 2019), composed by adding RDP curves over the
  orders in `RDP_ORDERS`, then converted to (ε, δ) with the bound of Canonne,
  Kamath and Steinke (2020, Prop. 12) that `dp_accounting` uses. This is a
  valid upper bound and the field's usual number. It is lower than the
  classic conversion `ε = min_α RDP(α) + log(1/δ) / (α - 1)` (Mironov 2017,
  Prop. 3) that older TF Privacy releases published: for MNIST (N=60000,
  B=256, σ=1.1, 60 epochs, δ=1e-5) the same RDP curve gives 3.01 there and
  2.60 here.
- ``"pld"``: privacy loss distributions (Meiser and Mohammadi, 2018;
  Koskela, Jälkö and Honkela, 2020; Doroshenko et al., 2022), composed
  numerically with a pessimistic discretisation whose interval is refined
  (from 1e-3 down to at most 1e-5, see `PLD_VALUE_DISCRETIZATION_INTERVALS`)
  until ε changes by less than 1%. Still an upper bound, and tighter than
  RDP for DP-SGD (MNIST as above: 2.38).

Correlated noise (``min_separation=b > 1``): amplified banded matrix
factorization (BandMF; Choquette-Choo et al. 2023, Theorem 4 and Algorithm
2). b is `min_separation`: b-min-separation participation, the name
used throughout tf_pxg (it was `num_bands` here, a deprecated alias; a
b-banded strategy needs exactly this b). The step adds the noise x_i = (C⁻¹ z)_i of a lower-triangular b-banded
strategy C whose columns have L2 norm <= 1 (`tf_pxg.mf.BandedToeplitz`),
and the batches come from cyclic Poisson sampling: the examples are split
into b fixed groups, step i samples from group i mod b only, each example
of that group independently with probability

    q = batch_size * min_separation / num_examples

(the expected batch is still `batch_size`; q <= 1 needs b <= N // B). An
example's participations are then at least b steps apart, so it touches
disjoint rows of C at each one (one column of norm <= 1 each time), and
Theorem 4 of Choquette-Choo et al. reduces the run to ceil(T / b) "rounds",
in each of which every example is in at most one Poisson-sampled step:

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)),
                        ceil(T / b)).

This is the event of jax-privacy's `accounting.amplified_bandmf_event(
noise_multiplier, iterations, num_bands=b, sampling_prob=q)` (read in
github.com/google-deepmind/jax_privacy, jax_privacy/accounting.py at commit
8967688c: it returns its `dpsgd_event` with `iterations=math.ceil(
iterations / num_bands)`, and takes σ "assuming the strategy matrix has
maximum L2 column norm of one"), used with
`batch_selection.CyclicPoissonSampling(cycle_length=b)`, which samples
`partition[i % cycle_length]` at step i. b = 1 is the DP-SGD event above,
unchanged. The ε holds when:

  - C's columns have L2 norm <= 1 (`BandedToeplitz` normalises ||c||_2 = 1;
    explicit coefficients are normalised too) and C has at most b bands;
  - every example is in exactly one group, and its group does not depend on
    the other examples (fixed per example, e.g. from its own id or drawn
    independently at random: under add/remove-one neighbours a split that
    reshuffles everyone when one example is added is only covered for
    replace-one; jax-privacy's `PartitionType.INDEPENDENT` vs
    `EQUAL_SPLIT` makes the same distinction);
  - step i, counted in global optimizer steps from the run's first step
    (continuing across resumed fits, never restarting at an epoch or a new
    `fit`), samples group i mod b and nothing else, at exactly the rate q
    above; the noise state of C⁻¹ continues across the same steps;
  - T is the total number of steps. b need not divide the steps per epoch
    nor T: the groups follow the global step, and the last, partial round
    counts as a whole one (ceil);
  - q = B b / N <= 1, i.e. b <= N // B (`max_min_separation`); larger b is
    refused.

Adaptive clipping (Andrew et al. 2021): a step that releases the clipped
gradient sum with noise std σ_g × R (R the clip norm) and the count of
examples whose norm is <= R, each contributing 1[‖g‖ <= R] - 1/2
(sensitivity 1/2), with noise std σ_b, is as private as one Gaussian
mechanism with noise multiplier σ,
σ⁻² = σ_g⁻² + (2 σ_b)⁻² (Theorem 1; Rényi DP of Gaussians adds in 1/σ²).
So account the run with σ and add gradient noise σ_g =
`split_noise_multipliers(σ, σ_b)`.

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Mironov, "Rényi Differential Privacy", CSF 2017.
  Mironov, Talwar and Zhang, "Rényi Differential Privacy of the Sampled
    Gaussian Mechanism", arXiv:1908.10530, 2019.
  Canonne, Kamath and Steinke, "The Discrete Gaussian for Differential
    Privacy", NeurIPS 2020.
  Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta and Xu,
    "(Amplified) Banded Matrix Factorization: A unified approach to private
    training", NeurIPS 2023, arXiv:2306.08153.
  Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning
    with Adaptive Clipping", NeurIPS 2021, arXiv:1905.03871.
  Meiser and Mohammadi, "Tight on Budget? Tight Bounds for r-Fold
    Approximate Differential Privacy", CCS 2018.
  Koskela, Jälkö and Honkela, "Computing Tight Differential Privacy
    Guarantees Using FFT", AISTATS 2020.
  Doroshenko et al., "Connect the Dots: Tighter Discrete Approximations of
    Privacy Loss Distributions", PETS 2022.
"""

import contextlib
import fractions
import logging
import math
import numbers
import os
import warnings
from typing import Iterator, Optional, Tuple, Union

import dp_accounting
from scipy import optimize

from tf_pxg import _renamed
# The noise's shares among releases of one step (re-exported: `__all__`).
from tf_pxg.noise_shares import combined_noise_multiplier
from tf_pxg.noise_shares import split_noise_multipliers

__all__ = [
    "ACCOUNTANTS",
    "PLD_VALUE_DISCRETIZATION_INTERVALS",
    "RDP_ORDERS",
    "combined_noise_multiplier",
    "compute_epsilon",
    "cyclic_poisson_event",
    "dp_event",
    "event_epsilon",
    "max_min_separation",
    "max_num_bands",
    "mechanism_dp_event",
    "mechanism_epsilon",
    "noise_multiplier_for_epsilon",
    "sampling_probability",
    "split_noise_multipliers",
    "steps_for",
    "TruncationAccountedWithPLD",
    "truncated_poisson_event",
]

# The accountants `compute_epsilon` and `noise_multiplier_for_epsilon` accept.
ACCOUNTANTS = ("rdp", "pld")

# RDP orders: TF Privacy's dense list (fine steps near 1 for small ε, integers
# to 63) plus a few large orders for very small noise or very few steps.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) +
                   [128, 256, 512, 1024])

# PLD discretisation: the interval starts at the first value and is refined by
# sqrt(10) per round while ε still changes by more than the relative tolerance,
# down to the last value. Every PLD estimate here is pessimistic (a valid upper
# bound); refinement only tightens it. Coarse intervals are accurate and cheap
# where ε is large (MNIST, σ=1.1: 2.3906 at 1e-3 vs 2.3817 at 1e-5) but loose
# where ε is small and there are many steps (σ=17, 14063 steps: 0.170 at 1e-3
# vs 0.090 at 1e-5), and fine intervals are cheap exactly there.
PLD_VALUE_DISCRETIZATION_INTERVALS = tuple(
    10.0**(-k / 2) for k in range(6, 11))  # 1e-3, 3.2e-4, ..., 1e-5
_PLD_RELATIVE_TOLERANCE = 0.01

# `noise_multiplier_for_epsilon` searches σ in (0, this].
_MAX_NOISE_MULTIPLIER = float(2**20)

_Number = Union[int, float]


# ---------------------------------------------------------------------------
# dp_accounting's log output.
#
# What it prints (measured with dp-accounting 0.6): the RDP accountant warns
# through absl logging (logger "absl") when the series for a fractional order
# does not converge ("_compute_log_a_frac failed to converge after 1000
# iterations ... Excluding this order", e.g. q = 0.5, σ >= 2: one line per
# order, ~20 lines per call) and when an RDP value is numerically negative
# (e.g. MNIST sampling with σ ~ 1e5). Both are harmless for us: an excluded
# order only makes ε larger (the minimum is over fewer orders) and a tiny
# negative RDP means ε ~ 0. The
# PLD code logs through the root logger only on a path we do not take
# (connect-the-dots with an optimistic estimate); it printed nothing in our
# runs. Neither emits Python `warnings`. So we drop, while our calls run,
# exactly the log records whose source file is inside the dp_accounting
# package, and leave every other record alone.
# ---------------------------------------------------------------------------

_DP_ACCOUNTING_DIR = os.path.dirname(os.path.abspath(dp_accounting.__file__))


class _DropDpAccountingRecords(logging.Filter):
  """Rejects log records emitted from files of the dp_accounting package."""

  def filter(self, record: logging.LogRecord) -> bool:
    path = os.path.abspath(record.pathname or "")
    return not path.startswith(_DP_ACCOUNTING_DIR + os.sep)


@contextlib.contextmanager
def _quiet_dp_accounting() -> Iterator[None]:
  """Silences dp_accounting's log records while the block runs.

  Adds a filter to the "absl" logger (the RDP code logs there) and to the root
  logger (the PLD code logs there); a logger's filters see the records logged
  on that logger itself, so records of other libraries pass unchanged. The
  filters are removed on exit.
  """
  record_filter = _DropDpAccountingRecords()
  loggers = (logging.getLogger("absl"), logging.getLogger())
  for logger in loggers:
    logger.addFilter(record_filter)
  try:
    yield
  finally:
    for logger in loggers:
      logger.removeFilter(record_filter)


# ---------------------------------------------------------------------------
# Input checks. Messages name the argument, the bad value and what is allowed.
# ---------------------------------------------------------------------------


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive_int(name: str, value) -> int:
  if not _is_int(value) or value < 1:
    raise ValueError(
        f"{name} must be a positive integer (>= 1); got {value!r}.")
  return int(value)


def _check_batch_size(batch_size, num_examples: int) -> int:
  if not _is_int(batch_size) or not 0 < batch_size <= num_examples:
    raise ValueError(
        "batch_size must be an integer with 0 < batch_size <= num_examples "
        f"(= {num_examples}); got {batch_size!r}.")
  return int(batch_size)


def _check_delta(delta) -> float:
  if not _is_real(delta) or not 0.0 < delta < 1.0:
    raise ValueError(
        f"delta must be a number with 0 < delta < 1; got {delta!r}.")
  return float(delta)


def _check_noise_multiplier(noise_multiplier) -> float:
  if (not _is_real(noise_multiplier) or not math.isfinite(noise_multiplier) or
      noise_multiplier < 0):
    raise ValueError(
        "noise_multiplier must be a finite number >= 0; "
        f"got {noise_multiplier!r}.")
  return float(noise_multiplier)


def _check_accountant(accountant) -> str:
  if accountant not in ACCOUNTANTS:
    allowed = ", ".join(repr(a) for a in ACCOUNTANTS)
    raise ValueError(
        f"accountant must be one of {allowed}; got {accountant!r}.")
  return accountant


def _check_epochs(epochs) -> None:
  if not _is_real(epochs) or not math.isfinite(epochs) or epochs < 0:
    raise ValueError(f"epochs must be a finite number >= 0; got {epochs!r}.")


def _check_steps(steps) -> int:
  if not _is_int(steps) or steps < 0:
    raise ValueError(f"steps must be an integer >= 0; got {steps!r}.")
  return int(steps)


def _check_min_separation(min_separation, num_examples: int,
                          batch_size: int,
                          name: str = "min_separation") -> int:
  """b, a positive int with batch_size * b <= num_examples (q <= 1).
  `name`: the argument's name in messages (the one the caller used)."""
  if not _is_int(min_separation) or min_separation < 1:
    raise ValueError(
        f"{name} must be a positive integer (1 = DP-SGD); got "
        f"{min_separation!r}.")
  b = int(min_separation)
  if batch_size * b > num_examples:
    raise ValueError(
        f"{name}={b} is too large for num_examples={num_examples} "
        f"and batch_size={batch_size}: each of the {b} groups holds "
        f"about {num_examples / b:g} examples, fewer than the "
        f"expected batch, so the sampling rate batch_size * {name} / "
        f"num_examples = {batch_size * b / num_examples:g} exceeds "
        f"1. Use {name} <= {num_examples // batch_size} "
        "(num_examples // batch_size), or a smaller batch_size.")
  return b


def _separation(min_separation, num_bands, where: str, num_examples: int,
                batch_size: int) -> int:
  """`min_separation`, or its deprecated alias `num_bands`, checked."""
  value, name = _renamed.argument(min_separation, num_bands,
                                  new="min_separation", old="num_bands",
                                  where=where, default=1, depth=4)
  return _check_min_separation(value, num_examples, batch_size, name)


def _resolve_steps(num_examples: int, batch_size: int,
                   epochs: Optional[_Number], steps: Optional[int]) -> int:
  """The step count from exactly one of `epochs` and `steps`."""
  if (epochs is None) == (steps is None):
    raise ValueError(
        "Pass exactly one of epochs and steps; got "
        f"epochs={epochs!r}, steps={steps!r}.")
  if steps is not None:
    return _check_steps(steps)
  return steps_for(num_examples, batch_size, epochs)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def steps_for(num_examples: int, batch_size: int, epochs: _Number) -> int:
  """Number of optimizer steps in `epochs` epochs of Poisson-sampled DP-SGD.

  One epoch is `num_examples / batch_size` steps in expectation (each step
  samples `batch_size` examples in expectation), so the count is
  `ceil(epochs * num_examples / batch_size)`. The product is formed exactly
  from the shortest decimal form of `epochs`, so e.g. `epochs=1.1`,
  `num_examples=100`, `batch_size=10` gives 11 steps, not the 12 that
  floating point (`1.1 * 100 / 10 = 11.000000000000002`) would.

  Args:
    num_examples: Training set size N, a positive integer.
    batch_size: Expected batch size B, an integer with 0 < B <= N.
    epochs: Number of epochs, a finite number >= 0 (fractions allowed).

  Returns:
    The number of steps, an int >= 0.

  Raises:
    ValueError: If an argument is out of range or of the wrong type.
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  _check_epochs(epochs)
  if _is_int(epochs):
    exact_epochs = fractions.Fraction(int(epochs))
  else:
    exact_epochs = fractions.Fraction(repr(float(epochs)))
  return math.ceil(exact_epochs * num_examples / batch_size)


def max_min_separation(num_examples: int, batch_size: int) -> int:
  """The largest `min_separation` b with cyclic sampling rate B b / N <= 1:
  N // B.

  Raises:
    ValueError: If num_examples or batch_size is invalid (see `steps_for`).
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  return num_examples // batch_size


def max_num_bands(num_examples: int, batch_size: int) -> int:
  """Deprecated name of `max_min_separation`."""
  _renamed.warn("max_num_bands", "max_min_separation", "tf_pxg.accounting")
  return max_min_separation(num_examples, batch_size)


def sampling_probability(num_examples: int,
                         batch_size: int,
                         min_separation: int = 1, *,
                         num_bands: Optional[int] = _renamed.NOT_GIVEN) -> float:
  """The per-step inclusion probability q that the accounting assumes.

  q = batch_size * min_separation / num_examples, computed as one float division
  of the integer product (exactly B / N for b = 1). With b = 1 every example
  is eligible at every step (Poisson sampling); with b > 1 only the examples
  of group i mod b are eligible at step i (cyclic Poisson sampling, see the
  module docstring), each with this probability. A sampler must use exactly
  this q for the ε of `compute_epsilon(..., min_separation=b)` to hold.

  Args:
    num_examples: Training set size N, a positive integer.
    batch_size: Expected batch size B, an integer with 0 < B <= N.
    min_separation: b, a positive integer with B b <= N (`num_bands`,
      its deprecated name, too).

  Returns:
    q as a Python float in (0, 1].

  Raises:
    ValueError: If an argument is invalid; for b > N // B the message says
      b is too large and gives N // B.
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  b = _separation(min_separation, num_bands, "sampling_probability",
                  num_examples, batch_size)
  return batch_size * b / num_examples


def _rounds(steps: int, min_separation: int) -> int:
  """ceil(T / b): the rounds of the amplified BandMF composition."""
  return -(-steps // min_separation)


def dp_event(num_examples: int,
             batch_size: int,
             noise_multiplier: float,
             epochs: Optional[_Number] = None,
             steps: Optional[int] = None,
             *,
             min_separation: int = 1,
             num_bands: Optional[int] = _renamed.NOT_GIVEN,
             max_batch_size: Optional[int] = None) -> dp_accounting.DpEvent:
  """The `dp_accounting` event of a DP-SGD or BandMF run (module docstring).

  Args:
    num_examples: Training set size N, a positive integer.
    batch_size: Expected batch size B, an integer with 0 < B <= N; the
      sampling probability is q = B b / N.
    noise_multiplier: σ, the noise std divided by the clipping norm (for
      BandMF: the std of z, whose strategy C has column norms <= 1); finite,
      >= 0.
    epochs: Number of epochs; give exactly one of `epochs` and `steps`.
    steps: Number of optimizer steps.
    min_separation: b of the cyclic participation (the bands of the BandMF
      strategy, `tf_pxg.mf`, and the number of cyclic sampling groups); 1
      (default) is DP-SGD. A positive integer <= N // B.
    num_bands: deprecated name of `min_separation`.
    max_batch_size: B_max of truncated Poisson sampling (None: none): the
      event is then `truncated_poisson_event(N, q, B_max, σ, T)`; only with
      `min_separation=1`.

  Returns:
    `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), R)`
    with q = B b / N and R = ceil(T / b) for T the step count (for b = 1:
    q = B / N and R = T, DP-SGD), ready for any `dp_accounting` accountant.
    For b > 1 this is jax-privacy's `amplified_bandmf_event`.

  Raises:
    ValueError: If an argument is out of range, of the wrong type, or both or
      neither of `epochs` and `steps` are given.
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  noise_multiplier = _check_noise_multiplier(noise_multiplier)
  b = _separation(min_separation, num_bands, "dp_event", num_examples,
                  batch_size)
  cap = _truncation(max_batch_size, b, num_examples, "dp_event")
  steps = _resolve_steps(num_examples, batch_size, epochs, steps)
  return _make_event(batch_size * b / num_examples, noise_multiplier,
                     _rounds(steps, b),
                     None if cap is None else (num_examples, cap))


class TruncationAccountedWithPLD(UserWarning):
  """An RDP request for an event dp-accounting's RDP cannot analyse (the
  truncated Poisson event), answered with PLD."""


def truncated_poisson_event(num_examples: int, sampling_probability: float,
                            max_batch_size: int, noise_multiplier: float,
                            steps: int) -> dp_accounting.DpEvent:
  """`steps` compositions of truncated Poisson sampling with the Gaussian
  mechanism: `SelfComposedDpEvent(TruncatedSubsampledGaussianDpEvent(N, q,
  B_max, σ), steps)` (dp-accounting >= 0.6.0; Choquette-Choo et al. 2025,
  arXiv:2508.15089). Each step draws a Poisson sample at rate q, keeps a
  uniformly random subset of `max_batch_size` when it is larger, and adds
  Gaussian noise of std σC to the sum of the kept examples' gradients
  clipped to C (`tf_pxg.data.truncated_poisson`). RDP has no analysis of
  it: `event_epsilon` accounts it with PLD (`TruncationAccountedWithPLD`).

  Raises:
    ValueError: an argument out of range (named).
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
  if not _is_real(sampling_probability) or not (
      0 < sampling_probability <= 1):
    raise ValueError(f"sampling_probability must be in (0, 1]; got "
                     f"{sampling_probability!r}.")
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.TruncatedSubsampledGaussianDpEvent(
          num_examples, float(sampling_probability), max_batch_size,
          _check_noise_multiplier(noise_multiplier)), _check_steps(steps))


def _truncation(max_batch_size, b: int, num_examples: int,
                where: str) -> Optional[int]:
  """`max_batch_size` checked (None: no truncation); only with b = 1."""
  if max_batch_size is None:
    return None
  max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
  if b != 1:
    raise ValueError(
        f"{where}: max_batch_size (truncated Poisson sampling) is accounted "
        f"for independent Gaussian noise only, not min_separation={b} "
        "(cyclic participation). Drop one of them.")
  return max_batch_size


def _has_truncation(event) -> bool:
  """Whether a `TruncatedSubsampledGaussianDpEvent` is inside `event`."""
  if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
    return True
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return any(_has_truncation(e) for e in event.events)
  inner = getattr(event, "event", None)
  return isinstance(inner, dp_accounting.DpEvent) and _has_truncation(inner)


def _make_event(sampling_probability: float, noise_multiplier: float,
                steps: int, truncation: Optional[Tuple[int, int]] = None
                ) -> dp_accounting.DpEvent:
  """DP-SGD's event; with `truncation=(N, B_max)` the truncated one."""
  if truncation is not None:
    return truncated_poisson_event(truncation[0], sampling_probability,
                                   truncation[1], noise_multiplier, steps)
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_probability,
          dp_accounting.GaussianDpEvent(noise_multiplier)), steps)


def _rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
  accountant = dp_accounting.rdp.RdpAccountant(list(RDP_ORDERS))
  return float(accountant.compose(event).get_epsilon(delta))


def _pld_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
  """PLD ε, refining the discretisation until it changes by < 1%."""
  epsilon = math.inf
  for interval in PLD_VALUE_DISCRETIZATION_INTERVALS:
    accountant = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=interval)
    finer = float(accountant.compose(event).get_epsilon(delta))
    converged = (math.isinf(finer) or
                 abs(epsilon - finer) <= _PLD_RELATIVE_TOLERANCE * finer)
    # Both are upper bounds on the true ε; keep the smaller.
    epsilon = min(epsilon, finer)
    if converged:
      break
  return epsilon


def _pld_for_truncation(accountant: str, truncated: bool) -> str:
  """The accountant of an event with (`truncated`) or without a truncated
  Poisson part: "pld" for one, since dp-accounting (0.6) has no RDP
  analysis of it, warning `TruncationAccountedWithPLD` when "rdp" was
  asked; else `accountant`."""
  if accountant == "rdp" and truncated:
    warnings.warn(
        "TruncatedSubsampledGaussianDpEvent (truncated Poisson sampling) has "
        "no RDP analysis in dp-accounting; its ε is accounted with PLD. Pass "
        "accountant='pld' to say so and silence this warning.",
        TruncationAccountedWithPLD, stacklevel=4)
    return "pld"
  return accountant


def _composed_epsilon(event: dp_accounting.DpEvent, delta: float,
                      accountant: str) -> float:
  """ε of `event` by `accountant`; an event with a truncated Poisson part
  by PLD whatever it says (`_pld_for_truncation`)."""
  accountant = _pld_for_truncation(accountant, _has_truncation(event))
  with _quiet_dp_accounting():
    if accountant == "rdp":
      return _rdp_epsilon(event, delta)
    return _pld_epsilon(event, delta)


def _epsilon(sampling_probability: float, noise_multiplier: float, steps: int,
             delta: float, accountant: str,
             truncation: Optional[Tuple[int, int]] = None) -> float:
  """ε for already validated inputs; `steps` counts compositions (rounds);
  `truncation`: `(N, B_max)` of truncated Poisson sampling, or None."""
  if steps == 0:
    return 0.0
  if noise_multiplier == 0.0:
    return math.inf
  return _composed_epsilon(
      _make_event(sampling_probability, noise_multiplier, steps, truncation),
      delta, accountant)


def compute_epsilon(num_examples: int,
                    batch_size: int,
                    noise_multiplier: float,
                    epochs: Optional[_Number] = None,
                    steps: Optional[int] = None,
                    delta: float = 1e-5,
                    accountant: str = "rdp",
                    *,
                    min_separation: int = 1,
                    num_bands: Optional[int] = _renamed.NOT_GIVEN,
                    max_batch_size: Optional[int] = None) -> float:
  """ε such that a DP-SGD (or BandMF) run is (ε, δ)-differentially private.

  The run is `steps` steps (or `epochs` epochs, i.e. `ceil(epochs *
  num_examples / batch_size)` steps) of the Poisson-subsampled Gaussian
  mechanism with sampling probability `batch_size / num_examples` and noise
  multiplier `noise_multiplier`; see the module docstring for the derivation.
  With `min_separation=b > 1` it is amplified BandMF with cyclic Poisson
  sampling: ceil(T / b) compositions at rate `batch_size * b /
  num_examples` (`dp_event`; the conditions under which this ε holds are in
  the module docstring).

  Args:
    num_examples: Training set size N, a positive integer.
    batch_size: Expected batch size B, an integer with 0 < B <= N.
    noise_multiplier: σ = noise std / `l2_norm_clip`; finite, >= 0. Zero means
      no noise, so ε = inf (unless there are no steps).
    epochs: Number of epochs (>= 0, may be fractional); give exactly one of
      `epochs` and `steps`.
    steps: Number of optimizer steps (integer >= 0), e.g. the optimizer's
      `iterations`.
    delta: Target δ, 0 < δ < 1; usually below 1 / N.
    accountant: "rdp" (Rényi DP; Mironov 2017, Mironov et al. 2019) or "pld"
      (privacy loss distributions; tighter).
    min_separation: b of the cyclic participation (the number of bands of
      the BandMF strategy and of cyclic sampling groups), a positive
      integer <= num_examples // batch_size; 1 (default) is DP-SGD, giving
      exactly the DP-SGD ε.
    num_bands: deprecated name of `min_separation` (error messages then
      name `num_bands`).
    max_batch_size: B_max of truncated Poisson sampling (None: none):
      every step keeps a random `max_batch_size` of a larger draw
      (`truncated_poisson_event`); accounted with PLD whatever
      `accountant` says (RDP has no analysis of it; "rdp" warns). Only
      with `min_separation=1`.

  Returns:
    ε as a Python float: 0.0 for zero steps, inf for `noise_multiplier=0`.

  Raises:
    ValueError: If an argument is out of range, of the wrong type, or both or
      neither of `epochs` and `steps` are given. The message names the
      argument, the value and what is allowed (for a too large b,
      the largest allowed).

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    Mironov, "Rényi Differential Privacy", CSF 2017.
    Mironov, Talwar and Zhang, "Rényi Differential Privacy of the Sampled
    Gaussian Mechanism", 2019.
    Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", 2023.
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  noise_multiplier = _check_noise_multiplier(noise_multiplier)
  delta = _check_delta(delta)
  accountant = _check_accountant(accountant)
  b = _separation(min_separation, num_bands, "compute_epsilon",
                  num_examples, batch_size)
  cap = _truncation(max_batch_size, b, num_examples, "compute_epsilon")
  steps = _resolve_steps(num_examples, batch_size, epochs, steps)
  return _epsilon(batch_size * b / num_examples, noise_multiplier,
                  _rounds(steps, b), delta, accountant,
                  None if cap is None else (num_examples, cap))


def mechanism_dp_event(mechanism, num_examples: int, batch_size: int,
                       noise_multiplier: float,
                       steps: int) -> Optional[dp_accounting.DpEvent]:
  """The event of `steps` steps: cyclic Poisson sampling x `mechanism`.

  The sampler's event composes the mechanism's and nothing else: with
  b = `mechanism.min_separation` cyclic groups (b = 1: plain Poisson
  sampling) at rate q = B b / N, the run is
  `SelfComposed(PoissonSampled(q, mechanism.dp_event(sigma)), ceil(T / b))`
  (for the independent Gaussian and BandMF exactly `dp_event`'s event). A
  mechanism whose `dp_event` is already the event of the whole run
  (`whole_run_event`, e.g. BLT: its sensitivity covers every
  participation of the cyclic schema, no amplification claimed) is
  returned as it is, for T up to its `num_steps`; None beyond (no ε is
  claimed for a longer run).

  Args:
    mechanism: a `tf_pxg.dp.mechanisms.NoiseMechanism`.
    num_examples, batch_size, noise_multiplier, steps: as `dp_event`.

  Raises:
    ValueError: out-of-range arguments (as `dp_event`).
  """
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  b = _check_min_separation(int(mechanism.min_separation), num_examples,
                            batch_size)
  return cyclic_poisson_event(mechanism, batch_size * b / num_examples,
                              b, noise_multiplier, steps)


def cyclic_poisson_event(mechanism, sampling_probability: float,
                         min_separation: int, noise_multiplier: float,
                         steps: int) -> Optional[dp_accounting.DpEvent]:
  """`mechanism_dp_event` for a sampler's rate q and b groups (the
  sampler's own `dp_event`, `tf_pxg.data.PoissonSampler.dp_event`)."""
  noise_multiplier = _check_noise_multiplier(noise_multiplier)
  steps = _check_steps(steps)
  if mechanism.whole_run_event:
    if steps > mechanism.num_steps:
      return None
    return mechanism.dp_event(noise_multiplier)
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_probability, mechanism.dp_event(noise_multiplier)),
      _rounds(steps, int(min_separation)))


def event_epsilon(event: Optional[dp_accounting.DpEvent], delta: float,
                  accountant: str = "rdp") -> float:
  """ε of a composed event (None: inf, no ε claimed). An event holding
  a truncated Poisson part is accounted with PLD also for "rdp" (warning
  `TruncationAccountedWithPLD`): dp-accounting's RDP has no analysis of
  it."""
  delta = _check_delta(delta)
  accountant = _check_accountant(accountant)
  if event is None:
    return math.inf
  return _composed_epsilon(event, delta, accountant)


def mechanism_epsilon(mechanism, num_examples: int, batch_size: int,
                      noise_multiplier: float, steps: int,
                      delta: float = 1e-5, accountant: str = "rdp") -> float:
  """ε of `mechanism_dp_event` (0 for no steps; inf without noise, or past
  a whole-run mechanism's `num_steps`). For the independent Gaussian and
  BandMF it equals `compute_epsilon(..., min_separation=b)`."""
  event = mechanism_dp_event(mechanism, num_examples, batch_size,
                             noise_multiplier, steps)
  if steps == 0:
    return 0.0
  if noise_multiplier == 0.0:
    return math.inf
  return event_epsilon(event, delta, accountant)


def noise_multiplier_for_epsilon(target_epsilon: float,
                                 num_examples: int,
                                 batch_size: int,
                                 epochs: Optional[_Number] = None,
                                 steps: Optional[int] = None,
                                 delta: float = 1e-5,
                                 accountant: str = "rdp",
                                 tolerance: float = 1e-4,
                                 *,
                                 min_separation: int = 1,
                                 num_bands: Optional[int] = _renamed.NOT_GIVEN,
                                 max_batch_size: Optional[int] = None
                                 ) -> float:
  """The smallest noise multiplier σ whose run is (target_epsilon, δ)-DP.

  Keeps a bracket `ε(lo) > target_epsilon >= ε(hi)` and narrows it (Brent's
  method, then bisection) until `hi - lo <= tolerance`; returns `hi`. So,
  with ε decreasing in σ:
  `compute_epsilon(..., noise_multiplier=σ*) <= target_epsilon` and
  `compute_epsilon(..., noise_multiplier=σ* - tolerance) > target_epsilon`
  (same other arguments). The bracket is found by doubling or halving from
  σ = 1.

  Args:
    target_epsilon: The ε to reach, finite and > 0.
    num_examples: Training set size N, a positive integer.
    batch_size: Expected batch size B, an integer with 0 < B <= N.
    epochs: Number of epochs; give exactly one of `epochs` and `steps`.
    steps: Number of optimizer steps.
    delta: Target δ, 0 < δ < 1.
    accountant: "rdp" or "pld", as in `compute_epsilon`.
    tolerance: Absolute tolerance on σ, finite and > 0.
    min_separation: b for amplified BandMF, as in `compute_epsilon`
      (1 = DP-SGD).
    num_bands: deprecated name of `min_separation`.
    max_batch_size: B_max of truncated Poisson sampling, as in
      `compute_epsilon` (PLD whatever `accountant` says).

  Returns:
    σ* as a Python float (0.0 if there are no steps).

  Raises:
    ValueError: If an argument is invalid (see `compute_epsilon`), or if
      `target_epsilon` is not reached by any σ up to 2**20 (a tiny target with
      a tiny `delta` and very many steps).
  """
  if (not _is_real(target_epsilon) or not math.isfinite(target_epsilon) or
      target_epsilon <= 0):
    raise ValueError(
        f"target_epsilon must be a finite number > 0; got {target_epsilon!r}.")
  if not _is_real(tolerance) or not math.isfinite(tolerance) or tolerance <= 0:
    raise ValueError(
        f"tolerance must be a finite number > 0; got {tolerance!r}.")
  num_examples = _check_positive_int("num_examples", num_examples)
  batch_size = _check_batch_size(batch_size, num_examples)
  delta = _check_delta(delta)
  accountant = _check_accountant(accountant)
  b, name = _renamed.argument(min_separation, num_bands,
                              new="min_separation", old="num_bands",
                              where="noise_multiplier_for_epsilon",
                              default=1)
  b = _check_min_separation(b, num_examples, batch_size, name)
  cap = _truncation(max_batch_size, b, num_examples,
                    "noise_multiplier_for_epsilon")
  truncation = None if cap is None else (num_examples, cap)
  accountant = _pld_for_truncation(accountant, truncation is not None)
  steps = _resolve_steps(num_examples, batch_size, epochs, steps)
  if steps == 0:
    return 0.0
  target_epsilon = float(target_epsilon)
  q = batch_size * b / num_examples
  rounds = _rounds(steps, b)
  cache = {}

  def gap(sigma: float) -> float:
    """ε(σ) - target: <= 0 means private enough. Decreasing in σ."""
    if sigma not in cache:
      cache[sigma] = _epsilon(q, sigma, rounds, delta, accountant,
                              truncation)
    return cache[sigma] - target_epsilon

  # Bracket: gap(lo) > 0 >= gap(hi). ε(0) = inf, so lo = 0 always qualifies.
  lo, hi = 0.0, 1.0
  if gap(hi) <= 0:
    while hi > tolerance:
      if gap(hi / 2) > 0:
        lo = hi / 2
        break
      hi /= 2
  else:
    while gap(hi) > 0:
      if hi >= _MAX_NOISE_MULTIPLIER:
        raise ValueError(
            f"target_epsilon={target_epsilon!r} is not reachable: even "
            f"noise_multiplier={hi:g} gives "
            f"epsilon={gap(hi) + target_epsilon:g} with {steps} steps"
            f"{f' ({name}={b})' if b > 1 else ''}, "
            f"delta={delta:g}, accountant={accountant!r}. "
            "Ask for a larger epsilon or delta, or train fewer steps.")
      lo, hi = hi, 2 * hi

  # Brent's method finds the crossing in a few evaluations (ε is smooth in σ
  # for RDP, nearly so for PLD). The points it evaluated, or else two probes
  # at ±tolerance/2 around its root, narrow the bracket. Bisection finishes
  # whatever is left, needing only the bracket invariant, so the result holds
  # even where ε is not smooth.
  if lo > 0 and hi - lo > tolerance:
    root = optimize.brentq(gap, lo, hi, xtol=tolerance / 4)
    if min(s for s in cache if gap(s) <= 0) - max(
        s for s in cache if gap(s) > 0) > tolerance:
      gap(min(hi, root + tolerance / 2))
      gap(max(lo, root - tolerance / 2))
    hi = min(s for s in cache if gap(s) <= 0)
    lo = max([lo] + [s for s in cache if s < hi and gap(s) > 0])
  while hi - lo > tolerance:
    mid = 0.5 * (lo + hi)
    if gap(mid) <= 0:
      hi = mid
    else:
      lo = mid
  return hi
