"""Balls-in-bins sampling: every example in exactly one batch per epoch.

Each epoch e (k logical steps), every example is thrown independently and
uniformly into one of the epoch's k bins; step `t = e k + j` trains on bin
j (Chua, Ghazi, Harrison, Kamath, Kumar, Leeman, Manurangsi, Sinha, Zhang,
"Balls-and-Bins Sampling for DP-SGD", AISTATS 2025, arXiv:2412.16802).
Like shuffling, every example is seen once per epoch; unlike shuffling, the
bins' sizes are random (`Binomial(N, 1/k)`), so the batches are laid out
exactly as Poisson batches are (`PoissonSampler`'s fixed-shape masked
physical batches, overflow included) and the clipped sum is divided by the
expected batch size N / k, never by the realised size (which depends on
the data only through the public N, but dividing by it would make the
sensitivity data-dependent).

The bins of epoch e are a pure function of `(seed, e)`: the assignment is
drawn by TF's stateless RNG (philox) under a key folded from the seed and
the epoch (`epoch_key`), so every step of the epoch, a resumed `fit`, and
the NumPy path (`indices_for_step`, which runs the same TF ops eagerly)
see the same bins. Secure mode is refused: its per-step OS keys cannot key
a whole epoch (use Poisson sampling there).

**Accounting: a certified upper bound (the default) and a Monte-Carlo ε
with a stated confidence (an option).** dp-accounting (0.6.0, the newest
release) has no balls-in-bins event.

*The certified bound* (`accounting="upper_bound"`, `dp_event`): fix any
assignment of the bins; then a unit's data enters exactly one step per
epoch, so the release is the adaptive composition of one Gaussian mechanism
(sensitivity C, noise multiplier sigma; the mechanism's per-participation
event) per epoch, and the other steps do not depend on it. The actual
release is a mixture over assignments drawn independently of the data, and
the hockey-stick divergence is jointly convex, so the bound for every fixed
assignment holds for the mixture:

    SelfComposedDpEvent(mechanism.dp_event(sigma), ceil(T / k)).

This is the deterministic-participation (no amplification) bound, also
valid for shuffling; it is loose (it ignores that the adversary does not
know the step), often far above Poisson's ε at rate 1/k (docs/sampling.md
gives numbers). It needs a per-step mechanism with no cyclic schema
(`min_separation == 1`, no `whole_run_event`); others are refused by
`tf_pxg.data.participation.check` (the sampler's `schema` says so).

*The Monte-Carlo ε* (`accounting="monte_carlo"`, `epsilon`): Chua et al.'s
tight dominating pair of balls-in-bins, estimated by sampling
(`tf_pxg.data.balls_in_bins_accounting`): with probability at least
`confidence` over the accountant's own draw (seeded, independent of the
data), the run is (ε, δ)-DP. It is near Poisson's ε at rate 1/k (equal for
k = 1, converging to it as sigma grows), far below the certified bound,
but it is not certified: a bad draw (probability <= 1 - confidence) can
state too small an ε. `epsilon` returns the smaller of the two (both hold,
the first with that confidence). `dp_event` stays the certified bound in
both modes (a dp-accounting event cannot carry a Monte-Carlo estimate), so
whatever composes events (`tf_pxg.accounting`, `PrivacyCallback`) states
the certified bound.

Added in this one file plus a generic hook: `PoissonSampler`'s subclass
defines `step_indices` (the sampler protocol's selection, which
`tf_pxg.data.sampling_ops.index_stream` calls), `schema` and `dp_event`,
and changes the config (B = N / k, k steps per epoch) in its constructor;
`fit` takes it as `sampling="balls_in_bins"`, `sampling=BallsInBinsSampler` (or
`sampling=BallsInBinsSampler.configured(accounting="monte_carlo")`). The
Monte-Carlo accountant is the second file,
`tf_pxg.data.balls_in_bins_accounting`.
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_pxg import accounting as tf_pxg_accounting
from tf_pxg.data import balls_in_bins_accounting
from tf_pxg.data import participation
from tf_pxg.data import poisson
from tf_pxg.data import protocol
from tf_pxg.data import samplers

__all__ = ["BallsInBinsSampler"]

_EPOCH_SALT = 0x62616C6C  # "ball": keeps epoch keys apart from step keys
_ACCOUNTINGS = ("upper_bound", "monte_carlo")


@samplers.register("balls_in_bins")  # fit/DPOptimizer(sampling=) name
class BallsInBinsSampler(poisson.PoissonSampler):
  """Balls-in-bins logical batches, laid out as `PoissonSampler`'s.

  Args (a `tf_pxg.data.SamplerConfig`, or its fields as `PoissonSampler`
  takes them, plus the accounting options):
    num_examples: N.
    expected_batch_size: B; the epoch has `k = steps_per_epoch` bins
      (default `round(N / B)`, at least 1) and the expected batch size is
      N / k (B exactly when k divides N).
    seed: the assignment's seed (None: OS entropy, drawn once).
    secure_mode: must be False (module docstring).
    min_separation: must be 1 (no cyclic schema; `num_groups`, its
      deprecated name, too).
    accounting: what `epsilon` states: "upper_bound" (the default, the
      certified bound) or "monte_carlo" (module docstring). Through `fit`:
      pass the instance, or the class `configured(...)`.
    confidence, num_samples, accounting_seed: the Monte-Carlo accountant's
      (`balls_in_bins_accounting.monte_carlo_epsilon`); unused for
      "upper_bound".
    others: as `PoissonSampler` (`group_seed` is ignored).

  Raises:
    ValueError: secure mode, `min_separation > 1`, bad sizes, an unknown
      `accounting`, a confidence outside (0, 1).
  """

  #: Defaults of the accounting options (`configured` overrides them).
  _accounting_options = {}
  #: One participation per epoch, in a random step of it: separation 1,
  #: and whole-run events are not taken (`dp_event` composes per epoch).
  schema = participation.Participation(
      "balls in bins", 1, note="its ε is stated for a per-step mechanism "
      "without cyclic participation")

  def __init__(self, *args, accounting: Optional[str] = None,
               confidence: Optional[float] = None,
               num_samples: Optional[int] = None,
               accounting_seed: Optional[int] = None, **kwargs):
    config, name = protocol.SamplerConfig.named(
        *args, where="BallsInBinsSampler", **kwargs)
    given = {"accounting": accounting, "confidence": confidence,
             "num_samples": num_samples, "accounting_seed": accounting_seed}
    options = {"accounting": "upper_bound", "confidence": 0.99,
               "num_samples": 1_000_000, "accounting_seed": 0,
               **self._accounting_options,
               **{k: v for k, v in given.items() if v is not None}}
    if options["accounting"] not in _ACCOUNTINGS:
      raise ValueError(
          f"BallsInBinsSampler: accounting must be one of {_ACCOUNTINGS}; "
          f"got {options['accounting']!r}.")
    if not 0.0 < float(options["confidence"]) < 1.0:
      raise ValueError(
          f"BallsInBinsSampler: confidence must be in (0, 1) (the "
          f"probability that the Monte-Carlo ε holds); got "
          f"{options['confidence']!r}.")
    self.accounting = options["accounting"]
    self.confidence = float(options["confidence"])
    self.num_samples = int(options["num_samples"])
    self.accounting_seed = int(options["accounting_seed"])
    self._monte_carlo_cache = {}
    if config.secure_mode:
      raise ValueError(
          "BallsInBinsSampler: secure mode draws every step's key from the "
          "OS, but balls-in-bins needs one assignment per epoch shared by "
          "its k steps. Use Poisson sampling (the default) in secure mode.")
    if config.min_separation != 1:
      raise ValueError(
          f"BallsInBinsSampler has no cyclic groups; the model's noise "
          f"mechanism needs {name}={config.min_separation} (BandMF/BLT "
          "participation). Use Poisson sampling (the default) for it.")
    bins = config.steps_per_epoch or max(1, round(
        config.num_examples / config.expected_batch_size))
    super().__init__(config.replace(
        expected_batch_size=config.num_examples / bins, steps_per_epoch=bins,
        group_seed=None))

  @classmethod
  def configured(cls, **options) -> type:
    """A subclass whose accounting options default to `options` (keys:
    accounting, confidence, num_samples, accounting_seed), for
    `fit(..., sampling=BallsInBinsSampler.configured(
    accounting="monte_carlo"))` (fit builds the sampler from the class; an
    instance works too)."""
    unknown = set(options) - {"accounting", "confidence", "num_samples",
                              "accounting_seed"}
    if unknown:
      raise ValueError(f"BallsInBinsSampler.configured: unknown options "
                       f"{sorted(unknown)}.")
    return type(cls.__name__, (cls,), {
        "_accounting_options": {**cls._accounting_options, **options},
        "__module__": cls.__module__})

  @property
  def num_bins(self) -> int:
    """k, the batches (steps) of an epoch."""
    return self.steps_per_epoch

  def epoch_key(self, epoch) -> tf.Tensor:
    """The `[2]` int64 stateless key of epoch `epoch`'s assignment."""
    base = tf.constant([self.seed >> 32, self.seed & 0xFFFFFFFF], tf.int64)
    return tf.cast(tf.random.experimental.stateless_fold_in(
        tf.random.experimental.stateless_fold_in(base, _EPOCH_SALT),
        tf.cast(epoch, tf.int64)), tf.int64)

  def step_indices(self, step, key=None) -> tf.Tensor:
    """TF ops: the sorted indices of logical step `step` (bin
    `step mod k` of epoch `step div k`). `key` (the stream's per-step
    key) is not used: the epoch's key is."""
    del key
    step = tf.cast(step, tf.int64)
    k = tf.constant(self.num_bins, tf.int64)
    bins = tf.random.stateless_uniform(
        [self.num_examples], seed=self.epoch_key(step // k), minval=0,
        maxval=self.num_bins, dtype=tf.int64, alg="philox")
    return tf.where(tf.equal(bins, tf.math.floormod(step, k)))[:, 0]

  def indices_for_step(self, step: int) -> np.ndarray:
    return self.step_indices(int(step)).numpy().astype(np.int64)

  def dp_event(self, mechanism, noise_multiplier: float,
               steps: int) -> dp_accounting.DpEvent:
    """The upper bound of the module docstring: the mechanism's event
    composed once per epoch begun, `ceil(steps / k)` times.

    Raises:
      ValueError: a mechanism with a cyclic schema or a whole-run event
        (`tf_pxg.data.participation.check`).
    """
    participation.check(self, mechanism, "BallsInBinsSampler.dp_event")
    return dp_accounting.SelfComposedDpEvent(
        mechanism.dp_event(noise_multiplier),
        math.ceil(int(steps) / self.num_bins))

  def monte_carlo_epsilon(self, mechanism, noise_multiplier: float,
                          steps: int, delta: float
                          ) -> balls_in_bins_accounting.MonteCarloEpsilon:
    """The Monte-Carlo ε of `steps` steps (`ceil(steps / k)` epochs of
    Chua et al.'s pair at the mechanism's Gaussian noise multiplier), at
    this sampler's confidence, samples and seed; cached.

    Raises:
      ValueError: a mechanism whose per-participation event is not one
        Gaussian (the pair is stated for the Gaussian mechanism), or with a
        cyclic schema / whole-run event (as `dp_event`).
    """
    self.dp_event(mechanism, noise_multiplier, steps)  # refuses the same
    event = mechanism.dp_event(noise_multiplier)
    if not isinstance(event, dp_accounting.GaussianDpEvent):
      raise ValueError(
          f"BallsInBinsSampler: the Monte-Carlo ε is stated for a Gaussian "
          f"mechanism; {mechanism!r} has the event {event!r}. Use "
          "accounting='upper_bound'.")
    key = (float(event.noise_multiplier), math.ceil(int(steps) /
                                                     self.num_bins),
           float(delta))
    if key not in self._monte_carlo_cache:
      self._monte_carlo_cache[key] = (
          balls_in_bins_accounting.monte_carlo_epsilon(
              key[0], self.num_bins, key[1], key[2],
              confidence=self.confidence, num_samples=self.num_samples,
              seed=self.accounting_seed))
    return self._monte_carlo_cache[key]

  def epsilon(self, mechanism, noise_multiplier: float, steps: int,
              delta: float, accountant: str = "pld") -> float:
    """ε after `steps` steps at `delta`: the certified bound
    (`dp_event`'s ε by `accountant`) for accounting="upper_bound"; for
    "monte_carlo" the smaller of it and the Monte-Carlo ε (which holds
    with probability >= `confidence`, module docstring). 0 for no steps,
    inf without noise."""
    if int(steps) == 0:
      return 0.0
    if noise_multiplier == 0:
      return math.inf
    certified = tf_pxg_accounting.event_epsilon(
        self.dp_event(mechanism, noise_multiplier, steps), delta,
        accountant)
    if self.accounting == "upper_bound":
      return certified
    return min(certified, self.monte_carlo_epsilon(
        mechanism, noise_multiplier, steps, delta).epsilon)
