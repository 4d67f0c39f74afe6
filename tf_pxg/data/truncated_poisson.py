"""Truncated Poisson sampling: every logical step is ONE physical batch.

Each logical step draws a Poisson sample S (every example independently
with probability q = B / N, `n = |S| ~ Binomial(N, q)`, the draw of
`tf_pxg.data.PoissonSampler`) and, when n exceeds the batch's `B_max`
rows, keeps a uniformly random subset of `B_max` of its examples
(Choquette-Choo et al. 2025, arXiv:2508.15089, the analysis behind
dp-accounting's `TruncatedSubsampledGaussianDpEvent`). So the step is exactly one physical batch of `B_max` rows
(`physical_batch_size = B_max`, `accumulation_steps = 1`), with masked
padding rows when `min(n, B_max) < B_max`: one fixed shape per step, no
carried (overflow) physical batches, which accelerators prefer.

Selection, as TF ops in the input pipeline (no Python per example or per
step): the Poisson draw is `tf_pxg.data.sampling_ops.step_indices` under the
stream's key of the step (seeded: `step_key(seed, step)`, a pure function of
`(seed, step)`; secure mode: 128 fresh bits from the OS CSPRNG per step,
as `PoissonSampler`'s stream); the kept subset is the top `B_max` of i.i.d.
uniform priorities drawn under `fold_in(key, TRUNCATION_SALT)` (a key the
draw never uses: its rounds fold in 0, 1, ...). The top `B_max` of i.i.d.
continuous priorities is a uniformly random `B_max`-subset (exchangeability),
independent of which examples were drawn; ties (float64, probability
about `n^2 2^-53`) are broken by position, a negligible departure.

Accounting. The release of a step is
`sum_{b in S'} clip(g_b) + N(0, (sigma C)^2)` with S' the truncated sample:
the Gaussian mechanism with sensitivity C per example (add/remove
adjacency) on a truncated Poisson sample, which is exactly dp-accounting's
`TruncatedSubsampledGaussianDpEvent(N, q, B_max, sigma)` (dp-accounting
>= 0.6.0). `dp_event` composes it once per step
(`tf_pxg.accounting.truncated_poisson_event`). The noisy sum is divided by
the expected batch size `q N = B` (`NORMALIZER`, the same data-independent
constant as Poisson sampling; dividing by the realised size would make the
sensitivity data-dependent). Its ε is at least Poisson's at rate q (it is
another mechanism: truncation changes the law) and decreases to it as
`B_max` grows; docs/sampling.md tabulates the cost.

RDP: dp-accounting 0.6's RDP accountant has no analysis of this event.
`tf_pxg.accounting.event_epsilon` (what `PrivacyCallback`, the ledger and
`model.epsilon` call) therefore accounts any composition holding it with
PLD, also when the plan's accountant is "rdp" (the default), and warns once
(`TruncationAccountedWithPLD`); `model.privacy_summary()` names the event
and that accountant. `tf-pxg epsilon/noise --max_batch_size` do the same.

Not supported (refused by name): cyclic participation (`min_separation >
1`, BandMF/BLT: `tf_pxg.data.participation.check`), `accumulation_steps >
1` (a step is one physical batch by definition), mechanisms whose
per-step event is not one Gaussian.

Added as docs/extending.md "samplers" says: this file (a `PoissonSampler`
subclass with `step_indices`, `dp_event`, `schema`), its name in
`tf_pxg.parts.BUILTIN_MODULES` and a row in tests/test_parts.py. `fit`
takes it as `sampling="truncated_poisson"`, or by its one argument
`max_batch_size=B_max` (which implies this sampling).
"""

from __future__ import annotations

import os
from typing import Optional

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_pxg import accounting
from tf_pxg.data import participation
from tf_pxg.data import poisson
from tf_pxg.data import protocol
from tf_pxg.data import samplers
from tf_pxg.data import sampling_ops

__all__ = ["TruncatedPoissonSampler", "fit_sampling", "truncate"]

#: Folded into a step's key for the truncation's priorities ("trun"): far
#: above the round counters the Poisson draw folds in.
TRUNCATION_SALT = 0x7472756E


def truncate(indices, key, max_batch_size: int) -> tf.Tensor:
  """TF ops: a uniformly random subset of at most `max_batch_size` of
  `indices`, sorted.

  Args:
    indices: `[n]` int64 distinct indices (a step's Poisson draw).
    key: the step's `[2]` int64 stateless key.
    max_batch_size: B_max, a positive Python int.

  Returns:
    `[min(n, B_max)]` int64, sorted: all of `indices` when n <= B_max,
    else the B_max with the largest i.i.d. uniform priorities (keyed by
    `fold_in(key, TRUNCATION_SALT)`), a uniformly random B_max-subset.
  """
  indices = tf.cast(indices, tf.int64)
  n = tf.shape(indices)[0]
  seed = tf.random.experimental.stateless_fold_in(
      tf.cast(key, tf.int64), TRUNCATION_SALT, alg="philox")
  priorities = tf.random.stateless_uniform([n], seed, dtype=tf.float64,
                                           alg="philox")
  _, keep = tf.math.top_k(priorities, k=tf.minimum(n, int(max_batch_size)),
                          sorted=False)
  return tf.sort(tf.gather(indices, keep))


@samplers.register("truncated_poisson")  # fit/DPOptimizer(sampling=) name
class TruncatedPoissonSampler(poisson.PoissonSampler):
  """Poisson draws truncated to one physical batch of `B_max` rows.

  Args (a `tf_pxg.data.SamplerConfig`, or its fields as `PoissonSampler`
  takes them):
    num_examples: N.
    expected_batch_size: B; q = B / N.
    physical_batch_size: B_max, the rows of every step's one physical
      batch and the truncation size (default
      `default_physical_batch_size(B, 1, R)` = ceil(B + 4 sqrt(B)), rounded
      up to a multiple of R: the shape padded Poisson sampling uses).
    max_batch_size: the same B_max by its own name (give one of the two,
      or both equal).
    accumulation_steps: must be 1.
    min_separation: must be 1.
    others (`num_replicas`, `steps_per_epoch`, `seed`, `secure_mode`,
      `start_step`): as `PoissonSampler`.

  Attributes:
    max_batch_size: B_max (== `physical_batch_size`).

  Raises:
    ValueError: `accumulation_steps` or `min_separation` other than 1, a
      `max_batch_size` that differs from `physical_batch_size`, and
      `PoissonSampler`'s (bad sizes, B_max not a multiple of R, ...).
  """

  schema = participation.Participation(
      "truncated poisson", 1,
      note="its ε (TruncatedSubsampledGaussianDpEvent) is stated for the "
      "independent Gaussian mechanism, one event per step")

  def __init__(self, *args, max_batch_size: Optional[int] = None, **kwargs):
    config, name = protocol.SamplerConfig.named(
        *args, where="TruncatedPoissonSampler", **kwargs)
    if max_batch_size is not None:
      if config.physical_batch_size not in (None, max_batch_size):
        raise ValueError(
            f"TruncatedPoissonSampler: max_batch_size={max_batch_size} and "
            f"physical_batch_size={config.physical_batch_size} differ, but "
            "they are the same number (every step is one physical batch of "
            "B_max rows). Give one of them.")
      config = config.replace(physical_batch_size=max_batch_size)
    if config.accumulation_steps != 1:
      raise ValueError(
          f"TruncatedPoissonSampler: accumulation_steps="
          f"{config.accumulation_steps}, but every logical step of truncated "
          "Poisson sampling is one physical batch of max_batch_size rows. "
          "Use accumulation_steps=1 (a smaller max_batch_size for memory), "
          "or sampling='poisson' to accumulate physical batches.")
    if config.min_separation != 1:
      raise ValueError(
          f"TruncatedPoissonSampler has no cyclic groups; the model's noise "
          f"mechanism needs {name}={config.min_separation} (BandMF/BLT "
          "participation). Use sampling='poisson' for it.")
    super().__init__(config)

  @property
  def max_batch_size(self) -> int:
    """B_max: the truncation size and the one physical batch's rows."""
    return self.physical_batch_size

  @property
  def ledger_settings(self) -> dict:
    """What the privacy ledger's summary records besides the sampler."""
    return {"max_batch_size": self.max_batch_size,
            "event": "TruncatedSubsampledGaussianDpEvent (accounted with "
                     "PLD: RDP has no analysis of it)"}

  def step_indices(self, step, key=None) -> tf.Tensor:
    """TF ops: the sorted indices of logical step `step`: the Poisson draw
    under `key` (the stream's `[2]` int64 key of the step; None: the seeded
    key `step_key(seed, step)`), truncated by `truncate`.

    Returns:
      `[min(n, B_max)]` int64, sorted, distinct, `n ~ Binomial(N, q)`.
    """
    if key is None:
      key = sampling_ops.step_key(self.seed, step)
    drawn = sampling_ops.step_indices(key, self.num_examples,
                                      self.sampling_rate)
    return truncate(drawn, key, self.max_batch_size)

  def indices_for_step(self, step: int) -> np.ndarray:
    """`step_indices` run eagerly: the stream's step `step` for a seeded
    sampler; in secure mode a fresh 128-bit key from `os.urandom`."""
    key = (tf.constant(np.frombuffer(os.urandom(16), np.int64))
           if self.secure_mode else None)
    return self.step_indices(int(step), key).numpy().astype(np.int64)

  def dp_event(self, mechanism, noise_multiplier: float,
               steps: int) -> dp_accounting.DpEvent:
    """`steps` compositions of `TruncatedSubsampledGaussianDpEvent(N, q,
    B_max, sigma)` (`tf_pxg.accounting.truncated_poisson_event`), sigma
    the mechanism's Gaussian noise multiplier.

    Raises:
      ValueError: a mechanism with cyclic participation or a whole-run
        event (`participation.check`), or whose per-step event is not one
        Gaussian (the truncated event is stated for the Gaussian).
    """
    participation.check(self, mechanism, "TruncatedPoissonSampler.dp_event")
    event = mechanism.dp_event(noise_multiplier)
    if not isinstance(event, dp_accounting.GaussianDpEvent):
      raise ValueError(
          f"TruncatedPoissonSampler: dp-accounting's truncated event is "
          f"stated for the Gaussian mechanism; {mechanism!r} has the event "
          f"{event!r}. Use sampling='poisson' with this mechanism.")
    return accounting.truncated_poisson_event(
        self.num_examples, self.sampling_rate, self.max_batch_size,
        event.noise_multiplier, steps)


def fit_sampling(sampling, max_batch_size: int,
                 physical_batch_size: Optional[int]):
  """`fit(max_batch_size=...)`: the sampling and the physical batch size.

  Args:
    sampling: fit's `sampling=`, else the DP plan's choice (None: not
      chosen; a name, class or instance).
    max_batch_size: B_max.
    physical_batch_size: fit's argument (None, or B_max).

  Returns:
    `(sampling, physical_batch_size)`: `TruncatedPoissonSampler` (or the
    given truncating sampling) and B_max.

  Raises:
    ValueError: a sampling that does not truncate (named), or a
      `physical_batch_size` other than B_max.
  """
  if physical_batch_size not in (None, max_batch_size):
    raise ValueError(
        f"fit: max_batch_size={max_batch_size} and physical_batch_size="
        f"{physical_batch_size} differ; with truncated Poisson sampling "
        "every step is one physical batch of max_batch_size rows. Drop "
        "physical_batch_size.")
  if sampling is None:
    return TruncatedPoissonSampler, max_batch_size
  cls = samplers.resolve(sampling if isinstance(sampling, (str, type))
                         else type(sampling))
  if not issubclass(cls, TruncatedPoissonSampler):
    raise ValueError(
        f"fit: max_batch_size={max_batch_size} truncates Poisson draws "
        f"(sampling='truncated_poisson'), but the sampling is "
        f"{cls.__name__}, which does not truncate. Drop max_batch_size, or "
        "use sampling='truncated_poisson' (or none).")
  return sampling, max_batch_size
